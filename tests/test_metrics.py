"""Prometheus scrape after some traffic, and JSON log lines."""

import json
import re
import urllib.request

from specd.client import CoordinatorClient, make_request
from specd.launch import Stack, free_ports


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return response.read().decode()


def value(text: str, prefix: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


def test_metrics_after_requests_and_json_logs(tiny_model_dir, tmp_path):
    # one batch, so no two of these (the services' own ports too) can be the same port
    verifier_metrics, coordinator_metrics, *service_ports = free_ports(5)
    ports = {"verifier": verifier_metrics, "coordinator": coordinator_metrics}
    with Stack(
        target=str(tiny_model_dir),
        drafter="ngram",
        ports=dict(zip(("verifier", "drafter", "coordinator"), service_ports, strict=True)),
        log_dir=tmp_path,
        verifier_args=["--metrics-port", str(ports["verifier"]), "--log-format", "json"],
        drafter_args=["--metrics-port", "0"],  # the OS picks; the log says which
        coordinator_args=["--metrics-port", str(ports["coordinator"])],
    ) as stack:
        client = CoordinatorClient(stack.coordinator)
        for prompt in ("abcabcabc", "hello hello hello"):
            client.generate(make_request(prompt=prompt, max_tokens=30))
        coordinator = scrape(ports["coordinator"])
        verifier = scrape(ports["verifier"])
        drafter_log = stack.services["drafter"].log_path.read_text()
        chosen = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", drafter_log)
        assert chosen, drafter_log
        drafter = scrape(int(chosen.group(1)))
        log_lines = stack.services["verifier"].log_path.read_text().splitlines()
    assert value(coordinator, "specd_requests_total{") == 2
    assert value(coordinator, "specd_generated_tokens_total") > 0
    assert value(coordinator, "specd_acceptance_length_count") == 2
    assert value(coordinator, "specd_verify_seconds_count") > 0
    assert value(coordinator, "specd_round_overhead_seconds_count") > 0
    assert value(verifier, 'specd_rpc_total{code="OK",method="Verify"}') > 0
    # each request opens a drafter session and drafts at least once (calls or a stream of them)
    assert value(drafter, 'specd_rpc_total{code="OK",method="OpenSession"}') == 2
    assert value(drafter, 'specd_rpc_total{code="OK",method="Draft') > 0
    assert "specd_open_sessions" in verifier
    records = [json.loads(line) for line in log_lines if line.startswith("{")]
    assert any("ready" in r["message"] for r in records)


def test_kv_cache_bytes_and_the_kv_memory_limit(tiny_model_dir, tmp_path):
    import grpc
    import pytest

    from specd.launch import spawn
    from specd.service import channel_options
    from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    metrics_port, port = free_ports(2)  # together, so the service's port is not the same
    # a limit of one byte: the first session passes it, the second is refused
    flags = ["--model", str(tiny_model_dir), "--metrics-port", str(metrics_port),
             "--max-kv-memory", "1", "--prefix-cache", "1MiB"]  # fmt: skip
    verifier = spawn("verifier", flags, port=port, log_dir=tmp_path)
    try:
        verifier.wait_healthy(120)
        with grpc.insecure_channel(verifier.address, options=channel_options()) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)

            def open_session():
                request = verifier_pb2.OpenSessionRequest(prompt_ids=list(range(3, 15)))
                return stub.OpenSession(request, timeout=60).session_id

            assert value(scrape(metrics_port), "specd_kv_cache_bytes") == 0
            assert value(scrape(metrics_port), "specd_prefix_cache_bytes") == 0
            first = open_session()
            held = value(scrape(metrics_port), "specd_kv_cache_bytes")
            assert held > 0
            # the prompt kept for later ones, apart from the sessions' KV and its limit
            assert 0 < value(scrape(metrics_port), "specd_prefix_cache_bytes") < held
            with pytest.raises(grpc.RpcError) as refused:
                open_session()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-kv-memory" in refused.value.details()
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=first), timeout=30)
            assert value(scrape(metrics_port), "specd_kv_cache_bytes") == 0
            second = open_session()  # room again once the first is closed
            assert value(scrape(metrics_port), "specd_kv_cache_bytes") == held
            stub.CloseSession(common_pb2.CloseSessionRequest(session_id=second), timeout=30)
            text = scrape(metrics_port)
            assert value(text, 'specd_mlx_memory_bytes{kind="peak"}') >= held
    finally:
        verifier.stop()
