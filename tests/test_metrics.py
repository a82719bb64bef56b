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
