"""`specd demo` on a tiny target: the answer, then the speed-up split into what the drafts add
(drafter against drafting off through the same services) and what the engine adds."""

import re
import subprocess
import sys

from tiny import make_tiny_eagle3_dir


def demo(target_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specd", "demo", "--target", str(target_dir), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_prints_the_speed_up_and_its_parts(tiny_model_dir):
    run = demo(tiny_model_dir, "--prompt", "abcabcabc abcabc", "--max-tokens", "24")
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
    run = demo(tiny_model_dir, "--prompt", "hello", "--max-tokens", "8", "--drafter", "none")
    assert run.returncode == 0, run.stderr
    assert "speed-up" in run.stdout and "from the drafts" not in run.stdout


def test_demo_with_the_eagle3_drafter_given_its_head(tiny_model_dir, tmp_path):
    head = make_tiny_eagle3_dir(tmp_path / "e3", tiny_model_dir)
    run = demo(tiny_model_dir, "--prompt", "abcabcabc abcabc", "--max-tokens", "16",
               "--drafter", "eagle3", "--drafter-weights", str(head))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "eagle3 against drafting off" in run.stdout
    assert "identical output  True" in run.stdout


def test_demo_says_what_to_pass_when_no_head_ships_for_the_target(tiny_model_dir):
    run = demo(tiny_model_dir, "--prompt", "hello", "--max-tokens", "8", "--drafter", "eagle3")
    assert run.returncode == 1
    assert "the services did not start" in run.stderr and "no EAGLE-3 head ships" in run.stderr
    assert "--drafter-weights DIR" in run.stderr and "Traceback" not in run.stderr
    refused = demo(tiny_model_dir, "--drafter", "ngram", "--drafter-weights", "x")
    assert refused.returncode == 2 and "--drafter-weights is for" in refused.stderr
