"""How the round's stream client treats a stream the service refuses (no real server: the
race these cases come from cannot be forced on loopback; test_services covers the real path)."""

import asyncio

import grpc
import pytest

from coordinator.clients import SessionStreams, UpstreamError

REFUSED = dict(code=grpc.StatusCode.INTERNAL, details="Internal error from Core")


def _error(code, details):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeStream:
    def __init__(self, error=None, answer="streamed"):
        self.error, self.answer, self.cancelled = error, answer, False

    async def write(self, request):
        if self.error is not None:
            raise self.error

    async def read(self):
        return self.answer

    def cancel(self):
        self.cancelled = True


def _streams(opened: list, unary_answer="unary"):
    unary_calls = []

    async def unary(request, timeout, metadata):
        unary_calls.append(request)
        if isinstance(unary_answer, Exception):
            raise unary_answer
        return unary_answer

    def open_stream(metadata):
        return opened.pop(0)

    return SessionStreams("drafter x", open_stream, unary, ()), unary_calls


def test_a_new_stream_refused_before_its_first_write_falls_back_to_unary():
    client, unary_calls = _streams([FakeStream(_error(**REFUSED))])
    assert asyncio.run(client.call("s", "request", 5)) == "unary"
    assert unary_calls == ["request"] and not client.streaming


def test_the_unary_answer_decides_when_the_refusal_was_something_else():
    denied = _error(grpc.StatusCode.UNAUTHENTICATED, "no token")
    client, _ = _streams([FakeStream(_error(**REFUSED))], unary_answer=denied)
    with pytest.raises(UpstreamError) as err:
        asyncio.run(client.call("s", "request", 5))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and client.streaming


def test_an_open_stream_failing_is_an_error_not_a_retry():
    stream = FakeStream()
    client, unary_calls = _streams([stream])

    async def go():
        assert await client.call("s", "first", 5) == "streamed"
        stream.error = _error(**REFUSED)  # e.g. the service's process exiting
        await client.call("s", "second", 5)

    with pytest.raises(UpstreamError) as err:
        asyncio.run(go())
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert unary_calls == [] and client.streaming and stream.cancelled


def test_a_write_to_a_stream_whose_call_already_finished_is_the_service_gone():
    """gRPC raises asyncio.InvalidStateError, not an RPC error, for a write after the call
    ended (a verifier killed between two requests): the session is lost, UNAVAILABLE, so the
    coordinator re-opens it instead of failing the request."""
    stream = FakeStream()
    client, unary_calls = _streams([stream])

    async def go():
        assert await client.call("s", "first", 5) == "streamed"
        stream.error = asyncio.InvalidStateError("RPC already finished.")
        await client.call("s", "second", 5)

    with pytest.raises(UpstreamError) as err:
        asyncio.run(go())
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert unary_calls == [] and stream.cancelled
