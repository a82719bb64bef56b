"""gRPC ports for the round loop, with deadlines; upstream errors keep their status code."""

from __future__ import annotations

import asyncio

import grpc

from coordinator.rounds import Drafted, Opened, Verified, close_in_background, close_quietly
from specd import wire
from specd.security import ClientSecurity
from specd.service import ServiceError, channel_options
from specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc


class UpstreamError(ServiceError):
    """A verifier or drafter call failed; re-raised to our caller with the same code."""

    def __init__(self, service: str, code: grpc.StatusCode, details: str | None):
        super().__init__(f"{service}: {details}")
        self.code = code

    @classmethod
    def of(cls, service: str, err: grpc.aio.AioRpcError) -> UpstreamError:
        return cls(service, err.code(), err.details())


def _ended(service: str) -> UpstreamError:
    """The service ended a stream between requests: it is stopping (a graceful shutdown
    cancels open streams once its grace period is over). Like a refused call: UNAVAILABLE."""
    return UpstreamError(
        service, grpc.StatusCode.UNAVAILABLE, "the service ended the stream (shutting down?)"
    )


def _refused_before_sending(err: grpc.aio.AioRpcError) -> bool:
    """grpc-python's status when a stream's first write fails because the service already
    ended the stream (an UNIMPLEMENTED method, say) before that status has arrived."""
    return err.code() == grpc.StatusCode.INTERNAL and err.details() == "Internal error from Core"


class SessionStreams:
    """The round's hot calls of each session over one bidirectional stream, opened on first
    use and ended when the session closes: a message on an open stream costs about half a
    unary call here. A service without the stream method gets unary calls instead.

    A failed, timed-out or cancelled exchange drops the stream, so a response can never be
    read as the answer to a later request; the session's next call opens a new one. A
    session makes one call at a time (the round loop awaits each), which keeps the pairing.
    """

    def __init__(self, service: str, open_stream, unary, metadata):
        self.service = service
        self.open_stream = open_stream
        self.unary = unary
        self.metadata = metadata
        self.streaming = True  # False once the service answered UNIMPLEMENTED
        self._streams: dict[str, grpc.aio.StreamStreamCall] = {}

    async def call(self, session_id: str, request, timeout: float):
        if not self.streaming:
            return await self._unary(request, timeout)
        stream = self._streams.get(session_id)
        fresh = stream is None
        if fresh:
            stream = self._streams[session_id] = self.open_stream(metadata=self.metadata)
        try:
            return await asyncio.wait_for(self._exchange(stream, request), timeout)
        except asyncio.InvalidStateError:  # the call had finished (the service went away)
            self._drop(session_id)
            raise _ended(self.service) from None
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            self._drop(session_id)
            raise UpstreamError(
                self.service, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {timeout:g}s"
            ) from None
        except grpc.aio.AioRpcError as err:
            self._drop(session_id)
            if err.code() == grpc.StatusCode.CANCELLED:  # we never read after cancelling
                raise _ended(self.service) from None
            if err.code() != grpc.StatusCode.UNIMPLEMENTED and not (
                fresh and _refused_before_sending(err)
            ):
                raise UpstreamError.of(self.service, err) from None
            # The request never reached the service's handler: ask it unary. A service that
            # answers unary but refused a new stream has no stream method.
            response = await self._unary(request, timeout)
            self.streaming = False
            return response
        except BaseException:  # cancelled mid-exchange: the stream's next message is stale
            self._drop(session_id)
            raise

    async def _exchange(self, stream, request):
        await stream.write(request)
        response = await stream.read()
        if response is grpc.aio.EOF:
            raise _ended(self.service)
        return response

    async def _unary(self, request, timeout: float):
        try:
            return await self.unary(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise UpstreamError.of(self.service, err) from None

    async def end(self, session_id: str) -> None:
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            try:
                await stream.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                stream.cancel()

    def _drop(self, session_id: str) -> None:
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            stream.cancel()


async def _open_session(call, client):
    """Await an OpenSession call. If our caller is cancelled meanwhile (its client went away),
    the call still completes and the session it made is closed, so nothing is left open on
    the service until it idles out."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda done: _close_opened(done, client))
        raise


def _close_opened(done: asyncio.Future, client) -> None:
    if not done.cancelled() and done.exception() is None:
        close_in_background(close_quietly(client, done.result().session_id))


def _channel(address: str, security: ClientSecurity) -> grpc.aio.Channel:
    credentials = security.credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=channel_options())
    return grpc.aio.secure_channel(address, credentials, options=channel_options())


def _join_rows(rows: list) -> common_pb2.Tensor | None:
    """Concatenate row tensors along axis 0 without decoding them (row-major, same dtype)."""
    rows = [r for r in rows if r is not None and not wire.is_empty(r)]
    if not rows:
        return None
    if len(rows) == 1:
        return rows[0]
    shape = list(rows[0].shape)
    shape[0] = sum(r.shape[0] for r in rows)
    return common_pb2.Tensor(dtype=rows[0].dtype, shape=shape, data=b"".join(r.data for r in rows))


class VerifierClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = 60.0,
        prefill_timeout_s: float = 600.0,
        security: ClientSecurity | None = None,
    ):
        security = security or ClientSecurity()
        self.address = address
        self.channel = _channel(address, security)
        self.metadata = security.metadata()
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self.timeout_s = timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.rounds = SessionStreams(
            f"verifier {address}", self.stub.VerifyStream, self.stub.Verify, self.metadata
        )

    async def _call(self, method, request, timeout: float):
        try:
            return await method(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise UpstreamError.of(f"verifier {self.address}", err) from None

    async def info(self) -> verifier_pb2.VerifierInfo:
        return await self._call(self.stub.GetInfo, common_pb2.InfoRequest(), self.timeout_s)

    async def tokenizer_files(self) -> dict[str, bytes]:
        files = await self._call(self.stub.GetTokenizer, common_pb2.InfoRequest(), self.timeout_s)
        return dict(files.files)

    async def open(self, prompt_ids, capture_layers, sampling) -> Opened:
        request = verifier_pb2.OpenSessionRequest(
            prompt_ids=prompt_ids, capture_layers=capture_layers, sampling=sampling
        )
        r = await _open_session(
            self._call(self.stub.OpenSession, request, self.prefill_timeout_s), self
        )
        return Opened(r.session_id, r.first_token, r.finished, r.hidden_rows, r.compute_s)

    async def verify(
        self, session_id, position, draft_ids, draft_probs, draft_parents=None, plain_steps=0
    ) -> Verified:
        request = verifier_pb2.VerifyRequest(
            session_id=session_id,
            position=position,
            draft_ids=draft_ids,
            draft_probs=draft_probs,
            draft_parents=draft_parents or (),
            plain_steps=plain_steps,
        )
        r = await self.rounds.call(session_id, request, self.timeout_s)
        return Verified(
            list(r.committed_ids), r.num_accepted, r.finished, r.hidden_rows, r.compute_s,
            r.forward_share or 1.0,
        )  # fmt: skip

    async def close(self, session_id: str) -> None:
        await self.rounds.end(session_id)
        request = common_pb2.CloseSessionRequest(session_id=session_id)
        await self._call(self.stub.CloseSession, request, self.timeout_s)


class DrafterClient:
    def __init__(
        self, address: str, timeout_s: float = 30.0, security: ClientSecurity | None = None
    ):
        security = security or ClientSecurity()
        self.address = address
        self.channel = _channel(address, security)
        self.metadata = security.metadata()
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.timeout_s = timeout_s
        self.capture_layers: tuple[int, ...] = ()
        self.accepts_speculative_ids = False
        self.sends_draft_probs = True  # until told: a sampled guess is drawn from q
        self.rounds = SessionStreams(
            f"drafter {address}", self.stub.DraftStream, self.stub.Draft, self.metadata
        )

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise UpstreamError.of(f"drafter {self.address}", err) from None

    async def info(self) -> drafter_pb2.DrafterInfo:
        info = await self._call(self.stub.GetInfo, common_pb2.InfoRequest())
        self.capture_layers = tuple(info.capture_layers)
        self.accepts_speculative_ids = info.accepts_speculative_ids
        self.sends_draft_probs = info.sends_draft_probs
        return info

    async def open(self, context_ids, rows) -> str:
        """`rows`: one tensor, or a list of them (a re-open sends every row kept so far)."""
        rows = _join_rows(rows if isinstance(rows, list) else [rows])
        request = drafter_pb2.DraftOpenRequest(context_ids=context_ids, hidden_rows=rows)
        opened = await _open_session(self._call(self.stub.OpenSession, request), self)
        return opened.session_id

    async def draft(
        self, session_id, position, new_ids, rows, k, sampling, speculative_ids=(), tree=None
    ) -> Drafted:
        request = drafter_pb2.DraftRequest(
            session_id=session_id,
            position=position,
            new_ids=new_ids,
            hidden_rows=_join_rows(rows),
            num_draft_tokens=k,
            sampling=sampling,
            speculative_ids=speculative_ids,
            tree=tree,
        )
        r = await self.rounds.call(session_id, request, self.timeout_s)
        probs = None if wire.is_empty(r.draft_probs) else r.draft_probs
        parents = list(r.draft_parents) if r.draft_parents else None
        scores = list(r.draft_scores) if r.draft_scores else None
        return Drafted(list(r.draft_ids), probs, r.compute_s, parents, scores)

    async def close(self, session_id: str) -> None:
        await self.rounds.end(session_id)
        await self._call(
            self.stub.CloseSession, common_pb2.CloseSessionRequest(session_id=session_id)
        )
