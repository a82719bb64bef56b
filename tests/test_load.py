"""Many requests and sessions at once: outputs as when run alone, memory flat."""

import sys
from pathlib import Path

import grpc

from specd.launch import Stack
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from load import run_load  # noqa: E402


def test_16_concurrent_requests_match_their_solo_runs(tiny_model_dir, tmp_path):
    with Stack(target=str(tiny_model_dir), drafter="ngram", log_dir=tmp_path) as stack:
        result = run_load(stack.coordinator, concurrency=16, max_tokens=128)
    print(
        f"\nload: {result['tokens']} tokens in {result['seconds']:.1f}s "
        f"({result['tokens_per_s']:.0f} tok/s), errors {result['errors']}"
    )
    assert result["errors"] == []
    assert result["identical_to_solo"] == 16


def test_1000_sessions_leave_memory_flat(tiny_model_dir, tmp_path):
    with (
        Stack(target=str(tiny_model_dir), drafter=None, log_dir=tmp_path) as stack,
        grpc.insecure_channel(stack.services["verifier"].address) as channel,
    ):
        stub = verifier_pb2_grpc.VerifierStub(channel)

        def cycle(n):
            for i in range(n):
                opened = stub.OpenSession(
                    verifier_pb2.OpenSessionRequest(prompt_ids=[3 + i % 200] * 40), timeout=30
                )
                if not opened.finished:  # a random prompt can end at once
                    request = verifier_pb2.VerifyRequest(
                        session_id=opened.session_id, position=opened.position, draft_ids=[5, 6]
                    )
                    stub.Verify(request, timeout=30)
                stub.CloseSession(
                    common_pb2.CloseSessionRequest(session_id=opened.session_id), timeout=30
                )

        def rss():
            return stub.GetInfo(common_pb2.InfoRequest(), timeout=30).process

        cycle(50)  # allocator pools and caches settle
        before = rss()
        cycle(1000)
        after = rss()
    print(
        f"\n1000 sessions: RSS {before.rss_bytes / 2**20:.1f} -> {after.rss_bytes / 2**20:.1f} "
        f"MiB, open sessions {after.open_sessions}"
    )
    assert after.open_sessions == 0
    assert after.rss_bytes < before.rss_bytes + 32 * 2**20
