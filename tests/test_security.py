"""TLS, mutual TLS and token auth, accepted and refused, with certificates made here."""

import grpc
import pytest
from certs import make_pki

from specd.client import CoordinatorClient, make_request
from specd.launch import spawn
from specd.security import ClientSecurity
from specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    paths = make_pki(folder)
    paths["token"] = folder / "token"
    paths["token"].write_text(TOKEN + "\n")
    paths["wrong_token"] = folder / "wrong"
    paths["wrong_token"].write_text("not-the-token-but-long-enough")
    return paths


def server_args(pki, mtls: bool) -> list[str]:
    args = [
        "--tls-cert",
        str(pki["server_cert"]),
        "--tls-key",
        str(pki["server_key"]),
        "--auth-token-file",
        str(pki["token"]),
    ]
    return args + (["--tls-client-ca", str(pki["ca"])] if mtls else [])


def info_code(address: str, security: ClientSecurity, insecure: bool = False, stream: bool = False):
    """Status of a GetInfo call, or with `stream` of a DraftStream of one request."""
    credentials = None if insecure else security.credentials()
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        try:
            if stream:
                request = drafter_pb2.DraftRequest(session_id="none")
                list(stub.DraftStream(iter([request]), timeout=10, metadata=security.metadata()))
            else:
                stub.GetInfo(common_pb2.InfoRequest(), timeout=10, metadata=security.metadata())
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return err.code()


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_drafter_accepts_and_refuses(pki, tmp_path, mtls):
    drafter = spawn("drafter", ["--kind", "ngram", *server_args(pki, mtls)], log_dir=tmp_path)
    try:
        client = ClientSecurity(pki["ca"], pki["client_cert"], pki["client_key"], pki["token"])
        drafter.wait_healthy(60, credentials=client.credentials())
        ok = grpc.StatusCode.OK
        assert info_code(drafter.address, client) == ok
        no_token = ClientSecurity(pki["ca"], pki["client_cert"], pki["client_key"])
        assert info_code(drafter.address, no_token) == grpc.StatusCode.UNAUTHENTICATED
        refused = info_code(drafter.address, no_token, stream=True)
        assert refused == grpc.StatusCode.UNAUTHENTICATED
        # with the token the stream reaches the servicer: the session is unknown
        assert (
            info_code(drafter.address, client, stream=True) == grpc.StatusCode.FAILED_PRECONDITION
        )
        wrong = ClientSecurity(pki["ca"], pki["client_cert"], pki["client_key"], pki["wrong_token"])
        assert info_code(drafter.address, wrong) == grpc.StatusCode.UNAUTHENTICATED
        assert info_code(drafter.address, client, insecure=True) == grpc.StatusCode.UNAVAILABLE
        no_cert = ClientSecurity(pki["ca"], token_file=pki["token"])
        rogue = ClientSecurity(pki["ca"], pki["rogue_cert"], pki["rogue_key"], pki["token"])
        expected = grpc.StatusCode.UNAVAILABLE if mtls else ok
        assert info_code(drafter.address, no_cert) == expected
        assert info_code(drafter.address, rogue) == expected
    finally:
        drafter.stop()


def test_full_stack_over_mtls_with_token(pki, tiny_model_dir, tmp_path):
    secure = server_args(pki, mtls=True)
    upstream = [
        "--upstream-tls-ca",
        str(pki["ca"]),
        "--upstream-tls-cert",
        str(pki["client_cert"]),
        "--upstream-tls-key",
        str(pki["client_key"]),
        "--upstream-token-file",
        str(pki["token"]),
    ]
    client = ClientSecurity(pki["ca"], pki["client_cert"], pki["client_key"], pki["token"])
    verifier = spawn("verifier", ["--model", str(tiny_model_dir), *secure], log_dir=tmp_path)
    drafter = spawn("drafter", ["--kind", "ngram", *secure], log_dir=tmp_path)
    coordinator = spawn(
        "coordinator",
        ["--verifier", verifier.address, "--drafter", drafter.address, *secure, *upstream],
        log_dir=tmp_path,
    )
    try:
        for service in (verifier, drafter, coordinator):
            service.wait_healthy(120, credentials=client.credentials())
        out = CoordinatorClient(coordinator.address, client).generate(
            make_request(prompt="abcabcabc", max_tokens=20, num_draft_tokens=4)
        )
        assert len(out.token_ids) == 20 and out.stats["drafted"] > 0
        with pytest.raises(grpc.RpcError) as err:
            CoordinatorClient(
                coordinator.address,
                ClientSecurity(pki["ca"], pki["client_cert"], pki["client_key"]),
            ).generate(make_request(prompt="x", max_tokens=2), timeout_s=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for service in (coordinator, drafter, verifier):
            service.stop()
