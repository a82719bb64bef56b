"""Real processes, real kills: a lost drafter or verifier costs speed, never tokens."""

import signal
import time

import grpc
import pytest
from tiny import make_tiny_dflash_dir, make_tiny_eagle3_dir, make_tiny_model_dir

from coordinator.bench import plain_decode
from specd.client import CoordinatorClient, make_request
from specd.launch import Stack, spawn
from specd.models.load import load_target

PROMPT = "abcabcabc hello hello hello"
TOKENS = 600
K = 4  # pinned: adaptation could stop drafting on a tiny target, and faults need drafts


def ngram_stack(model_dir, log_dir, recovery_s: int = 60) -> Stack:
    return Stack(
        target=str(model_dir),
        drafter="ngram",
        log_dir=log_dir,
        coordinator_args=["--verifier-recovery-timeout", str(recovery_s)],
    )


@pytest.fixture
def stack(tiny_model_dir, tmp_path):
    with ngram_stack(tiny_model_dir, tmp_path) as s:
        yield s


def generate_with_fault(client, fault, **request):
    """Stream a generation and call fault() once the first tokens have arrived."""
    ids, stats, faulted = [], None, False
    for message in client.stream(make_request(num_draft_tokens=K, **request)):
        ids.extend(message.token_ids)
        if not faulted and ids:
            fault()
            faulted = True
        if message.finish_reason:
            stats = message.stats
    return ids, stats


def until_drafting(client, reference, max_tokens, timeout_s=60.0):
    """Generate until the coordinator drafts again (it notices a returned drafter within a
    request or two); every output on the way must equal the reference."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = client.generate(
            make_request(prompt=PROMPT, max_tokens=max_tokens, num_draft_tokens=K)
        )
        assert out.token_ids == reference
        if out.stats["draft_calls"] > 0 or time.monotonic() > deadline:
            return out


def test_drafter_killed_mid_generation(stack, tiny_model_dir, tmp_path):
    client = CoordinatorClient(stack.coordinator)
    reference = client.generate(
        make_request(prompt=PROMPT, max_tokens=TOKENS, num_draft_tokens=K)
    ).token_ids
    drafter = stack.services["drafter"]
    ids, stats = generate_with_fault(client, drafter.kill, prompt=PROMPT, max_tokens=TOKENS)
    assert ids == reference
    assert stats.drafter_failed
    # a new drafter on the same address: later requests draft again
    port = drafter.address.rsplit(":", 1)[1]
    stack.services["drafter"] = spawn(
        "drafter", ["--kind", "ngram"], port=int(port), log_dir=tmp_path
    )
    stack.services["drafter"].wait_healthy(60)
    again = until_drafting(client, reference, TOKENS)
    assert again.stats["draft_calls"] > 0 and not again.stats["drafter_failed"]


def test_verifier_killed_then_restarted_on_same_address(stack, tiny_model_dir, tmp_path):
    client = CoordinatorClient(stack.coordinator)
    reference = client.generate(
        make_request(prompt=PROMPT, max_tokens=TOKENS, num_draft_tokens=K)
    ).token_ids
    verifier = stack.services["verifier"]
    port = int(verifier.address.rsplit(":", 1)[1])

    def kill_and_restart():
        verifier.kill()
        stack.services["verifier"] = spawn(
            "verifier", ["--model", str(tiny_model_dir)], port=port, log_dir=tmp_path
        )

    ids, stats = generate_with_fault(client, kill_and_restart, prompt=PROMPT, max_tokens=TOKENS)
    assert ids == reference  # no gap, no repeat
    assert stats.generated_tokens == len(reference)
    log = stack.services["coordinator"].log_path.read_text()
    assert "lost the session" in log  # the fault did hit the request in flight


def test_verifier_that_never_comes_back(tiny_model_dir, tmp_path):
    with ngram_stack(tiny_model_dir, tmp_path, recovery_s=2) as stack:
        client = CoordinatorClient(stack.coordinator)
        received = []
        with pytest.raises(grpc.RpcError) as err:
            for message in client.stream(
                make_request(prompt=PROMPT, max_tokens=TOKENS, num_draft_tokens=K)
            ):
                received.extend(message.token_ids)
                if len(received) == 1:
                    stack.services["verifier"].kill()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no verifier answered" in err.value.details()
        assert received  # what was committed before the fault reached the client


def test_hung_drafter_times_out_and_drafting_resumes(tiny_model_dir, tmp_path):
    """SIGSTOP freezes the drafter: its calls time out, rounds go on, output is unchanged."""
    import signal

    with Stack(
        target=str(tiny_model_dir),
        drafter="ngram",
        log_dir=tmp_path,
        coordinator_args=["--draft-timeout", "0.3"],
    ) as stack:
        client = CoordinatorClient(stack.coordinator)
        reference = client.generate(
            make_request(prompt=PROMPT, max_tokens=200, num_draft_tokens=K)
        ).token_ids
        drafter = stack.services["drafter"].process
        drafter.send_signal(signal.SIGSTOP)
        try:
            hung = client.generate(make_request(prompt=PROMPT, max_tokens=200, num_draft_tokens=K))
        finally:
            drafter.send_signal(signal.SIGCONT)
        assert hung.token_ids == reference and hung.stats["drafter_failed"]
        assert until_drafting(client, reference, 200).stats["draft_calls"] > 0


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_another_verifier_takes_over(tmp_path, fault):
    """--verifier A,B: A dies (or is stopped: SIGTERM, in-flight calls drained) mid-generation
    and B carries the session on."""
    # a long generation (no EOS in reach), so the kill lands mid-request
    tiny_model_dir = make_tiny_model_dir(
        tmp_path / "long", max_positions=16384, eos_token="<|im_start|>"
    )
    tokens = 3000
    first = spawn("verifier", ["--model", str(tiny_model_dir)], log_dir=tmp_path / "a")
    second = spawn("verifier", ["--model", str(tiny_model_dir)], log_dir=tmp_path / "b")
    coordinator = None
    try:
        # both verifiers up before the coordinator connects, so it picks the first one
        for service in (first, second):
            service.wait_healthy(120)
        coordinator = spawn(
            "coordinator",
            ["--verifier", f"{first.address},{second.address}", "--drafter", "none"],
            log_dir=tmp_path,
        )
        coordinator.wait_healthy(120)
        client = CoordinatorClient(coordinator.address)
        reference = client.generate(make_request(prompt=PROMPT, max_tokens=tokens)).token_ids
        assert client.info().verifier_address == first.address
        ids, stats = generate_with_fault(
            client, getattr(first, fault), prompt=PROMPT, max_tokens=tokens
        )
        assert ids == reference and stats.generated_tokens == len(reference) == tokens
        log = coordinator.log_path.read_text()
        assert "lost the session" in log
        if fault == "stop":  # its stream ends at once, not cancelled at the end of the grace
            # period (which surfaced as CANCELLED and failed the request). How it ends depends
            # on where the stop lands: the next message refused ("shutting down"), a call still
            # on its way cancelled as gRPC stops (GOAWAY, "Cancelling all calls") or the port
            # already closed. No call that reached the verifier held its stop:
            assert "still running" not in first.log_path.read_text()
            # a clean exit: MLX's thread no longer aborts the process as it ends
            assert first.process.wait(30) == 0, first.log_tail()
        assert client.info().verifier_address == second.address
    finally:
        for service in (coordinator, second, first):
            if service is not None:
                service.stop()


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_model_drafter_restart_mid_generation_keeps_output(kind, tmp_path):
    """Kill a drafter that reads target hidden rows during a long generation and start a new
    one on its port: the coordinator re-opens it with every row it kept and drafts again in the
    same request; the output stays the target's."""
    # a long context and an EOS this prompt never reaches: the request outlives a restart
    tiny_model_dir = make_tiny_model_dir(
        tmp_path / "long", max_positions=16384, eos_token="<|im_start|>"
    )
    make_weights = {"eagle3": make_tiny_eagle3_dir, "dflash": make_tiny_dflash_dir}[kind]
    drafter_args = ["--weights", str(make_weights(tmp_path / kind, tiny_model_dir))]
    plain = load_target(str(tiny_model_dir), "float32")
    prompt, tokens = PROMPT, 1500
    reference = plain_decode(
        plain.model, plain.tokenizer.encode(prompt), tokens, set(plain.identity.eos_token_ids)
    ).token_ids
    with Stack(
        target=str(tiny_model_dir),
        drafter=kind,
        drafter_args=drafter_args,
        startup_timeout_s=120,
        log_dir=tmp_path,
    ) as s:
        client = CoordinatorClient(s.coordinator)
        drafter = s.services["drafter"]
        port = int(drafter.address.rsplit(":", 1)[1])

        def restart():
            drafter.kill()
            # the verifier waits, stopped, until the new drafter serves: otherwise the request
            # can end before a drafter process has started (the tiny target is that fast)
            verifier = s.services["verifier"].process
            verifier.send_signal(signal.SIGSTOP)
            try:
                s.services["drafter"] = spawn(
                    "drafter",
                    ["--kind", kind, "--target", str(tiny_model_dir), *drafter_args],
                    port=port,
                    log_dir=tmp_path / "second",
                )
                s.services["drafter"].wait_healthy(120)
            finally:
                verifier.send_signal(signal.SIGCONT)

        ids, stats = [], None
        request = make_request(prompt=prompt, max_tokens=tokens, num_draft_tokens=3)
        for message in client.stream(request):
            ids.extend(message.token_ids)
            if drafter is s.services["drafter"] and len(ids) > 20:
                restart()
            if message.finish_reason:
                stats = message.stats
        assert ids == reference
        assert stats.drafter_failed
        log = s.services["coordinator"].log_path.read_text()
        assert "drafter is back" in log, "the drafter was not re-opened within the request"
        client.close()


def test_which_upstream_errors_count_as_a_lost_session():
    from coordinator.clients import UpstreamError
    from coordinator.failover import session_lost

    def err(code, details):
        return UpstreamError("verifier 127.0.0.1:1", code, details)

    assert session_lost(err(grpc.StatusCode.UNAVAILABLE, "the service is shutting down"))
    assert session_lost(err(grpc.StatusCode.CANCELLED, "Cancelling all calls"))
    assert session_lost(err(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert session_lost(err(grpc.StatusCode.FAILED_PRECONDITION, "unknown session 'x'"))
    # a servicer's own failure is a bug to report, not a reason to move the session
    assert not session_lost(err(grpc.StatusCode.INTERNAL, "internal error: ValueError: x"))
    assert not session_lost(err(grpc.StatusCode.INVALID_ARGUMENT, "bad draft_ids"))


def test_faults_under_load_lose_no_request(tiny_model_dir, tmp_path):
    """16 sessions at once; the drafter killed and the verifier restarted while all of them run:
    every request completes with the output it had without faults."""
    from argparse import Namespace

    from coordinator.concurrency import FaultDrill, services

    prompts = [f"{PROMPT} {n} " * (1 + n % 3) for n in range(16)]

    def request_of(prompt):
        return make_request(prompt=prompt, max_tokens=TOKENS, num_draft_tokens=K)

    with ngram_stack(tiny_model_dir, tmp_path, recovery_s=120) as stack:
        client = CoordinatorClient(stack.coordinator)
        drill = FaultDrill(stack, timeout_s=120)
        clean, faulted = services(
            client, request_of, prompts, [16], Namespace(concurrency_requests=1), drill
        )
        log = stack.services["coordinator"].log_path.read_text()
    assert drill.error is None, drill.error
    want = "drafter killed, verifier killed and restarted, drafter restarted"
    assert faulted["faults"] == want, faulted
    assert clean["failed"] == faulted["failed"] == 0, (clean, faulted)
    assert clean["requests"] == faulted["requests"] == 16
    assert faulted["outputs_differing_from_solo"] == 0
    assert faulted["tokens"] == clean["tokens"]
    # the verifier's restart hit requests in flight, not one request alone
    assert log.count("lost the session") >= 8, log.count("lost the session")
