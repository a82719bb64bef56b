"""`specd serve coordinator`: connect to verifier and drafter, then serve clients."""

from __future__ import annotations

import logging

from coordinator.config import CoordinatorConfig
from coordinator.servicer import CoordinatorServicer
from specd.service import Server, register
from specd.v1 import coordinator_pb2

log = logging.getLogger("specd.coordinator")
SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
SERVICE_NAME = SERVICE.full_name


async def serve(config: CoordinatorConfig) -> None:
    servicer = CoordinatorServicer(config)
    server = Server(config.host, config.port, [SERVICE_NAME], config.security, config.metrics_port)
    register(server.server, servicer, SERVICE)
    await server.start()
    log.info(
        "coordinator listening on %s; verifier %s, drafter %s",
        server.address,
        config.verifier,
        config.drafter or "none",
    )
    servicer.on_ready = server.ready
    ready = await servicer.connect()
    http = await _start_http(servicer, config) if config.http_port is not None else None
    if ready:
        await server.ready()
        log.info("coordinator ready")
    await server.run_until_signal()
    if http is not None:
        await http.cleanup()


async def _start_http(servicer: CoordinatorServicer, config: CoordinatorConfig):
    from aiohttp import web

    from coordinator.http_api import OpenAIApi

    api = OpenAIApi(servicer, servicer.verifier_info.model.name)
    # a client that disconnects cancels its request, so no generation runs on for nobody
    runner = web.AppRunner(api.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.http_port).start()
    log.info("OpenAI-compatible API on http://%s:%d/v1", config.host, config.http_port)
    return runner
