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
    server = Server(config.host, config.port, [SERVICE_NAME], config.security)
    register(server.server, servicer, SERVICE)
    await server.start()
    log.info(
        "coordinator listening on %s; verifier %s, drafter %s",
        server.address,
        config.verifier,
        config.drafter or "none",
    )
    if await servicer.connect():
        await server.ready()
        log.info("coordinator ready")
    await server.run_until_signal()
