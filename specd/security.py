"""TLS, mutual TLS and a shared bearer token for links between hosts.

Services bind to loopback unless told otherwise; across hosts, turn these on. Nothing received
is ever unpickled or evaluated: every message is protobuf and every array a typed buffer.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

# Probes and service discovery stay open, as load balancers and grpcurl expect.
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class ServerSecurity:
    cert: Path | None = None  # PEM certificate chain: TLS on
    key: Path | None = None
    client_ca: Path | None = None  # PEM CA: clients must present a certificate it signed (mTLS)
    token_file: Path | None = None  # callers must send "authorization: Bearer <token>"

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None and self.key is None:
            if self.client_ca is not None:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if self.cert is None or self.key is None:
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def interceptors(self) -> list:
        return [TokenCheck(read_token(self.token_file))] if self.token_file else []


@dataclass(frozen=True)
class ClientSecurity:
    ca: Path | None = None  # PEM CA that signed the server's certificate: TLS on
    cert: Path | None = None  # our certificate and key, for servers that require mTLS
    key: Path | None = None
    token_file: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca is None:
            if self.cert or self.key:
                raise ValueError("a client certificate needs --tls-ca for the server too")
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (
            (("authorization", f"Bearer {read_token(self.token_file)}"),) if self.token_file else ()
        )


def read_token(path: Path) -> str:
    token = path.read_text().strip()
    if len(token) < 16:
        raise ValueError(f"the token in {path} is shorter than 16 characters")
    return token


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuse calls without the shared token (UNAUTHENTICATED), in constant time."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode(), self.expected):
            return await continuation(details)
        return _refusal(await continuation(details))


def _refusal(handler):
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""

    async def deny(request, context):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong token: send 'authorization: Bearer <token>'",
        )

    async def deny_stream(request, context):
        await deny(request, context)
        yield  # pragma: no cover - never reached

    if handler is None:
        return None
    if handler.unary_unary:
        make, behaviour = grpc.unary_unary_rpc_method_handler, deny
    elif handler.stream_stream:
        make, behaviour = grpc.stream_stream_rpc_method_handler, deny_stream
    else:
        make, behaviour = grpc.unary_stream_rpc_method_handler, deny_stream
    return make(behaviour, handler.request_deserializer, handler.response_serializer)
