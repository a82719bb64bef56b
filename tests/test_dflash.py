"""DFlash: loading the z-lab config, attention visibility, the cache of accepted context, and
greedy identity through real services with a tiny random target and drafter."""

from __future__ import annotations

import itertools
import json
import shutil

import grpc
import mlx.core as mx
import numpy as np
import pytest
from stats import chi_square
from test_sampling_services import PROMPT, exact_second_token_distribution, sample_many
from tiny import make_tiny_dflash_dir

from coordinator.bench import plain_decode
from drafter_svc.checkpoints import CheckpointError
from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.dflash.draft import BlockDrafter, best_first_tree
from drafter_svc.dflash.model import load_drafter, save_draft_vocab, save_drafter
from drafter_svc.dflash.proposer import DEFAULT_TREE_TOP_K
from drafter_svc.proposal import TreeShape
from drafter_svc.server import make_proposer
from specd.client import CoordinatorClient, make_request
from specd.launch import Stack, spawn
from specd.models.load import load_target
from specd.v1 import common_pb2, drafter_pb2_grpc
from verifier_svc.tree import check_parents, depths

PROMPTS = ["Hello there, hello there, hello", "abcabcabcabc", "The quick brown fox"]


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir, tmp_path_factory):
    return make_tiny_dflash_dir(tmp_path_factory.mktemp("dflash") / "d", tiny_model_dir)


@pytest.fixture(scope="module")
def block(drafter_dir):
    rng = np.random.default_rng(0)
    model = load_drafter(drafter_dir)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    emb = mx.array(rng.normal(size=(vocab, hidden)).astype(np.float32))
    head = mx.array(rng.normal(size=(vocab, hidden)).astype(np.float32))
    return BlockDrafter(model, emb, head)


def rows_for(n: int, width: int, seed: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=(n, width)).astype(np.float32))


def test_published_config_fields_load_and_round_trip(drafter_dir, tmp_path):
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [0, 1]}
    assert config["block_size"] == 4
    model = load_drafter(drafter_dir)
    save_drafter(model, tmp_path / "again", dtype=mx.float32)
    again = load_drafter(tmp_path / "again")
    emb = mx.ones((1, 4, model.config.hidden_size))
    assert np.allclose(np.array(model(emb, 0, [None] * 2)), np.array(again(emb, 0, [None] * 2)))


@pytest.mark.parametrize("missing", ["mask_token_id", "target_layer_ids"])
def test_required_fields_are_never_guessed(drafter_dir, tmp_path, missing):
    target = tmp_path / "d"
    target.mkdir()
    config = json.loads((drafter_dir / "config.json").read_text())
    del config["dflash_config"][missing]
    (target / "config.json").write_text(json.dumps(config))
    (target / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="not guessed"):
        load_drafter(target)


def test_block_is_bidirectional_and_sees_only_earlier_context(block):
    """Changing a later block token changes earlier block outputs (bidirectional); context
    rows at or after the anchor are never read."""
    width = block.row_width
    tokens = [5, 6, 7, 8, 9, 10]
    state = block.open(tokens, rows_for(5, width))
    base = np.array(block.block_logits(state, 4))
    # the block itself: a different last-token at position 0 alters every output position
    other = block.open([5, 6, 7, 8, 9, 11], rows_for(5, width))
    changed = np.array(block.block_logits(other, 4))
    assert not np.allclose(base, changed)
    # bidirectional: position 1's output depends on position 3's token
    n = len(tokens) - 1
    emb = block.embedding[mx.array([10, 0, 0, 0])][None]
    emb2 = block.embedding[mx.array([10, 0, 0, 3])][None]
    h1 = np.array(block.model(emb, n, state.context()))[0, 1]
    h2 = np.array(block.model(emb2, n, state.context()))[0, 1]
    assert not np.allclose(h1, h2)
    # the context: rows of positions before the anchor only (entries = len - 1)
    assert state.entries == len(tokens) - 1


def test_cache_holds_accepted_context_only(block):
    width = block.row_width
    state = block.open([1, 2, 3, 4], rows_for(3, width))
    before = [np.array(k) for k, _ in state.context()]
    block.propose(state, 3)
    block.propose(state, 3, temperature=1.0, rng=np.random.default_rng(0))
    assert state.entries == 3 and state.tokens == [1, 2, 3, 4]
    after = [np.array(k) for k, _ in state.context()]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    # extending with committed tokens adds exactly their rows
    block.extend(state, [5, 6], rows_for(2, width, seed=2))
    assert state.entries == 5
    all_rows = mx.concatenate([rows_for(3, width), rows_for(2, width, seed=2)])
    whole = block.open([1, 2, 3, 4, 5, 6], all_rows)
    assert np.allclose(np.array(block.block_logits(state, 4)),
                       np.array(block.block_logits(whole, 4)), atol=1e-4)  # fmt: skip
    with pytest.raises(ValueError, match="rows for"):
        block.extend(state, [7], rows_for(3, width))
    assert state.tokens == [1, 2, 3, 4, 5, 6]


def test_sampled_drafts_come_with_their_distributions(block):
    state = block.open([1, 2, 3, 4], rows_for(3, block.row_width))
    p = block.propose(state, 3, temperature=0.8, rng=np.random.default_rng(1))
    assert len(p.ids) == 3 and p.probs.shape == (3, block.cfg.vocab_size)
    assert np.allclose(p.probs.sum(1), 1, atol=1e-4)
    assert all(p.probs[i, t] > 0 for i, t in enumerate(p.ids))


def test_frequency_ranked_readout_drafts_the_best_listed_token(block):
    state = block.open([1, 2, 3, 4], rows_for(3, block.row_width))
    full = np.array(block.block_logits(state, 5))
    best = full.argmax(1)
    vocab = block.cfg.vocab_size
    unlisted = int(best[0])  # the full head's first choice is left out of the list
    listed = np.array([t for t in range(vocab) if t != unlisted and t % 3 != 1])
    part = BlockDrafter(block.model, block.embedding, block.lm_head, readout_ids=listed[::-1])
    got = part.propose(state, 4).ids
    assert got == [int(listed[full[i, listed].argmax()]) for i in range(4)]
    assert got[0] != unlisted
    sampled = part.propose(state, 4, temperature=1.0, rng=np.random.default_rng(2))
    assert sampled.probs.shape == (4, vocab) and np.allclose(sampled.probs.sum(1), 1, atol=1e-4)
    outside = np.setdiff1d(np.arange(vocab), listed)
    assert not sampled.probs[:, outside].any() and set(sampled.ids) <= set(listed.tolist())


def test_draft_vocab_options_are_checked(drafter_dir, tiny_model_dir, tmp_path):
    def proposer(weights, n=None):
        options = drafter_options("dflash", weights=weights, draft_vocab=n)
        return make_proposer(DrafterConfig(**options, target=str(tiny_model_dir)))

    assert proposer(drafter_dir).params()["draft_vocab"] == "all"
    with pytest.raises(CheckpointError, match="has no draft_vocab.npy"):
        proposer(drafter_dir, 10)
    listed = tmp_path / "listed"
    shutil.copytree(drafter_dir, listed)
    save_draft_vocab(listed, [5, 9, 2, 7])
    assert proposer(listed).params()["draft_vocab"] == "4"
    assert proposer(listed, 2).drafter.readout_ids.tolist() == [5, 9]
    assert proposer(listed, 0).params()["draft_vocab"] == "all"
    with pytest.raises(CheckpointError, match="lists 4 tokens"):
        proposer(listed, 5)
    save_draft_vocab(listed, [5, 5])
    with pytest.raises(CheckpointError, match="repeat"):
        proposer(listed)
    with pytest.raises(ValueError, match="--draft-vocab"):
        drafter_options("dflash", draft_vocab=-1)


def test_a_bad_draft_vocab_ends_the_drafter_with_its_reason(tmp_path):
    """It failed as it should, yet the process then aborted (134) in 3 of 4 tries: the MLX
    thread, just done with the failed load, raced the interpreter's finalization. The shipped
    drafter (its 8192-token list) on the embedded target, as a user would start it."""
    for attempt in range(3):
        args = ["--kind", "dflash", "--draft-vocab", "99999"]
        proc = spawn("drafter", args, log_dir=tmp_path / str(attempt))
        assert proc.process.wait(timeout=120) == 1, proc.log_tail()
        assert "lists 8192 tokens" in proc.log_path.read_text()


@pytest.fixture(scope="module")
def listed_drafter_dir(drafter_dir, tiny_model_dir, tmp_path_factory):
    listed = tmp_path_factory.mktemp("listed") / "d"
    shutil.copytree(drafter_dir, listed)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    save_draft_vocab(listed, np.random.default_rng(3).permutation(vocab)[: vocab // 2])
    return listed


def test_greedy_output_with_a_readout_list_equals_plain_decoding(
    tiny_model_dir, listed_drafter_dir, tmp_path
):
    plain = load_target(str(tiny_model_dir), "float32")
    with Stack(
        target=str(tiny_model_dir),
        drafter="dflash",
        drafter_args=["--weights", str(listed_drafter_dir)],
        startup_timeout_s=120,
        log_dir=tmp_path,
    ) as s:
        client = CoordinatorClient(s.coordinator)
        for prompt in PROMPTS:
            ids = plain.tokenizer.encode(prompt)
            ref = plain_decode(plain.model, ids, 40, set(plain.identity.eos_token_ids)).token_ids
            result = client.generate(make_request(prompt=prompt, max_tokens=40, num_draft_tokens=3))
            assert result.token_ids == ref, prompt
            assert result.stats["drafted"] > 0
        client.close()


@pytest.fixture(scope="module")
def stack(tiny_model_dir, drafter_dir, tmp_path_factory):
    with Stack(
        target=str(tiny_model_dir),
        drafter="dflash",
        drafter_args=["--weights", str(drafter_dir)],
        # trees reach the verifier whole: the tests count their nodes, which the cut at
        # measured prices would make depend on timings
        coordinator_args=["--no-priced-tree-cut"],
        startup_timeout_s=120,
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as s:
        yield s


@pytest.mark.parametrize("k", [None, 1, 7])  # default block 4, then blocks 2 and 8
def test_greedy_output_equals_plain_decoding(stack, tiny_model_dir, k):
    plain = load_target(str(tiny_model_dir), "float32")
    client = CoordinatorClient(stack.coordinator)
    drafted = 0
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        ref = plain_decode(plain.model, ids, 40, set(plain.identity.eos_token_ids)).token_ids
        result = client.generate(make_request(prompt=prompt, max_tokens=40, num_draft_tokens=k))
        assert result.token_ids == ref, prompt
        # adaptive k (k None) probes a random drafter it finds hopeless beside decode bursts,
        # so not every request verifies drafts; every one asks the drafter
        assert result.stats["draft_calls"] > 0
        assert k is None or result.stats["drafted"] > 0  # k pinned: every round drafts
        drafted += result.stats["drafted"]
    assert drafted > 0
    client.close()


def test_drafter_for_another_target_is_refused(other_tiny_model_dir, drafter_dir, tmp_path):
    proc = spawn(
        "drafter",
        ["--kind", "dflash", "--target", str(other_tiny_model_dir), "--weights",
         str(drafter_dir)],
        log_dir=tmp_path,
    )  # fmt: skip
    assert proc.process.wait(timeout=120) != 0
    assert "trained for target" in proc.log_path.read_text()


def test_conversations_packed_in_one_step_are_drafted_as_each_alone(block):
    """Training packs several conversations into one context: each block sees its own
    conversation only, so its logits equal those with that conversation alone."""
    from drafter_svc.dflash.train import dflash_loss

    model, emb, head = block.model, block.embedding, block.lm_head
    cfg = model.config
    width = len(cfg.target_layer_ids) * cfg.feature_size
    bs, vocab = cfg.block_size, cfg.vocab_size
    lengths, anchors_of = (9, 12), (np.array([2, 5]), np.array([1, 4, 8]))
    rows = [rows_for(n, width, seed=n) for n in lengths]
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, vocab, size=(len(a), bs)).astype(np.int32) for a in anchors_of]
    target_p = [mx.softmax(mx.array(rng.normal(size=(len(a), bs - 1, vocab))), -1)
                for a in anchors_of]  # fmt: skip
    weights = [mx.ones((len(a), bs - 1)) for a in anchors_of]

    def logits(rows, anchors, starts, ids, p, w):
        _, out = dflash_loss(model, emb, head, rows, mx.array(anchors), mx.array(starts),
                             mx.array(ids), p, w)  # fmt: skip
        return np.array(out)

    alone = [
        logits(r, a, np.zeros(len(a), np.int64), ids, p, w)
        for r, a, ids, p, w in zip(rows, anchors_of, blocks, target_p, weights, strict=True)
    ]
    offset = lengths[0]
    packed = logits(
        mx.concatenate(rows),
        np.concatenate([anchors_of[0], anchors_of[1] + offset]),
        np.concatenate([np.zeros(2, np.int64), np.full(3, offset)]),
        np.concatenate(blocks),
        mx.concatenate(target_p),
        mx.concatenate(weights),
    )
    assert np.allclose(packed[:2], alone[0], atol=1e-4)
    assert np.allclose(packed[2:], alone[1], atol=1e-4)


def test_best_first_tree_takes_the_best_root_paths():
    rng = np.random.default_rng(3)
    depth, width, budget = 5, 3, 10
    logp = np.sort(np.log(rng.dirichlet(np.ones(8), size=depth))[:, :width], axis=1)[:, ::-1]
    parents, picks = best_first_tree(logp, budget)
    paths = []
    for node, (d, rank) in enumerate(picks):
        parent = parents[node]
        assert parent < node  # parents come first
        assert d == (0 if parent < 0 else picks[parent][0] + 1)
        paths.append((() if parent < 0 else paths[parent]) + (rank,))
        if node and parent == node - 1:
            assert rank == 0  # depth-first: a node's first child, its likeliest, follows it
        elif node:
            assert rank > 0  # a later sibling
    every = [p for n in range(1, depth + 1) for p in itertools.product(range(width), repeat=n)]

    def score(path):
        return sum(logp[d, r] for d, r in enumerate(path))

    assert sorted(paths) == sorted(sorted(every, key=score, reverse=True)[:budget])


def test_a_probability_floor_ends_the_best_first_tree():
    """--tree-min-prob: the best root paths down to the floor, the first always."""
    rng = np.random.default_rng(5)
    logp = np.sort(np.log(rng.dirichlet(np.ones(8), size=5))[:, :3], axis=1)[:, ::-1]
    whole_parents, whole = best_first_tree(logp, 30)

    def score(node, parents, picks):
        total = 0.0
        while node >= 0:
            total += logp[picks[node]]
            node = parents[node]
        return total

    scores = sorted((score(n, whole_parents, whole) for n in range(30)), reverse=True)
    for floor in (scores[0] + 1, scores[3], scores[10] - 1e-9, -np.inf):
        parents, picks = best_first_tree(logp, 30, floor)
        kept = [score(n, parents, picks) for n in range(len(picks))]
        assert len(picks) == max(1, sum(s >= floor for s in scores))
        assert (
            all(s >= floor for s in kept[1:]) and sorted(kept, reverse=True) == scores[: len(kept)]
        )


def test_a_block_tree_holds_each_positions_best_tokens(block):
    state = block.open([1, 2, 3, 4, 5], rows_for(4, block.row_width))
    logits = np.array(block.block_logits(state, 5))
    tree = block.tree(state, TreeShape(total_tokens=9, depth=4, top_k=3))
    assert len(tree.ids) == 9 and tree.probs is None
    assert tree.ids[0] == block.propose(state, 4).ids[0]  # the root's best child: the chain's
    node_depths = depths(tree.parents)
    for node, depth in enumerate(node_depths):
        assert tree.ids[node] in np.argsort(-logits[depth - 1])[:3]
    siblings = [(tree.parents[i], tree.ids[i]) for i in range(9)]
    assert len(set(siblings)) == 9 and max(node_depths) <= 4
    check_parents(tree.parents, len(tree.ids))  # parents first, as the verifier takes them
    for node, parent in enumerate(tree.parents):  # each node's path log-probability
        row = logits[node_depths[node] - 1].astype(np.float64)
        own = row[tree.ids[node]] - np.logaddexp.reduce(row)
        base = 0.0 if parent < 0 else tree.scores[parent]
        assert tree.scores[node] == pytest.approx(base + own, abs=1e-4)
    line = [0]
    while line[-1] + 1 < 9 and tree.parents[line[-1] + 1] == line[-1]:
        line.append(line[-1] + 1)
    assert tree.ids[: len(line)] == block.propose(state, len(line)).ids  # the likeliest line


def test_a_shallow_tree_reads_the_whole_block(block):
    """A drafter trained on blocks of N guesses worse in shorter ones, so a tree shallower than
    the block (adaptive k asks for such) still runs the whole block."""
    state = block.open([1, 2, 3, 4, 5], rows_for(4, block.row_width))
    whole = np.array(block.block_logits(state, 8))[0]
    tree = block.tree(state, TreeShape(total_tokens=3, depth=1, top_k=3), block_drafts=7)
    assert set(tree.ids) == set(np.argsort(-whole)[:3].tolist())
    assert tree.parents == [-1, -1, -1]


def test_dflash_tree_options_reach_the_proposer(drafter_dir, tiny_model_dir):
    def proposer(**tree):
        options = drafter_options("dflash", weights=drafter_dir, **tree)
        return make_proposer(DrafterConfig(target=str(tiny_model_dir), **options))

    chains = proposer()
    assert chains.default_tree.total_tokens == 0 and chains.params()["tree"] == "chain"
    block = chains.default_draft_tokens
    trees = proposer(tree_total_tokens=6)
    assert trees.default_tree == TreeShape(6, block, DEFAULT_TREE_TOP_K)
    # any tree flag turns trees of the default size on, as for EAGLE-3
    assert proposer(tree_top_k=3).default_tree == TreeShape(TreeShape.total_tokens, block, 3)
    state = trees.open([1, 2, 3, 4], rows_for(3, trees.drafter.row_width))
    drafted = trees.propose(state, block)
    assert len(drafted.ids) == 6 and drafted.parents is not None
    assert max(depths(drafted.parents)) <= block
    assert max(depths(trees.propose(state, 2).parents)) <= 2  # k bounds the depth
    chain = trees.propose(state, 3, tree=TreeShape(6, 0, 1))  # one token a position
    assert chain.parents is None and chain.ids == chains.propose(state, 3).ids


def test_greedy_output_with_trees_equals_plain_decoding(stack, tiny_model_dir):
    plain = load_target(str(tiny_model_dir), "float32")
    client = CoordinatorClient(stack.coordinator)
    for prompt in PROMPTS:
        ids = plain.tokenizer.encode(prompt)
        ref = plain_decode(plain.model, ids, 40, set(plain.identity.eos_token_ids)).token_ids
        request = make_request(prompt=prompt, max_tokens=40, num_draft_tokens=3, tree=(7, 3, 3))
        result = client.generate(request)
        assert result.token_ids == ref, prompt
        assert result.stats["drafted"] > 3 * result.stats["rounds"]  # more than a chain of 3
    client.close()


def test_a_chain_default_drafter_tells_the_tree_it_would_draw(stack):
    """Trees a request asks of it take its fan-out (8), also under adaptive k."""
    with grpc.insecure_channel(stack.services["drafter"].address) as channel:
        info = drafter_pb2_grpc.DrafterStub(channel).GetInfo(common_pb2.InfoRequest())
    assert info.drafts_trees and info.max_tree_tokens > 0
    assert info.default_tree.total_tokens == 0 and info.default_tree.top_k == DEFAULT_TREE_TOP_K


def test_sampled_trees_keep_the_targets_distribution(stack, tiny_model_dir):
    target = load_target(str(tiny_model_dir), "float32")
    prompt_ids = target.tokenizer.encode(PROMPT)
    expected = exact_second_token_distribution(target.model, prompt_ids)
    client = CoordinatorClient(stack.coordinator)
    tokens, drafted = sample_many(client, prompt_ids, 600, num_draft_tokens=3, tree=(6, 3, 3))
    client.close()
    assert drafted >= 600 * 6  # every first round verified a tree
    second = np.array([t[1] for t in tokens if len(t) > 1])
    observed = np.bincount(second, minlength=len(expected))
    assert not observed[expected == 0].any(), "a token outside top-k was emitted"
    stat, crit, df = chi_square(observed, expected)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"


def test_sampled_requests_with_adaptive_k_complete(stack):
    """Unseeded sampling runs adaptive k, whose plain bursts of several steps bring back the
    hidden rows the drafter takes."""
    client = CoordinatorClient(stack.coordinator)
    for _ in range(3):
        result = client.generate(make_request(prompt=PROMPTS[0], max_tokens=40, temperature=1.0))
        assert 0 < len(result.token_ids) <= 40
        assert result.stats["rounds"] < len(result.token_ids)  # bursts of several steps ran
    client.close()
