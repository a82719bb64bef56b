"""`specd bench` end to end on a tiny target: JSON shape, identity, the in-process column."""

import json
import subprocess
import sys


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
            "ngram,none",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "out-ngram.json").read_text())
    none = json.loads((tmp_path / "out-none.json").read_text())
    assert none["drafter"] == "none" and none["overall"]["tau"] == 1.0
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
        } <= set(q)
    assert set(result["by_category"]) == {"a", "b"}
    overall = result["overall"]
    assert overall["identical"] == overall["count"] == 2
    assert overall["speedup"] > 0 and overall["split_vs_inprocess"] > 0
    assert "OVERALL" in run.stdout
