from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specd.security import ClientSecurity, ServerSecurity


@dataclass
class CoordinatorConfig:
    verifier: str = "127.0.0.1:50051"  # comma-separated: the others take over on a fault
    drafter: str | None = "127.0.0.1:50052"  # None: no speculation, verify-only rounds
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50050
    http_port: int | None = None  # OpenAI-compatible HTTP API; None: off
    default_max_tokens: int = 256  # when a request leaves max_tokens at 0
    overlap_drafting: bool = False  # draft the next block during the verify (across hosts)
    adaptive: bool = True  # choose k per round, up to the drafter's default; off: always that
    decode_burst: int = 4  # tokens one verify call decodes when no drafts are wanted
    draft_beside_decode: bool = True  # after an empty draft call, the next runs beside a burst
    verify_timeout_s: float = 60.0  # deadline of one Verify call
    prefill_timeout_s: float = 600.0  # long prompts on a CPU take minutes
    draft_timeout_s: float = 5.0  # a hung drafter costs at most this, then rounds go on without
    verifier_recovery_s: float = 60.0  # how long a lost session waits for a verifier to return
    drafter_wait_s: float = 30.0  # at start, how long to wait for the drafter before serving
    connect_timeout_s: float = 600.0  # how long to wait at start for the verifier to load
    cache_dir: Path | None = None  # where tokenizer files from the verifier are kept

    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, token
    metrics_port: int | None = None  # Prometheus /metrics on this port; 0: the OS picks
    upstream: ClientSecurity = field(default_factory=ClientSecurity)  # to verifier/drafter

    @property
    def verifier_addresses(self) -> list[str]:
        return [a.strip() for a in self.verifier.split(",") if a.strip()]
