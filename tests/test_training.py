"""`specd train eagle3` / `specd train dflash` end to end on a tiny target and a handful of
conversations: outputs load, checkpoints resume, progress is printed."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from drafter_svc.dflash.model import load_draft_vocab, load_drafter
from drafter_svc.dflash.train import DFlashOptions
from drafter_svc.dflash.train import train as train_dflash
from drafter_svc.eagle3.model import load_head
from drafter_svc.eagle3.train import TrainOptions
from drafter_svc.eagle3.train import train as train_eagle3
from drafter_svc.features import FeatureSelection

REPLIES = ["abc abc abc abc", "hello there hello there", "one two three four five six"]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "chats.jsonl"
    rows = []
    for i in range(6):
        rows.append(
            {
                "conversations": [
                    {"from": "human", "value": f"say something {i}"},
                    {"from": "gpt", "value": REPLIES[i % 3] * 2},
                    {"from": "human", "value": "again"},
                    {"from": "gpt", "value": REPLIES[(i + 1) % 3]},
                ]
            }
        )
    rows.append({"conversations": [{"from": "human", "value": "no reply"}]})  # skipped
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_eagle3_training_writes_a_loadable_head_and_resumes(tiny_model_dir, data, tmp_path, capsys):
    out = tmp_path / "head"
    common = dict(target=str(tiny_model_dir), out=out, conversations=6, max_len=64,
                  draft_vocab=100, save_every=2, warmup=2, data=data)  # fmt: skip
    first = train_eagle3(TrainOptions(**common, epochs=1))
    assert first["conversations"] == 6 and first["steps"] == 6
    assert "loss" in capsys.readouterr().err  # the progress line
    head, _ = load_head(out)
    assert head.config.draft_vocab_size == first["draft_vocab"] <= 100
    assert head.config.capture_layers == (0, 1)
    assert head.config.target_fingerprint
    again = train_eagle3(TrainOptions(**common, epochs=2))
    assert again["steps"] == 12  # resumed at 6, not from 0
    assert "resumed" in capsys.readouterr().err
    assert json.loads((out / "training.json").read_text())["steps"] == 12


def test_training_stops_at_its_time_limit_then_goes_on(tiny_model_dir, data, tmp_path, capsys):
    """A limit reached before the first step still writes the checkpoint, a loadable model and
    training.json; the run after it takes every step from there."""
    out = tmp_path / "head"
    common = dict(target=str(tiny_model_dir), out=out, conversations=6, max_len=64,
                  draft_vocab=100, save_every=2, warmup=2, data=data, epochs=1)  # fmt: skip
    stopped = train_eagle3(TrainOptions(**common, time_limit=1e-6))
    assert (stopped["steps"], stopped["total_steps"]) == (0, 6)
    assert "--time-limit reached at step 0 of 6" in capsys.readouterr().err
    load_head(out)
    assert (out / "checkpoint").is_dir()
    finished = train_eagle3(TrainOptions(**common, time_limit=600))
    assert (finished["steps"], finished["total_steps"]) == (6, 6)
    df_out = tmp_path / "dflash"
    df = dict(target=str(tiny_model_dir), out=df_out, conversations=6, max_len=64, block_size=4,
              layers=1, anchors=4, epochs=1, warmup=2, data=data, draft_vocab=20)  # fmt: skip
    assert train_dflash(DFlashOptions(**df, time_limit=1e-6))["steps"] == 0
    load_drafter(df_out)
    assert train_dflash(DFlashOptions(**df))["steps"] == 6


def test_eagle3_training_in_batches_takes_fewer_steps_and_resumes(tiny_model_dir, data,
                                                                   tmp_path):  # fmt: skip
    out = tmp_path / "head"
    common = dict(target=str(tiny_model_dir), out=out, conversations=6, max_len=64,
                  draft_vocab=100, save_every=1, warmup=1, data=data, batch_size=4)  # fmt: skip
    first = train_eagle3(TrainOptions(**common, epochs=1))
    assert first["steps"] == 2 and first["batch_size"] == 4  # ceil(6 / 4)
    assert len(first["final_agreement_per_pass"]) == 3
    load_head(out)
    again = train_eagle3(TrainOptions(**common, epochs=2))
    assert again["steps"] == 3  # ceil(12 / 4), resumed at 2
    with pytest.raises(ValueError, match="checkpoint"):  # another batch size is another run
        train_eagle3(TrainOptions(**{**common, "batch_size": 2}, epochs=3))


def test_dflash_training_writes_a_loadable_drafter(tiny_model_dir, data, tmp_path):
    out = tmp_path / "dflash"
    summary = train_dflash(
        DFlashOptions(target=str(tiny_model_dir), out=out, conversations=6, max_len=64,
                      block_size=4, layers=1, anchors=4, epochs=1, warmup=2, data=data,
                      draft_vocab=20)
    )  # fmt: skip
    assert summary["steps"] == 6
    model = load_drafter(out)
    cfg = model.config
    listed = load_draft_vocab(out, cfg.vocab_size)  # the readout list, most frequent first
    assert listed is not None and len(listed) == 20 and len(set(listed.tolist())) == 20
    train_dflash(
        DFlashOptions(target=str(tiny_model_dir), out=out, conversations=6, max_len=64,
                      block_size=4, layers=1, anchors=4, epochs=1, warmup=2, data=data,
                      draft_vocab=0, resume=False)
    )  # fmt: skip
    assert load_draft_vocab(out, cfg.vocab_size) is None  # no stale list from the first run
    assert cfg.block_size == 4 and cfg.num_hidden_layers == 1
    assert cfg.target_layer_ids == (0, 1)
    assert cfg.mask_token_id not in (1, 2)  # never a chat marker the target emits


def test_dflash_training_packs_conversations_per_step(tiny_model_dir, data, tmp_path):
    summary = train_dflash(
        DFlashOptions(target=str(tiny_model_dir), out=tmp_path / "dflash", conversations=6,
                      max_len=64, block_size=4, layers=1, anchors=4, epochs=1, warmup=1,
                      data=data, draft_vocab=20, batch_size=3)
    )  # fmt: skip
    assert summary["steps"] == 2 and summary["batch_size"] == 3
    assert summary["tau_estimate"] >= 1
    load_drafter(tmp_path / "dflash")


def test_held_out_agreement_is_measured_at_every_checkpoint(tiny_model_dir, data, tmp_path,
                                                             capsys):  # fmt: skip
    eagle = train_eagle3(
        TrainOptions(target=str(tiny_model_dir), out=tmp_path / "head", conversations=6,
                     max_len=64, draft_vocab=100, save_every=2, warmup=1, data=data, epochs=1,
                     held_out=2)
    )  # fmt: skip
    assert eagle["conversations"] == 4 and eagle["held_out_conversations"] == 2
    curve = eagle["held_out_curve"]
    assert [point["step"] for point in curve] == [0, 2, 4]  # the start, checkpoints, the end
    assert all(len(p["agreement_per_pass"]) == 3 for p in curve)
    assert all(0 <= a <= 1 for p in curve for a in p["agreement_per_pass"])
    assert "held-out" in capsys.readouterr().err
    dflash = train_dflash(
        DFlashOptions(target=str(tiny_model_dir), out=tmp_path / "dflash", conversations=6,
                      max_len=64, block_size=4, layers=1, anchors=4, epochs=1, warmup=1,
                      save_every=2, data=data, draft_vocab=20, held_out=2)
    )  # fmt: skip
    assert [p["step"] for p in dflash["held_out_curve"]] == [0, 2, 4]
    assert all(1 <= p["tau_estimate"] <= 4 for p in dflash["held_out_curve"])
    with pytest.raises(ValueError, match="--held-out"):
        train_eagle3(TrainOptions(target=str(tiny_model_dir), out=tmp_path / "x",
                                  conversations=6, max_len=64, data=data, held_out=6))  # fmt: skip


def test_held_out_data_is_measured_and_never_trained_on(tiny_model_dir, data, tmp_path):
    seen = json.loads(data.read_text().splitlines()[0])  # a record the selection trains on
    unseen = {"conversations": [{"from": "human", "value": "something new"},
                                {"from": "gpt", "value": REPLIES[2] * 3}]}  # fmt: skip
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps(seen) + "\n" + json.dumps(unseen) + "\n")
    common = dict(target=str(tiny_model_dir), conversations=6, max_len=64, save_every=2,
                  warmup=1, data=data, epochs=1, held_out=2, held_out_data=held)  # fmt: skip
    eagle = train_eagle3(TrainOptions(out=tmp_path / "head", draft_vocab=100, **common))
    # six selected, the one also held out not trained on: 5 train, both held out
    assert eagle["conversations"] == 5 and eagle["held_out_conversations"] == 2
    assert [p["step"] for p in eagle["held_out_curve"]] == [0, 2, 4, 5]
    dflash = train_dflash(
        DFlashOptions(out=tmp_path / "dflash", block_size=4, layers=1, anchors=4,
                      draft_vocab=20, **common)
    )  # fmt: skip
    assert dflash["conversations"] == 5 and dflash["held_out_conversations"] == 2
    with pytest.raises(ValueError, match="needs --held-out N"):
        train_eagle3(TrainOptions(out=tmp_path / "x", **{**common, "held_out": 0}))
    # its features are not cached under its name: a file of the same name holding only the
    # new conversation holds out that one, and all six train
    same_name = tmp_path / "other" / held.name
    same_name.parent.mkdir()
    same_name.write_text(json.dumps(unseen) + "\n")
    again = train_eagle3(TrainOptions(out=tmp_path / "y", draft_vocab=100,
                                      **{**common, "held_out_data": same_name}))  # fmt: skip
    assert again["conversations"] == 6 and again["held_out_conversations"] == 1


def test_a_resumed_run_reports_the_held_out_curve_from_its_first_step(tiny_model_dir, data,
                                                                      tmp_path):  # fmt: skip
    def eagle(epochs, resume=True):
        return train_eagle3(
            TrainOptions(target=str(tiny_model_dir), out=tmp_path / "head", conversations=6,
                         max_len=64, draft_vocab=100, save_every=2, warmup=1, data=data,
                         epochs=epochs, held_out=2, resume=resume)
        )["held_out_curve"]  # fmt: skip

    first = eagle(1)
    assert [p["step"] for p in first] == [0, 2, 4]
    assert [p["step"] for p in eagle(2)] == [0, 2, 4, 6, 8]  # resumed at 4
    assert eagle(2)[:3] == first
    assert [p["step"] for p in eagle(1, resume=False)] == [0, 2, 4]  # none of the old run's

    def dflash(epochs):
        return train_dflash(
            DFlashOptions(target=str(tiny_model_dir), out=tmp_path / "dflash", conversations=6,
                          max_len=64, block_size=4, layers=1, anchors=4, epochs=epochs,
                          warmup=1, save_every=2, data=data, draft_vocab=20, held_out=2)
        )["held_out_curve"]  # fmt: skip

    assert [p["step"] for p in dflash(1)] == [0, 2, 4]
    assert [p["step"] for p in dflash(2)] == [0, 2, 4, 6, 8]


def test_training_continues_from_a_given_model(tiny_model_dir, data, tmp_path):
    first = tmp_path / "first"
    common = dict(target=str(tiny_model_dir), conversations=6, max_len=64, draft_vocab=100,
                  warmup=2, data=data, epochs=1)  # fmt: skip
    train_eagle3(TrainOptions(**common, out=first))
    before, _ = load_head(first)
    train_eagle3(TrainOptions(**common, out=tmp_path / "second", init_from=first))
    after, _ = load_head(tmp_path / "second")
    assert (after.d2t == before.d2t).all()  # same draft vocabulary, kept from the start point
    df_common = dict(target=str(tiny_model_dir), conversations=6, max_len=64, block_size=4,
                     layers=1, anchors=4, epochs=1, warmup=2, data=data)  # fmt: skip
    train_dflash(DFlashOptions(**df_common, out=tmp_path / "d1"))
    summary = train_dflash(DFlashOptions(**df_common, out=tmp_path / "d2",
                                         init_from=tmp_path / "d1"))  # fmt: skip
    assert summary["steps"] == 6 and load_drafter(tmp_path / "d2").config.num_hidden_layers == 1


def test_a_continued_head_can_grow_or_shrink_its_draft_vocabulary(tiny_model_dir, data, tmp_path,
                                                                  capsys):  # fmt: skip
    common = dict(target=str(tiny_model_dir), conversations=6, max_len=64, warmup=2, data=data,
                  epochs=1)  # fmt: skip
    train_eagle3(TrainOptions(**common, out=tmp_path / "small", draft_vocab=40))
    small, _ = load_head(tmp_path / "small")
    train_eagle3(TrainOptions(**common, out=tmp_path / "big", draft_vocab=60,
                              init_from=tmp_path / "small"))  # fmt: skip
    big, _ = load_head(tmp_path / "big")
    old_ids = set((np.arange(40) + np.array(small.d2t)).tolist())
    new_ids = np.arange(60) + np.array(big.d2t)
    assert big.config.draft_vocab_size == 60 and old_ids <= set(new_ids.tolist())
    assert (np.diff(new_ids) > 0).all()  # d2t stays an increasing map
    train_eagle3(TrainOptions(**common, out=tmp_path / "less", draft_vocab=20,
                              init_from=tmp_path / "big"))  # fmt: skip
    less, _ = load_head(tmp_path / "less")
    kept = np.arange(20) + np.array(less.d2t)
    assert less.config.draft_vocab_size == 20 and less.lm_head.weight.shape[0] == 20
    assert set(kept.tolist()) <= set(new_ids.tolist()) and (np.diff(kept) > 0).all()
    assert "draft vocabulary 60 -> 20: covers" in capsys.readouterr().err
    # chosen afresh: the data's own most frequent tokens, as a new head of that size takes
    train_eagle3(TrainOptions(**common, out=tmp_path / "afresh", draft_vocab=40,
                              init_from=tmp_path / "less", vocab_from_data=True))  # fmt: skip
    afresh, _ = load_head(tmp_path / "afresh")
    assert (np.array(afresh.d2t) == np.array(small.d2t)).all()
    assert afresh.lm_head.weight.shape[0] == 40
    assert "draft vocabulary 20 -> 40: covers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs --init-from"):
        train_eagle3(TrainOptions(**common, out=tmp_path / "new", vocab_from_data=True))
    assert not (tmp_path / "new").exists()


def test_a_widened_head_computes_what_it_did_then_trains_and_loads(tiny_model_dir, data,
                                                                   tmp_path, capsys):  # fmt: skip
    from drafter_svc.eagle3.train import widen_mlp

    common = dict(target=str(tiny_model_dir), conversations=6, max_len=64, warmup=2, data=data,
                  epochs=1, draft_vocab=60)  # fmt: skip
    train_eagle3(TrainOptions(**common, out=tmp_path / "narrow"))
    narrow, _ = load_head(tmp_path / "narrow")
    width = narrow.config.intermediate_size
    hidden = narrow.config.hidden_size
    emb = mx.random.normal((1, 5, hidden), key=mx.random.key(1))
    feature = mx.random.normal((1, 5, hidden), key=mx.random.key(2))
    before, _ = narrow.step(emb, feature, 0, None, None)
    wide = widen_mlp(narrow, 2 * width)
    after, _ = wide.step(emb, feature, 0, None, None)
    assert wide.midlayer.mlp.down_proj.weight.shape == (hidden, 2 * width)
    np.testing.assert_allclose(np.array(after), np.array(before), atol=1e-5, rtol=1e-5)
    assert (np.array(wide.d2t) == np.array(narrow.d2t)).all()
    with pytest.raises(ValueError, match="narrower than the start head"):
        widen_mlp(wide, width)

    summary = train_eagle3(TrainOptions(**common, out=tmp_path / "wide", mlp_width=2 * width,
                                        init_from=tmp_path / "narrow"))  # fmt: skip
    assert summary["steps"] == 6
    assert f"MLP widened {width} -> {2 * width} units" in capsys.readouterr().err
    trained, _ = load_head(tmp_path / "wide")
    assert trained.config.intermediate_size == 2 * width
    new_units = np.array(trained.midlayer.mlp.down_proj.weight)[:, width:]
    assert np.abs(new_units).max() > 0  # the new units learned


def test_a_deepened_dflash_drafter_computes_what_it_did_then_trains(tiny_model_dir, data,
                                                                    tmp_path, capsys):  # fmt: skip
    from drafter_svc.dflash.train import deepen

    common = dict(target=str(tiny_model_dir), conversations=6, max_len=64, block_size=4,
                  anchors=4, epochs=1, warmup=2, data=data)  # fmt: skip
    train_dflash(DFlashOptions(**common, layers=1, out=tmp_path / "one"))
    one = load_drafter(tmp_path / "one")
    cfg = one.config
    rows = mx.random.normal((1, 6, len(cfg.target_layer_ids) * cfg.feature_size),
                            key=mx.random.key(3))  # fmt: skip
    block = mx.random.normal((1, 4, cfg.hidden_size), key=mx.random.key(4))
    before = one(block, 6, one.context_kv(rows, 0))
    three = deepen(one, 3)
    after = three(block, 6, three.context_kv(rows, 0))
    assert len(three.layers) == 3
    np.testing.assert_allclose(np.array(after), np.array(before), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="fewer than the start drafter's 3"):
        deepen(three, 2)

    summary = train_dflash(DFlashOptions(**common, layers=2, out=tmp_path / "two",
                                         init_from=tmp_path / "one"))  # fmt: skip
    assert summary["layers"] == 2 and "drafter deepened 1 -> 2 layers" in capsys.readouterr().err
    two = load_drafter(tmp_path / "two")
    assert len(two.layers) == 2
    assert np.abs(np.array(two.layers[1].self_attn.o_proj.weight)).max() > 0  # it learned
    kept = train_dflash(DFlashOptions(**common, out=tmp_path / "kept", init_from=tmp_path / "two"))
    assert kept["layers"] == 2  # no --layers: the start drafter's


def test_weights_past_the_file_limit_are_written_as_shards_that_load_back(tmp_path):
    from drafter_svc.checkpoints import read_weights, save_weights

    weights = {f"w{i}": mx.full((64, 16), float(i), dtype=mx.float16) for i in range(5)}  # 2 kB
    paths = save_weights(tmp_path, weights, limit=5000)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all(p.stat().st_size <= 5000 + 1024 for p in paths)  # the limit, plus each header
    back = read_weights(tmp_path)
    assert sorted(back) == sorted(weights)
    assert all((back[k] == weights[k]).all() for k in weights)
    # a later save that fits one file leaves no shard of the first behind
    assert [p.name for p in save_weights(tmp_path, {"w0": weights["w0"]}, limit=5000)] == [
        "model.safetensors"
    ]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]


def test_a_tensor_past_the_file_limit_is_written_in_row_blocks_that_join_back(tmp_path):
    """A wide read-out (a draft vocabulary of 16,384 is 18.9 MB in float16) is stored as blocks
    of its rows, each file within the limit, and reads back as the one tensor."""
    from drafter_svc.checkpoints import CheckpointError, read_weights, save_weights

    wide = mx.arange(300 * 8, dtype=mx.float16).reshape(300, 8)  # 4,800 bytes
    small = mx.ones((4,), dtype=mx.float32)
    paths = save_weights(tmp_path, {"lm_head.weight": wide, "norm.weight": small}, limit=1000)
    assert len(paths) > 4 and all(p.stat().st_size <= 1000 + 1024 for p in paths)
    back = read_weights(tmp_path)
    assert sorted(back) == ["lm_head.weight", "norm.weight"]
    assert back["lm_head.weight"].shape == (300, 8) and (back["lm_head.weight"] == wide).all()
    paths[0].unlink()  # a block missing: named, not a silently short tensor
    with pytest.raises(CheckpointError, match="row blocks"):
        read_weights(tmp_path)
    with pytest.raises(ValueError, match="one row"):
        save_weights(tmp_path, {"w": mx.zeros((2, 600), dtype=mx.float32)}, limit=1000)


def test_distill_writes_the_targets_own_replies_and_resumes(tiny_model_dir, data, tmp_path):
    """Every user turn is a prompt after the conversation before it; each record is that
    conversation ended with the target's own greedy reply; a second run only adds the rest."""
    from coordinator.bench import plain_decode
    from drafter_svc.data import ROLES
    from drafter_svc.distill import DistillOptions, distill
    from specd.models.load import load_target

    out = tmp_path / "replies.jsonl"
    opts = DistillOptions(target=str(tiny_model_dir), out=out, conversations=3,
                          max_new_tokens=12, batch_size=1, data=data)  # fmt: skip
    assert distill(opts)["new_replies"] == 3
    records = [json.loads(line)["conversations"] for line in out.read_text().splitlines()]
    assert sorted(len(turns) for turns in records) == [2, 2, 4]  # one conversation's two turns
    plain = load_target(str(tiny_model_dir), "float32")
    for turns in records:
        assert [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2)
        assert turns[0]["value"].startswith("say something")
        chat = [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns[:-1]]
        prompt = plain.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                     tokenize=True)  # fmt: skip
        greedy = plain_decode(plain.model, list(prompt), 12, set(plain.identity.eos_token_ids))
        assert turns[-1]["value"] == plain.tokenizer.decode(greedy.token_ids).strip()
    opts.conversations, opts.batch_size = 6, 3
    summary = distill(opts)  # resumes: only the three missing replies are generated
    assert summary["new_replies"] == 3 and summary["replies"] == 6
    timing = summary["replies_timing"]  # one wave of three prompts
    assert timing["waves"] == 1 and timing["prefill_tok_s"] > 0
    assert 1 <= timing["decode_steps"] <= 12 and timing["decode_ms_per_step"] > 0
    assert timing["decode_rows_used"] == round(
        summary["new_tokens"] / (3 * timing["decode_steps"]), 3
    )
    prompts = [json.dumps(json.loads(line)["conversations"][:-1])
               for line in out.read_text().splitlines()]  # fmt: skip
    assert len(prompts) == len(set(prompts)) == 6


def test_distill_groups_prompts_in_their_shuffled_order(tiny_model_dir, data, tmp_path,
                                                        monkeypatch):  # fmt: skip
    """Waves are sorted by length only within a group, so a run stopped early has answered
    prompts of every length, in the shuffled order, group after group."""
    import drafter_svc.distill as distill_module
    from drafter_svc.data import read_conversations
    from drafter_svc.distill import DistillOptions, distill, prompt_groups, prompt_key, user_turns

    assert [len(g) for g in prompt_groups(range(7), 3)] == [3, 3, 1]
    assert list(prompt_groups([], 3)) == []
    monkeypatch.setattr(distill_module, "WAVES_PER_GROUP", 1)
    monkeypatch.setattr(distill_module, "PROMPT_CHUNK", 2)  # prompts tokenized two at a time
    out = tmp_path / "grouped.jsonl"
    opts = DistillOptions(target=str(tiny_model_dir), out=out, conversations=5,
                          max_new_tokens=3, batch_size=1, data=data, seed=3)  # fmt: skip
    distill(opts)
    written = [prompt_key([{"role": "user" if t["from"] == "human" else "assistant",
                            "content": t["value"]} for t in json.loads(line)["conversations"][:-1]])
               for line in out.read_text().splitlines()]  # fmt: skip
    streamed = [prompt_key(chat) for chat in user_turns(read_conversations(data), 3)][:5]
    assert written == streamed


def test_distill_of_first_turns_answers_each_opening_message(tiny_model_dir, data, tmp_path):
    from drafter_svc.distill import DistillOptions, distill

    out = tmp_path / "first.jsonl"
    opts = DistillOptions(target=str(tiny_model_dir), out=out, conversations=4,
                          max_new_tokens=4, batch_size=4, data=data, turns="first")  # fmt: skip
    distill(opts)
    records = [json.loads(line)["conversations"] for line in out.read_text().splitlines()]
    assert len(records) == 4 and all(len(turns) == 2 for turns in records)
    assert len({turns[0]["value"] for turns in records}) == 4


def test_distill_starts_no_wave_after_its_time_limit(tiny_model_dir, data, tmp_path):
    from drafter_svc.distill import DistillOptions, distill

    out = tmp_path / "limited.jsonl"
    opts = DistillOptions(target=str(tiny_model_dir), out=out, conversations=4, max_new_tokens=4,
                          batch_size=1, data=data, time_limit=1e-6)  # fmt: skip
    assert distill(opts)["new_replies"] == 0
    opts.prompts, opts.max_prompt_tokens = "self", 150
    assert distill(opts)["new_replies"] == 0 and not out.read_text()
    opts.time_limit = None
    assert distill(opts)["new_replies"] == 4
    with pytest.raises(ValueError, match="--time-limit must be > 0"):
        distill(DistillOptions(target=None, out=out, time_limit=0))


def test_distill_tokenizes_no_prompt_after_its_time_limit(tiny_model_dir, data, tmp_path,
                                                          monkeypatch):  # fmt: skip
    """A run at its time limit stops taking prompts: it does not tokenize the rest of the data
    before it ends."""
    import drafter_svc.distill as distill_module

    tokenized = []
    encode = distill_module.encode_texts
    monkeypatch.setattr(
        distill_module,
        "encode_texts",
        lambda tok, texts: tokenized.append(len(texts)) or encode(tok, texts),
    )
    opts = distill_module.DistillOptions(target=str(tiny_model_dir), out=tmp_path / "r.jsonl",
                                         conversations=4, max_new_tokens=2, batch_size=1,
                                         data=data, time_limit=1e-6)  # fmt: skip
    summary = distill_module.distill(opts)
    assert summary["new_replies"] == 0 and tokenized == []
    opts.time_limit = None
    summary = distill_module.distill(opts)
    assert summary["new_replies"] == 4 and tokenized == [12]  # the data's 12 prompts, one chunk
    assert summary["prompt_seconds"] >= 0 and summary["message_seconds"] is None


@pytest.mark.parametrize("setting", ["none", "padding", "truncation"])
def test_batched_prompt_encoding_equals_the_chat_templates_own(tiny_model_dir, tmp_path, setting):
    """Also for a tokenizer.json that turns padding or truncation on: the template's own call
    switches them off, so a batched encode must too (it runs first here, on a fresh load)."""
    import shutil

    from mlx_lm.utils import load_tokenizer

    from drafter_svc.distill import encode_texts

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    if setting == "padding":
        spec["padding"] = {"strategy": "BatchLongest", "direction": "Right",
                           "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0,
                           "pad_token": "<|endoftext|>"}  # fmt: skip
    elif setting == "truncation":
        spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                              "stride": 0}  # fmt: skip
    (model / "tokenizer.json").write_text(json.dumps(spec))
    chats = [[{"role": "user", "content": "say something"}],
             [{"role": "user", "content": "héllo — 世界 \u2028 emoji 🙂"},
              {"role": "assistant", "content": "  spaced\n\n reply "},
              {"role": "user", "content": "and\tthen?"}]]  # fmt: skip
    tokenizer = load_tokenizer(model)
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in chats]  # fmt: skip
    got = encode_texts(tokenizer, texts)
    expected = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True))
                for c in chats]  # fmt: skip
    assert len(expected[0]) != len(expected[1]) and min(map(len, expected)) > 8
    assert got == expected

    class OneAtATime:  # a tokenizer that only encodes one text at a time
        encode = staticmethod(tokenizer.encode)

    assert encode_texts(OneAtATime(), texts) == expected


def test_distill_in_another_dtype_gives_the_greedy_replies_of_that_dtype(
    tiny_model_dir, data, tmp_path
):
    from coordinator.bench import plain_decode
    from drafter_svc.data import ROLES
    from drafter_svc.distill import DistillOptions, distill
    from specd.models.load import load_target

    out = tmp_path / "half.jsonl"
    opts = DistillOptions(target=str(tiny_model_dir), out=out, conversations=2, max_new_tokens=8,
                          batch_size=1, data=data, dtype="bfloat16")  # fmt: skip
    assert distill(opts)["dtype"] == "bfloat16"
    half = load_target(str(tiny_model_dir), "bfloat16")
    assert half.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    for line in out.read_text().splitlines():
        turns = json.loads(line)["conversations"]
        chat = [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns[:-1]]
        prompt = half.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                    tokenize=True)  # fmt: skip
        greedy = plain_decode(half.model, list(prompt), 8, set(half.identity.eos_token_ids))
        assert turns[-1]["value"] == half.tokenizer.decode(greedy.token_ids).strip()


def test_distill_of_self_written_prompts_answers_messages_the_target_wrote(
    tiny_model_dir, tmp_path, monkeypatch
):
    """--prompts self: the target continues its template's opening of a user turn into a
    message, then answers it greedily; no message twice, none cut off at the cap, none a
    benchmark question, and a second run adds new ones."""
    from coordinator.bench import plain_decode
    from drafter_svc.distill import DistillOptions, distill, user_turn_opening
    from specd import datasets
    from specd.models.load import load_target

    plain = load_target(str(tiny_model_dir), "float32")
    tokenizer = plain.tokenizer
    opening = user_turn_opening(tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}],
                                         tokenize=True, add_generation_prompt=False)  # fmt: skip
    assert list(chat[: len(opening)]) == opening  # what the target continues is the template's

    def run(name: str, wanted: int, cap: int = 150) -> list[list[dict]]:
        out = tmp_path / name
        opts = DistillOptions(target=str(tiny_model_dir), out=out, conversations=wanted,
                              max_new_tokens=6, max_prompt_tokens=cap, batch_size=4,
                              prompts="self")  # fmt: skip
        summary = distill(opts)
        assert summary["prompts"] == "self" and summary["replies"] == wanted
        assert 0 < summary["message_seconds"] <= summary["seconds"]
        return [json.loads(line)["conversations"] for line in out.read_text().splitlines()]

    records = run("self.jsonl", 5)
    messages = [turns[0]["value"] for turns in records]
    assert len(records) == 5 and len(set(messages)) == 5
    eos = set(plain.identity.eos_token_ids)
    for turns in records:
        assert [t["from"] for t in turns] == ["human", "gpt"] and len(turns[0]["value"]) >= 8
        message = [{"role": "user", "content": turns[0]["value"]}]
        prompt = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True)
        greedy = plain_decode(plain.model, list(prompt), 6, eos).token_ids
        reply = [t for t in greedy if t not in eos]  # the EOS ends the reply, not part of it
        assert turns[1]["value"] == tokenizer.decode(reply).strip()
    resumed = run("self.jsonl", 8)  # draws afresh: three new messages, none repeated
    assert [t[0]["value"] for t in resumed[:5]] == messages
    assert len({t[0]["value"] for t in resumed}) == 8
    # the same seed writes the same messages again; one made a benchmark question is dropped
    monkeypatch.setattr(datasets, "benchmark_keys",
                        lambda: frozenset({datasets.benchmark_key(messages[0])}))  # fmt: skip
    again = [turns[0]["value"] for turns in run("again.jsonl", 2)]
    assert len(again) == 2 and messages[0] not in again and set(again) <= set(messages)
    with pytest.raises(ValueError, match="no new user message"):  # every message cut at 2
        run("cut.jsonl", 2, cap=2)


def test_self_written_messages_begin_with_the_openings_asked_for(tiny_model_dir, tmp_path):
    """--prompt-leads: every message starts with one of the openings, the target writing the
    rest after it, and its reply is the target's greedy answer to the whole message."""
    from coordinator.bench import plain_decode
    from drafter_svc.distill import TASK_LEADS, DistillOptions, distill, prompt_leads
    from specd.models.load import load_target

    leads = tmp_path / "leads.txt"
    leads.write_text("Write a poem about\n\nSolve for x:\n")
    assert prompt_leads(str(leads)) == ["Write a poem about", "Solve for x:"]
    assert prompt_leads("tasks") == list(TASK_LEADS) and prompt_leads(None) == []
    out = tmp_path / "led.jsonl"
    opts = DistillOptions(target=str(tiny_model_dir), out=out, conversations=6, max_new_tokens=4,
                          max_prompt_tokens=150, batch_size=4, prompts="self",
                          prompt_leads=str(leads))  # fmt: skip
    assert distill(opts)["replies"] == 6
    messages = [
        json.loads(line)["conversations"][0]["value"] for line in out.read_text().splitlines()
    ]
    assert len(set(messages)) == 6
    assert all(m.startswith(("Write a poem about", "Solve for x:")) for m in messages)
    assert {m.startswith("Solve") for m in messages} == {True, False}  # both drawn
    plain = load_target(str(tiny_model_dir), "float32")
    eos = set(plain.identity.eos_token_ids)
    for line in out.read_text().splitlines():
        message, reply = (t["value"] for t in json.loads(line)["conversations"])
        chat = [{"role": "user", "content": message}]
        prompt = plain.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True
        )
        greedy = plain_decode(plain.model, list(prompt), 4, eos).token_ids
        assert reply == plain.tokenizer.decode([t for t in greedy if t not in eos]).strip()
    for bad, why in ((tmp_path / "none.txt", "neither"), (tmp_path / "empty.txt", "no opening")):
        if "empty" in bad.name:
            bad.write_text("\n \n")
        with pytest.raises(ValueError, match=why):
            distill(DistillOptions(target=str(tiny_model_dir), out=tmp_path / "x.jsonl",
                                   prompts="self", prompt_leads=str(bad)))  # fmt: skip
    with pytest.raises(ValueError, match="--prompts self"):
        distill(DistillOptions(target=str(tiny_model_dir), out=tmp_path / "x.jsonl",
                               prompt_leads="tasks"))  # fmt: skip


def test_distill_waves_of_unequal_prompts_give_each_prompt_its_greedy_reply(tiny_model_dir):
    from coordinator.bench import plain_decode
    from drafter_svc.distill import greedy_waves
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    eos = set(loaded.identity.eos_token_ids)
    prompts = [[5 + i for i in range(n)] for n in (3, 11, 7, 20, 4)]
    got = dict(greedy_waves(loaded.model, prompts, 10, eos, batch_size=3))
    assert sorted(got) == list(range(len(prompts)))
    for index, prompt in enumerate(prompts):
        alone = plain_decode(loaded.model, prompt, 10, eos).token_ids
        assert got[index] == [t for t in alone if t not in eos]


def test_sampled_distill_draws_from_the_targets_distribution(tiny_model_dir):
    """At temperature 0.7 a reply's first token follows softmax(logits / 0.7) (chi-square over
    4,000 draws at once); seeded draws repeat; a near-zero temperature is the greedy reply."""
    from stats import chi_square

    from drafter_svc.distill import greedy_waves
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    eos = set(loaded.identity.eos_token_ids)
    prompt = [5, 9, 14, 3, 7]
    logits = loaded.model(mx.array([prompt]))[0, -1].astype(mx.float32)
    probs = np.array(mx.softmax(logits / 0.7))

    def first_tokens(temperature: float, copies: int, seed: int) -> list[int]:
        mx.random.seed(seed)
        waves = greedy_waves(loaded.model, [prompt] * copies, 1, set(), copies, temperature)
        return [reply[0] for _, reply in sorted(waves)]

    draws = first_tokens(0.7, 4000, seed=3)
    stat, critical, _ = chi_square(np.bincount(draws, minlength=len(probs)), probs)
    assert stat < critical
    assert first_tokens(1.0, 50, seed=4) == first_tokens(1.0, 50, seed=4)
    greedy = dict(greedy_waves(loaded.model, [prompt], 6, eos, 1))[0]
    cold = dict(greedy_waves(loaded.model, [prompt], 6, eos, 1, temperature=1e-4))[0]
    assert cold == greedy


def test_sampled_distill_runs_repeat_with_their_seed(tiny_model_dir, data, tmp_path):
    from drafter_svc.distill import DistillOptions, distill

    def run(name: str, seed: int) -> str:
        out = tmp_path / name
        summary = distill(DistillOptions(target=str(tiny_model_dir), out=out, conversations=3,
                                         max_new_tokens=8, batch_size=3, data=data,
                                         temperature=0.8, seed=seed))  # fmt: skip
        assert summary["temperature"] == 0.8 and summary["new_replies"] == 3
        return out.read_text()

    assert run("a.jsonl", 1) == run("b.jsonl", 1)
    with pytest.raises(ValueError, match="temperature"):
        distill(DistillOptions(target=str(tiny_model_dir), out=tmp_path / "c.jsonl",
                               temperature=-1.0, data=data))  # fmt: skip


def test_distill_resumes_after_a_kill_mid_write(tiny_model_dir, data, tmp_path):
    from drafter_svc.distill import DistillOptions, distill

    out = tmp_path / "replies.jsonl"
    opts = DistillOptions(target=str(tiny_model_dir), out=out, conversations=2,
                          max_new_tokens=6, batch_size=2, data=data)  # fmt: skip
    distill(opts)
    whole = out.read_text()
    out.write_text(whole + whole.splitlines()[0][:20])  # a third record cut off by a kill
    opts.conversations = 3
    assert distill(opts)["new_replies"] == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and out.read_text().startswith(whole)


def test_distill_refuses_an_out_file_it_did_not_write(tiny_model_dir, data, tmp_path):
    from drafter_svc.distill import DistillOptions, distill

    out = tmp_path / "other.jsonl"
    out.write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match="other.jsonl:1"):
        distill(DistillOptions(target=str(tiny_model_dir), out=out, conversations=1, data=data))
    assert out.read_text() == '{"a": 1}\n'


def test_features_reuse_a_smaller_cache_and_a_partial_run(tiny_model_dir, data, tmp_path,
                                                         monkeypatch):  # fmt: skip
    from drafter_svc import features as feature_cache
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    cache = tmp_path / "features"

    def features(n):
        opts = TrainOptions(target=str(tiny_model_dir), out=tmp_path, conversations=n,
                            max_len=64, data=data, cache_dir=cache)  # fmt: skip
        return feature_cache.prepare_features(FeatureSelection.of(opts), loaded, (0, 1))

    computed = []
    real = feature_cache.TargetFeatures.many
    monkeypatch.setattr(feature_cache.TargetFeatures, "many",
                        lambda self, exs: computed.extend(exs) or real(self, exs))  # fmt: skip
    small = features(2)
    assert len(computed) == 2
    full = features(6)
    assert len(computed) == 6  # the first two came from the n=2 cache
    for a, b in zip(small, full[:2], strict=True):
        assert (a.ids == b.ids).all() and (a.rows == b.rows).all()

    # a run cut off after a partial save resumes from it
    monkeypatch.setattr(feature_cache, "FEATURE_SAVE_EVERY", 2)
    monkeypatch.setattr(feature_cache, "FEATURE_SAVE_SECONDS", 0)
    for f in cache.glob("*.npz"):
        f.unlink()
    calls = {"n": 0}

    def dies_after_three(self, exs):
        calls["n"] += len(exs)
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(self, exs)

    monkeypatch.setattr(feature_cache.TargetFeatures, "many", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        features(6)
    assert len(list(cache.glob("*.partial.npz"))) == 1
    computed.clear()
    monkeypatch.setattr(feature_cache.TargetFeatures, "many",
                        lambda self, exs: computed.extend(exs) or real(self, exs))  # fmt: skip
    again = features(6)
    assert len(computed) == 4  # two were saved before the cut
    assert not list(cache.glob("*.partial.npz"))
    assert len(again) == len(full) == 6
    assert all(
        (a.ids == b.ids).all() and (a.lse == b.lse).all() for a, b in zip(again, full, strict=True)
    )


def test_features_that_cannot_fit_the_disk_are_refused_before_any_forward(
    tiny_model_dir, data, tmp_path, monkeypatch
):
    from drafter_svc import features as feature_cache
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    opts = TrainOptions(target=str(tiny_model_dir), out=tmp_path, conversations=6, max_len=64,
                        data=data, cache_dir=tmp_path / "f")  # fmt: skip
    computed = []
    real = feature_cache.TargetFeatures.many
    monkeypatch.setattr(feature_cache.TargetFeatures, "many",
                        lambda self, exs: computed.extend(exs) or real(self, exs))  # fmt: skip
    monkeypatch.setattr(feature_cache, "_free_bytes", lambda directory: 1000)
    with pytest.raises(ValueError, match=r"need .* GiB in .*f, which has 0.0 GiB free; pass fewer"):
        feature_cache.prepare_features(FeatureSelection.of(opts), loaded, (0, 1))
    assert computed == []

    # with room, the estimate is the file's contents: what the features hold per token
    monkeypatch.setattr(feature_cache, "_free_bytes", lambda directory: 2**40)
    feats = feature_cache.prepare_features(FeatureSelection.of(opts), loaded, (0, 1))
    tokens = sum(len(f.ids) for f in feats)
    per_token = feature_cache.feature_bytes_per_token(loaded.identity.hidden_size, 2)
    assert feature_cache._features_bytes(feats) == per_token * tokens


def test_the_final_feature_save_drops_the_partial_when_both_do_not_fit(
    tiny_model_dir, data, tmp_path, monkeypatch
):
    from drafter_svc import features as feature_cache
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    monkeypatch.setattr(feature_cache, "FEATURE_SAVE_EVERY", 2)
    monkeypatch.setattr(feature_cache, "FEATURE_SAVE_SECONDS", 0)
    cache = tmp_path / "f"
    opts = TrainOptions(target=str(tiny_model_dir), out=tmp_path, conversations=6, max_len=64,
                        data=data, cache_dir=cache, batch_size=2)  # fmt: skip
    real_save = feature_cache.save_features
    seen_at_final = []

    def save(path, feats):
        if ".partial." not in path.name:
            seen_at_final.append(sorted(f.name for f in cache.glob("*.npz")))
        real_save(path, feats)

    monkeypatch.setattr(feature_cache, "save_features", save)
    monkeypatch.setattr(feature_cache, "_free_bytes", lambda directory: 2**40)
    feature_cache.prepare_features(FeatureSelection.of(opts), loaded, (0, 1))
    assert any("partial" in name for name in seen_at_final[0])  # room for both: kept to the end

    for f in cache.glob("*.npz"):
        f.unlink()
    seen_at_final.clear()
    free = iter([2**40] + [10] * 100)  # room at the start, little at the final save
    monkeypatch.setattr(feature_cache, "_free_bytes", lambda directory: next(free))
    feats = feature_cache.prepare_features(FeatureSelection.of(opts), loaded, (0, 1))
    assert seen_at_final == [[]]
    assert sorted(f.name for f in cache.glob("*.npz")) == [
        f"n6-len64-seed0-layers0_1-{data.stem}-clean.npz"
    ]
    again = feature_cache.prepare_features(FeatureSelection.of(opts), loaded, (0, 1))
    assert all((a.rows == b.rows).all() for a, b in zip(feats, again, strict=True))


def test_features_of_a_padded_batch_equal_those_of_each_conversation_alone(tiny_model_dir,
                                                                           data):  # fmt: skip
    from drafter_svc.data import TargetFeatures, build_examples, read_conversations
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    examples = build_examples(loaded.tokenizer, read_conversations(data), 6, 4096, seed=0)
    assert len({len(ex.ids) for ex in examples}) > 1  # padding is exercised
    extractor = TargetFeatures(loaded.model, (0, 1))
    batched = extractor.many(examples)
    for ex, got in zip(examples, batched, strict=True):
        alone = extractor(ex)
        assert got.rows.shape == alone.rows.shape == (len(ex.ids), alone.rows.shape[1])
        np.testing.assert_allclose(got.rows, alone.rows, atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(got.final, alone.final, atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(got.lse, alone.lse, atol=1e-4, rtol=1e-5)
        assert (got.argmax == alone.argmax).all()


def test_features_in_batches_save_and_resume_like_one_at_a_time(tiny_model_dir, data, tmp_path,
                                                                monkeypatch):  # fmt: skip
    from drafter_svc import features as feature_cache
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    monkeypatch.setattr(feature_cache, "FEATURE_SAVE_EVERY", 3)
    monkeypatch.setattr(feature_cache, "FEATURE_SAVE_SECONDS", 0)
    opts = TrainOptions(target=str(tiny_model_dir), out=tmp_path, conversations=6, max_len=64,
                        data=data, cache_dir=tmp_path / "f", batch_size=4)  # fmt: skip
    real = feature_cache.TargetFeatures.many
    sizes = []

    def dies_on_second_batch(self, exs):
        sizes.append(len(exs))
        if len(sizes) == 2:
            raise KeyboardInterrupt
        return real(self, exs)

    monkeypatch.setattr(feature_cache.TargetFeatures, "many", dies_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        feature_cache.prepare_features(FeatureSelection.of(opts), loaded, (0, 1))
    assert sizes == [4, 2]  # the first batch crossed a save point, so it was kept
    monkeypatch.setattr(feature_cache.TargetFeatures, "many",
                        lambda self, exs: sizes.append(len(exs)) or real(self, exs))  # fmt: skip
    feats = feature_cache.prepare_features(FeatureSelection.of(opts), loaded, (0, 1))
    assert sizes[2:] == [2] and len(feats) == 6


def test_a_checkpoint_of_another_run_is_refused(tiny_model_dir, data, tmp_path):
    out = tmp_path / "head"
    common = dict(target=str(tiny_model_dir), out=out, max_len=64, draft_vocab=100,
                  save_every=2, warmup=2, data=data, epochs=1)  # fmt: skip
    train_eagle3(TrainOptions(**common, conversations=6))
    with pytest.raises(ValueError, match=r"another training run \(conversations 6 -> 4\)"):
        train_eagle3(TrainOptions(**common, conversations=4))
    fresh = train_eagle3(TrainOptions(**common, conversations=4, resume=False))
    assert fresh["steps"] == 4
    # a checkpoint written before an option existed resumes while the option stays unset
    state = out / "checkpoint" / "state.json"
    saved = json.loads(state.read_text())
    del saved["run"]["held_out_data"]
    state.write_text(json.dumps(saved))
    assert train_eagle3(TrainOptions(**{**common, "epochs": 2}, conversations=4))["steps"] == 8


def test_no_benchmark_prompt_reaches_training_or_distillation(tmp_path):
    """A conversation holding a turn of MT-bench, HumanEval or the input-grounded set, however
    its whitespace and case differ, is left out of what train and distill read."""
    from drafter_svc.data import read_conversations
    from drafter_svc.distill import user_turns
    from specd.datasets import load_questions

    grounded = load_questions("input-grounded")[0].turns[0]
    mt_second_turn = load_questions("mt-bench")[3].turns[1]

    def chat(*turns):
        roles = ["human", "gpt"] * len(turns)
        pairs = zip(roles[: len(turns)], turns, strict=True)
        return {"conversations": [{"from": r, "value": t} for r, t in pairs]}

    records = [
        chat("a fresh question", "an answer"),
        chat("  " + grounded.upper().replace("\n", "  \n "), "copied"),
        chat("warm-up", "ok", mt_second_turn, "reply"),
        chat("another fresh one", "fine"),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    kept = read_conversations(path)
    assert [r["conversations"][0]["value"] for r in kept] == ["a fresh question",
                                                              "another fresh one"]  # fmt: skip
    openings = [chat[0]["content"] for chat in user_turns(kept, seed=0)]
    assert sorted(openings) == ["a fresh question", "another fresh one"]


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """A reply may hold U+2028, U+0085 or a form feed, which str.splitlines() splits at but
    JSON Lines does not: training and distill's resume read such a record whole."""
    from drafter_svc.data import read_conversations
    from drafter_svc.distill import _done_prompts

    odd = "one\u2028two\x85three\x0cfour"
    record = {"conversations": [{"from": "human", "value": f"q {odd}"},
                                {"from": "gpt", "value": odd}]}  # fmt: skip
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_conversations(path) == [record]
    assert len(_done_prompts(path)) == 1


def test_a_checkpoint_killed_mid_write_still_resumes(tmp_path, monkeypatch):
    import mlx.nn as nn
    import mlx.optimizers as optim

    from drafter_svc import checkpoints

    model, optimizer = nn.Linear(4, 3), optim.Adam(1e-3)
    optimizer.init(model.trainable_parameters())
    run = {"data": "chats.jsonl"}
    checkpoints.save_training_state(tmp_path, model, optimizer, 40, run)
    saved = np.array(model.weight)
    model.weight = model.weight + 1

    real_save = mx.save_safetensors

    def killed_after_half(path, arrays):  # the optimizer's file is cut off part way
        if "optimizer" in str(path):
            real_save(path, arrays)
            with open(path, "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            raise KeyboardInterrupt
        real_save(path, arrays)

    monkeypatch.setattr(checkpoints.mx, "save_safetensors", killed_after_half)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save_training_state(tmp_path, model, optimizer, 80, run)
    monkeypatch.undo()
    fresh, fresh_optimizer = nn.Linear(4, 3), optim.Adam(1e-3)
    fresh_optimizer.init(fresh.trainable_parameters())
    # the step before, its optimizer whole; the weights written whole are the newer ones
    assert checkpoints.load_training_state(tmp_path, fresh, fresh_optimizer, run) == 40
    np.testing.assert_array_equal(np.array(fresh.weight), saved + 1)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]


def test_dflash_step_cut_into_groups_updates_as_one_packed_context(
    tiny_model_dir, data, tmp_path, monkeypatch
):
    """A step's conversations packed in several contexts (to bound the attention scores) give
    the update one context gives: the groups' gradients summed by their weights."""
    from mlx.utils import tree_flatten

    import drafter_svc.dflash.train as dflash_train
    from specd.models.load import load_target

    opts = DFlashOptions(target=str(tiny_model_dir), out=tmp_path / "d", conversations=6,
                         max_len=64, block_size=4, layers=1, anchors=4, warmup=1, data=data,
                         batch_size=6, lr=1e-2)  # fmt: skip
    loaded = load_target(opts.target, "float32")
    layers = (0, 1)
    feats = dflash_train.prepare_features(FeatureSelection.of(opts), loaded, layers)

    def one_step():
        mx.random.seed(0)
        trainer = dflash_train.DFlashTrainer(opts, loaded, feats, layers)
        before = {k: np.array(v) for k, v in tree_flatten(trainer.model.parameters())}
        loss, tau = trainer.train_step(feats, np.random.default_rng(3))
        after = {k: np.array(v) for k, v in tree_flatten(trainer.model.parameters())}
        return trainer, loss, tau, before, after

    whole, loss, tau, before, after = one_step()
    assert len(whole.groups(feats)) == 1
    assert max(np.abs(after[k] - before[k]).max() for k in after) > 1e-4  # it did learn
    monkeypatch.setattr(dflash_train, "MAX_SCORES_PER_GROUP", 1)  # one conversation a group
    cut, cut_loss, cut_tau, cut_before, cut_after = one_step()
    assert len(cut.groups(feats)) == len(feats)
    assert cut_loss == pytest.approx(loss, rel=1e-5) and cut_tau == pytest.approx(tau)
    for key, value in after.items():
        np.testing.assert_array_equal(cut_before[key], before[key])
        np.testing.assert_allclose(cut_after[key], value, atol=1e-5)
