"""Running the `specd` command the way a user does, from tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from grpc_health.v1 import health_pb2

from specd.launch import health_status


def specd(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


def generate_json(address: str, *args: str) -> tuple[str, dict]:
    """`specd generate ... --json`: (everything printed, the final JSON object)."""
    out = specd("generate", "--coordinator", address, *args, "--json").stdout
    return out, json.loads(out.strip().splitlines()[-1])


def wait_serving(address: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while health_status(address) != health_pb2.HealthCheckResponse.SERVING:
        assert process.poll() is None, process.stderr.read() if process.stderr else "exited"
        assert time.monotonic() < deadline, f"{address} did not become healthy"
        time.sleep(0.3)
