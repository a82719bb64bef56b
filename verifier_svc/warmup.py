"""Run every forward a round can ask of the verifier before it reports SERVING.

On a GPU, MLX compiles a kernel the first time a forward meets a new class of shapes (on an H200
with MLX's CUDA build: about 15 s per kernel module; a 4-bit SmolLM2 met new ones at 1, 8 and
17 tokens per forward and at its first long prefill). Without a warm-up the first client pays
for all of them. The full warm-up runs, at a short and at a long context: verifies of every size
up to max_draft_tokens + 1, draft trees of every size, a decode burst, a sampled verify, with and
without hidden-row capture; with a KV pool, batched rounds of plain steps, chains, a tree and a
sampled verify. The compiled kernels are kept on disk (specd.mlx_settings), so a
restart on the same machine spends seconds here, not minutes. On a CPU nothing is compiled per
shape and a token's round trip is all a warm-up needs.

On an H200 a verifier that had run the full warm-up itself decoded ~40 % slower for as long as it
served than one whose kernels another process had compiled (drafting off 0.63x of plain mlx-lm
against 0.91x, same host, same bench run; docs/gpu.md). Why is not known; the `separate` mode,
auto's choice on a GPU, therefore runs the full warm-up in a short-lived child process, whose
kernels land in the disk cache, and in the serving process a prefill and a few
rounds (`serving_warmup`).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from specd.cpu.llama import Segment
from specd.models.compiled import MAX_POOLED_ROWS, traced_rows
from specd.models.load import warmup_mode
from verifier_svc.engine import (
    PREFILL_CHUNK,
    PromptToPrefill,
    Round,
    Target,
    _rollback,
    decode,
    prefill,
    prefill_many,
    rounds_many,
    verify,
    verify_tree,
)
from verifier_svc.sampling import SamplingConfig

log = logging.getLogger("specd.verifier")


@dataclass
class WarmupReport:
    mode: str
    calls: int  # prefills, verifies and decode bursts run
    seconds: float


def _prompt(target: Target, length: int, seed: int) -> list[int]:
    """Token ids without an EOS, so nothing stops early."""
    vocab = target.identity.vocab_size
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=length).tolist()
    return [t if t not in target.eos_ids else (t + 1) % vocab for t in ids]


def _capture_layers(target: Target) -> tuple[int, ...]:
    layers = target.identity.num_layers
    return tuple(sorted({0, layers // 2, layers - 1}))


def full_warmup(target: Target, max_draft_tokens: int, long_context: int = PREFILL_CHUNK + 64):
    """The forwards of every round shape; returns how many engine calls ran. The long context
    stays clear of the model's limit by what the rounds below can commit (drafts are random
    tokens: a verify commits about one)."""
    calls = 0
    sizes = range(1, max_draft_tokens + 2)
    long_context = min(long_context, target.loaded.max_context - 4 * len(sizes) - 8)
    contexts = [(64, (), 1)] + [(long_context, _capture_layers(target), 2)] * (long_context > 64)
    for context, capture, seed in contexts:
        session = prefill(target, _prompt(target, context, seed), capture).session
        drafts = _prompt(target, max_draft_tokens, seed + 10)
        for n in sizes:
            verify(target, session, drafts[: n - 1])
        trees = sizes[1:] if target.supports_trees(session.cache) else ()
        for n in trees:
            verify_tree(target, session, drafts[: n - 1], list(range(-1, n - 2)))
        decode(target, session, 4)
        calls += 2 + len(sizes) + len(trees)
    if target.kv_pool is not None:  # pooled sessions' batched forwards have kernels of their own
        # the first opened may keep a cache of its own (`Target.pool_alone`); the pair opened
        # beside it pool, prefilled together as sessions opening at once are
        first = prefill(target, _prompt(target, 64, 4)).session  # noqa: F841 - held open
        asks = [PromptToPrefill(_prompt(target, n, seed)) for n, seed in ((64, 5), (40, 6))]
        pair = [opened.session for opened in prefill_many(target, asks)]
        rounds_many(target, [Round(pair[0], [], 2), Round(pair[1], _prompt(target, 3, 7), 1)])
        # a tree and a sampled verify in the batch: per-row positions, tree masks, draws
        drawn = prefill(target, _prompt(target, 48, 11), sampling=SamplingConfig(1.0), seed=1)
        vocab = target.identity.vocab_size
        mixed = [Round(pair[1], [], 1),
                 Round(drawn.session, _prompt(target, 2, 12), 1,
                       draft_probs=np.full((2, vocab), 1 / vocab))]  # fmt: skip
        if target.supports_trees(pair[0].cache):
            mixed.append(Round(pair[0], _prompt(target, 3, 13), 1, parents=[-1, -1, 0]))
        rounds_many(target, mixed)
        # a sampled session's plain steps drawn in the batch (`device_draws` on a GPU)
        rounds_many(target, [Round(pair[1], [], 1), Round(drawn.session, [], 2)])
        # the prefills and rounds before, this prefill, its rounds, the plain draws' step
        calls += 4 + 1 + len(mixed) + 1
        calls += compiled_pooled_traces(target)
    sampled = SamplingConfig(temperature=1.0)
    session = prefill(target, _prompt(target, 64, 3), (), sampling=sampled, seed=0).session
    vocab = target.identity.vocab_size
    for n in (1, 2, max_draft_tokens + 1):
        verify(target, session, _prompt(target, n - 1, 4), np.full((n - 1, vocab), 1 / vocab))
    return calls + 4


def compiled_pooled_traces(target: Target) -> int:
    """Trace the compiled pooled forward (`--compiled-pooled`) at each row count it runs at
    (`traced_rows`, up to MAX_POOLED_ROWS): mx.compile's traces live in the process that made
    them, so the serving process runs this too. Two pooled sessions bring the rows (a trace
    depends on their total alone); their caches are rolled back after each forward. Returns
    the forwards run."""
    forward = target._mlx
    if forward.compiled_pooled is None:
        return 0
    asks = [PromptToPrefill(_prompt(target, 16, 20 + n)) for n in range(2)]
    sessions = [opened.session for opened in prefill_many(target, asks)]
    ids = np.array(_prompt(target, MAX_POOLED_ROWS, 22))
    counts = sorted({traced_rows(n) for n in range(2, MAX_POOLED_ROWS + 1)})
    for n in counts:
        kept = [s.cache[0].offset for s in sessions]
        halves = (ids[: n // 2], ids[n // 2 : n])
        outs = forward.forward_pooled(
            [Segment(part, s.cache) for part, s in zip(halves, sessions, strict=True)],
            frozenset(),
        )
        mx.eval([logits for logits, _ in outs])
        for s, keep in zip(sessions, kept, strict=True):
            _rollback(s.cache, keep)
    return 1 + len(counts)


def resolve_mode(requested: str) -> str:
    """auto: `separate` on a GPU, minimal on a CPU; other modes as asked."""
    if requested == "separate":
        return requested
    mode = warmup_mode(requested)
    return "separate" if requested == "auto" and mode == "full" else mode


def _full_warmup_here(config) -> int:
    """The child's work: load the target as the verifier serves it, run the full warm-up."""
    from specd import mlx_settings
    from verifier_svc.servicer import target_for

    mlx_settings.apply()
    return full_warmup(target_for(config), config.max_draft_tokens)


def full_warmup_in_child(config) -> int | None:
    """The full warm-up in a spawned process (kernels compiled there reach the disk cache); its
    engine calls, or None where the child failed (then the first requests compile instead)."""
    context = multiprocessing.get_context("spawn")  # no MLX state inherited
    try:
        # an executor, not a Pool: a child killed outright (out of memory) raises here
        with ProcessPoolExecutor(1, mp_context=context) as child:
            return child.submit(_full_warmup_here, config).result()
    except Exception as exc:  # the service still serves; it only loses the compiled kernels
        log.warning("the warm-up in a separate process failed (%s: %s); first requests may "
                    "wait while kernels compile", type(exc).__name__, exc)  # fmt: skip
        return None


def minimal_warmup(target: Target) -> int:
    verify(target, prefill(target, _prompt(target, 3, 0)).session, _prompt(target, 2, 1))
    return 2


def serving_warmup(target: Target, max_draft_tokens: int = 0) -> int:
    """The serving process's share of `separate`: the kernels are on disk, but each process
    still loads them at a shape class's first use (on the H200 a first prompt's prefill took
    236 ms, the same prefill later 25 ms), so a prompt of a typical length, a decode burst as
    served, a short verify and a draft tree of every size up to max_draft_tokens + 1 run here
    (a compiled tree forward traces per node count, and traces live in their process); no
    long context (see the module's note)."""
    session = prefill(target, _prompt(target, 64, 8)).session
    decode(target, session, 4, look_ahead=True)
    verify(target, session, _prompt(target, 2, 9))
    # a sampled prompt and step: on a GPU their draws' kernels (`device_draws`) load here
    drawn = prefill(target, _prompt(target, 16, 14), sampling=SamplingConfig(1.0), seed=2)
    decode(target, drawn.session, 2)
    trees = range(2, max_draft_tokens + 2) if target.supports_trees(session.cache) else ()
    drafts = _prompt(target, max_draft_tokens, 10)
    for n in trees:  # a tree that branches at its root, so its mask is not a chain's
        verify_tree(target, session, drafts[: n - 1], [-1] + list(range(-1, n - 3)))
    return 5 + len(trees) + compiled_pooled_traces(target) + minimal_warmup(target)


def warm_up(target: Target, max_draft_tokens: int, mode: str = "auto") -> WarmupReport:
    """mode auto: full on a GPU, minimal on a CPU. `separate` is the servicer's (it needs the
    configuration to load the target again in a child): see `warm_up_served`."""
    mode = warmup_mode(mode)
    start = time.perf_counter()
    calls = full_warmup(target, max_draft_tokens) if mode == "full" else minimal_warmup(target)
    return WarmupReport(mode, calls, time.perf_counter() - start)


def warm_up_served(config, load) -> tuple[Target, WarmupReport]:
    """Load the target with `load()` and warm it up as `config.warmup` asks; for `separate`,
    the child runs before the target is loaded here, so the two copies never coexist."""
    mode = resolve_mode(config.warmup)
    if mode != "separate":
        target = load()
        return target, warm_up(target, config.max_draft_tokens, mode)
    start = time.perf_counter()
    child_calls = full_warmup_in_child(config) or 0
    target = load()
    calls = child_calls + serving_warmup(target, config.max_draft_tokens)
    return target, WarmupReport(mode, calls, time.perf_counter() - start)
