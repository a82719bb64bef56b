"""Rounds of concurrent sessions, greedy or sampled, plain or verifying draft trees, batched in
the verifier: the same tokens as each session alone, and batches of more than one session do
form under load."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest

from specd.launch import free_ports, spawn
from specd.service import channel_options
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(4 + 3 * i)] for i in range(6)]
CALLS, STEPS = 6, 16


# a draft tree each call: two roots, the first with two children
TREE, TREE_PARENTS = [5, 9, 6, 7], [-1, -1, 0, 0]


def _decode(
    stub, prompt: list[int], sampling: common_pb2.SamplingParams | None, trees: bool = False
) -> list[int]:
    opened = stub.OpenSession(
        verifier_pb2.OpenSessionRequest(prompt_ids=prompt, sampling=sampling), timeout=60
    )
    ids, position = [opened.first_token], opened.position
    for _ in range(CALLS * (4 if trees else 1)):
        round_of = {"plain_steps": STEPS}
        if trees:
            round_of = {"draft_ids": TREE, "draft_parents": TREE_PARENTS}
        answer = stub.Verify(
            verifier_pb2.VerifyRequest(session_id=opened.session_id, position=position, **round_of),
            timeout=60,
        )
        ids += answer.committed_ids
        position = answer.position
        if answer.finished:
            break
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=opened.session_id))
    return ids


def _batches(metrics_port: int) -> tuple[float, float]:
    """(batches, batches of one session) from the verifier's /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    count = alone = 0.0
    for line in text.splitlines():
        if line.startswith("specd_decode_batch_sessions_count"):
            count = float(line.split()[-1])
        elif line.startswith('specd_decode_batch_sessions_bucket{le="1.0"}'):
            alone = float(line.split()[-1])
    return count, alone


MLX = ["--gemv-rows", "0", "--row-forwards", "on"]


def _sampling(n: int, sampled: bool) -> common_pb2.SamplingParams | None:
    """Greedy, or sampled on a seed of the session's own."""
    return common_pb2.SamplingParams(temperature=1.0, top_k=20, seed=n) if sampled else None


FORWARDS = {
    "cpu-kernels": [],
    "mlx": MLX,
    "mlx-pooled": [*MLX, "--kv-pool", "on"],
    "mlx-pooled-compiled": [*MLX, "--kv-pool", "on", "--compiled-pooled", "on"],
}
MODES = ("greedy", "sampled", "trees", "sampled-trees")
CASES = [(name, mode) for name in FORWARDS for mode in MODES]


@pytest.mark.parametrize(("forwards", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_concurrent_sessions_decode_together_and_as_each_alone(
    tiny_model_dir, tmp_path, forwards, mode
):
    """On the CPU kernels, and in MLX as on a GPU: per-session caches, and the KV pool (its
    batches through the model's own modules, and compiled)."""
    sampled, trees = mode.startswith("sampled"), mode.endswith("trees")
    forwards = FORWARDS[forwards]
    metrics_port, port = free_ports(2)
    verifier = spawn(
        "verifier",
        ["--model", str(tiny_model_dir), "--metrics-port", str(metrics_port), *forwards],
        port=port,
        log_dir=tmp_path,
    )
    try:
        verifier.wait_healthy(120)
        with grpc.insecure_channel(verifier.address, options=channel_options()) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            solo = [_decode(stub, p, _sampling(n, sampled), trees) for n, p in enumerate(PROMPTS)]
            count, alone = _batches(metrics_port)
            assert count == alone > 0  # one client at a time: batches of one
            together: list = [None] * len(PROMPTS)

            def client(n: int) -> None:
                together[n] = _decode(stub, PROMPTS[n], _sampling(n, sampled), trees)

            threads = [threading.Thread(target=client, args=(n,)) for n in range(len(PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert together == solo
            count_after, alone_after = _batches(metrics_port)
            assert count_after - count > alone_after - alone  # some batch held 2+ sessions
    finally:
        verifier.stop()
