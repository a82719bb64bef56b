from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specd.argtypes import int_between, positive_float, positive_int
from specd.argtypes import port as port_number  # `port` is a field here
from specd.options import option
from specd.security import ClientSecurity, ServerSecurity


@dataclass
class CoordinatorConfig:
    """The coordinator's settings; those with a flag of `specd serve coordinator` declare it
    (specd.options)."""

    verifier: str = option(
        "127.0.0.1:50051", "verifier address; several, comma-separated, take over from each other"
    )
    drafter: str | None = option(
        "127.0.0.1:50052", "drafter address, or 'none' for plain decoding through the verifier"
    )  # None: no speculation, verify-only rounds
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50050
    http_port: int | None = option(
        None, "also serve the OpenAI-compatible API on this port", type=port_number
    )
    default_max_tokens: int = option(
        256, "tokens when a request leaves max_tokens at 0", type=int_between(1)
    )
    overlap_drafting: bool = option(
        False,
        "draft the next block while the verify runs, betting on full acceptance; hides "
        "drafter latency when it is on another host",
    )
    adaptive: bool = option(
        True,
        "always draft the drafter's default k instead of adapting it per round",
        flag="--no-adaptive",
    )
    decode_burst: int = option(
        16,
        "tokens one verifier call may decode when no drafts are wanted (no drafter, or adaptive "
        "k at 0): fewer round trips; streamed output arrives in chunks of up to this size (a "
        "request's first bursts are 4 tokens, then as long as its output so far). 1: a call "
        "per token",
        type=positive_int,
    )
    draft_beside_decode: bool = option(
        True,
        "after a draft call that proposed nothing (no n-gram match), and for adaptive k's "
        "probes of a drafter without hidden rows while the verifier batches the session with "
        "others, make the next call before the verify as usual, instead of beside a decode "
        "burst of up to --decode-burst tokens whose tokens it must then match",
        flag="--no-draft-beside-decode",
    )
    draft_max_requests: int = option(
        32,
        "under load, decode plainly through the verifier: while more requests than this run "
        "in this coordinator, adapted ones draft nothing and call no drafter, and one arriving "
        "then opens no drafter session; there a drafter's calls and CPU cost more than its "
        "drafts add. Pinned num_draft_tokens and seeded sampling draft whatever the load. 0: no "
        "limit",
        type=int_between(0),
    )
    priced_tree_cut: bool = option(
        True,
        "verify a drafted tree whole instead of cutting it to the nodes worth their rows: "
        "those whose path probability under the drafter beats their price at the verify "
        "times the rounds measure (adaptive k's, or with k pinned the coordinator's own)",
        flag="--no-priced-tree-cut",
    )
    verify_timeout_s: float = option(
        60.0, "deadline of one verify call, seconds", type=positive_float
    )
    prefill_timeout_s: float = 600.0  # long prompts on a CPU take minutes
    draft_timeout_s: float = option(
        5.0,
        "deadline of one draft call, seconds; past it the round goes on without drafts",
        type=positive_float,
    )
    verifier_recovery_s: float = option(
        180.0,
        "seconds a request waits for a lost verifier to come back (a GPU verifier's restart "
        "takes about a minute with its warm-up)",
        flag="--verifier-recovery-timeout",
        type=positive_float,
    )
    drafter_wait_s: float = 30.0  # at start, how long to wait for the drafter before serving
    connect_timeout_s: float = 600.0  # how long to wait at start for the verifier to load
    cache_dir: Path | None = None  # where tokenizer files from the verifier are kept

    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, token
    metrics_port: int | None = None  # Prometheus /metrics on this port; 0: the OS picks
    upstream: ClientSecurity = field(default_factory=ClientSecurity)  # to verifier/drafter

    @property
    def verifier_addresses(self) -> list[str]:
        return [a.strip() for a in self.verifier.split(",") if a.strip()]
