"""Property-based fuzzing of every RPC of every service with random and malformed fields:
no crash, no hang, only the status codes a caller can act on, and service as usual after."""

import collections
import json

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.client import CoordinatorClient, make_request
from specd.launch import Stack
from specd.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    drafter_pb2,
    drafter_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

EXAMPLES = 100  # per RPC
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

ints = st.one_of(st.integers(-5, 300), st.integers(-(2**31), 2**31 - 1))
token_lists = st.lists(ints, max_size=40) | st.lists(st.integers(0, 258), min_size=1, max_size=3000)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
tensors = st.builds(
    common_pb2.Tensor,
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "int32", "", "int8", "x" * 99]),
    shape=st.lists(st.integers(-3, 2**40), max_size=4) | st.lists(st.integers(0, 8), max_size=3),
    data=st.binary(max_size=600),
)
sampling = st.builds(
    common_pb2.SamplingParams,
    temperature=floats,
    top_k=ints,
    top_p=floats,
    min_p=floats,
    seed=st.none() | st.integers(0, 2**64 - 1),
)
text = st.text(max_size=200)


def session_ids(valid: str):
    # half the time a live session, so checks past the session lookup are reached too
    return st.one_of(
        st.just(valid), st.just(valid), st.sampled_from(["", "nope"]), st.text(max_size=40)
    )


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with Stack(
        target=str(tiny_model_dir), drafter="ngram", log_dir=tmp_path_factory.mktemp("logs")
    ) as s:
        yield s
    report = {rpc: {code.name: n for code, n in counts.items()} for rpc, counts in SEEN.items()}
    print("\nfuzz report:", json.dumps(report, indent=1))


def fuzz(name: str, call, strategy):
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def run(request):
        try:
            result = call(request)
            if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
                for _ in result:
                    pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
            assert code in ALLOWED, f"{name}: {code} {err.details()} for {request}"
        SEEN[name][code] += 1

    run()


def test_fuzz_verifier(stack):
    with grpc.insecure_channel(stack.services["verifier"].address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        opened = stub.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=[5, 6]), timeout=30)
        fuzz(
            "Verifier.OpenSession",
            lambda r: stub.OpenSession(r, timeout=30),
            st.builds(
                verifier_pb2.OpenSessionRequest,
                prompt_ids=token_lists,
                capture_layers=st.lists(ints, max_size=5),
                sampling=sampling,
                rows_dtype=st.sampled_from(["", "float16", "float32", "bfloat16", "int4"]),
            ),
        )
        fuzz(
            "Verifier.Verify",
            lambda r: stub.Verify(r, timeout=30),
            st.builds(
                verifier_pb2.VerifyRequest,
                session_id=session_ids(opened.session_id),
                position=st.sampled_from([opened.position]) | ints,
                draft_ids=st.lists(ints, max_size=80),
                draft_probs=st.none() | tensors,
            ),
        )
        fuzz(
            "Verifier.CloseSession",
            lambda r: stub.CloseSession(r, timeout=30),
            st.builds(common_pb2.CloseSessionRequest, session_id=text),
        )
        fuzz(
            "Verifier.GetInfo",
            lambda r: stub.GetInfo(r, timeout=30),
            st.just(common_pb2.InfoRequest()),
        )
        # still serving: a normal session works
        ok = stub.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=[1, 2, 3]), timeout=30)
        stub.Verify(
            verifier_pb2.VerifyRequest(session_id=ok.session_id, position=ok.position), timeout=30
        )


def test_fuzz_drafter(stack):
    with grpc.insecure_channel(stack.services["drafter"].address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        valid = stub.OpenSession(drafter_pb2.DraftOpenRequest(context_ids=[1, 2, 1]), timeout=30)
        fuzz(
            "Drafter.OpenSession",
            lambda r: stub.OpenSession(r, timeout=30),
            st.builds(
                drafter_pb2.DraftOpenRequest,
                context_ids=token_lists,
                hidden_rows=st.none() | tensors,
            ),
        )
        fuzz(
            "Drafter.Draft",
            lambda r: stub.Draft(r, timeout=30),
            st.builds(
                drafter_pb2.DraftRequest,
                session_id=session_ids(valid.session_id),
                position=ints,
                new_ids=st.lists(ints, max_size=20),
                hidden_rows=st.none() | tensors,
                num_draft_tokens=ints,
                sampling=sampling,
            ),
        )
        fuzz(
            "Drafter.CloseSession",
            lambda r: stub.CloseSession(r, timeout=30),
            st.builds(common_pb2.CloseSessionRequest, session_id=text),
        )
        info = stub.GetInfo(common_pb2.InfoRequest(), timeout=30)
        assert info.kind == "ngram" and info.text_driven


def test_fuzz_coordinator(stack):
    with grpc.insecure_channel(stack.coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        chat = st.builds(
            coordinator_pb2.ChatMessages,
            messages=st.lists(
                st.builds(
                    coordinator_pb2.ChatMessage,
                    role=st.sampled_from(["user", "system", "", "x"]),
                    content=text,
                ),
                max_size=3,
            ),
        )
        requests = st.builds(
            coordinator_pb2.GenerateRequest,
            prompt=st.none() | text,
            chat=st.none() | chat,
            prompt_ids=st.none()
            | st.builds(coordinator_pb2.TokenIds, ids=st.lists(ints, max_size=30)),
            max_tokens=st.integers(-3, 12) | ints,
            sampling=sampling,
            stop=st.lists(text, max_size=3),
            num_draft_tokens=st.none() | ints,
        )
        fuzz("Coordinator.Generate", lambda r: stub.Generate(r, timeout=60), requests)
    client = CoordinatorClient(stack.coordinator)
    assert client.generate(make_request(prompt="still fine", max_tokens=5)).token_ids


def test_fuzz_raw_bytes_are_refused(stack):
    """Bytes that are not a protobuf message at all: INVALID_ARGUMENT, not UNKNOWN."""
    methods = {
        "/specd.v1.Verifier/OpenSession": "verifier",
        "/specd.v1.Verifier/Verify": "verifier",
        "/specd.v1.Drafter/Draft": "drafter",
        "/specd.v1.Coordinator/GetInfo": "coordinator",
    }
    for method, service in methods.items():
        with grpc.insecure_channel(stack.services[service].address) as channel:
            call = channel.unary_unary(method)
            fuzz(
                f"raw {method}",
                lambda r, call=call: call(r, timeout=30),
                st.binary(min_size=1, max_size=300),
            )
    CoordinatorClient(stack.coordinator).info()
