"""What every service shares: status errors, the MLX thread, the aio server with health
and reflection, process stats."""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import json
import logging
import math
import queue
import resource
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd import metrics
from specd.security import ServerSecurity
from specd.v1 import common_pb2
from specd.wire import WireError

log = logging.getLogger("specd")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # hidden rows of a long prompt fit; anything bigger is refused


class ServiceError(Exception):
    """An error the caller can act on, sent as a gRPC status."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


def check_token_ids(ids, vocab_size: int, what: str) -> list[int]:
    ids = list(ids)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{what} has ids outside [0, {vocab_size}): {bad[:5]}")
    return ids


def check_sampling_params(params) -> None:
    """A SamplingParams message's values, as every service that takes one checks them."""
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidArgument(f"temperature must be a finite number >= 0, got {params.temperature}")
    for name in ("top_p", "min_p"):
        value = getattr(params, name)
        if not 0 <= value <= 1:  # NaN fails this too
            raise InvalidArgument(f"{name} must be in [0, 1], got {value}")
    if params.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0, got {params.top_k}")


def check_tree_request(tree, kind: str, drafts_trees: bool, max_tree_tokens: int) -> None:
    """A TreeShape message asked of a drafter (total_tokens 0: a chain)."""
    if min(tree.total_tokens, tree.depth, tree.top_k) < 0:
        raise InvalidArgument("tree total_tokens, depth and top_k must be >= 0")
    if tree.total_tokens and not drafts_trees:
        raise InvalidArgument(
            f"the {kind} drafter drafts chains only; leave tree unset (or total_tokens 0)"
        )
    if tree.total_tokens > max_tree_tokens:
        raise InvalidArgument(
            f"tree of {tree.total_tokens} tokens exceeds the drafter's limit {max_tree_tokens}"
        )


def _status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, WireError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.exception("internal error")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


class Malformed:
    """Stands in for a request whose bytes are not a protobuf message of the right type."""

    def __init__(self, error: Exception):
        self.error = error


def _refuse_malformed(request) -> None:
    if isinstance(request, Malformed):
        raise InvalidArgument(f"the request is not a valid protobuf message: {request.error}")


_HANDLER_KINDS = {  # (client streaming, server streaming) -> handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def register(server: grpc.aio.Server, servicer, service: ServiceDescriptor) -> None:
    """Add `servicer` for `service`; undecodable requests become INVALID_ARGUMENT
    (the generated add_*_to_server would let them surface as UNKNOWN)."""
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)

        def parse(data: bytes, cls=request_cls):
            try:
                return cls.FromString(data)
            except DecodeError as err:
                return Malformed(err)

        make = _HANDLER_KINDS[method.client_streaming, method.server_streaming]
        handlers[method.name] = make(
            _calls.track(getattr(servicer, method.name)),
            request_deserializer=parse,
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(service.full_name, handlers)]
    )


def rpc(method):
    """Turn exceptions of a unary aio servicer method into gRPC statuses."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        return await _handle_one(method.__name__, method, self, request, context)

    return wrapper


_SHUTTING_DOWN = "the service is shutting down"


class _Calls:
    """The calls of this process's services that reached their method and have not ended.

    A graceful stop sets `stopping` and drains these while the server still serves, refusing
    new calls, and only then stops gRPC: a call that reaches grpc-python's server as its stop
    begins can be left without a handler (the request it was matched to is dropped) until the
    grace period ends, which held a client's failover for the whole grace period."""

    def __init__(self):
        self.stopping = False  # set once per process, when its server begins a graceful stop
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def track(self, method):
        if inspect.isasyncgenfunction(method):

            @functools.wraps(method)
            async def streaming(request_or_iterator, context):
                await self._enter(method.__name__, context)
                try:
                    async for response in method(request_or_iterator, context):
                        yield response
                finally:
                    self._leave()

            return streaming
        if not inspect.iscoroutinefunction(method):
            raise TypeError(f"{method.__qualname__} must be async (an aio servicer method)")

        @functools.wraps(method)
        async def unary(request, context):
            await self._enter(method.__name__, context)
            try:
                return await method(request, context)
            finally:
                self._leave()

        return unary

    async def _enter(self, name: str, context) -> None:
        if self.stopping:  # a new call: the client should go elsewhere
            metrics.RPCS.labels(name, grpc.StatusCode.UNAVAILABLE.name).inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, _SHUTTING_DOWN)
        self.count += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            return False
        return True


_calls = _Calls()


def stream_of(unary):
    """A bidirectional stream method answering each request as the `rpc` method `unary`
    does; the first error ends the stream with the status that call would have returned.

    A message on an open stream costs about half a unary call here (no per-call setup), so
    the coordinator sends a session's rounds over one stream."""
    method = unary.__wrapped__  # the servicer's own method, under `rpc`
    name = method.__name__

    async def stream(self, requests, context):
        async for request in requests:
            # once stopping, refused as a new unary call would be, so callers move on
            handler = _refuse_while_stopping if _calls.stopping else method
            yield await _handle_one(name, handler, self, request, context)

    stream.__name__ = stream.__qualname__ = f"{name}Stream"
    return stream


async def _refuse_while_stopping(self, request, context):
    raise Unavailable(_SHUTTING_DOWN)


async def _handle_one(name: str, method, self, request, context):
    start, code = time.perf_counter(), grpc.StatusCode.OK
    try:
        _refuse_malformed(request)
        return await method(self, request, context)
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - every error becomes a status, never a crash
        code, message = _status_of(exc)
        await context.abort(code, message)
    finally:
        metrics.RPCS.labels(name, code.name).inc()
        metrics.RPC_SECONDS.labels(name).observe(time.perf_counter() - start)
        if hasattr(self, "sessions"):
            metrics.SESSIONS.set(len(self.sessions))


def rpc_stream(method):
    """Same as `rpc` for server-streaming methods (async generators)."""

    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context):
        code = grpc.StatusCode.OK
        try:
            _refuse_malformed(request)
            async for item in method(self, request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001
            code, message = _status_of(exc)
            await context.abort(code, message)
        finally:
            metrics.RPCS.labels(name, code.name).inc()

    return wrapper


class SessionTable:
    """Sessions by id, with a size limit and an idle timeout: sessions a dead client left
    behind are freed instead of holding memory forever."""

    def __init__(self, limit: int, idle_timeout_s: float, what: str = "session"):
        self.limit = limit
        self.idle_timeout_s = idle_timeout_s
        self.what = what
        self._items: dict[str, list] = {}  # id -> [value, last used]

    def __len__(self) -> int:
        return len(self._items)

    def ensure_room(self) -> None:
        """Raise RESOURCE_EXHAUSTED now rather than after an expensive open."""
        self.expire()
        if len(self._items) >= self.limit:
            raise ResourceExhausted(
                f"{len(self._items)} {self.what}s open, the limit is {self.limit}; "
                f"close finished {self.what}s or raise the limit"
            )

    def add(self, value) -> str:
        self.ensure_room()
        session_id = uuid.uuid4().hex
        self._items[session_id] = [value, time.monotonic()]
        return session_id

    def get(self, session_id: str):
        item = self._items.get(session_id)
        if item is None:
            raise FailedPrecondition(
                f"unknown {self.what} {session_id!r} (closed, expired after "
                f"{self.idle_timeout_s:.0f}s idle, or never opened)"
            )
        item[1] = time.monotonic()
        return item[0]

    def values(self) -> list:
        """The open items (a snapshot: safe to read from another thread)."""
        return [value for value, _ in list(self._items.values())]

    def pop(self, session_id: str):
        value = self.get(session_id)
        del self._items[session_id]
        return value

    def expire(self) -> int:
        cutoff = time.monotonic() - self.idle_timeout_s
        idle = [sid for sid, (_, used) in self._items.items() if used < cutoff]
        for sid in idle:
            del self._items[sid]
        if idle:
            log.info("freed %d idle %ss", len(idle), self.what)
        return len(idle)

    async def expire_forever(self, interval_s: float = 10.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.expire()


@dataclass(eq=False)
class Batch:
    """Jobs that one call can run together (`MlxThread.submit_batched`): `run_many(items)`
    returns a result, or an exception to raise, for each item in order.

    Callers tend to come back together a moment after their answers: while some of the
    callers seen in the last `recent_s` (by `key(item)`) are missing, the worker waits up to
    `gather_s` for them, so the callers of several small calls merge into one call. A lone
    caller never waits. A key of None is a caller that does not come back (a prompt, whose
    session's rounds come back under their own key): it is never waited for."""

    run_many: Callable[[list], list]
    key: Callable[[Any], Hashable] = id
    # run_stream(items, more, answer), where given, runs instead of run_many: it answers each
    # item (`answer(item, result)`) when it is done and takes the jobs of this batch queued
    # since (`more()`; without held_job_steps empty while other jobs wait) until it returns
    run_stream: Callable[[list, Callable[[], list], Callable[[Any, Any], None]], None] | None = None
    gather_s: float = 0.005
    recent_s: float = 0.5
    # with run_stream: None, the stream takes no more jobs once another job waits, and that
    # job runs when the stream's items are done; N (0 included: at once), the stream goes on
    # taking its jobs and runs the other jobs between two of its steps once they have waited
    # N steps (those that arrived meanwhile with them). Not while the thread shuts down.
    held_job_steps: int | None = None
    seen: dict = field(default_factory=dict)  # key -> when its last job ran

    def missing(self, items: list, now: float) -> bool:
        for k, when in list(self.seen.items()):
            if now - when > self.recent_s:
                self.seen.pop(k, None)
        return bool(self.seen.keys() - {self.key(item) for item in items})

    def ran(self, items: list, now: float) -> None:
        self.seen.update((key, now) for key in map(self.key, items) if key is not None)

    def forget(self, key: Hashable) -> None:
        """A caller that will not come back (any thread may say so)."""
        self.seen.pop(key, None)


class MlxThread:
    """All MLX work of a process runs here, one job at a time, off the event loop.

    The thread is a daemon that stays parked until the process ends rather than exiting: an
    exiting thread destroys MLX's thread-local compile cache, whose destructor takes the GIL, and
    if the interpreter is finalizing by then the process aborts ("terminate called without an
    active exception", exit status 134).
    """

    def __init__(self, inline_rounds: bool = True):
        """inline_rounds: let `run_round` run on the caller's thread when the worker is idle
        (a CPU). On a GPU keep it False: MLX's default stream and its cache of kernel graphs
        are per thread, so work on a second thread meets cold graphs (the warm-up ran on the
        worker) and waits across streams."""
        self._inline = inline_rounds
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        # each written by one thread only: idle when every submitted job has finished
        self._submitted = 0
        self._finished = 0
        threading.Thread(target=self._work, name="mlx", daemon=True).start()

    def _work(self) -> None:
        held: collections.deque = collections.deque()  # taken from the queue, not yet run
        while True:
            future, fn, args = held.popleft() if held else self._jobs.get()
            if isinstance(fn, Batch):
                self._run_batch(fn, [(future, args)], held)
            else:
                self._run_one(future, fn, args)
            # not held while waiting for the next job: the last job's arguments and result
            # (a closed session's caches, and through them a KV pool's slot) would stay alive
            del future, fn, args

    def _run_one(self, future: Future, fn: Callable, args) -> None:
        settle = None
        if future.set_running_or_notify_cancel():
            try:
                settle = functools.partial(future.set_result, fn(*args))
            except BaseException as exc:  # the caller gets it, as from an executor
                settle = functools.partial(future.set_exception, exc)
        # counted before the caller can wake: its next round job sees the worker idle
        self._finished += 1
        if settle is not None:
            settle()

    def _run_batch(self, batch: Batch, jobs: list, held: collections.deque) -> None:
        """This job and every job of the same batch held or queued behind it, in one call;
        other jobs met on the way keep their order and run next."""
        # jobs of this batch held back by an earlier call (another batch's gather took them
        # from the queue) join this call rather than each running a call of its own
        jobs.extend(_take_jobs_of(batch, held))
        deadline = time.perf_counter() + batch.gather_s
        while True:
            try:
                now = time.perf_counter()
                if now < deadline and not held and batch.missing([i for _, i in jobs], now):
                    job = self._jobs.get(timeout=deadline - now)
                else:
                    job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job[1] is batch:
                jobs.append((job[0], job[2]))
            else:
                held.append(job)
        batch.ran([item for _, item in jobs], time.perf_counter())
        if batch.run_stream is not None:
            self._stream_batch(batch, jobs, held)
        else:
            self._run_many(batch, jobs)

    def _run_many(self, batch: Batch, jobs: list) -> None:
        taken = len(jobs)
        jobs = [(future, item) for future, item in jobs if future.set_running_or_notify_cancel()]
        try:
            results = batch.run_many([item for _, item in jobs]) if jobs else []
        except BaseException as exc:  # the whole call failed: every caller gets it
            results = [exc] * len(jobs)
        self._finished += taken
        for (future, _), result in zip(jobs, results, strict=True):
            _settle(future, result)

    def _run_now(self, jobs: collections.deque) -> None:
        """Jobs taken off the queue, run at once in their order, a batch's together in one
        call where its first stands (without gathering: a stream's sessions wait for its
        next step)."""
        while jobs:
            future, fn, args = jobs.popleft()
            if isinstance(fn, Batch):
                self._run_many(fn, [(future, args), *_take_jobs_of(fn, jobs)])
            else:
                self._run_one(future, fn, args)

    def _stream_batch(self, batch: Batch, jobs: list, held: collections.deque) -> None:
        """`batch.run_stream` over `jobs`: each caller answered as its item is done, and jobs
        of the batch queued meanwhile joining while no other job waits, or, with
        `batch.held_job_steps`, other jobs (a prompt's prefill) run between two of its steps
        and the stream goes on: held until it is done, they make it drain (its items finish
        while new ones wait)."""
        futures: dict[int, Future] = {}

        def started(new: list) -> list:
            items = []
            for future, item in new:
                if future.set_running_or_notify_cancel():
                    futures[id(item)] = future
                    items.append(item)
                else:
                    self._finished += 1
            return items

        waited = 0  # steps the held jobs have waited

        def more() -> list:
            nonlocal waited
            new = []
            # shutting down, its job must run after the stream, as every other job then
            interleave = batch.held_job_steps is not None and not self._closed
            while interleave or not held:  # else other work waits: let the running items finish
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job[1] is batch:
                    new.append((job[0], job[2]))
                else:
                    held.append(job)
            if not (interleave and held):
                waited = 0
            elif (waited := waited + 1) > batch.held_job_steps:
                self._run_now(held)  # those that arrived meanwhile with them
                waited = 0
            batch.ran([item for _, item in new], time.perf_counter())
            return started(new)

        def answer(item, result) -> None:
            future = futures.pop(id(item))
            self._finished += 1  # counted before the caller can wake, as in _work
            _settle(future, result)

        error: BaseException = RuntimeError("the batch returned without answering")
        try:
            batch.run_stream(started(jobs), more, answer)
        except BaseException as exc:  # the callers not answered yet get it
            error = exc
        for future in futures.values():
            self._finished += 1
            future.set_exception(error)

    def submit_batched(self, batch: Batch, item) -> Future:
        """A job that runs together with the other jobs of `batch` waiting when it starts:
        `batch.run_many(items)` answers each item (a result or an exception) in order."""
        return self._queue(batch, item)

    async def run_batched(self, batch: Batch, item, inline: bool = False):
        """`submit_batched`, awaited. inline: with the worker idle and no other caller of the
        batch seen lately (a lone session), the job runs on the event loop's own thread, as
        `run_round`'s do: there is nothing to batch it with, and the hop to the worker and
        back costs ~0.5 ms a round on two busy cores."""
        if inline and self._inline and not self._closed and self._finished == self._submitted:
            now = time.perf_counter()
            if not batch.missing([item], now):
                batch.ran([item], now)
                [result] = batch.run_many([item])
                if isinstance(result, BaseException):
                    raise result
                return result
        return await asyncio.wrap_future(self.submit_batched(batch, item))

    def submit(self, fn: Callable, *args) -> Future:
        return self._queue(fn, args)

    def _queue(self, fn, args) -> Future:
        if self._closed:
            raise RuntimeError("the MLX thread is shut down")
        future: Future = Future()
        self._submitted += 1
        self._jobs.put((future, fn, args))
        return future

    async def run(self, fn: Callable, *args):
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def run_round(self, fn: Callable, *args):
        """One round's job (a draft, a verify: tens of ms at most). With the worker idle it
        runs on the event loop's own thread, since the hop to the worker and back costs
        ~0.25 ms, as much as a small draft; behind other jobs it queues on the worker, in
        order, even those whose caller gave up."""
        if self._closed:
            raise RuntimeError("the MLX thread is shut down")
        if self._inline and self._finished == self._submitted:
            return fn(*args)
        return await self.run(fn, *args)

    def shutdown(self) -> None:
        """Cancel queued jobs and wait for the running one, so no MLX work overlaps the
        interpreter's finalization; the thread itself stays parked."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        idle: Future = Future()
        self._jobs.put((idle, lambda: None, ()))
        idle.result()


def _take_jobs_of(batch: Batch, held: collections.deque) -> list:
    """The (future, item) of `batch`'s jobs among `held`, taken out of it; the rest stay in
    their order."""
    taken = [(job[0], job[2]) for job in held if job[1] is batch]
    if taken:
        others = [job for job in held if job[1] is not batch]
        held.clear()
        held.extend(others)
    return taken


def _settle(future: Future, result) -> None:
    """A batch's answer to its caller: an exception raised there, anything else returned."""
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def process_stats(open_sessions: int = 0) -> common_pb2.ProcessStats:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a service started by a big
    # parent would report the parent's size
    peak_kib, rss_kib = _status_kib("VmHWM"), _status_kib("VmRSS")
    if peak_kib is None:  # macOS: ru_maxrss in bytes
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return common_pb2.ProcessStats(
            peak_rss_bytes=peak, rss_bytes=peak, open_sessions=open_sessions
        )
    return common_pb2.ProcessStats(
        peak_rss_bytes=peak_kib * 1024, rss_bytes=rss_kib * 1024, open_sessions=open_sessions
    )


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # a restarted drafter or verifier is found within a second, not after gRPC's
        # default backoff of up to two minutes
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class CannotBind(OSError):
    """The service's address is taken (or not ours to listen on)."""


def _why_not_bound(host: str) -> str:
    import socket

    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return f"the host {host!r} does not resolve to an address"
    return "the port is in use or not allowed"


class Server:
    """An aio server with health (NOT_SERVING until `ready()`) and reflection."""

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Iterable[str],
        security: ServerSecurity | None = None,
        metrics_port: int | None = None,
    ):
        security = security or ServerSecurity()
        # no SO_REUSEPORT (gRPC's default): a port already in use is an error, not a port
        # silently shared with whatever listens there
        self.server = grpc.aio.server(
            options=[*channel_options(), ("grpc.so_reuseport", 0)],
            interceptors=security.interceptors(),
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        credentials = security.credentials()
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, credentials)
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            self.port = 0
        if self.port == 0:
            raise CannotBind(f"cannot listen on {address}: {_why_not_bound(host)}")
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        if metrics_port is not None:
            # only once the gRPC port is ours: a metrics port the OS picks (0) could otherwise
            # be the very port this server was told to listen on
            self._serve_metrics(host, metrics_port)

    @staticmethod
    def _serve_metrics(host: str, port: int) -> None:
        try:
            bound = metrics.serve_metrics(host, port)
        except OSError as exc:
            raise CannotBind(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        log.info("metrics at http://%s:%d/metrics", host, bound)

    async def start(self):
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def ready(self, serving: bool = True):
        status = health_pb2.HealthCheckResponse
        await self._set_all(status.SERVING if serving else status.NOT_SERVING)

    async def _set_all(self, status):
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def run_until_signal(self, grace_s: float = 5.0):
        """Serve until SIGINT/SIGTERM, then drain in-flight calls for `grace_s`."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        _calls.stopping = True  # new calls and an open stream's next message are refused
        await self.health.enter_graceful_shutdown()
        if not await _calls.drained(grace_s):
            log.warning("%d calls still running after %gs; cancelled", _calls.count, grace_s)
        await self.server.stop(None)  # what is left never reached a method, or overstayed


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if json_lines
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler])
