from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specd.argtypes import byte_size, byte_size_or_zero, int_between, non_negative_float
from specd.cpu import FLOAT32_COPIES_BYTES
from specd.options import GPU_MODES, option
from specd.security import ServerSecurity

# --prefill-in-steps where the pool kernel runs; longer prompts keep their prefill jobs
PREFILL_IN_STEPS_AUTO = 512
DTYPE_CHOICES = ("auto", "native", "float32", "float16", "bfloat16")  # specd.models.load.DTYPES
WARMUP_CHOICES = ("auto", "full", "separate", "minimal")  # verifier_svc.warmup.resolve_mode
GEMV_HELP = (
    "forwards of at most N tokens (decode steps, verifies) run on numpy, float32 on the CPU "
    "only: whole layers for Llama-family targets, the weight products alone for others; "
    "0: all in MLX (default on the CPU with float32: 32 for Llama-family targets, 3 for "
    "others; else 0)"
)
FLOAT32_WEIGHTS_HELP = (
    "keep every weight float32 in memory; by default, with the numpy forwards above, weights "
    "that float16 holds exactly (all of a model dequantized from a 4-bit or half checkpoint, "
    "as the embedded one is) are kept as float16: half the bytes per decode step, same outputs "
    f"(a target whose forwards run on numpy as whole layers prefills there too; for "
    f"others a prompt's prefill reads float32 copies made at load, up to "
    f"{FLOAT32_COPIES_BYTES >> 30} GiB)"
)


@dataclass
class VerifierConfig:
    """The verifier's settings; each with a flag of `specd serve verifier` (specd.options)."""

    model: str | None = option(
        None, "mlx-lm dir, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    dtype: str = option(
        "auto",
        "compute dtype; auto = float32 on CPU; on a GPU the faster of the model as stored and "
        "float32, timed at start-up (half precision is never chosen: it flips near-ties)",
        choices=DTYPE_CHOICES,
    )
    gemv_rows: int | None = option(None, GEMV_HELP, type=int_between(0), metavar="N")
    half_weights: bool = option(True, FLOAT32_WEIGHTS_HELP, flag="--float32-weights", invert=True)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50051
    max_sessions: int = option(
        64, "sessions held at once, each with its KV cache; beyond it OpenSession is refused",
        type=int_between(1),
    )  # fmt: skip
    max_kv_bytes: int | None = option(
        None,
        "refuse new sessions while the open ones' KV caches hold this much (e.g. 8GiB; "
        "default: no limit beyond --max-sessions)",
        flag="--max-kv-memory",
        type=byte_size,
        metavar="SIZE",
    )
    prefix_cache_bytes: int | None = option(
        None,
        "keep prompts' keys and values up to SIZE (e.g. 512MiB; least recently used evicted "
        "first), so a later prompt that begins with the same tokens (the chat template's "
        "system turn, a conversation's earlier turns) prefills only the rest; 0: off. "
        "Default: 256MiB where a reused prefix is bit for bit the prefill it replaces (the "
        "CPU layers with float16 weights on an x86-64 CPU with AVX2 and F16C), else off: "
        "elsewhere it can differ from the prompt's own prefill in the last bits and flip a "
        "near-tie. "
        "Sessions on the KV pool (--kv-pool) reuse none",
        flag="--prefix-cache",
        type=byte_size_or_zero,
        metavar="SIZE",
    )
    max_context: int = option(
        0, "tokens a session may hold; 0: the model's own limit", type=int_between(0)
    )
    session_idle_timeout_s: float = 600.0  # sessions a dead coordinator left are freed after
    max_draft_tokens: int = option(
        64, "the most tokens one verify takes (drafts or plain steps)", type=int_between(1)
    )
    prefill_slice_tokens: int = option(
        256,
        "prefill prompts longer than N a decoder layer at a time while other sessions are "
        "open, so their rounds run in between instead of waiting for the whole prompt (the "
        "same numbers; 0: never)",
        type=int_between(0),
        metavar="N",
    )
    prefill_in_steps: int | None = option(
        None,
        "where sessions are pooled (--kv-pool), a prompt of at most N tokens opens as rows of "
        "the running rounds' batched steps (all but its last token in chunks of as many rows "
        "as the pool kernel attends in place for a session, then the last; a step's prompts "
        "four such chunks at most) instead of a prefill job that holds them; 0: never; "
        f"default: {PREFILL_IN_STEPS_AUTO} where the pool kernel attends the pooled rows "
        "(--pool-kernel: a CUDA GPU) and --max-kv-memory is not set, else 0",
        type=int_between(0),
        metavar="N",
    )
    prefill_between_steps: int = option(
        0,
        "a prompt that opens while other sessions' rounds run waits N of their batched "
        "steps (a round run alone counts as one; each layer of a sliced prompt waits again), "
        "then is prefilled between two of them with the prompts that opened meanwhile, the "
        "rounds going on after it; 0: it waits until the running rounds are done and new "
        "rounds wait behind it, so the batch drains first. Not with --max-kv-memory",
        type=int_between(0),
        metavar="N",
    )
    warmup: str = option(
        "auto",
        "forwards run before health reports SERVING: full = every verify, tree and decode "
        "shape a round can use (a GPU compiles kernels per shape class); separate = the same "
        "in a short-lived child process, whose kernels reach the disk cache, then one round "
        "here (a verifier that ran the full warm-up itself decoded slower on an H200); "
        "minimal = one round; auto = separate on a GPU, minimal on a CPU",
        choices=WARMUP_CHOICES,
    )
    look_ahead: str = option(
        "auto",
        "after a greedy plain decode, queue the forward of the token just committed before "
        "answering, so the device works while the answer travels (as mlx-lm's decode loop "
        "keeps one step queued); auto = on on a GPU",
        choices=GPU_MODES,
    )
    row_forwards: str = option(
        "auto",
        "compute verifies of 2-16 tokens row by row with the kernels of a decode step "
        "(Llama-family models with unquantized weights): on a GPU one-row kernels cost a "
        "fraction of the matrix products, and each row's logits are the decode step's; auto = "
        "on on a GPU",
        choices=GPU_MODES,
    )
    compiled_forwards: str = option(
        "auto",
        "run forwards of 1-16 tokens with the work between two attentions (products, norms, "
        "MLP, RoPE) as one compiled MLX function a layer, each row on a decode step's "
        "kernels, so on CUDA equal to the decode steps bit for bit (elsewhere up to float32 "
        "rounding; Llama-family models with unquantized weights, no biases, no sliding "
        "window): on a GPU, where Python's building of the graph bounds a small model's step, "
        "decode steps and verifies cost less; auto = on on a GPU",
        choices=GPU_MODES,
    )
    kv_pool: str = option(
        "auto",
        "keep every session's KV cache in one pool, so the rounds of sessions ready at "
        "once run as one batched forward with a constant number of operations per layer "
        "(the per-session path costs several per session, each a kernel launch on a GPU); "
        "sums over the batch may round unlike a session alone, so a greedy choice can differ "
        "at a near-tie (Llama-family models in MLX; the CPU kernels take no pooled session); "
        "auto = on a GPU, a session alone keeps a cache of its own (its decode step costs "
        "less) and moves into the pool when other sessions' rounds come; on = every session",
        choices=GPU_MODES,
    )
    compiled_pooled: str = option(
        "auto",
        "run the KV pool's batched forwards of up to 256 rows with the work between two "
        "attentions as one compiled MLX function a layer, as --compiled-forwards does for one "
        "session (row counts padded to few traced sizes; Llama-family models with unquantized "
        "weights, no biases, no sliding window): where Python's building of the graph bounds "
        "a batched step, as on a GPU; auto = on on a GPU",
        choices=GPU_MODES,
    )
    pool_kernel: str = option(
        "auto",
        "in the compiled pooled forward (--compiled-pooled), attend each row in one CUDA "
        "kernel launch a layer that reads the row's own session where the KV pool keeps it, "
        "instead of gathering every session's keys and attending through a mask; a chain's "
        "row sums as a decode step of that session alone (float32 targets, sessions of at "
        "most 32 new rows, rows over at most 1024 keys; checked against MLX's attention at "
        "first use, else the mask); a draft tree's nodes on a session's own cache "
        "(--compiled-forwards) attend in the same launch; auto = where it runs (a CUDA GPU, "
        "a float32 target), elsewhere the mask; on = the same, with a warning where it "
        "cannot run",
        choices=GPU_MODES,
    )
    log_stats_s: float = option(
        10.0,
        "log the load every SECONDS while calls come: verify calls, tokens committed, "
        "sessions per batched forward, how long a call was held (waiting, then in forwards) "
        "and a session away between calls, prompts prefilled and their jobs' time, open "
        "sessions, KV memory (0: never)",
        type=non_negative_float,
        metavar="SECONDS",
    )
    cache_dir: Path | None = None  # where the embedded model is materialized
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, token
    metrics_port: int | None = None  # Prometheus /metrics on this port; 0: the OS picks

    def prompts_in_steps(self, pool_attends_in_place: bool) -> int:
        """The longest prompt opened as rows of the steps: --prefill-in-steps, or by default
        PREFILL_IN_STEPS_AUTO where the pool kernel attends them (on this project's CPU,
        without it, every session's attention pads to a prompt chunk's rows: 0.42× the
        prefill jobs at 16 clients) and no --max-kv-memory limit forbids it."""
        if self.prefill_in_steps is not None:
            return self.prefill_in_steps
        return PREFILL_IN_STEPS_AUTO if pool_attends_in_place and self.max_kv_bytes is None else 0
