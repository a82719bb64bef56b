"""Prometheus metrics of a service process, served on --metrics-port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)

RPCS = Counter("specd_rpc_total", "RPCs served, by method and status code", ["method", "code"])
RPC_SECONDS = Histogram("specd_rpc_seconds", "time to answer an RPC", ["method"], buckets=_FAST)
SESSIONS = Gauge("specd_open_sessions", "sessions open in this service")
KV_BYTES = Gauge("specd_kv_cache_bytes", "bytes the open sessions' KV caches hold (verifier)")
PREFIX_BYTES = Gauge(
    "specd_prefix_cache_bytes", "bytes of prompts' KV the prefix cache holds (verifier)"
)
MLX_BYTES = Gauge(
    "specd_mlx_memory_bytes", "MLX memory: active (in arrays), cache (freed, kept), peak", ["kind"]
)

REQUESTS = Counter(
    "specd_requests_total", "generation requests, by finish reason or error", ["outcome"]
)
TOKENS = Counter("specd_generated_tokens_total", "tokens generated for clients")
PROMPT_TOKENS = Counter("specd_prompt_tokens_total", "prompt tokens processed")
ACCEPTANCE = Histogram(
    "specd_acceptance_length",
    "tau (1 + accepted / rounds) per request",
    buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12),
)
DRAFT_SECONDS = Histogram("specd_draft_seconds", "draft RPC time per round", buckets=_FAST)
VERIFY_SECONDS = Histogram("specd_verify_seconds", "verify RPC time per round", buckets=_FAST)
ROUND_OVERHEAD = Histogram(
    "specd_round_overhead_seconds",
    "round time outside the draft and verify compute: RPCs, serialization, the coordinator",
    buckets=_FAST,
)
DRAFTER_FALLBACKS = Counter(
    "specd_drafter_fallbacks_total", "requests that lost their drafter and went on without it"
)
DECODE_BATCH = Histogram(
    "specd_decode_batch_sessions",
    "sessions in each forward the verifier shared among rounds (plain steps, draft chains)",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
VERIFIER_REOPENS = Counter(
    "specd_verifier_reopens_total", "sessions re-opened after a verifier was lost"
)


def watch_mlx_memory() -> None:
    """Read MLX's allocator at each scrape."""
    import mlx.core as mx

    for kind, read in (("active", mx.get_active_memory), ("cache", mx.get_cache_memory),
                       ("peak", mx.get_peak_memory)):  # fmt: skip
        MLX_BYTES.labels(kind).set_function(read)


def serve_metrics(host: str, port: int) -> int:
    """Serve /metrics from a background thread; returns the port (0 asks the OS for one)."""
    server, _ = start_http_server(port, addr=host)
    return server.server_port


def observe_request(stats, outcome: str) -> None:
    REQUESTS.labels(outcome).inc()
    TOKENS.inc(stats.generated_tokens)
    PROMPT_TOKENS.inc(stats.prompt_tokens)
    if stats.rounds:
        ACCEPTANCE.observe(stats.tau)
    if stats.drafter_failed:
        DRAFTER_FALLBACKS.inc()
    for t in stats.round_times:
        DRAFT_SECONDS.observe(t.draft)
        VERIFY_SECONDS.observe(t.verify)
        ROUND_OVERHEAD.observe(t.outside_forwards)
