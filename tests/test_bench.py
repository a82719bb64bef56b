"""`specd bench` end to end on a tiny target: JSON shape, identity, the in-process column."""

import json
import os
import subprocess
import sys
import time

import pytest


def test_bench_compares_drafters_and_writes_json_markdown_chart(tiny_model_dir, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        '{"question_id": 1, "category": "a", "turns": ["abcabcabc abc"]}\n'
        '{"question_id": 2, "category": "b", "turns": ["hello hello hello"]}\n'
    )
    out = tmp_path / "out.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "specd",
            "bench",
            "--questions",
            str(questions),
            "--target",
            str(tiny_model_dir),
            "--max-tokens",
            "24",
            "--in-process",
            "--drafter",
            "ngram,ngram-k2,ngram-serial,none",
            "--json",
            str(out),
            "--repeat",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "out-ngram.json").read_text())
    none = json.loads((tmp_path / "out-none.json").read_text())
    assert none["drafter"] == "none" and none["overall"]["tau"] == 1.0
    pinned = json.loads((tmp_path / "out-ngram-k2.json").read_text())
    assert result["adaptive"] is True and pinned["adaptive"] is False
    assert result["repeat"] == 2
    assert result["host"]["cores"] == os.cpu_count()  # timings say which machine made them
    # k pinned at 2: no round asks for more (n-gram's own default is 8)
    assert all(q["drafted"] <= 2 * q["rounds"] for q in pinned["questions"])
    assert pinned["overall"]["identical"] == 2
    assert {"draft_compute", "verify_compute"} <= set(pinned["overall"]["round_split_ms"])
    assert 0 < pinned["overall"]["round_outside_median_ms"] < 1000
    # the prompt's cost on each side: the services' prefill, plain mlx-lm's first token
    assert pinned["overall"]["prefill_median_ms"] > 0
    assert (
        0
        < pinned["overall"]["baseline_first_token_median_ms"]
        < 1000 * min(q["baseline_s"] for q in pinned["questions"])
    )
    assert "prompt, median question: prefill" in run.stdout
    table = (tmp_path / "out.md").read_text()
    assert "| ngram | **overall** |" in table and "| none | **overall** |" in table
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    assert {
        "target",
        "drafter",
        "dtype",
        "max_tokens",
        "temperature",
        "questions",
        "by_category",
        "overall",
    } <= set(result)
    # the first request after SERVING was timed and set against the same request run later
    assert result["first_request_vs_later"] > 0
    assert result["questions"][0]["first_request_tokens"] == result["questions"][0]["tokens"]
    from coordinator.bench import FIRST_REQUEST_AGAIN

    assert len(result["questions"][0]["first_request_again_s"]) == FIRST_REQUEST_AGAIN
    for q in result["questions"]:
        assert {
            "question_id",
            "category",
            "tokens",
            "baseline_s",
            "spec_s",
            "tau",
            "identical",
            "inproc_s",
            "inproc_verify_compute_s",
        } <= set(q)
        assert q["inproc_verify_compute_s"] > 0
    assert set(result["by_category"]) == {"a", "b"}
    overall = result["overall"]
    assert overall["identical"] == overall["count"] == 2
    assert overall["speedup"] > 0 and overall["split_vs_inprocess"] > 0
    assert overall["compute_split_vs_inprocess"] > 0
    assert overall["speedup_median"] > 0 and overall["split_vs_inprocess_median"] > 0
    # "-serial": the coordinator makes every draft call before its verify
    serial = json.loads((tmp_path / "out-ngram-serial.json").read_text())
    assert serial["overall"]["identical"] == 2
    assert all(q["beside_calls"] == 0 < q["draft_calls"] for q in serial["questions"])
    # on by default (k pinned: adaptive k's requests start from the drafter's fruitless streak
    # of the requests before, and these short ones then skip its calls)
    assert sum(q["beside_calls"] for q in pinned["questions"]) > 0
    assert "the target's forwards alone:" in run.stdout
    assert "median question: speed-up" in run.stdout
    assert "OVERALL" in run.stdout


def test_medians_per_question_shrug_off_one_slow_question():
    from coordinator.bench import summarize

    def row(base, spec, inproc):
        return {"baseline_s": base, "spec_s": spec, "inproc_s": inproc, "rounds": 10,
                "accepted": 0, "identical": True, "baseline_tokens": 10, "tokens": 10,
                "draft_s": 0, "verify_s": 0, "coordinator_s": 0, "draft_compute_s": 0,
                "verify_compute_s": 1, "inproc_verify_compute_s": 1, "prefill_s": 0.1,
                "baseline_first_token_s": 0.05, "round_overhead_median_s": 0.001}  # fmt: skip

    rows = [row(3, 1, 1), row(3, 1, 0.9), row(3, 1, 1.1), row(3, 3, 1)]  # the last: a slow spell
    out = summarize(rows)
    assert out["speedup"] == 2.0 and out["speedup_median"] == 3.0
    assert out["split_vs_inprocess"] == pytest.approx(4 / 6)
    assert out["split_vs_inprocess_median"] == pytest.approx(0.95)  # of 1/3, 0.9, 1, 1.1
    assert (out["prefill_median_ms"], out["baseline_first_token_median_ms"]) == (100.0, 50.0)


def test_repeats_keep_the_fastest_run_of_each_mode_and_every_difference():
    from types import SimpleNamespace

    from coordinator.bench import Baseline, _fastest_row
    from coordinator.rounds import RoundStats

    keys = ("tau", "rounds", "drafted", "accepted", "draft_s", "verify_s", "coordinator_s",
            "prefill_s", "draft_compute_s", "verify_compute_s", "round_overhead_median_s",
            "draft_calls", "beside_calls", "predrafted_rounds")  # fmt: skip

    def spec(ids, tau):
        return SimpleNamespace(token_ids=ids, stats={k: 1.0 for k in keys} | {"tau": tau})

    def inproc(seconds, tokens=3):
        return seconds, RoundStats(
            rounds=5, total_s=seconds, verify_compute_s=seconds / 2, generated_tokens=tokens
        )

    question = SimpleNamespace(question_id=7, category="c")
    base = Baseline([1, 2, 3], 3.0, [])
    tries = [(spec([1, 2, 3], 1.1), 1.5, inproc(1.2)), (spec([1, 2, 3], 1.2), 1.0, inproc(1.4))]
    row = _fastest_row(question, base, tries, 0.0)
    assert row["spec_s"] == 1.0 and row["tau"] == 1.2 and row["identical"] is True
    assert row["inproc_s"] == 1.2 and row["inproc_verify_compute_s"] == 0.6
    tries.append((spec([1, 2, 4], 1.0), 2.0, inproc(1.3)))  # slower, but it differs
    row = _fastest_row(question, base, tries, 0.0)
    assert row["identical"] is False and row["first_difference"] == 2
    row = _fastest_row(question, base, [(spec([1, 2, 4], 1.0), 0.5, inproc(1.0))], 0.0)
    assert row["identical"] is False and row["spec_s"] == 0.5  # the fastest run differs
    # sampled runs differ in length: the fastest per token is kept, not the shortest
    short = (spec([1], 1.0), 0.6, inproc(0.5, tokens=1))
    long = (spec([1, 2, 3, 4], 1.0), 1.2, inproc(1.0, tokens=4))
    row = _fastest_row(question, base, [short, long], 0.7)
    assert row["spec_s"] == 1.2 and row["inproc_s"] == 1.0 and row["identical"] is None


def test_drafter_names_parse_into_their_suffixes():
    from coordinator.bench import BenchDrafter, parse_drafter_name

    assert parse_drafter_name("ngram") == BenchDrafter("ngram", "ngram", "ngram")
    assert parse_drafter_name("none-burst16") == BenchDrafter(
        "none-burst16", "none", None, burst=16
    )
    assert parse_drafter_name("ngram-nolimit-serial") == BenchDrafter(
        "ngram-nolimit-serial", "ngram", "ngram", nolimit=True, serial=True
    )
    name = "eagle3-mlx-p50-burst8-serial-k2"
    assert parse_drafter_name(name) == BenchDrafter(
        name, "eagle3-mlx", "eagle3", p_min=0.5, burst=8, serial=True, pinned_k=2
    )
    assert parse_drafter_name("eagle3-k3") == BenchDrafter(
        "eagle3-k3", "eagle3", "eagle3", pinned_k=3
    )
    assert parse_drafter_name("eagle3-serial-overlap-k1") == BenchDrafter(
        "eagle3-serial-overlap-k1", "eagle3", "eagle3", serial=True, overlap=True, pinned_k=1
    )
    assert parse_drafter_name("eagle3-tree") == BenchDrafter("eagle3-tree", "eagle3-tree", "eagle3")
    assert parse_drafter_name("eagle3-tree-p20-uncut") == BenchDrafter(
        "eagle3-tree-p20-uncut", "eagle3-tree", "eagle3", p_min=0.2, uncut=True
    )
    assert parse_drafter_name("dflash-b8-k3") == BenchDrafter(
        "dflash-b8-k3", "dflash-b8", "dflash", pinned_k=3
    )
    bad = [
        "ngram-serial-nolimit",  # out of order
        "ngram-k2-serial",
        "eagle3-burst8-p50",
        "ngram-serial-serial",  # twice
        "eagle3-tree-uncut-p20",
        "eagle3-uncut",  # -uncut: trees only
        "ngram-uncut",
        "none-k2",  # no drafts to pin k of
        "none-serial-k2",
        "none-burst16-k2",
        "none-overlap",  # no drafts to draft ahead of
        "eagle3-overlap-serial",
        "eagle3-k0",
        "eagle3-kx",
        "none-burst0",
        "ngram-burst",
        "dflash-p50",  # -pNN: EAGLE-3 chains and trees, two digits
        "eagle3-p5",
        "eagle3-p100",
        "eagle3-p",
        "ngram-p50",
        "dflash-b",
        "nonsense",
        "",
    ]
    for name in bad:
        with pytest.raises(ValueError, match="unknown drafter"):
            parse_drafter_name(name)


def test_suffixes_reach_their_stacks_coordinator_and_requests(tmp_path):
    from argparse import ArgumentParser

    from coordinator import bench

    p = ArgumentParser()
    bench.add_bench_args(p)
    args = p.parse_args(["--questions", "mt-bench"])
    flags = bench.bench_stack(args, "ngram-nolimit", tmp_path).coordinator_args
    assert flags[flags.index("--draft-max-requests") + 1] == "0"
    assert "--draft-max-requests" not in bench.bench_stack(args, "ngram", tmp_path).coordinator_args
    flags = bench.bench_stack(args, "none-burst16-serial", tmp_path).coordinator_args
    assert flags[flags.index("--decode-burst") + 1] == "16" and "--no-draft-beside-decode" in flags
    default = bench.bench_stack(args, "none", tmp_path).coordinator_args
    assert "--overlap-drafting" not in default
    assert (
        "--overlap-drafting"
        in bench.bench_stack(args, "eagle3-overlap-k1", tmp_path).coordinator_args
    )
    assert default[default.index("--decode-burst") + 1] == str(args.decode_burst)
    assert bench.bench_request([1, 2], args, "ngram-serial-k8").num_draft_tokens == 8
    assert (
        "--no-priced-tree-cut"
        in bench.bench_stack(args, "dflash-tree-uncut", tmp_path).coordinator_args
    )
    assert (
        "--no-priced-tree-cut"
        not in bench.bench_stack(args, "dflash-tree", tmp_path).coordinator_args
    )


@pytest.mark.parametrize("where", ["mlx", "host"])
def test_head_forwards_variants_pass_the_choice_to_their_drafter(where):
    from argparse import ArgumentParser

    from coordinator.bench import _drafter_args, add_bench_args, parse_drafter_name

    p = ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["--questions", "mt-bench"])
    assert parse_drafter_name(f"eagle3-tree-{where}-k4").drafter == "eagle3"
    chain = _drafter_args(args, f"eagle3-{where}-k6")
    assert chain[chain.index("--head-forwards") + 1] == where
    tree = _drafter_args(args, f"eagle3-tree-{where}")
    assert tree[tree.index("--head-forwards") + 1] == where
    assert tree[tree.index("--tree-total-tokens") + 1] != "0"
    assert "--head-forwards" not in _drafter_args(args, "eagle3")


def test_p_min_variants_pass_the_threshold_to_their_drafter():
    from argparse import ArgumentParser

    from coordinator.bench import _drafter_args, add_bench_args

    p = ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["--questions", "mt-bench"])
    chain = _drafter_args(args, "eagle3-host-p50-k6")
    assert chain[chain.index("--draft-p-min") + 1] == "0.5"
    assert chain[chain.index("--head-forwards") + 1] == "host"
    assert "--draft-p-min" not in _drafter_args(args, "eagle3-k6")
    for tree_name in ("eagle3-tree-p10", "eagle3-tree-host-p10-k6", "dflash-tree-p10"):
        tree = _drafter_args(args, tree_name)  # a tree's floor is on its nodes' path probability
        assert tree[tree.index("--tree-min-prob") + 1] == "0.1" and "--draft-p-min" not in tree
    assert "--tree-min-prob" not in _drafter_args(args, "eagle3-tree")


def test_a_difference_is_explained_by_the_logits_and_their_rounding(tiny_model_dir):
    import mlx.core as mx
    import numpy as np

    from coordinator.bench import logit_rounding
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    prompt, tokens = [3, 40, 41, 42], [43, 40, 41]
    found = logit_rounding(loaded.model, prompt, tokens, 2)
    logits = loaded.model(mx.array(prompt + tokens[:2])[None])[0, -1].tolist()
    top = sorted(logits, reverse=True)[:2]
    assert found["top_logits"] == pytest.approx(top)
    assert found["logit_margin"] == pytest.approx(top[0] - top[1])
    assert found["logit_dtype"] == "float32"
    assert found["rounding"] == float(np.spacing(np.float32(top[0])))


def test_first_request_ratio_is_time_per_token_first_over_later():
    from coordinator.bench import first_request_ratio

    row = {"first_request_s": 3.0, "first_request_tokens": 10, "spec_s": 1.0, "tokens": 5}
    assert first_request_ratio([row]) == pytest.approx(1.5)
    assert first_request_ratio([{"spec_s": 1.0, "tokens": 5}]) is None
    # against the median of the later runs: one fast run alone does not make the first slow
    runs = {"first_request_again_s": [3.0, 2.0], "first_request_again_tokens": [10, 10]}
    assert first_request_ratio([{**row, **runs}]) == pytest.approx(0.3 / 0.2)
    faster = {"first_request_again_s": [1.5, 1.4], "first_request_again_tokens": [10, 10]}
    assert first_request_ratio([{**row, **faster}]) == pytest.approx(0.3 / 0.15)
    assert first_request_ratio([]) is None


def test_time_limit_reports_the_questions_done(tiny_model_dir, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "".join(
            f'{{"question_id": {i}, "category": "a", "turns": ["abc abc {i}"]}}\n' for i in range(3)
        )
    )
    out = tmp_path / "out.json"
    run = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--questions", str(questions),
         "--target", str(tiny_model_dir), "--max-tokens", "8", "--drafter", "none",
         "--time-limit", "0.001", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "reporting the 1 of 3 questions done" in run.stderr
    assert "1 of 3 questions (--time-limit)" in run.stdout
    result = json.loads(out.read_text())
    assert result["questions_asked"] == 3 and len(result["questions"]) == 1


def _say_questions(tmp_path, count: int):
    """A question file of `count` short questions the tiny model answers fast."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "".join(
            f'{{"question_id": {i}, "category": "a", "turns": ["say {i} {i} {i}"]}}\n'
            for i in range(count)
        )
    )
    return questions


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_concurrency_levels_measure_services_beside_mlx_lm_batched(
    tiny_model_dir, tmp_path, temperature
):
    questions = _say_questions(tmp_path, 3)
    out = tmp_path / "levels.json"
    run = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--questions", str(questions), "--target",
         str(tiny_model_dir), "--max-tokens", "12", "--drafter", "ngram,none",
         "--concurrency", "1,3", "--concurrency-requests", "2", "--temperature", temperature,
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    levels = json.loads(out.read_text())
    assert set(levels) == {"mlx-lm batched", "ngram", "none"}
    for rows in levels.values():
        assert [r["clients"] for r in rows] == [1, 3]
        assert [r["requests"] for r in rows] == [2, 6]
        for r in rows:
            assert r["tokens"] > 0 and r["aggregate_tok_s"] > 0 and r["p99_s"] >= r["p50_s"] > 0
    # how much each stack drafted: nothing without a drafter
    assert all(r["drafted_per_token"] == 0 and r["tau"] == 1 for r in levels["none"])
    if sys.platform == "linux":  # the cores each service used in each level, from /proc
        for name, services in (("ngram", {"verifier", "drafter", "coordinator"}),
                               ("none", {"verifier", "coordinator"})):  # fmt: skip
            assert [set(r["cpu_cores"]) for r in levels[name]] == [services, services]
            assert all(used >= 0 for r in levels[name] for used in r["cpu_cores"].values())
            assert sum(r["cpu_cores"]["verifier"] for r in levels[name]) > 0
        assert "cpu_cores" not in levels["mlx-lm batched"][0]
        assert "CPU cores verifier" in run.stderr
    differing = {n: [r["outputs_differing_from_solo"] for r in rows] for n, rows in levels.items()}
    if temperature == "0":  # every service output under concurrency equals its solo output
        assert differing["ngram"] == differing["none"] == [0, 0]
    else:  # seeded by its prompt: drafting off draws the same; the others are not compared
        assert differing == {"mlx-lm batched": [None, None], "ngram": [None, None],
                             "none": [0, 0]}  # fmt: skip
    table = (tmp_path / "levels.md").read_text()
    assert "| ngram | 3 |" in table and "| mlx-lm batched | 1 |" in table
    assert (tmp_path / "levels.png").read_bytes()[:4] == b"\x89PNG"


def test_concurrency_rows_say_how_much_was_drafted():
    from types import SimpleNamespace

    from coordinator.concurrency import level_row

    stats = [SimpleNamespace(rounds=10, generated_tokens=20, drafted=30, accepted=10,
                             verify_calls=10, draft_calls=10, forward_sessions=1.0),
             SimpleNamespace(rounds=30, generated_tokens=40, drafted=0, accepted=0,
                             verify_calls=5, draft_calls=3, forward_sessions=4.0)]  # fmt: skip
    row = level_row(2, 60, 1.0, [0.5, 0.7], 0, 0, stats)
    assert row["drafted_per_token"] == 0.5 and row["tau"] == 1.25
    assert row["verify_calls_per_token"] == 0.25 and row["draft_calls_per_token"] == 13 / 60
    assert row["forward_sessions"] == (10 * 1.0 + 5 * 4.0) / 15  # weighted by calls
    assert "tau" not in level_row(2, 60, 1.0, [0.5, 0.7], 0)  # mlx-lm's rows draft nothing


def test_a_level_where_every_request_failed_is_reported_not_a_crash(tmp_path, capsys):
    from coordinator.concurrency import _print_rows, concurrency_table, level_row

    row = level_row(4, 0, 2.0, [], 0, failed=4)
    assert row["requests"] == 0 and row["failed"] == 4 and row["p50_s"] is None
    _print_rows("none", [row])
    assert "     –      –" in capsys.readouterr().err
    assert "| none | 4 | 0.0 | – | – | – | 0 | 4 |" in concurrency_table({"none": [row]})


def test_outputs_unlike_their_solo_run_are_found_at_their_first_difference():
    from coordinator.concurrency import _differences

    solo: dict = {}
    assert _differences(solo, [0, 1], [[5, 6, 7], [1, 2]]) == []  # the first level sets them
    found = _differences(solo, [0, 1, 0], [[5, 6, 7], [1, 2, 3], [5, 9, 7]])
    assert found == [
        {"prompt": 1, "position": 2, "solo_token": None, "token": 3},  # solo ended there
        {"prompt": 0, "position": 1, "solo_token": 6, "token": 9},
    ]


def test_a_difference_is_explained_by_the_target_logits_after_the_common_prefix(
    tiny_model_dir,
):
    """Greedy: the top-2 margin where the outputs part; sampled: the target's probability
    strictly between the two draws in vocabulary order (0 for neighbours in the running sum)."""
    import mlx.core as mx
    import numpy as np

    from coordinator.concurrency import (
        _explained,
        concurrency_table,
        explain_difference,
        level_row,
    )
    from specd.models.load import load_target

    model = load_target(str(tiny_model_dir), "float32").model
    prompt, solo = [1, 5, 9], [4, 8, 15, 16]
    logits = np.array(model(mx.array([*prompt, 4, 8])[None])[0, -1], dtype=np.float64)
    top = np.sort(logits)[::-1]
    difference = {"prompt": 0, "position": 2, "solo_token": 15, "token": 40}
    greedy = explain_difference(model, prompt, solo, difference, 0.0)
    assert greedy["logit_margin"] == pytest.approx(top[0] - top[1], abs=1e-5)
    p = np.exp((logits - logits.max()) / 0.7)
    p /= p.sum()
    sampled = explain_difference(model, prompt, solo, difference, 0.7)
    assert sampled["mass_between"] == pytest.approx(p[16:40].sum(), rel=1e-4)
    assert sampled["draw_probs"] == pytest.approx([p[15], p[40]], rel=1e-4)
    neighbours = explain_difference(model, prompt, solo, {**difference, "token": 16}, 0.7)
    assert neighbours["mass_between"] == 0.0
    assert _explained([greedy]) == f" (top-2 margins <= {top[0] - top[1]:.1e})"
    assert _explained([sampled, neighbours]).startswith(" (mass between the draws <= ")
    assert _explained([]) == ""
    row = {**level_row(4, 40, 1.0, [0.5] * 4, 1), "differences": [{**difference, **greedy}]}
    assert f"| 1 (top-2 margins <= {top[0] - top[1]:.1e}) | 0 |" in concurrency_table(
        {"none": [row]}
    )


def test_a_level_keeps_each_difference_with_its_explanation():
    """services() compares each level with the first and keeps every difference, explained."""
    from argparse import Namespace
    from types import SimpleNamespace

    from coordinator.concurrency import services

    class Client:  # prompt [2] gives [7, 8] in the first level's two requests, then [7, 9]
        calls = 0

        def stream(self, prompt):
            Client.calls += 1
            tail = 9 if prompt == [2] and Client.calls > 2 else 8
            yield SimpleNamespace(token_ids=[7, tail], finish_reason="", stats=None)

    asked = []

    def explain(index, solo_ids, difference):
        asked.append((index, solo_ids))
        return {"logit_margin": 1e-6}

    rows = services(Client(), lambda ids: ids, [[1], [2]], [1, 2],
                    Namespace(concurrency_requests=2), explain=explain)  # fmt: skip
    assert [r["outputs_differing_from_solo"] for r in rows] == [0, 2]
    assert "differences" not in rows[0]
    assert rows[1]["differences"] == 2 * [
        {"prompt": 1, "position": 1, "solo_token": 8, "token": 9, "logit_margin": 1e-6}
    ]
    assert asked == 2 * [(1, [7, 8])]


def test_a_faulted_runs_differences_name_the_request_and_its_prompt():
    """The fault drill's run compares request by request: a difference keeps the request and
    is explained with that request's prompt (requests outnumber prompts)."""
    from argparse import Namespace
    from types import SimpleNamespace

    from coordinator.concurrency import services

    class Client:  # prompt [2] gives [7, 8] in the clean run, [7, 9] in the faulted one
        calls = 0

        def stream(self, prompt):
            Client.calls += 1
            tail = 9 if prompt == [2] and Client.calls > 4 else 8
            yield SimpleNamespace(token_ids=[7, tail], finish_reason="", stats=None)

    class Drill:
        def __call__(self):
            pass

        def summary(self):
            return "nothing done"

    asked = []

    def explain(index, solo_ids, difference):
        asked.append(index)
        return {"logit_margin": 1e-6}

    rows = services(Client(), lambda ids: ids, [[1], [2]], [2],
                    Namespace(concurrency_requests=2), Drill(), explain=explain)  # fmt: skip
    faulted = rows[-1]
    assert faulted["faults"] == "nothing done" and faulted["outputs_differing_from_solo"] == 2
    assert [(d["request"], d["prompt"]) for d in faulted["differences"]] == [(1, 1), (3, 1)]
    assert asked == [1, 1]


def test_a_process_cpu_time_is_read_while_it_runs_and_none_after(tmp_path):
    from specd.launch import process_cpu_seconds

    if sys.platform != "linux":
        assert process_cpu_seconds(os.getpid()) is None
        return
    before = process_cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:
        pass
    assert process_cpu_seconds(os.getpid()) >= before + 0.05
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_cpu_seconds(child.pid) is None  # reaped: no /proc entry


def test_concurrency_levels_are_checked():
    from coordinator.concurrency import parse_levels, percentile

    assert parse_levels("16,1,4,4") == [1, 4, 16]
    for bad in ("", "0,2", "a,b"):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_levels(bad)
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 9.0], 0.99) == 9.0


def test_concurrency_faults_need_levels(capsys):
    from specd.cli import main

    assert main(["bench", "--questions", "mt-bench", "--concurrency-faults"]) == 2
    assert "--concurrency-faults needs --concurrency" in capsys.readouterr().err


def test_a_stack_named_twice_is_refused_per_question(capsys):
    """Per question the stacks are keyed by name: a second of the same would merge into the
    first (its rows printed twice) and fail at the end; --concurrency runs each in turn."""
    from specd.cli import main

    assert main(["bench", "--questions", "mt-bench", "--drafter", "none,ngram,none"]) == 2
    assert "none named twice in --drafter" in capsys.readouterr().err


def test_plain_mlx_lm_runs_in_a_process_of_its_own(tiny_model_dir):
    """The bench's baseline child decodes what plain mlx-lm decodes in this process, and
    explains a position with the same rounding."""
    import os

    from coordinator.baseline import BaselineProcess
    from coordinator.bench import logit_rounding, plain_decode
    from specd.models.load import load_target

    loaded = load_target(str(tiny_model_dir), "float32")
    prompt = [5, 9, 14, 3, 7]
    here = plain_decode(loaded.model, prompt, 12, set(loaded.identity.eos_token_ids))
    with BaselineProcess(str(tiny_model_dir), "float32") as plain:
        assert plain.target.dtype == "float32"
        assert plain.target.eos_token_ids == loaded.identity.eos_token_ids
        assert plain._process.pid != os.getpid()
        there = plain.decode(prompt, 12)
        assert there.token_ids == here.token_ids and there.seconds > 0
        assert there.margins == pytest.approx(here.margins, abs=1e-5)
        rounding = plain.rounding(prompt, here.token_ids, 3)
    want = logit_rounding(loaded.model, prompt, here.token_ids, 3)
    assert rounding["top_logits"] == pytest.approx(want["top_logits"], abs=1e-4)
    assert rounding["logit_dtype"] == want["logit_dtype"] == "float32"
    assert not plain._process.is_alive()


def test_bench_says_why_plain_mlx_lm_could_not_load(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--questions", "mt-bench", "--limit", "1",
         "--target", str(tmp_path / "missing"), "--drafter", "none"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1
    assert "plain mlx-lm could not load the target" in run.stderr and "missing" in run.stderr


@pytest.mark.parametrize("levels", [None, "1"])
def test_a_stack_that_cannot_start_is_named_with_its_reason_not_a_traceback(tiny_model_dir, levels):
    # no shipped EAGLE-3 head fits the tiny target, so its drafter exits at start
    run = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--questions", "mt-bench", "--limit", "1",
         "--max-tokens", "4", "--target", str(tiny_model_dir), "--drafter", "eagle3",
         *(["--concurrency", levels] if levels else [])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1
    assert "specd: bench: the eagle3 stack did not start: drafter exited" in run.stderr
    assert "no EAGLE-3 head ships for this target" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_stack_that_cannot_start_under_concurrency_keeps_the_others_levels(
    tiny_model_dir, tmp_path
):
    out = tmp_path / "levels.json"
    run = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--questions", "mt-bench", "--limit", "1",
         "--max-tokens", "4", "--target", str(tiny_model_dir), "--drafter", "none,eagle3,ngram",
         "--concurrency", "1", "--concurrency-requests", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert set(json.loads(out.read_text())) == {"mlx-lm batched", "none", "ngram"}
    table = out.with_suffix(".md").read_text()
    assert "the eagle3 stack did not start" in table and "host: " in table
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    # the reason after the table too, so a reader of either end sees it
    assert run.stderr.count("specd: bench: the eagle3 stack did not start: drafter exited") == 2
    table = [line.split("|")[1].strip() for line in run.stdout.splitlines()
             if line.startswith("| ") and line[2:].strip()[:3] not in ("run", "---")]  # fmt: skip
    assert table == ["mlx-lm batched", "none", "ngram"]


def test_a_killed_plain_mlx_lm_process_is_reported_not_hung(tiny_model_dir):
    from coordinator.baseline import BaselineProcess, PlainProcessDied

    with BaselineProcess(str(tiny_model_dir), "float32") as plain:
        plain._process.kill()
        plain._process.join()
        with pytest.raises(PlainProcessDied, match=r"plain mlx-lm process died \(exit code -9\)"):
            plain.decode([5, 6, 7], 4)


def test_the_drafts_share_is_drafting_offs_time_over_the_drafters_per_question():
    from coordinator.bench import drafts_share

    off = {"questions": [{"question_id": 1, "spec_s": 2.0}, {"question_id": 2, "spec_s": 1.0},
                         {"question_id": 3, "spec_s": 5.0}]}  # fmt: skip
    drafter = {"questions": [{"question_id": 1, "spec_s": 1.0}, {"question_id": 2, "spec_s": 2.0},
                             {"question_id": 4, "spec_s": 9.0}]}  # fmt: skip
    # questions 1 and 2 ran in both: 2x and 0.5x, geometric mean 1x; 3 and 4 are left out
    assert drafts_share(drafter, off) == pytest.approx(1.0)
    assert drafts_share({"questions": [{"question_id": 1, "spec_s": 4.0}]}, off) == 0.5
    assert drafts_share({"questions": []}, off) is None


def test_the_in_process_loop_serves_the_target_as_the_stacks_verifier_does(tmp_path):
    from coordinator.bench import verifier_config
    from specd.cli import build_parser

    flags = (
        f"--row-forwards on --kv-pool off --port 0 --session-idle-timeout 5 --cache-dir {tmp_path}"
    )
    args = build_parser().parse_args(
        ["bench", "--questions", "mt-bench", "--target", "m", "--dtype", "float32",
         "--gemv-rows", "0", "--verifier-args", flags]
    )  # fmt: skip
    config = verifier_config(args, "eagle3-k6")
    assert (config.model, config.dtype, config.gemv_rows) == ("m", "float32", 0)
    assert (config.row_forwards, config.kv_pool) == ("on", "off")
    assert (config.cache_dir, config.session_idle_timeout_s) == (tmp_path, 5)
    assert config.half_weights  # the verifier's default, as the service keeps them
    args = build_parser().parse_args(["bench", "--questions", "mt-bench", "--float32-weights"])
    assert not verifier_config(args, "none").half_weights
    # a deployment file's [verifier] table counts, as it does for the service
    deployment = tmp_path / "specd.toml"
    deployment.write_text('[verifier]\nrow-forwards = "off"\n')
    args = build_parser().parse_args(
        ["bench", "--questions", "mt-bench", "--verifier-args", f"--config {deployment}"]
    )
    assert verifier_config(args, "none").row_forwards == "off"


def test_dflash_tree_variant_asks_its_drafter_for_trees_of_a_block():
    from argparse import ArgumentParser

    from coordinator.bench import _drafter_args, add_bench_args, parse_drafter_name

    p = ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["--questions", "mt-bench"])
    assert parse_drafter_name("dflash-tree-k15").drafter == "dflash"
    tree = _drafter_args(args, "dflash-tree")
    assert tree[tree.index("--tree-total-tokens") + 1] == "15"  # a block of 16's draft rows
    chain = _drafter_args(args, "dflash")
    assert chain[chain.index("--tree-total-tokens") + 1] == "0"
    args = p.parse_args(
        ["--questions", "mt-bench", "--tree-total-tokens", "7", "--tree-top-k", "3"]
    )
    tree = _drafter_args(args, "dflash-tree")
    assert tree[tree.index("--tree-total-tokens") + 1] == "7"
    assert tree[tree.index("--tree-top-k") + 1] == "3"


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_prompts_opened_in_the_steps_leave_every_output_as_solo(
    tiny_model_dir, tmp_path, temperature
):
    """The services with pooled sessions and `--prefill-in-steps`: clients' prompts open as
    rows of the running rounds' steps, and every output under concurrency equals its solo run
    (sampled ones seeded by their prompts)."""
    questions = _say_questions(tmp_path, 4)
    out = tmp_path / "levels.json"
    run = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--questions", str(questions), "--target",
         str(tiny_model_dir), "--max-tokens", "12", "--drafter", "none", "--concurrency", "1,4",
         "--concurrency-requests", "2", "--temperature", temperature, "--json", str(out),
         "--verifier-args", "--gemv-rows 0 --row-forwards on --kv-pool on --prefill-in-steps 64"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    levels = json.loads(out.read_text())
    assert [r["outputs_differing_from_solo"] for r in levels["none"]] == [0, 0]
    assert [r["failed"] for r in levels["none"]] == [0, 0]


def test_stacks_spawned_together_get_distinct_ports_and_keep_given_ones(monkeypatch):
    """Spawned before any binds its ports, the stacks' ports are chosen in one go."""
    from specd import launch

    spawned = []

    class Spawned:
        def __init__(self, name, port):
            self.name, self.address = name, f"127.0.0.1:{port}"

        def stop(self):
            pass

    def fake_spawn(name, args, host, port, log_dir):
        spawned.append((name, port))
        return Spawned(name, port)

    monkeypatch.setattr(launch, "spawn", fake_spawn)
    asked = []
    chosen = launch.free_ports

    def counted_free_ports(count, host="127.0.0.1"):
        asked.append(count)
        return chosen(count, host)

    monkeypatch.setattr(launch, "free_ports", counted_free_ports)
    stacks = [launch.Stack(drafter=d) for d in ("ngram", None, "eagle3")]
    stacks[1].ports = {"verifier": 1}  # a port given stays
    launch.spawn_together(stacks)
    assert [name for name, _ in spawned] == [
        "verifier", "drafter", "coordinator", "verifier", "coordinator",
        "verifier", "drafter", "coordinator",
    ]  # fmt: skip
    ports = [port for _, port in spawned]
    assert ports[3] == 1 and len(set(ports)) == len(ports)
    assert asked == [7]  # every port not given, chosen in one go
    assert all(s.services for s in stacks)  # spawned, not waited for


def test_the_first_stack_and_the_first_of_each_model_drafter_warm_up_alone():
    from coordinator.bench import _stacks_started_alone

    assert _stacks_started_alone(["none", "ngram", "ngram-k2"]) == ["none"]
    assert _stacks_started_alone(["eagle3-k1", "eagle3-overlap-k1", "none"]) == ["eagle3-k1"]
    assert _stacks_started_alone(["none", "eagle3", "dflash", "eagle3-tree", "dflash-b8"]) == [
        "none", "eagle3", "dflash",
    ]  # fmt: skip


def test_a_stack_that_stops_under_concurrency_keeps_the_levels_it_finished(monkeypatch, tmp_path):
    import contextlib
    from types import SimpleNamespace

    import coordinator.bench as bench
    import coordinator.concurrency as concurrency

    def row(clients: int) -> dict:
        return concurrency.level_row(clients, 10, 1.0, [1.0], 0, 0, [])

    started = []

    @contextlib.contextmanager
    def stack(args, drafter, log_dir, name):
        started.append((drafter, log_dir.name, name))
        yield SimpleNamespace(drafter=drafter)

    def levels(stack, d, prompts, levels, args, explain, rows):
        for clients in levels:
            if d == "ngram" and clients == 4:
                raise RuntimeError("the coordinator exited (code -9)")
            rows.append(row(clients))

    monkeypatch.setattr(bench, "running_stack", stack)
    monkeypatch.setattr(concurrency, "_stack_levels", levels)
    monkeypatch.setattr(concurrency, "mlx_lm_batched", lambda t, p, ls, a: [row(c) for c in ls])
    args = SimpleNamespace(concurrency="1,4,16", concurrency_faults=False)
    drafters = ["ngram", "none", "none"]
    results, failed = concurrency.run_concurrency(args, None, drafters, [[1]], tmp_path)
    assert [r["clients"] for r in results["ngram"]] == [1]  # the level before the failure
    assert [r["clients"] for r in results["none"]] == [1, 4, 16]  # the next stack still ran
    # a drafter named again is a run of its own, not written over the first
    assert list(results) == ["mlx-lm batched", "ngram", "none", "none #2"]
    assert started[-1] == ("none", "concurrency-none-2", "none #2")  # its drafter, its logs
    assert failed == [
        "the ngram stack stopped after 1 of 3 levels: "
        "RuntimeError: the coordinator exited (code -9)"
    ]
