from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specd.security import ServerSecurity

GPU_MODES = ("auto", "on", "off")  # auto: on where MLX runs the target on a GPU


@dataclass
class VerifierConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU; on a GPU the faster of as stored and float32, timed
    gemv_rows: int | None = None  # None: Target's default for the device, dtype, architecture
    half_weights: bool = True  # weights float16 holds exactly kept half for the numpy forwards
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50051
    max_sessions: int = 64  # each holds a KV cache; beyond this OpenSession is refused
    max_kv_bytes: int | None = None  # new sessions refused while open ones' KV caches hold this
    max_context: int = 0  # 0: the model's max_position_embeddings
    session_idle_timeout_s: float = 600.0  # sessions a dead coordinator left are freed after
    max_draft_tokens: int = 64  # a verify of more tokens costs more than it can save
    # longer prompts are prefilled a decoder layer per job while other sessions are open, so
    # their rounds run in between (0: never); a layer of a 1,000-token prompt is ~0.2 s on a CPU
    prefill_slice_tokens: int = 256
    warmup: str = "auto"  # verifier_svc.warmup: full on a GPU, minimal on a CPU
    look_ahead: str = "auto"  # GPU_MODES: queue the next forward after a plain decode
    row_forwards: str = "auto"  # GPU_MODES: verifies of a few tokens as decode steps compute rows
    cache_dir: Path | None = None  # where the embedded model is materialized
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, token
    metrics_port: int | None = None  # Prometheus /metrics on this port; 0: the OS picks
