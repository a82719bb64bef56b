"""A verifier port over one or more verifier addresses that survives losing a verifier.

The coordinator holds the committed tokens, so a session whose verifier died (or restarted and
forgot it) is re-opened by prefilling prompt + committed tokens on the first verifier that
answers, the same address first. The round loop sees one round that committed one token.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from coordinator.clients import UpstreamError, VerifierClient
from coordinator.rounds import Opened, Verified
from specd import metrics
from specd.service import Unavailable
from specd.v1 import common_pb2

log = logging.getLogger("specd.failover")


# INTERNAL from gRPC's transport, not from a servicer (whose INTERNAL reads "internal error:
# ..."): seen when a stopping verifier's process ends while a stream is still open
TRANSPORT_FAILURES = ("Internal error from Core", "RST_STREAM")


def session_lost(err: UpstreamError) -> bool:
    """The verifier is gone, hung, stopping (it cancels calls still open when its grace period
    ends; we never cancel an upstream call we still wait for), or restarted without our
    session. Re-opening elsewhere is always safe: the committed tokens are kept here."""
    code = err.code
    gone = (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    )
    return (
        code in gone
        or (code == grpc.StatusCode.FAILED_PRECONDITION and "unknown session" in err.message)
        or (
            code == grpc.StatusCode.INTERNAL
            and any(marker in err.message for marker in TRANSPORT_FAILURES)
        )
    )


def last_row(rows: common_pb2.Tensor) -> common_pb2.Tensor:
    """The final row of a [n, d] tensor, without decoding it."""
    if not rows.shape or rows.shape[0] == 0:
        return rows
    row_bytes = len(rows.data) // rows.shape[0]
    return common_pb2.Tensor(
        dtype=rows.dtype, shape=[1, *rows.shape[1:]], data=rows.data[-row_bytes:]
    )


@dataclass
class _Tracked:
    client: int  # index into the pool
    remote_id: str
    context: list[int]  # prompt + committed tokens: what a re-open prefills
    capture: tuple[int, ...]
    sampling: common_pb2.SamplingParams | None


class VerifierPool:
    def __init__(
        self,
        clients: list[VerifierClient],
        fingerprint: str = "",
        recovery_timeout_s: float = 180.0,
        retry_interval_s: float = 0.5,
    ):
        self.clients = clients
        self.fingerprint = (
            fingerprint  # set after connect; a verifier serving another model is skipped
        )
        self.recovery_timeout_s = recovery_timeout_s
        self.retry_interval_s = retry_interval_s
        self.preferred = 0
        self.sessions: dict[str, _Tracked] = {}

    @property
    def address(self) -> str:
        return self.clients[self.preferred].address

    async def info(self):
        return await self.clients[self.preferred].info()

    async def open(self, prompt_ids, capture_layers, sampling) -> Opened:
        tracked = _Tracked(self.preferred, "", list(prompt_ids), tuple(capture_layers), sampling)
        opened = await self._open_anywhere(tracked, sampling)
        tracked.context.append(opened.first_token)
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = tracked
        return Opened(
            session_id, opened.first_token, opened.finished, opened.rows, opened.compute_s
        )

    async def verify(
        self, session_id, position, draft_ids, draft_probs, draft_parents=None, plain_steps=0
    ) -> Verified:
        tracked = self.sessions[session_id]
        try:
            verified = await self.clients[tracked.client].verify(
                tracked.remote_id, position, draft_ids, draft_probs, draft_parents, plain_steps
            )
        except UpstreamError as err:
            if not session_lost(err):
                raise
            log.warning(
                "verifier %s lost the session (%s); re-opening from %d tokens",
                self.clients[tracked.client].address,
                err.message,
                len(tracked.context),
            )
            metrics.VERIFIER_REOPENS.inc()
            sampling = _reseeded(tracked.sampling, tracked.context)
            opened = await self._open_anywhere(tracked, sampling)
            tracked.context.append(opened.first_token)
            return Verified(
                [opened.first_token], 0, opened.finished, last_row(opened.rows), opened.compute_s
            )
        tracked.context.extend(verified.committed)
        return verified

    async def close(self, session_id) -> None:
        tracked = self.sessions.pop(session_id, None)
        if tracked is not None and tracked.remote_id:
            await self.clients[tracked.client].close(tracked.remote_id)

    async def _open_anywhere(self, tracked: _Tracked, sampling) -> Opened:
        """Open on the tracked client first, then the others, until the recovery deadline."""
        deadline = time.monotonic() + self.recovery_timeout_s
        order = [tracked.client] + [i for i in range(len(self.clients)) if i != tracked.client]
        while True:
            for index in order:
                client = self.clients[index]
                try:
                    if self.fingerprint and index != self.preferred:
                        info = await client.info()
                        if info.model.fingerprint != self.fingerprint:
                            log.error("verifier %s serves another model; skipped", client.address)
                            continue
                    opened = await client.open(tracked.context, tracked.capture, sampling)
                except UpstreamError as err:
                    if not session_lost(err):
                        raise
                    continue
                tracked.client, tracked.remote_id = index, opened.session_id
                self.preferred = index
                return opened
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"no verifier answered for {self.recovery_timeout_s:.0f}s "
                    f"({', '.join(c.address for c in self.clients)}); "
                    f"{len(tracked.context)} tokens of context were committed so far"
                )
            await asyncio.sleep(self.retry_interval_s)


def _reseeded(sampling, context: list[int]):
    """A fresh but reproducible seed: replaying the original stream would correlate draws."""
    if sampling is None or not sampling.HasField("seed"):
        return sampling
    fresh = common_pb2.SamplingParams()
    fresh.CopyFrom(sampling)
    fresh.seed = (sampling.seed * 1_000_003 + len(context)) % 2**64
    return fresh
