"""`specd serve drafter`: build the proposer, then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from drafter_svc.config import KINDS, DrafterConfig
from drafter_svc.ngram import NgramProposer
from drafter_svc.servicer import DrafterServicer
from drafter_svc.warmup import warm_up_drafter
from specd.models.load import device_kind
from specd.service import MlxThread, Server, register
from specd.v1 import drafter_pb2

log = logging.getLogger("specd.drafter")
SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"]
SERVICE_NAME = SERVICE.full_name


def make_proposer(config: DrafterConfig):
    if config.kind == "ngram":
        return NgramProposer(config.ngram)
    if config.kind == "eagle3":
        from drafter_svc.eagle3.proposer import load_eagle3

        target_dir, identity = describe_target(config)
        return load_eagle3(config.eagle3, target_dir, identity)
    if config.kind == "dflash":
        from drafter_svc.dflash.proposer import load_dflash

        target_dir, identity = describe_target(config)
        return load_dflash(config.dflash, target_dir, identity)
    raise ValueError(f"unknown drafter kind {config.kind!r}; available: {', '.join(KINDS)}")


def describe_target(config: DrafterConfig):
    """The target's directory and (fingerprint, vocab, hidden size, layers), weights unread.
    Model drafters always have a target: --target or the embedded default."""
    import json

    from specd.models.load import describe_tokenizer
    from specd.models.resolve import resolve_model

    path = resolve_model(config.target, config.cache_dir)
    fingerprint, vocab = describe_tokenizer(config.target, config.cache_dir)
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return path, (fingerprint, vocab, int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]))


def target_binding(config: DrafterConfig) -> tuple[str, int]:
    """(fingerprint, vocab size) of the target, so pairing refuses any other target: --target
    for n-gram (else unbound), the target a model drafter was loaded for."""
    if config.target is None and config.kind == "ngram":
        return "", 0
    from specd.models.load import describe_tokenizer

    return describe_tokenizer(config.target, config.cache_dir)


async def serve(config: DrafterConfig) -> None:
    if config.blas_threads > 0:
        from specd.platform import set_blas_threads

        if not set_blas_threads(config.blas_threads):
            log.warning("--blas-threads %d ignored: OpenBLAS is not loaded", config.blas_threads)
    mlx_thread = MlxThread(inline_rounds=device_kind() == "cpu")
    proposer = await mlx_thread.run(make_proposer, config)
    fingerprint, vocab_size = await mlx_thread.run(target_binding, config)
    mode, calls, seconds = await mlx_thread.run(
        warm_up_drafter, proposer, vocab_size, config.warmup
    )
    if calls:
        log.info("warm-up (%s): %d draft calls in %.1f s", mode, calls, seconds)
    servicer = DrafterServicer(proposer, config, mlx_thread, fingerprint, vocab_size)
    server = Server(config.host, config.port, [SERVICE_NAME], config.security, config.metrics_port)
    register(server.server, servicer, SERVICE)
    await server.start()
    await server.ready()
    log.info("drafter %s listening on %s %s", config.kind, server.address, proposer.params())
    sweeper = asyncio.create_task(servicer.sessions.expire_forever())
    await server.run_until_signal()
    sweeper.cancel()
    mlx_thread.shutdown()
