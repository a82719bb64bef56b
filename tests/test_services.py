"""RPC tests against real service processes on loopback, with a tiny random target."""

import asyncio
import time

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from helpers import generate_json
from test_rounds import GarbageProposer

from coordinator.bench import plain_decode
from coordinator.clients import DrafterClient, UpstreamError, VerifierClient
from coordinator.rounds import Plan, RoundStats, run_rounds
from specd import wire
from specd.client import CoordinatorClient, make_request
from specd.launch import Stack, spawn
from specd.models.load import load_target
from specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPTS = ["Hello there, hello there, hello", "abcabcabcabc", "The quick brown fox"]


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with Stack(
        target=str(tiny_model_dir),
        drafter="ngram",
        startup_timeout_s=120,
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return load_target(str(tiny_model_dir), "float32")


@pytest.fixture
def coordinator(stack):
    client = CoordinatorClient(stack.coordinator)
    yield client
    client.close()


@pytest.fixture
def verifier_stub(stack):
    with grpc.insecure_channel(stack.services["verifier"].address) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel)


@pytest.fixture
def drafter_stub(stack):
    with grpc.insecure_channel(stack.services["drafter"].address) as channel:
        yield drafter_pb2_grpc.DrafterStub(channel)


def code_of(call, *args):
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=30)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_identity_through_services(coordinator, plain, prompt):
    ids = plain.tokenizer.encode(prompt)
    eos = set(plain.identity.eos_token_ids)
    expected = plain_decode(plain.model, ids, 80, eos).token_ids
    for k in (None, 0, 3):
        got = coordinator.generate(make_request(prompt_ids=ids, max_tokens=80, num_draft_tokens=k))
        assert got.token_ids == expected, f"k={k}"
        assert got.stats["generated_tokens"] == len(expected)
        assert got.finish_reason == ("eos" if expected[-1] in eos else "length")


def test_streamed_text_and_json_stats(coordinator, plain):
    got = coordinator.generate(make_request(prompt="abcabcabc", max_tokens=40))
    eos = set(plain.identity.eos_token_ids)
    visible = [t for t in got.token_ids if t not in eos]
    assert got.text == plain.tokenizer.decode(visible)
    stats = got.stats
    for key in (
        "rounds",
        "drafted",
        "accepted",
        "tau",
        "draft_s",
        "verify_s",
        "coordinator_s",
        "prefill_s",
        "total_s",
    ):
        assert key in stats
    assert stats["total_s"] >= stats["verify_s"] + stats["draft_s"]


def test_stop_string_cuts_text_and_tokens(coordinator):
    full = coordinator.generate(make_request(prompt="abcabcabc", max_tokens=40))
    stop = full.text[5:8]
    assert len(stop) == 3
    got = coordinator.generate(make_request(prompt="abcabcabc", max_tokens=40, stop=[stop]))
    assert got.finish_reason == "stop"
    assert got.text == full.text[: full.text.index(stop)]
    assert got.token_ids == full.token_ids[: len(got.token_ids)]


def test_chat_prompt(coordinator):
    got = coordinator.generate(
        make_request(messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    )
    assert got.stats["prompt_tokens"] > 2 and got.finish_reason in ("length", "eos")


def test_garbage_drafter_keeps_output_identical(stack, plain):
    ids = plain.tokenizer.encode(PROMPTS[0])
    expected = plain_decode(plain.model, ids, 60, set(plain.identity.eos_token_ids)).token_ids

    async def go():
        from coordinator.local import LocalDrafter

        verifier = VerifierClient(stack.services["verifier"].address)
        drafter = LocalDrafter(GarbageProposer(plain.identity.vocab_size))
        out = []
        async for new, _ in run_rounds(verifier, drafter, ids, Plan(60, 5), RoundStats()):
            out.extend(new)
        return out

    assert asyncio.run(go()) == expected


def test_verifier_rejects_bad_input_and_keeps_serving(verifier_stub, plain):
    vocab = plain.identity.vocab_size
    open_ = verifier_stub.OpenSession
    code, msg = code_of(open_, verifier_pb2.OpenSessionRequest(prompt_ids=[]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in msg
    code, msg = code_of(open_, verifier_pb2.OpenSessionRequest(prompt_ids=[1, vocab]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside" in msg
    code, _ = code_of(open_, verifier_pb2.OpenSessionRequest(prompt_ids=[1], capture_layers=[99]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(open_, verifier_pb2.OpenSessionRequest(prompt_ids=[1], rows_dtype="int8"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(verifier_stub.Verify, verifier_pb2.VerifyRequest(session_id="nope"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    code, _ = code_of(verifier_stub.CloseSession, common_pb2.CloseSessionRequest(session_id="x"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION

    opened = open_(verifier_pb2.OpenSessionRequest(prompt_ids=[5, 6, 7]), timeout=30)
    sid = opened.session_id
    code, msg = code_of(
        verifier_stub.Verify, verifier_pb2.VerifyRequest(session_id=sid, position=99, draft_ids=[1])
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "position" in msg
    code, _ = code_of(
        verifier_stub.Verify,
        verifier_pb2.VerifyRequest(session_id=sid, position=opened.position, draft_ids=[-1]),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(
        verifier_stub.Verify,
        verifier_pb2.VerifyRequest(session_id=sid, position=opened.position, draft_ids=[1] * 1000),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # nothing was committed by the refused calls: the session goes on from where it was
    ok = verifier_stub.Verify(
        verifier_pb2.VerifyRequest(session_id=sid, position=opened.position, draft_ids=[1, 2]),
        timeout=30,
    )
    assert ok.position == opened.position + len(ok.committed_ids)
    verifier_stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=30)


def test_verifier_plain_steps_decode_in_one_call(verifier_stub, plain):
    prompt = [5, 6, 7, 8]
    expected = plain_decode(plain.model, prompt, 13, set(plain.identity.eos_token_ids)).token_ids
    opened = verifier_stub.OpenSession(
        verifier_pb2.OpenSessionRequest(prompt_ids=prompt, capture_layers=[0]), timeout=30
    )
    sid, position = opened.session_id, opened.position

    def verify(**fields):
        return verifier_pb2.VerifyRequest(session_id=sid, position=position, **fields)

    for bad in (
        verify(plain_steps=-1),
        verify(plain_steps=1000),
        verify(plain_steps=3, draft_ids=[1]),
    ):
        code, msg = code_of(verifier_stub.Verify, bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "plain_steps" in msg
    got = [opened.first_token]
    for steps in (4, 8):
        r = verifier_stub.Verify(verify(plain_steps=steps), timeout=30)
        assert r.position == position + len(r.committed_ids)
        assert wire.decode(r.hidden_rows).shape[0] == len(r.committed_ids)
        got += r.committed_ids
        position = r.position
        if r.finished:
            break
    assert got == expected[: len(got)] and (len(got) == 13 or r.finished)
    verifier_stub.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), timeout=30)


def test_look_ahead_keeps_greedy_identity_through_services(tiny_model_dir, plain, tmp_path):
    """--look-ahead, --row-forwards and --compiled-forwards on with MLX forwards (the GPU
    defaults): plain bursts leave a forward queued, which drafted rounds, one-token rounds and
    the next burst take up."""
    eos = set(plain.identity.eos_token_ids)
    with Stack(
        target=str(tiny_model_dir),
        drafter="ngram",
        verifier_args=[
            *("--look-ahead", "on", "--row-forwards", "on", "--compiled-forwards", "on"),
            *("--gemv-rows", "0"),
        ],
        coordinator_args=["--decode-burst", "3"],
        startup_timeout_s=120,
        log_dir=tmp_path,
    ) as stack:
        client = CoordinatorClient(stack.coordinator)
        try:
            for prompt in PROMPTS:
                ids = plain.tokenizer.encode(prompt)
                expected = plain_decode(plain.model, ids, 60, eos).token_ids
                for k in (None, 0, 3):
                    request = make_request(prompt_ids=ids, max_tokens=60, num_draft_tokens=k)
                    assert client.generate(request).token_ids == expected, (prompt, k)
        finally:
            client.close()


def test_drafter_rejects_malformed_arrays(drafter_stub):
    sid = drafter_stub.OpenSession(
        drafter_pb2.DraftOpenRequest(context_ids=[1, 2, 3]), timeout=30
    ).session_id
    bad_rows = [
        common_pb2.Tensor(dtype="float16", shape=[2, 4], data=b"\0" * 3),
        common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8),
        common_pb2.Tensor(dtype="float32", shape=[2, -4], data=b""),
        common_pb2.Tensor(dtype="float32", shape=[4], data=b"\0" * 16),
    ]
    for rows in bad_rows:
        code, _ = code_of(
            drafter_stub.Draft,
            drafter_pb2.DraftRequest(session_id=sid, position=4, new_ids=[1], hidden_rows=rows),
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, rows
    code, _ = code_of(
        drafter_stub.Draft, drafter_pb2.DraftRequest(session_id=sid, position=9, new_ids=[1])
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    code, _ = code_of(
        drafter_stub.Draft,
        drafter_pb2.DraftRequest(session_id=sid, position=4, new_ids=[1], num_draft_tokens=10_000),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    rows = wire.encode(__import__("numpy").zeros((1, 8), "float32"))
    ok = drafter_stub.Draft(
        drafter_pb2.DraftRequest(session_id=sid, position=4, new_ids=[1], hidden_rows=rows),
        timeout=30,
    )
    assert list(ok.draft_ids) == [2, 3, 1][: len(ok.draft_ids)]


def test_coordinator_rejects_bad_requests(coordinator, stack):
    bad = [
        make_request(),  # no input
        make_request(prompt="x", max_tokens=-3),
        make_request(prompt="x", temperature=-1),
        make_request(prompt="x", num_draft_tokens=9999),
        make_request(prompt_ids=[10**6]),
    ]
    chain_only = make_request(prompt="x", max_tokens=3)
    chain_only.tree.total_tokens = 8  # the n-gram drafter drafts chains only
    bad.append(chain_only)
    for request in bad:
        with pytest.raises(grpc.RpcError) as info:
            coordinator.generate(request, timeout_s=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
    assert "chains only" in info.value.details()
    assert coordinator.generate(make_request(prompt="ok", max_tokens=3)).token_ids


def test_reflection_lists_the_services(stack):
    for name, service in (
        ("verifier", "specd.v1.Verifier"),
        ("drafter", "specd.v1.Drafter"),
        ("coordinator", "specd.v1.Coordinator"),
    ):
        with grpc.insecure_channel(stack.services[name].address) as channel:
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert service in services and "grpc.health.v1.Health" in services


def test_incompatible_drafter_is_refused(stack, other_tiny_model_dir, tmp_path):
    drafter = spawn(
        "drafter", ["--kind", "ngram", "--target", str(other_tiny_model_dir)], log_dir=tmp_path
    )
    coordinator = spawn(
        "coordinator",
        ["--verifier", stack.services["verifier"].address, "--drafter", drafter.address],
        log_dir=tmp_path,
    )
    try:
        drafter.wait_healthy(60)
        client = CoordinatorClient(coordinator.address)
        deadline, pairing = time.monotonic() + 120, ""
        while not pairing and time.monotonic() < deadline:
            try:
                pairing = client.info(timeout_s=5).pairing_error
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        assert "made for a target" in pairing
        with pytest.raises(grpc.RpcError) as err:
            client.generate(make_request(prompt="hi", max_tokens=3), timeout_s=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "drafter" in err.value.details()
        client.close()
    finally:
        coordinator.stop()
        drafter.stop()


def test_generate_command_prints_text_then_json(stack):
    out, result = generate_json(stack.coordinator, "--prompt", "abcabc", "--max-tokens", "12")
    assert len(result["token_ids"]) == result["stats"]["generated_tokens"] > 0
    assert out.startswith(result["text"])


def test_limits_say_which_limit(tiny_model_dir, tmp_path):
    verifier = spawn(
        "verifier",
        ["--model", str(tiny_model_dir), "--max-sessions", "2", "--max-context", "64"],
        log_dir=tmp_path,
    )
    try:
        verifier.wait_healthy(120)
        with grpc.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            code, msg = code_of(
                stub.OpenSession, verifier_pb2.OpenSessionRequest(prompt_ids=[5] * 80)
            )
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "context limit 64" in msg
            opened = [
                stub.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=[5, 6]), timeout=30)
                for _ in range(2)
            ]
            code, msg = code_of(stub.OpenSession, verifier_pb2.OpenSessionRequest(prompt_ids=[5]))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 2" in msg
            huge = common_pb2.Tensor(dtype="float32", shape=[1], data=b"\0" * (65 << 20))
            code, msg = code_of(
                stub.Verify,
                verifier_pb2.VerifyRequest(
                    session_id=opened[0].session_id, position=opened[0].position, draft_probs=huge
                ),
            )
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in msg
            ok = stub.Verify(
                verifier_pb2.VerifyRequest(
                    session_id=opened[1].session_id, position=opened[1].position
                ),
                timeout=30,
            )
            assert len(ok.committed_ids) == 1
    finally:
        verifier.stop()


def test_overlap_drafting_through_services(stack, plain, tmp_path):
    coordinator = spawn(
        "coordinator",
        [
            "--verifier",
            stack.services["verifier"].address,
            "--drafter",
            stack.services["drafter"].address,
            "--overlap-drafting",
        ],
        log_dir=tmp_path,
    )
    try:
        coordinator.wait_healthy(120)
        client = CoordinatorClient(coordinator.address)
        eos = set(plain.identity.eos_token_ids)
        for prompt in PROMPTS:
            ids = plain.tokenizer.encode(prompt)
            expected = plain_decode(plain.model, ids, 80, eos).token_ids
            got = client.generate(make_request(prompt_ids=ids, max_tokens=80, num_draft_tokens=3))
            assert got.token_ids == expected
            assert "predrafted_rounds" in got.stats
        client.close()
    finally:
        coordinator.stop()


def test_drafter_speculative_ids_are_not_kept(drafter_stub):
    sid = drafter_stub.OpenSession(
        drafter_pb2.DraftOpenRequest(context_ids=[1, 2, 3, 4, 1, 2]), timeout=30
    ).session_id
    ahead = drafter_stub.Draft(
        drafter_pb2.DraftRequest(
            session_id=sid, position=6, num_draft_tokens=2, speculative_ids=[3]
        ),
        timeout=30,
    )
    assert list(ahead.draft_ids) == [4, 1]
    now = drafter_stub.Draft(
        drafter_pb2.DraftRequest(session_id=sid, position=6, num_draft_tokens=2), timeout=30
    )
    assert list(now.draft_ids) == [3, 4]


def test_round_streams_answer_as_unary_calls_do(stack, verifier_stub):
    """A session's verifies over one VerifyStream commit what unary Verify calls commit; an
    error ends the stream with Verify's status and commits nothing; the next call reopens."""
    prompt, drafts = [5, 6, 7, 8], [[1, 2], [], [3], [4, 4, 4]]
    opened = verifier_stub.OpenSession(
        verifier_pb2.OpenSessionRequest(prompt_ids=prompt), timeout=30
    )
    position, unary = opened.position, []
    for ids in drafts:
        r = verifier_stub.Verify(
            verifier_pb2.VerifyRequest(
                session_id=opened.session_id, position=position, draft_ids=ids
            ),
            timeout=30,
        )
        unary.append(list(r.committed_ids))
        position = r.position

    async def go():
        client = VerifierClient(stack.services["verifier"].address)
        session = await client.open(prompt, (), None)
        position, streamed = len(prompt) + 1, []
        with pytest.raises(UpstreamError) as err:
            await client.verify(session.session_id, position + 7, [1], None)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "position" in err.value.message and not client.rounds._streams
        for ids in drafts:
            v = await client.verify(session.session_id, position, ids, None)
            streamed.append(v.committed)
            position += len(v.committed)
        assert list(client.rounds._streams) == [session.session_id] and client.rounds.streaming
        await client.close(session.session_id)
        assert not client.rounds._streams
        return streamed

    assert asyncio.run(go()) == unary


def test_round_streams_refuse_malformed_messages(stack):
    address = stack.services["verifier"].address
    with grpc.insecure_channel(address) as channel:
        raw = channel.stream_stream("/specd.v1.Verifier/VerifyStream")
        with pytest.raises(grpc.RpcError) as err:
            list(raw(iter([b"\xff\xff\xff"]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf" in err.value.details()


def test_round_streams_fall_back_to_unary_and_time_out(stack):
    """A service without the stream method (UNIMPLEMENTED) is called unary from then on; an
    exchange past its deadline is DEADLINE_EXCEEDED and its stream is dropped."""
    address = stack.services["drafter"].address

    async def go():
        client = DrafterClient(address)
        session = await client.open([1, 2, 3, 1, 2], None)
        missing = client.channel.stream_stream(
            "/specd.v1.Drafter/NoSuchStream",
            drafter_pb2.DraftRequest.SerializeToString,
            drafter_pb2.DraftResponse.FromString,
        )
        client.rounds.open_stream = missing
        drafted = await client.draft(session, 5, [], [], 2, None)
        assert drafted.ids == [3, 1] and not client.rounds.streaming

        client.rounds.open_stream, client.rounds.streaming = client.stub.DraftStream, True
        with pytest.raises(UpstreamError) as err:
            await client.rounds.call(
                session, drafter_pb2.DraftRequest(session_id=session, position=5), 1e-6
            )
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not client.rounds._streams
        assert (await client.draft(session, 5, [], [], 2, None)).ids == [3, 1]
        await client.close(session)

    asyncio.run(go())
