"""`specd serve verifier`: load the target, then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from specd import metrics
from specd.models.load import device_kind
from specd.service import MlxThread, Server, register
from specd.v1 import verifier_pb2
from verifier_svc.config import VerifierConfig
from verifier_svc.servicer import VerifierServicer

log = logging.getLogger("specd.verifier")
SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]
SERVICE_NAME = SERVICE.full_name


async def serve(config: VerifierConfig) -> None:
    mlx_thread = MlxThread(inline_rounds=device_kind() == "cpu")
    servicer = VerifierServicer(config, mlx_thread)
    metrics.KV_BYTES.set_function(servicer.kv_bytes)
    metrics.PREFIX_BYTES.set_function(servicer.prefix_cache_bytes)
    metrics.watch_mlx_memory()
    server = Server(config.host, config.port, [SERVICE_NAME], config.security, config.metrics_port)
    register(server.server, servicer, SERVICE)
    await server.start()  # health answers NOT_SERVING while the model loads
    log.info(
        "verifier listening on %s, loading %s", server.address, config.model or "the embedded model"
    )
    await servicer.load()
    ident = servicer.target.identity
    log.info(
        "verifier ready: %s (%s, %d layers, dtype %s, forwards of up to %d tokens on numpy: %s)",
        ident.name,
        ident.fingerprint[:12],
        ident.num_layers,
        servicer.target.loaded.dtype,
        servicer.target.gemv_rows,
        servicer.target.numpy_part,
    )
    if servicer.target.pooled_path:
        log.info("sessions' batched forwards: %s", servicer.target.pooled_path)
    if config.prefill_in_steps and servicer.target.kv_pool is None:
        log.warning("--prefill-in-steps does nothing here: sessions are not pooled (--kv-pool)")
    elif servicer.prefill_in_steps:
        log.info("prompts of at most %d tokens open as rows of the batched steps",
                 servicer.prefill_in_steps)  # fmt: skip
    loaded, warmup = servicer.target.loaded, servicer.warmup
    if loaded.dtype_timings:
        timed = ", ".join(f"{d} {ms:.2f} ms" for d, ms in loaded.dtype_timings.items())
        log.info("dtype auto: %s (a decode step + a verify of 8 tokens: %s)", loaded.dtype, timed)
    log.info("warm-up (%s): %d calls in %.1f s", warmup.mode, warmup.calls, warmup.seconds)
    prefixes = servicer.target.prefix_cache
    if prefixes is not None:
        prefixes.clear()  # the warm-up's prompts
        exact = "bit for bit" if servicer.target.prefix_reuse_exact else "not bit for bit here"
        log.info("prefix cache: %.0f MiB of prompts' KV, reuse %s", prefixes.capacity_bytes / 2**20,
                 exact)  # fmt: skip
    await server.ready()
    tasks = [asyncio.create_task(servicer.sessions.expire_forever())]
    if config.log_stats_s > 0:
        tasks.append(asyncio.create_task(servicer.log_load_forever(log)))
    await server.run_until_signal()
    for task in tasks:
        task.cancel()
    mlx_thread.shutdown()
