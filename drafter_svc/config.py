from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from drafter_svc.dflash.proposer import DEFAULT_TREE_TOP_K, DFlashOptions
from drafter_svc.eagle3.proposer import HEAD_FORWARDS, Eagle3Options
from drafter_svc.ngram import NgramConfig
from specd.argtypes import non_negative_int
from specd.options import option
from specd.security import ServerSecurity

KINDS = ("ngram", "eagle3", "dflash")


@dataclass
class DrafterConfig:
    """The drafter's settings; those with a flag of `specd serve drafter` declare it
    (specd.options). The kind-specific flags build `ngram`, `eagle3` and `dflash` through
    `drafter_options`."""

    kind: str = option("ngram", "how drafts are made", choices=KINDS)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50052
    ngram: NgramConfig = field(default_factory=NgramConfig)
    eagle3: Eagle3Options = field(default_factory=Eagle3Options)
    dflash: DFlashOptions = field(default_factory=DFlashOptions)
    target: str | None = option(
        None,
        "bind to this target: pairing refuses any other (model drafters: the target whose "
        "embedding they read; default the embedded SmolLM2)",
    )
    cache_dir: Path | None = None  # where a --target model is resolved
    max_sessions: int = 1024  # n-gram state is only the token list
    max_context: int = 1 << 17  # tokens per session
    max_tree_tokens: int = 128  # largest draft tree a request may ask for
    session_idle_timeout_s: float = 600.0  # sessions a dead coordinator left are freed after
    blas_threads: int = option(
        1,
        "OpenBLAS threads for this drafter (0: the library's default, one per core). A "
        "drafter's products are small, and a second thread spins after each job on a core a "
        "verifier on the same machine needs (docs/history)",
        type=non_negative_int,
    )
    warmup: str = option(
        "auto",
        "eagle3, dflash: full = run the drafter's forwards of every size before health "
        "reports SERVING (a GPU compiles kernels per shape class), minimal = none; auto = full "
        "on a GPU",
        choices=("auto", "full", "minimal"),
    )
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, token
    metrics_port: int | None = None  # Prometheus /metrics on this port; 0: the OS picks


def drafter_options(
    kind: str,
    num_draft_tokens: int | None = None,
    ngram_min_n: int | None = None,
    ngram_max_n: int | None = None,
    weights: Path | None = None,
    tree_total_tokens: int | None = None,
    tree_depth: int | None = None,
    tree_top_k: int | None = None,
    block_size: int | None = None,
    draft_vocab: int | None = None,
    head_forwards: str | None = None,
    draft_p_min: float | None = None,
    tree_min_prob: float | None = None,
) -> dict:
    """The kind-specific parts of a DrafterConfig from command-line style options (None: the
    default); ValueError names the bad option."""
    from drafter_svc.proposal import TreeShape

    if kind not in KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; available: {', '.join(KINDS)}")
    if num_draft_tokens is not None and num_draft_tokens < 1:
        raise ValueError("--num-draft-tokens must be >= 1")
    ngram = NgramConfig()
    for name, value in (
        ("num_draft_tokens", num_draft_tokens),
        ("min_n", ngram_min_n),
        ("max_n", ngram_max_n),
    ):
        if value is not None:
            setattr(ngram, name, value)
    if not 1 <= ngram.min_n <= ngram.max_n:
        raise ValueError("need 1 <= --ngram-min-n <= --ngram-max-n")
    if head_forwards is not None and head_forwards not in HEAD_FORWARDS:
        raise ValueError(f"--head-forwards must be one of {', '.join(HEAD_FORWARDS)}")
    if draft_p_min is not None and not 0 <= draft_p_min < 1:
        raise ValueError("--draft-p-min must be >= 0 and < 1")
    if tree_min_prob is not None and not 0 <= tree_min_prob < 1:
        raise ValueError("--tree-min-prob must be >= 0 and < 1")
    eagle3 = Eagle3Options(
        weights=weights,
        num_draft_tokens=num_draft_tokens or 0,
        forwards=head_forwards or "auto",
        draft_p_min=draft_p_min or 0.0,
        tree_min_prob=tree_min_prob or 0.0,
    )
    shape = (tree_total_tokens, tree_depth, tree_top_k)
    if any(v is not None and v < 0 for v in shape):
        raise ValueError("--tree-total-tokens, --tree-depth and --tree-top-k must be >= 0")
    asks_trees = any(v is not None for v in shape)  # any tree flag: trees of the default size
    tree_total = TreeShape.total_tokens if tree_total_tokens is None else tree_total_tokens
    if asks_trees:
        eagle3.tree = TreeShape(
            total_tokens=tree_total,
            depth=tree_depth or TreeShape.depth,
            top_k=tree_top_k or TreeShape.top_k,
        )
    if block_size is not None and block_size < 2:
        raise ValueError("--block-size must be >= 2 (the last token and one draft)")
    if draft_vocab is not None and draft_vocab < 0:
        raise ValueError("--draft-vocab must be >= 0 (0: the whole vocabulary)")
    dflash = DFlashOptions(weights=weights, block_size=block_size or 0, draft_vocab=draft_vocab,
                           tree_min_prob=tree_min_prob or 0.0)  # fmt: skip
    if asks_trees:
        dflash.tree = TreeShape(
            total_tokens=tree_total,
            depth=tree_depth or 0,  # the block's drafts
            top_k=tree_top_k or DEFAULT_TREE_TOP_K,
        )
    if num_draft_tokens and kind == "dflash":
        dflash.block_size = dflash.block_size or num_draft_tokens + 1
    return {"kind": kind, "ngram": ngram, "eagle3": eagle3, "dflash": dflash}
