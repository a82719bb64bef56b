"""`specd demo` on a tiny target: the answer, then the speed-up split into what the drafts add
(drafter against drafting off through the same services) and what the engine adds."""

import re
import subprocess
import sys


def test_demo_prints_the_speed_up_and_its_parts(tiny_model_dir):
    run = subprocess.run(
        [sys.executable, "-m", "specd", "demo", "--target", str(tiny_model_dir),
         "--prompt", "abcabcabc abcabc", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    total = float(re.search(r"speed-up\s+([\d.]+)x", run.stdout).group(1))
    drafts = float(re.search(r"from the drafts ([\d.]+)x", run.stdout).group(1))
    engine = float(re.search(r"from the engine ([\d.]+)x", run.stdout).group(1))
    # the two parts multiply to the whole (each printed to two decimals)
    assert abs(drafts * engine - total) <= 0.01 * (drafts + engine) + 0.02
    assert "ngram against drafting off" in run.stdout
    assert "(each the faster of two runs)" in run.stdout
    assert "identical output  True" in run.stdout


def test_demo_without_a_drafter_has_no_parts(tiny_model_dir):
    run = subprocess.run(
        [sys.executable, "-m", "specd", "demo", "--target", str(tiny_model_dir),
         "--prompt", "hello", "--max-tokens", "8", "--drafter", "none"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "speed-up" in run.stdout and "from the drafts" not in run.stdout
