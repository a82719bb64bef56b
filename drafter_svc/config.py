from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from drafter_svc.eagle3.proposer import Eagle3Options
from drafter_svc.ngram import NgramConfig
from specd.security import ServerSecurity

KINDS = ("ngram", "eagle3")


@dataclass
class DrafterConfig:
    kind: str = "ngram"
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50052
    ngram: NgramConfig = field(default_factory=NgramConfig)
    eagle3: Eagle3Options = field(default_factory=Eagle3Options)
    target: str | None = None  # bind to this target: pairing then checks its fingerprint
    cache_dir: Path | None = None  # where a --target model is resolved
    max_sessions: int = 1024  # n-gram state is only the token list
    max_context: int = 1 << 17  # tokens per session
    max_tree_tokens: int = 128  # largest draft tree a request may ask for
    session_idle_timeout_s: float = 600.0  # sessions a dead coordinator left are freed after
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, token
