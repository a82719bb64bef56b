"""`specd serve drafter`: build the proposer, then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from drafter_svc.config import KINDS, DrafterConfig
from drafter_svc.ngram import NgramProposer
from drafter_svc.servicer import DrafterServicer
from specd.service import MlxThread, Server, register
from specd.v1 import drafter_pb2

log = logging.getLogger("specd.drafter")
SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"]
SERVICE_NAME = SERVICE.full_name


def make_proposer(config: DrafterConfig):
    if config.kind == "ngram":
        return NgramProposer(config.ngram)
    raise ValueError(f"unknown drafter kind {config.kind!r}; available: {', '.join(KINDS)}")


def target_binding(config: DrafterConfig) -> tuple[str, int]:
    """(fingerprint, vocab size) of --target, so pairing refuses any other target."""
    if config.target is None:
        return "", 0
    from specd.models.load import describe_tokenizer

    return describe_tokenizer(config.target, config.cache_dir)


async def serve(config: DrafterConfig) -> None:
    mlx_thread = MlxThread()
    proposer = make_proposer(config)
    fingerprint, vocab_size = await mlx_thread.run(target_binding, config)
    servicer = DrafterServicer(proposer, config, mlx_thread, fingerprint, vocab_size)
    server = Server(config.host, config.port, [SERVICE_NAME], config.security)
    register(server.server, servicer, SERVICE)
    await server.start()
    await server.ready()
    log.info("drafter %s listening on %s %s", config.kind, server.address, proposer.params())
    sweeper = asyncio.create_task(servicer.sessions.expire_forever())
    await server.run_until_signal()
    sweeper.cancel()
    mlx_thread.shutdown()
