"""The `specd` command as a user runs it: up, generate, Ctrl-C, model-path."""

import signal
import subprocess
import sys

import pytest
from helpers import generate_json, wait_serving

from specd.launch import free_port, health_status


def test_up_serves_and_ctrl_c_stops_all_three(tiny_model_dir):
    ports = [free_port() for _ in range(3)]
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specd",
            "up",
            "--target",
            str(tiny_model_dir),
            "--port",
            str(ports[0]),
            "--verifier-port",
            str(ports[1]),
            "--drafter-port",
            str(ports[2]),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    address = f"127.0.0.1:{ports[0]}"
    try:
        wait_serving(address, up)
        _, result = generate_json(address, "--chat", "--prompt", "hi", "--max-tokens", "6")
        assert result["stats"]["generated_tokens"] >= 1
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(60)
    assert code == 0
    for port in ports:
        assert health_status(f"127.0.0.1:{port}", timeout_s=0.5) is None


def test_model_path_of_a_directory_and_a_missing_model(tiny_model_dir):
    run = [sys.executable, "-m", "specd", "model-path"]
    out = subprocess.run([*run, str(tiny_model_dir)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tiny_model_dir.resolve())
    bad = subprocess.run([*run, "/nonexistent/model.gguf"], capture_output=True, text=True)
    assert bad.returncode == 1 and "does not exist" in bad.stderr


def test_generate_against_nothing_says_unavailable():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specd",
            "generate",
            "--coordinator",
            f"127.0.0.1:{free_port()}",
            "--prompt",
            "hi",
            "--timeout",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-tokens", "99999999999"), ("--top-k", "99999999999"), ("--seed", "-1"),
     ("--num-draft-tokens", "99999999999")],
)  # fmt: skip
def test_generate_refuses_a_value_its_request_cannot_hold(flag, value):
    out = subprocess.run(
        [sys.executable, "-m", "specd", "generate", "--coordinator", f"127.0.0.1:{free_port()}",
         "--prompt", "hi", flag, value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert f"specd: generate: {flag} must be between" in out.stderr
    assert "Traceback" not in out.stderr


def test_numeric_flags_are_checked_when_parsed(capsys):
    from specd.cli import build_parser

    parser = build_parser()
    ok = parser.parse_args(["serve", "drafter", "--blas-threads", "0"])
    assert ok.blas_threads == 0
    for argv in (
        ["serve", "drafter", "--blas-threads", "-1"],
        ["serve", "coordinator", "--decode-burst", "0"],
        ["bench", "--questions", "mt-bench", "--decode-burst", "x"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "must be at least 0, got -1" in err and "must be at least 1, got 0" in err
    assert "expected an integer, got 'x'" in err
