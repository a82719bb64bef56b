"""One deployment file read by `specd up --config` and by each `specd serve --config`."""

import json
import signal
import subprocess
import sys
import time

from grpc_health.v1 import health_pb2

from specd.launch import free_port, health_status


def write_config(path, tiny_model_dir, ports) -> None:
    path.write_text(f"""
[verifier]
port = {ports[1]}
model = "{tiny_model_dir}"
max-sessions = 8

[drafter]
port = {ports[2]}
kind = "ngram"
num_draft_tokens = 4

[coordinator]
port = {ports[0]}
verifier = "127.0.0.1:{ports[1]}"
drafter = "127.0.0.1:{ports[2]}"
adaptive = false
""")


def test_up_with_a_deployment_file(tiny_model_dir, tmp_path):
    ports = [free_port() for _ in range(3)]
    config = tmp_path / "specd.toml"
    write_config(config, tiny_model_dir, ports)
    up = subprocess.Popen(
        [sys.executable, "-m", "specd", "up", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    address = f"127.0.0.1:{ports[0]}"
    try:
        deadline = time.monotonic() + 120
        while health_status(address) != health_pb2.HealthCheckResponse.SERVING:
            assert up.poll() is None and time.monotonic() < deadline, up.stderr.read()
            time.sleep(0.3)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "specd",
                "generate",
                "--coordinator",
                address,
                "--prompt",
                "abcabc",
                "--max-tokens",
                "12",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        stats = json.loads(out.splitlines()[-1])["stats"]
        assert stats["generated_tokens"] == 12
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0


def test_unknown_option_in_the_file_is_an_error(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[verifier]\nmax_sesions = 3\n")
    out = subprocess.run(
        [sys.executable, "-m", "specd", "serve", "verifier", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "max_sesions" in out.stderr
    config.write_text("[verifer]\n")
    out = subprocess.run(
        [sys.executable, "-m", "specd", "up", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "verifer" in out.stderr
