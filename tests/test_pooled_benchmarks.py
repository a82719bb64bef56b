"""The pooled-batch benchmarks (run on a lent GPU, where a failure costs device time) start and
time every piece on the tiny model here first."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("pooled_mix.py", ["--drafts", "0", "3", "--variants", "own", "compiled"],
         ["own      1 plain steps + a verify of  3", "compiled 1 plain steps + a verify of  3"]),
        ("pooled_pieces.py", [], ["gather", "whole forward, own", "whole forward, compiled"]),
    ],
)  # fmt: skip
def test_a_pooled_benchmark_runs_end_to_end(tiny_model_dir, script, args, expected):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--target", str(tiny_model_dir),
         "--sessions", "2", "--calls", "1", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for line in expected:
        assert line in done.stdout


def test_the_prefill_benchmark_times_prompts_arriving_together(tiny_model_dir):
    """`prefill_cost.py --group N`: a group's prefill in one job of pooled sessions beside the
    same prompts one by one and mlx-lm's, on the target the verifier flags make."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "prefill_cost.py"), "--target", str(tiny_model_dir),
         "--questions", "mt-bench", "--every", "40", "--rounds", "1", "--group", "2",
         "--verifier-args", "--kv-pool on"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 prompts in groups of 2 (sessions pooled: True)" in done.stdout
    header, row = done.stdout.splitlines()[1:3]
    assert header.split() == ["prompts", "tokens", "mlx-lm", "ms", "engine", "ms", "together",
                              "ms", "engine/mlx-lm", "together/engine"]  # fmt: skip
    assert row.split()[0] == "2" and row.endswith("x")
    assert "together/engine" in done.stdout.splitlines()[-1]
