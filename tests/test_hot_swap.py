"""Replacing the drafter under a running coordinator, during a load of requests."""

import subprocess
import sys
import threading
import time

import grpc
import pytest

from specd.client import CoordinatorClient, make_request
from specd.launch import Stack, spawn

PROMPT = "abcabcabc hello hello"


def wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_hot_swap_during_load(tiny_model_dir, other_tiny_model_dir, tmp_path):
    with Stack(target=str(tiny_model_dir), drafter="ngram", log_dir=tmp_path) as stack:
        other = spawn(
            "drafter",
            ["--kind", "ngram", "--num-draft-tokens", "3", "--ngram-min-n", "1"],
            log_dir=tmp_path / "b",
        )
        wrong = spawn(
            "drafter",
            ["--kind", "ngram", "--target", str(other_tiny_model_dir)],
            log_dir=tmp_path / "c",
        )
        try:
            other.wait_healthy(60)
            wrong.wait_healthy(120)
            client = CoordinatorClient(stack.coordinator)
            reference = client.generate(make_request(prompt=PROMPT, max_tokens=100)).token_ids
            results, errors, stop = [], [], threading.Event()

            def load():
                while not stop.is_set():
                    try:
                        out = client.generate(make_request(prompt=PROMPT, max_tokens=100))
                        results.append(out.token_ids)
                    except grpc.RpcError as err:
                        errors.append(err)

            threads = [threading.Thread(target=load) for _ in range(4)]
            for t in threads:
                t.start()
            wait_for(lambda: len(results) >= 8)
            info = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "specd",
                    "set-drafter",
                    other.address,
                    "--coordinator",
                    stack.coordinator,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert info.returncode == 0, info.stderr
            swapped_at = len(results)
            wait_for(lambda: len(results) >= swapped_at + 8)
            with pytest.raises(grpc.RpcError) as refused:
                client.set_drafter(wrong.address)
            stop.set()
            for t in threads:
                t.join()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert not errors and all(r == reference for r in results)
            assert client.info().drafter_address == other.address  # the refusal changed nothing
            assert client.set_drafter("none").drafter_address == ""
            off = client.generate(make_request(prompt=PROMPT, max_tokens=100))
            assert off.token_ids == reference and off.stats["drafted"] == 0
        finally:
            other.stop()
            wrong.stop()
