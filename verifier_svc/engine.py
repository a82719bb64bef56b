"""The target side of a round: prefill, incremental verify, KV rollback, hidden-row capture.

Pure MLX; the servicer adapts it to gRPC. One call at a time (the MLX thread).
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from specd.cpu.gemv import (
    check_max_rows,
    default_max_rows,
    set_max_rows,
    use_gemv,
)
from specd.cpu.half import float32_copy_bytes, stored_half
from specd.cpu.llama import DEFAULT_MAX_ROWS as CPU_MAX_ROWS
from specd.cpu.llama import CpuLlama, Segment
from specd.cpu.row_products import compiled as row_kernels_compiled
from specd.models import compiled, pool_attention, rowwise
from specd.models.capture import install_capture, install_tree_positions
from specd.models.compiled import CompiledForward
from specd.models.load import LoadedTarget, device_kind, resolve_dtype
from specd.platform import limit_numpy_blas_threads
from verifier_svc.accept import accept_greedy
from verifier_svc.device_draws import draw, drawable_on_device
from verifier_svc.forwards import (
    CompiledMlxForward,
    CpuKernelForward,
    Forward,
    MlxForward,
    TreeLayout,
)
from verifier_svc.kv_pool import KVPool, PooledCache
from verifier_svc.prefix_cache import AUTO_BYTES as PREFIX_CACHE_AUTO_BYTES
from verifier_svc.prefix_cache import Prefix, PrefixCache
from verifier_svc.sampling import SamplingConfig, accept_sampled, sample, target_distribution
from verifier_svc.tree import (
    accept_tree_greedy,
    accept_tree_sampled,
    check_parents,
)

GREEDY = SamplingConfig()
POOLED_MAX_ROWS = 1024  # rows of one batched forward over pooled sessions
# its attention's grid, sessions x the longest one's rows (a ragged batch's padding included)
POOLED_MAX_GRID = 4 * POOLED_MAX_ROWS
# a prompt opened in the steps (`prompt_round`) brings at most this many rows to one: as many
# as the pool kernel attends in place for a session, so a step holding prompts stays in it
# (a wider session sends every session's attention through a grid padded to its rows)
PROMPT_ROWS_A_STEP = pool_attention.MAX_NEW_ROWS
# the prompts' share of one step's rows, so that prompts arriving together do not crowd out
# the running rounds' rows
PROMPT_ROWS_IN_A_STEP = 4 * PROMPT_ROWS_A_STEP
PREFILL_CHUNK = 2048  # mlx-lm's prefill step: same chunks, same numerics as plain decoding


def half_weights_pay(dtype: str, gemv_rows: int | None) -> bool:
    """Whether to load a target keeping its exactly-half weights as float16: where the
    compiled products will read them (float32 on the CPU, numpy forwards on). Elsewhere MLX
    would convert them at every product."""
    return (
        row_kernels_compiled()
        and device_kind() == "cpu"
        and resolve_dtype(dtype) == "float32"
        and gemv_rows != 0
    )


class Target:
    """An mlx-lm model whose forward can also return chosen decoder-layer outputs."""

    def __init__(
        self,
        loaded: LoadedTarget,
        gemv_rows: int | None = None,
        row_forwards: bool = False,
        compiled_forwards: bool = False,
        kv_pool: bool = False,
        pool_alone: bool = True,
        compiled_pooled: bool = False,
        pool_kernel: str = "off",
        prefix_cache_bytes: int | None = 0,
    ):
        """gemv_rows: forwards of at most this many tokens run on numpy: whole layers for
        Llama-family models (specd.cpu.llama), else the weight products alone
        (specd.cpu.gemv); None: the default for the device, dtype and architecture.
        Weights the target was loaded keeping as float16 (`half_weights_pay`) are read so.
        row_forwards: forwards of a few tokens computed row by row as decode steps compute
        them (specd.models.rowwise), where the architecture allows.
        compiled_forwards: forwards of 1-16 tokens with the work between attentions compiled
        (specd.models.compiled), where the architecture allows.
        kv_pool: sessions' caches in one pool and their rounds batched
        (verifier_svc.kv_pool), where MLX's forward takes many sessions. pool_alone: False
        keeps a session opened while no other is open out of the pool (`new_cache`).
        compiled_pooled: the pool's batches of up to compiled.MAX_POOLED_ROWS rows with the
        work between attentions compiled, where the architecture allows. pool_kernel: auto, on
        or off: their rows, and a compiled forward's draft tree, attend in
        specd.models.pool_attention's one launch (auto: where it runs; on: a warning where it
        cannot). prefix_cache_bytes: prompts' KV kept this far for later prompts that begin
        alike (verifier_svc.prefix_cache); None: PREFIX_CACHE_AUTO_BYTES where reuse is exact
        (`prefix_reuse_exact`), else none; 0: none."""
        self.loaded = loaded
        self.model = loaded.model
        device = device_kind()
        products_rows = default_max_rows(device, loaded.dtype)
        if gemv_rows is None:
            gemv_rows = products_rows
            if gemv_rows and CpuLlama.supports(self.model):
                gemv_rows = CPU_MAX_ROWS
        check_max_rows(gemv_rows, device, loaded.dtype)
        if use_gemv(self.model, gemv_rows) and row_kernels_compiled():
            limit_numpy_blas_threads(1)  # see specd.cpu.row_products
        cpu_layers = CpuLlama.attach(self.model) if gemv_rows else None
        if cpu_layers is None and gemv_rows == CPU_MAX_ROWS > products_rows:
            gemv_rows = set_max_rows(self.model, products_rows)  # the default it could not use
        self.gemv_rows = gemv_rows
        products = "compiled products" if row_kernels_compiled() else "numpy's products"
        self.half_weights = stored_half(self.model)
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        self.weight_bytes += float32_copy_bytes(self.model)  # MLX's products read these
        self.weight_bytes += cpu_layers.paired_bytes() if cpu_layers else 0
        stored = f", {self.half_weights} weights stored float16" if self.half_weights else ""
        self.numpy_part = (
            f"{'whole layers' if cpu_layers else 'weight products'}, {products}{stored}"
        )
        self.identity = loaded.identity
        self.eos_ids = frozenset(loaded.identity.eos_token_ids)
        self._sink = install_capture(self.model)
        self.row_forwards = row_forwards and rowwise.install(self.model)
        # the seam: every forward goes to the first of these that fits (verifier_svc.forwards)
        self._mlx = MlxForward(self.model, self._sink)
        self.forwards: list[Forward] = [self._mlx]
        self.compiled_forwards = compiled_forwards and compiled.supports(self.model)
        pooled = kv_pool and self._mlx.takes_many()
        compiled_pooled = pooled and compiled_pooled and compiled.supports(self.model)
        if self.compiled_forwards or compiled_pooled:  # one set of joined weights for both
            compiled_forward = CompiledForward(self.model, pool_kernel=pool_kernel)
            if self.compiled_forwards:
                self.forwards.insert(0, CompiledMlxForward(compiled_forward))
            if compiled_pooled:
                self._mlx.compiled_pooled = compiled_forward
        if cpu_layers is not None:
            self.forwards.insert(0, CpuKernelForward(cpu_layers))
        self._tree_ready: bool | None = None
        self.kv_pool = KVPool(len(self.model.layers)) if pooled else None
        self.pool_alone = pool_alone
        self.prefix_reuse_exact = cpu_layers is not None and cpu_layers.rows_exact
        if prefix_cache_bytes is None:
            prefix_cache_bytes = PREFIX_CACHE_AUTO_BYTES if self.prefix_reuse_exact else 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self._open_sessions = 0  # caches made by new_cache and not yet garbage
        self._open_lock = threading.Lock()  # finalizers run on whichever thread drops a cache

    @property
    def pooled_path(self) -> str | None:
        """How sessions' batched forwards run, for the verifier's log; None without the pool."""
        if self.kv_pool is None:
            return None
        compiled_forward = self._mlx.compiled_pooled
        if compiled_forward is None:
            return "op by op, attention through a mask"
        attention = "the pool kernel" if compiled_forward.pool_kernel else "a mask"
        return f"compiled, attention through {attention}"

    @property
    def pool_attends_in_place(self) -> bool:
        """Whether pooled batches attend through the pool kernel (each row reading its
        session's keys in place), not a mask over a grid padded to the widest session."""
        compiled_forward = self._mlx.compiled_pooled
        return (
            self.kv_pool is not None
            and compiled_forward is not None
            and compiled_forward.pool_kernel
        )

    @property
    def prefill_chunk(self) -> int:
        """Tokens a prefill's forward takes at most: the CPU kernels' rows where they run
        the target (in chunks that size a prompt costs about half MLX's products there,
        docs/results.md), else mlx-lm's prefill step."""
        layers = self.cpu_layers
        return layers.max_rows if layers is not None else PREFILL_CHUNK

    @property
    def cpu_layers(self) -> CpuLlama | None:
        """The target's layers on the CPU kernels, where a backend uses them."""
        return next((f.layers for f in self.forwards if isinstance(f, CpuKernelForward)), None)

    @property
    def forwards_queue(self) -> bool:
        """Whether the forwards of decode steps are MLX graphs the device runs while Python
        goes on (the CPU kernels compute before returning)."""
        return self._backend(1, []).queues

    def _backend(self, tokens: int, cache: list) -> Forward:
        return next(f for f in self.forwards if f.fits(tokens, cache))

    def supports_trees(self, cache: list) -> bool:
        """Tree verify needs wrappable RoPE and plain KV caches (rows can be moved)."""
        if self._tree_ready is None:
            self._mlx.bypass.wrapped()
            self._tree_ready = install_tree_positions(self.model, self._sink)
        return self._tree_ready and all(type(c) in (KVCache, PooledCache) for c in cache)

    def forward_tree(
        self, token_ids: mx.array, parents: list[int], cache: list, capture: tuple[int, ...]
    ) -> tuple[mx.array, mx.array | None]:
        """[root, drafts...] at the cache end with ancestor-only attention, positions by depth."""
        if not self.supports_trees(cache):
            raise TreeUnsupported("this target's architecture or cache cannot verify draft trees")
        layout = TreeLayout(parents, _cache_len(cache))
        return self._backend(token_ids.size, cache)(token_ids, cache, capture, layout)

    @property
    def slices_prefill(self) -> bool:
        """Whether `prefill_steps` can run a prompt's forward a decoder layer at a time."""
        return self._mlx.slices_layers()

    def shared_forward(self, rounds: list[Round]):
        """(forward_many, rows it takes) for rounds that can share their forwards, or
        None (fewer than two rounds, or one that cannot join: `joins`)."""
        shared = self.many_forward()
        if len(rounds) < 2 or shared is None or not all(self.joins(r) for r in rounds):
            return None
        return shared

    def many_forward(self):
        """(forward over several sessions, rows it takes), or None where rounds never share:
        the pooled sessions' batch, the CPU kernels, or MLX's row-by-row (`shares_forwards`)."""
        if self.kv_pool is not None:
            return self._mlx.forward_pooled, POOLED_MAX_ROWS
        layers = self.cpu_layers
        if layers is not None:
            return layers.forward_many, layers.max_rows
        if self.shares_forwards:
            return self._mlx.forward_many, rowwise.DEFAULT_MAX_ROWS
        return None

    def grid_fits(self, sessions: int, longest: int) -> bool:
        """Whether a shared forward of `sessions` sessions, the longest bringing `longest`
        rows, stays within the pool's attention grid (a pooled batch attends over a grid
        padded to the longest; the other paths attend per session)."""
        return self.kv_pool is None or sessions * longest <= POOLED_MAX_GRID

    def joins(self, r: Round) -> bool:
        """Whether a round, greedy or sampled, can take part in `many_forward`: chain drafts,
        plain steps and draft trees (each session's positions and mask) wherever forwards are
        shared and the target can verify trees."""
        if r.parents is not None and not self.supports_trees(r.session.cache):
            return False
        if self.kv_pool is not None:
            return isinstance(r.session.cache[0], PooledCache)
        layers = self.cpu_layers
        if layers is not None:
            return layers.can_run(1 + len(r.drafts), r.session.cache)
        return self.shares_forwards

    @property
    def shares_forwards(self) -> bool:
        """Whether rounds of several sessions can share forwards at all: on the CPU
        kernels, or in MLX where the products of a few rows run row by row (`row_forwards`),
        each as a decode step computes it, so sharing changes no sum (a matrix product over
        the sessions' rows could round unlike their decode steps and flip a near-tie)."""
        return self.cpu_layers is not None or (self.row_forwards and self._mlx.takes_many())

    def on_mlx(self, tokens: int, cache: list) -> bool:
        """Whether the model's own MLX forward runs this (a prefill's chunk may then run a
        layer at a time with the same numbers; the CPU kernels' and the compiled forward's
        kernels are others)."""
        return self._backend(tokens, cache) is self._mlx

    def layer_by_layer(self, token_ids: mx.array, cache: list, capture: tuple[int, ...] = ()):
        """A generator: the forward of token_ids a layer per `next()`; returns the rows."""
        return self._mlx.layer_by_layer(token_ids, cache, capture)

    def new_cache(self, in_company: bool = False) -> list:
        """A session's caches: in the pool, unless `pool_alone` is off and no other session is
        open (in_company: others open with it, as the prompts of one batched prefill). A
        session alone shares no forward, and its decode step on caches of its own ran faster
        on the H200 (drafting off 0.94-0.96x of plain mlx-lm against 0.78-0.90x pooled,
        docs/gpu.md); one opened beside it is pooled, and a lone one moves into the pool when
        rounds of others come (`pool_session`)."""
        with self._open_lock:
            alone = self._open_sessions == 0
            self._open_sessions += 1
        if self.kv_pool is not None and (self.pool_alone or in_company or not alone):
            cache = self.kv_pool.open()
        else:
            cache = make_prompt_cache(self.model)
        opened = _Opened()  # the session's, whichever caches hold it later (`pool_session`)
        weakref.finalize(opened, self._closed)
        for layer in cache:
            layer.opened = opened
        return cache

    def pool_session(self, session: Session) -> bool:
        """Move a session's KV from caches of its own into a pool slot (its rows copied), so
        it can share forwards now that others are open; True when it is pooled (or already
        was), False where there is no pool or its caches are not plain ones."""
        if self.kv_pool is None:
            return False
        if isinstance(session.cache[0], PooledCache):
            return True
        if not all(type(layer) is KVCache for layer in session.cache):
            return False
        _drop_ahead(session)
        pooled = self.kv_pool.open()
        for own, slot in zip(session.cache, pooled, strict=True):
            slot.opened = getattr(own, "opened", None)
            if own.offset:
                end = own.offset
                slot.update_and_fetch(own.keys[..., :end, :], own.values[..., :end, :])
        session.cache = pooled
        return True

    def _closed(self) -> None:
        with self._open_lock:
            self._open_sessions -= 1

    @property
    def open_sessions(self) -> int:
        """Sessions whose caches are alive (closed ones count until collected)."""
        return self._open_sessions

    def forward(
        self, token_ids: mx.array, cache: list, capture: tuple[int, ...] = ()
    ) -> tuple[mx.array, mx.array | None]:
        """token_ids [T] appended at the cache end -> (logits [T, V], rows [T, L*H] or None)."""
        return self._backend(token_ids.size, cache)(token_ids, cache, capture, None)

    def prefixes_for(self, cache: list) -> PrefixCache | None:
        """The prefix cache, where there is one and `cache` is plain caches (not pooled)."""
        if self.prefix_cache is None or not all(type(c) is KVCache for c in cache):
            return None
        return self.prefix_cache

    def reusable_prefix(self, prompt_ids: list[int], capture: tuple[int, ...], rows_dtype,
                        cache: list):  # fmt: skip
        """The stored beginning of this prompt (`prefix_cache`) for its plain caches, with
        rows of `capture` in `rows_dtype` where it captures; or None."""
        prefixes = self.prefixes_for(cache)
        return prefixes.find(prompt_ids, capture, rows_dtype) if prefixes else None

    def keep_prefix(self, tokens: list[int], cache: list, rows=None, capture=()) -> None:
        """Store copies (the cache moves on) of the keys and values of `tokens`, the cache's
        first len(tokens) rows, with the rows sent for them [len(tokens), W] of layers
        `capture` (None without capture)."""
        prefixes = self.prefixes_for(cache)
        if prefixes is None:
            return
        n = len(tokens)
        keys = tuple(np.array(c.keys[0, :, :n]) for c in cache)
        values = tuple(np.array(c.values[0, :, :n]) for c in cache)
        prefixes.add(Prefix(np.asarray(tokens, np.int32), keys, values, rows, tuple(capture)))

    def keep_session(self, session: Session) -> None:
        """Store a closing session's KV for the tokens its cache holds (the prompt and the
        committed tokens but the last), for a later prompt that goes on from them: a chat's
        next turn; with the rows it sent for them, where it captured."""
        if not session.tokens or len(session.tokens) != session.position:
            return
        n = session.position - 1
        rows = mx.concatenate(session.rows_kept) if session.rows_kept else None
        if rows is not None and rows.shape[0] != n:
            rows = None  # not the cache's tokens one for one: the KV alone
        capture = session.capture if rows is not None else ()
        self.keep_prefix(session.tokens[:n], session.cache, rows, capture)

    def forward_rows(
        self, token_ids: mx.array, cache: list, capture: tuple[int, ...] = ()
    ) -> mx.array | None:
        """`forward` where the logits are not wanted (a prompt's chunks): its captured rows.
        MLX never computes logits nobody evaluates; the CPU kernels compute eagerly, so they
        are told to skip the output head."""
        backend = self._backend(token_ids.size, cache)
        if isinstance(backend, CpuKernelForward):
            return backend.rows_only(token_ids, cache, capture)
        return backend(token_ids, cache, capture, None)[1]


class _Opened:
    """A live session's mark: the open-session count drops when the last cache holding it goes."""

    __slots__ = ("__weakref__",)


@dataclass
class Session:
    cache: list
    capture: tuple[int, ...]
    rows_dtype: mx.Dtype
    position: int  # tokens in context, the pending last token included
    last_token: int  # committed, not yet in the cache
    finished: bool = False
    sampling: SamplingConfig = GREEDY
    rng: np.random.Generator | None = None  # per session: draws never depend on other sessions
    # greedy sessions only: the forward of last_token, queued when the last call returned so
    # the device works while the answer travels; its KV is in the cache (one past position-1)
    ahead: Ahead | None = None
    last_answer_s: float | None = None  # when the server last answered it (its load log)
    # the prompt and every committed token in order (the prefix cache stores a closed
    # session's); empty where it is not followed
    tokens: list[int] = field(default_factory=list)
    # with tokens and capture: the rows sent for the tokens in the cache, in order
    rows_kept: list = field(default_factory=list)

    def commit(self, tokens: list[int], finished: bool, rows=None) -> None:
        """Advance past committed `tokens` (the last one not yet in the cache), `rows` the
        captured rows of the tokens the round put in the cache."""
        self.position += len(tokens)
        self.last_token = tokens[-1]
        self.finished = finished
        if self.tokens:
            self.tokens.extend(tokens)
            if self.rows_kept and rows is not None:
                self.rows_kept.append(rows)


@dataclass
class Ahead:
    choice: mx.array  # [1] the target's greedy choice after last_token
    rows: mx.array | None  # [1, L*H] last_token's captured rows
    forward_rows: int = 1  # rows of the forward that computed it (shared ones: every session's)


@dataclass
class PrefillResult:
    session: Session
    first_token: int
    rows: mx.array | None  # [len(prompt), L*H]
    compute_s: float
    in_steps: bool = False  # prefilled as rows of other rounds' steps (`prompt_round`)


@dataclass
class VerifyResult:
    committed: list[int]
    num_accepted: int
    finished: bool
    rows: mx.array | None  # [1 + num_accepted, L*H]
    compute_s: float
    share: float = 1.0  # its rows over all rows of the forwards it shared (rounds_many)


# A float32 log-probability near the top lies in [-16, 0], where float32's spacing is at most
# 2**-20 and a subtraction is correctly rounded: a logit this far below the largest cannot round
# to the largest one's log-probability.
UNIQUE_TOP_GAP = 1e-5


def greedy_on_host(logits: np.ndarray) -> np.ndarray | None:
    """The greedy choices of float32 logits [n, V] without their log-probabilities, equal to
    `_greedy_next`'s where every row's largest logit leads the rest by UNIQUE_TOP_GAP; None
    where one does not (a near-tie, or a maximum that is not finite)."""
    top = logits.max(axis=-1)
    if not np.isfinite(top).all():
        return None
    if ((logits >= (top - UNIQUE_TOP_GAP)[:, None]).sum(axis=-1) != 1).any():
        return None
    return logits.argmax(axis=-1).astype(np.int32)


def _greedy_next(logits: mx.array) -> mx.array:
    # MLX's logsumexp costs ~0.7 ms a row on a CPU, a tenth of a forward's own time per row
    if logits.dtype == mx.float32 and device_kind() == "cpu":
        flat = np.array(logits.reshape(-1, logits.shape[-1]))
        choices = greedy_on_host(flat)
        if choices is not None:
            return mx.array(choices).reshape(logits.shape[:-1])
    # argmax of log-probs, as mlx-lm's greedy sampler takes it, so ties break identically
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1).astype(mx.int32)


def _greedy_ids(logits: mx.array) -> list[int]:
    return _greedy_next(logits).tolist()


def _cache_len(cache: list) -> int:
    return cache[0].offset


def _rollback(cache: list, keep: int) -> None:
    """Drop cache entries past `keep` tokens."""
    excess = _cache_len(cache) - keep
    if excess > 0:
        trim_prompt_cache(cache, excess)


def _drop_ahead(session: Session) -> None:
    """Forget a queued look-ahead forward: the cache ends at the committed tokens again."""
    if session.ahead is not None:
        session.ahead = None
        _rollback(session.cache, session.position - 1)


def prefill(
    target: Target,
    prompt_ids: list[int],
    capture: tuple[int, ...] = (),
    rows_dtype: mx.Dtype = mx.float16,
    sampling: SamplingConfig = GREEDY,
    seed: int | None = None,
    cache: list | None = None,
) -> PrefillResult:
    """Process the prompt like mlx-lm does (all but the last token in chunks, then the last),
    into `cache` (empty; default: a new one)."""
    steps = prefill_steps(target, prompt_ids, capture, rows_dtype, sampling, seed, sliced=False,
                          cache=cache)  # fmt: skip
    return advance(steps)


def advance(steps):
    """One `next()` of a prefill_steps generator: None, or its result once it is done."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    return None


def prefill_steps(
    target: Target,
    prompt_ids: list[int],
    capture: tuple[int, ...] = (),
    rows_dtype: mx.Dtype = mx.float16,
    sampling: SamplingConfig = GREEDY,
    seed: int | None = None,
    sliced: bool = True,
    cache: list | None = None,
):
    """`prefill` as a generator that returns its PrefillResult. sliced (where the target can,
    `Target.slices_prefill`): each `next()` runs one decoder layer of a chunk, so a server can
    run other sessions' rounds between them instead of stalling them for a long prompt's
    whole forward; the same kernels on the same shapes, so the same numbers."""
    start = time.perf_counter()
    sliced = sliced and target.slices_prefill
    cache = target.new_cache() if cache is None else cache
    prompt = mx.array(prompt_ids, dtype=mx.int32)
    row_chunks = []
    done = 0
    reuse = target.reusable_prefix(prompt_ids, capture, rows_dtype, cache)
    if reuse is not None:
        for layer_cache, keys, values in zip(cache, reuse.keys, reuse.values, strict=True):
            layer_cache.update_and_fetch(mx.array(keys[None]), mx.array(values[None]))
        if capture:
            row_chunks.append(reuse.rows)
        done = reuse.length
    while len(prompt_ids) - done > 1:
        n = min(target.prefill_chunk, len(prompt_ids) - done - 1)
        if sliced and target.on_mlx(n, cache):  # the CPU kernels' numbers differ: not sliced
            rows = yield from target.layer_by_layer(prompt[done : done + n], cache, capture)
        else:
            if sliced and done:  # the CPU kernels' chunks: other rounds run between them
                yield
            rows = target.forward_rows(prompt[done : done + n], cache, capture)
        if rows is not None:
            row_chunks.append(rows.astype(rows_dtype))
        mx.eval([c.state for c in cache], row_chunks)
        done += n
    logits, rows = target.forward(prompt[done:], cache, capture)
    if rows is not None:
        row_chunks.append(rows.astype(rows_dtype))
    rng = None
    if sampling.greedy:
        first = _greedy_ids(logits[-1:])[0]
    else:
        first, rng = _first_drawn(logits, sampling, seed)
    all_rows = mx.concatenate(row_chunks, axis=0) if row_chunks else None
    mx.eval([c.state for c in cache], *([all_rows] if all_rows is not None else []))
    target.keep_prefix(prompt_ids, cache, all_rows, capture)
    # its tokens followed for the prefix cache only where a closed session can be kept
    followed = target.prefixes_for(cache) is not None
    session = Session(
        cache=cache,
        capture=capture,
        rows_dtype=rows_dtype,
        position=len(prompt_ids) + 1,
        last_token=first,
        finished=first in target.eos_ids,
        sampling=sampling,
        rng=rng,
        tokens=[*prompt_ids, first] if followed else [],
        rows_kept=[all_rows] if followed and capture else [],
    )
    return PrefillResult(session, first, all_rows, time.perf_counter() - start)


def _first_drawn(logits, sampling: SamplingConfig, seed: int | None):
    """A sampled session's first token, drawn from its prompt's last row of logits, and the
    generator it drew with (seeded as every prefill seeds it; the session's from then on)."""
    rng = np.random.default_rng(seed)
    if _draws_on_device(sampling, logits.shape[-1]):
        return int(np.array(_drawn_last(logits, sampling, rng))[0]), rng
    return sample(target_distribution(_float32_rows(logits[-1:])[0], sampling), rng), rng


def _drawn_last(logits, sampling: SamplingConfig, rng: np.random.Generator) -> mx.array:
    """A lone session's plain draw from its last row of logits, its uniform taken from `rng`
    (`_drawn`): lazy."""
    return _drawn([logits[-1:]], [(sampling.temperature, rng.random())])


def _draws_on_device(sampling: SamplingConfig, vocab_size: int) -> bool:
    """Whether a plain draw for `sampling` is made by MLX (`device_draws`): on a GPU, where a
    row's copy to the host waits for the device; on a CPU the host's draw is the faster
    (0.14 against 0.75 ms a row of 49,152 at 64 rows, benchmarks/sampled_draws.py). Every
    plain draw of a process is made one way, so a session draws alike wherever it runs."""
    return _on_gpu() and drawable_on_device(sampling, vocab_size)


def _on_gpu() -> bool:
    return device_kind() == "gpu"


def _drawn(rows: list, asked: list[tuple[float, float]]) -> mx.array:
    """The tokens drawn from `rows` (each a forward's last row of logits, MLX's or the CPU
    kernels'), one a (temperature, uniform) in `asked`, by `device_draws.draw` over all of
    them at once: lazy."""
    joined = mx.concatenate([_mx(row) for row in rows]) if len(rows) > 1 else _mx(rows[0])
    temperatures = mx.array([t for t, _ in asked], dtype=mx.float32)
    uniforms = mx.array([u for _, u in asked], dtype=mx.float32)
    return draw(joined, temperatures, uniforms)


@dataclass
class PromptToPrefill:
    """One session's prompt and how it is opened (as `prefill` takes them)."""

    prompt_ids: list[int]
    capture: tuple[int, ...] = ()
    rows_dtype: mx.Dtype = mx.float16
    sampling: SamplingConfig = GREEDY
    seed: int | None = None


def prefill_many(target: Target, prompts: list[PromptToPrefill]) -> list[PrefillResult | Exception]:
    """Several prompts' prefills as shared forwards of pooled sessions (`Target.kv_pool`):
    all but each prompt's last token in one batch, then every last token in another, as
    `prefill` runs one prompt. Prompts past one chunk, or past what a forward takes, and
    every prompt on a target without the pool are prefilled alone; a shared forward that
    fails answers its prompts with the error."""
    if target.kv_pool is None:
        return [_prefill_alone(target, p) for p in prompts]
    answers: list[PrefillResult | Exception | None] = [None] * len(prompts)
    group: list[int] = []
    rows = 0
    for n, p in enumerate(prompts):
        size = len(p.prompt_ids)
        if size > PREFILL_CHUNK or size > POOLED_MAX_ROWS:
            answers[n] = _prefill_alone(target, p)
            continue
        if group and (len(group) + 1) * max(size, rows) > POOLED_MAX_ROWS:
            _prefill_group(target, prompts, group, answers)
            group, rows = [], 0
        group.append(n)
        rows = max(rows, size)
    if group:
        _prefill_group(target, prompts, group, answers)
    return answers


def _prefill_alone(
    target: Target, p: PromptToPrefill, cache: list | None = None
) -> PrefillResult | Exception:
    try:
        return prefill(target, p.prompt_ids, p.capture, p.rows_dtype, p.sampling, p.seed, cache)
    except Exception as exc:  # noqa: BLE001 - this prompt's error, not the others'
        return exc


def _prefill_group(target: Target, prompts, group: list[int], answers: list) -> None:
    if len(group) == 1:
        answers[group[0]] = _prefill_alone(target, prompts[group[0]])
        return
    start = time.perf_counter()
    chosen = [prompts[n] for n in group]
    caches = [target.new_cache(in_company=True) for _ in chosen]  # a shared forward: all pooled
    capture = frozenset().union(*(p.capture for p in chosen))
    try:
        parts: list[list] = [[] for _ in chosen]
        heads = [i for i, p in enumerate(chosen) if len(p.prompt_ids) > 1]
        if heads:
            outs = target._mlx.forward_pooled(
                [Segment(np.array(chosen[i].prompt_ids[:-1]), caches[i]) for i in heads], capture
            )
            for i, (_, outputs) in zip(heads, outs, strict=True):
                if chosen[i].capture:
                    parts[i].append(_joined([outputs[j] for j in chosen[i].capture], -1))
        lasts = target._mlx.forward_pooled(
            [Segment(np.array(p.prompt_ids[-1:]), c) for p, c in zip(chosen, caches, strict=True)],
            capture,
        )
        kept = []
        for i, (p, (_, outputs)) in enumerate(zip(chosen, lasts, strict=True)):
            if p.capture:
                parts[i].append(_joined([outputs[j] for j in p.capture], -1))
            kept.append(_joined(parts[i], 0).astype(p.rows_dtype) if parts[i] else None)
        sampled = [not p.sampling.greedy for p in chosen]
        also = [[r for r in kept if r is not None], [c.state for c in caches[0]]]
        firsts, drawn = _step_choices(lasts, sampled, also)
    except Exception as exc:  # noqa: BLE001 - the error of this group's prompts
        for n in group:
            answers[n] = exc
        return
    seconds = time.perf_counter() - start
    for n, p, cache, logits, first, rows in zip(group, chosen, caches, drawn, firsts, kept,
                                                strict=True):  # fmt: skip
        rng = None
        if p.sampling.greedy:
            token = int(first[-1])
        else:
            token, rng = _first_drawn(logits, p.sampling, p.seed)
        session = Session(
            cache=cache,
            capture=p.capture,
            rows_dtype=p.rows_dtype,
            position=len(p.prompt_ids) + 1,
            last_token=token,
            finished=token in target.eos_ids,
            sampling=p.sampling,
            rng=rng,
        )
        answers[n] = PrefillResult(session, token, rows, seconds)


def _accept(
    target: Target, session: Session, draft_ids, draft_probs, logits, rows=None, first=None
):
    """rows (cast for sending) are computed in the same evaluation as the greedy choices: one
    wait for the device a round, not two. first: the greedy choice after last_token when a
    look-ahead forward made it; logits then cover the drafts alone (None: no drafts)."""
    if session.rng is None:
        parts = [] if first is None else [first]
        if logits is not None:
            parts.append(_greedy_next(logits))
        choices = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        mx.eval(choices, *([rows] if rows is not None else []))
        return accept_greedy(draft_ids, choices.tolist(), target.eos_ids)
    if not draft_ids and _draws_on_device(session.sampling, logits.shape[-1]):
        drawn = _drawn_last(logits, session.sampling, session.rng)
        mx.eval(drawn, *([rows] if rows is not None else []))
        return accept_greedy([], np.array(drawn).tolist(), target.eos_ids)
    return _accept_sampled(target, session, draft_ids, draft_probs, _float32_rows(logits))


def _float32_rows(logits) -> np.ndarray:
    """A forward's logits [T, V] as float32 numpy (MLX's or the CPU kernels' own)."""
    if isinstance(logits, np.ndarray):
        return logits.astype(np.float32, copy=False)
    return np.array(logits.astype(mx.float32))


def _accept_sampled(target: Target, session: Session, draft_ids, draft_probs, logits: np.ndarray):
    """Speculative sampling of a sampled session's round, its draws from the session's own
    generator in the same order wherever its forward ran."""

    def target_row(i: int) -> np.ndarray:  # computed only up to the first rejection
        return target_distribution(logits[i], session.sampling)

    return accept_sampled(draft_ids, draft_probs, target_row, session.rng, target.eos_ids)


def verify(
    target: Target, session: Session, draft_ids: list[int], draft_probs: np.ndarray | None = None
) -> VerifyResult:
    """One forward over [last, d1..dk] at the cache end; keep the accepted prefix's KV.
    After a look-ahead (last already forwarded) the forward covers the drafts alone."""
    start = time.perf_counter()
    base = session.position - 1  # cache length before this round
    ahead, session.ahead = session.ahead, None
    tokens = [session.last_token, *draft_ids][ahead is not None :]
    draws = _draws(session)
    try:
        logits, rows = None, None
        if tokens:
            logits, rows = target.forward(
                mx.array(tokens, dtype=mx.int32), session.cache, session.capture
            )
        if ahead is not None and ahead.rows is not None:
            rows = ahead.rows if rows is None else mx.concatenate([ahead.rows, rows])
        if rows is not None:
            rows = rows.astype(session.rows_dtype)
        first = ahead.choice if ahead is not None else None
        acceptance = _accept(target, session, draft_ids, draft_probs, logits, rows, first)
        kept = 1 + acceptance.num_accepted
        _rollback(session.cache, base + kept)
        if rows is not None:
            rows = rows[:kept]
            mx.eval(rows)
    except BaseException:
        _rollback(session.cache, base)  # a failed round leaves the session as it was
        _restore_draws(session, draws)
        raise
    return _committed(session, acceptance, rows, start)


def _draws(session: Session) -> dict | None:
    """A sampled session's generator state, to put back if its round fails."""
    return None if session.rng is None else session.rng.bit_generator.state


def _restore_draws(session: Session, draws: dict | None) -> None:
    if draws is not None:
        session.rng.bit_generator.state = draws


def decode(target: Target, session: Session, steps: int, look_ahead: bool = False) -> VerifyResult:
    """Commit up to `steps` tokens by plain decoding, stopping after an EOS.

    Greedy sessions queue each next forward before reading the current token, as mlx-lm's
    decode loop does, so graph building overlaps compute; the same forwards and argmax keep
    the output identical to `steps` verify rounds with no drafts. look_ahead (greedy only):
    leave the forward after the last token queued too, so the device keeps working while the
    answer travels and the next call starts with it done (`Session.ahead`).
    """
    if session.rng is not None or (steps <= 1 and not look_ahead and session.ahead is None):
        # all or nothing, like one round: a failure leaves the session (and its draws) as it was
        saved = (session.position, session.last_token, session.finished)
        followed = (len(session.tokens), len(session.rows_kept))
        draws = _draws(session)
        results = []
        try:
            for _ in range(max(steps, 1)):
                results.append(verify(target, session, []))
                if session.finished:
                    break
        except BaseException:
            _rollback(session.cache, saved[0] - 1)
            session.position, session.last_token, session.finished = saved
            del session.tokens[followed[0] :], session.rows_kept[followed[1] :]
            _restore_draws(session, draws)
            raise
        return _merged(results)
    start = time.perf_counter()
    base = session.position - 1
    steps = max(steps, 1)
    committed: list[int] = []
    row_parts = []

    def queue(token: mx.array):
        logits, rows = target.forward(token, session.cache, session.capture)
        nxt = _greedy_next(logits)
        mx.async_eval(nxt, *([rows] if rows is not None else []))
        return nxt, rows

    ahead, session.ahead = session.ahead, None
    try:
        if ahead is not None:
            nxt, rows = ahead.choice, ahead.rows
        else:
            nxt, rows = queue(mx.array([session.last_token], dtype=mx.int32))
        while True:
            wanted = len(committed) + 1 < steps or look_ahead
            following = queue(nxt) if wanted else None
            token = nxt.item()
            committed.append(token)
            if rows is not None:
                row_parts.append(rows)
            if token in target.eos_ids or len(committed) == steps:
                break
            nxt, rows = following
        if following is not None and len(committed) == steps and token not in target.eos_ids:
            session.ahead = Ahead(*following)
        else:  # a forward queued past an EOS, or none
            _rollback(session.cache, base + len(committed))
        all_rows = None
        if row_parts:
            all_rows = mx.concatenate(row_parts, axis=0).astype(session.rows_dtype)
            mx.eval(all_rows)
    except BaseException:
        session.ahead = None
        _rollback(session.cache, base)
        raise
    session.commit(committed, committed[-1] in target.eos_ids, all_rows)
    return VerifyResult(committed, 0, session.finished, all_rows, time.perf_counter() - start)


@dataclass
class Round:
    """One session's round in `rounds_many`: a verify of `drafts` (a chain, or a tree by
    `parents`), or with none, `steps` plain decoding steps; greedy, or sampled as the session
    samples (`draft_probs`: the drafter's distributions for a sampled verify of a chain, None
    for one-hot drafts)."""

    session: Session
    drafts: list[int] = field(default_factory=list)
    steps: int = 1
    look_ahead: bool = False  # a plain round run alone leaves its next forward queued
    # a plain round finishing in shared forwards while others go on takes one more row in the
    # next, its next call's first token (`Session.ahead`), so the session misses no forward
    # while its answer travels
    ahead_in_company: bool = False
    draft_probs: np.ndarray | None = None
    parents: list[int] | None = None  # a draft tree: each draft's parent (-1: the root)
    # a prompt opened as rows of the steps (`prompt_round`): answered with a PrefillResult
    prompt: PromptToPrefill | None = None


def prompt_round(target: Target, ask: PromptToPrefill) -> Round:
    """A prompt's prefill as a round of `rounds_stream`: its session's cache fresh (in the pool
    once other rounds run beside it), all but its last token in chunks of PROMPT_ROWS_A_STEP
    rows a step, then the last token alone (as `prefill` runs a prompt: its chunks, then the
    last), its first token chosen there; answered with a PrefillResult. Run alone (no other
    round to share with), it is `prefill`."""
    session = Session(
        cache=target.new_cache(),  # pooled once it has company (`Target.pool_session`)
        capture=ask.capture,
        rows_dtype=ask.rows_dtype,
        position=1,  # an empty cache: a failed step rolls it back to nothing
        last_token=ask.prompt_ids[0],
        sampling=ask.sampling,
    )
    return Round(session, prompt=ask)


def _rows_asked(r: Round) -> int:
    """The rows a round brings to its first shared step."""
    if r.prompt is not None:
        return len(_prompt_chunk(r.prompt.prompt_ids, 0))
    return 1 + len(r.drafts)


def _prompt_chunk(ids: list[int], cached: int) -> list[int]:
    """A prompt's tokens for its next step, `cached` of them in its cache: all but its last
    in chunks of PROMPT_ROWS_A_STEP, then its last alone."""
    head = len(ids) - 1
    if cached < head:
        return ids[cached : min(cached + PROMPT_ROWS_A_STEP, head)]
    return ids[head:]


def rounds_many(
    target: Target, rounds: list[Round], stepped: Callable[[int], None] | None = None
) -> list[VerifyResult | Exception]:
    """Rounds of several sessions at once, each committing what `verify` (drafts) or `decode`
    (steps, stopping after an EOS) would commit alone; `rounds_stream` with no rounds
    arriving later. Each answer is a result or that round's error."""
    answers: dict[int, VerifyResult | Exception] = {}
    rounds_stream(target, rounds, list, lambda r, result: answers.__setitem__(id(r), result),
                  stepped)  # fmt: skip
    return [answers[id(r)] for r in rounds]


def rounds_stream(
    target: Target,
    rounds: list[Round],
    more: Callable[[], list[Round]],
    answer: Callable[[Round, VerifyResult | Exception], None],
    stepped: Callable[[int], None] | None = None,
) -> None:
    """Rounds run together, continuously: each step is one forward for the rounds
    running (`Target.many_forward`: on the CPU kernels each weight read once for all, in MLX
    a decode step's launches shared, pooled sessions as one batch), each round answered
    (`answer(round, result)`) the step it finishes, and rounds that arrived since (`more()`,
    asked between steps) joining the next step while the forward has rows to spare. Rounds
    that cannot share (`Target.joins`: another architecture, a cache it cannot read, a draft
    tree the target cannot verify, more rows than a forward takes) and a round with no other
    to share with run alone, as `verify`, `verify_tree` or `decode`. A sampled round draws
    from its session's generator as it would alone. A shared forward that fails
    before any verdict, with company, leaves the sessions in it as they were before that step,
    and its rounds go on from there at most half as many a step (a step too wide for the
    device is the failure this is for; the limit grows back by one round after each forward
    that ran); a round that fails alone is answered with the error, its session as it was
    before the round. `stepped(n)`:
    the sessions of each shared forward (1 for each forward of a round run alone). A plain
    round answered while others run on takes a row of the next forward if it asks
    (`Round.ahead_in_company`). Returns once every round is answered and `more()` has no more."""
    shared = target.many_forward()
    forward_many, max_rows = shared if shared is not None else (None, 0)
    pending = collections.deque(rounds)
    running: list[_Running] = []
    finished: list[Session] = []  # sessions answered by the last step that may look ahead
    most_rounds: int | None = None  # rounds a step, since a shared forward failed
    paused: collections.deque[_Running] = collections.deque()  # a failed step's, going on

    def room() -> bool:
        return most_rounds is None or len(running) < most_rounds

    while True:
        pending.extend(more())
        while paused and room():
            running.append(paused.popleft())
        if not pending and not running:
            return
        if target.kv_pool is not None and len(pending) + len(running) > 1:
            for r in pending:  # one opened alone joins the pool once it has company
                target.pool_session(r.session)
        alone = 0  # the rounds at the front that run alone
        while alone < len(pending) and (shared is None or not target.joins(pending[alone])):
            alone += 1
        if not alone and not running and len(pending) == 1:
            alone = 1  # nothing to share with
        for _ in range(alone):
            r = pending.popleft()
            if stepped is not None:
                for _ in range(1 if r.drafts else r.steps):  # a burst alone: a forward a step
                    stepped(1)
            answer(r, _alone(target, r))
        if alone:
            continue
        sizes = [len(state.tokens()) for state in running]  # each step's rows, taken once
        rows, longest = sum(sizes), max(sizes, default=0)
        prompt_rows = sum(n for n, s in zip(sizes, running, strict=True) if s.round.prompt)
        later: list[Round] = []  # prompts past this step's share, put back in order
        while pending and target.joins(pending[0]):
            r = pending[0]
            asks = _rows_asked(r)
            if running and (
                rows + asks > max_rows
                or not target.grid_fits(len(running) + 1, max(longest, asks))
                or not room()
            ):
                break
            if r.prompt is not None:
                # past the prompts' share, this prompt and those behind it wait in order (a
                # shorter one behind it would take the room it waits for); other rounds go on
                if later or (running and prompt_rows + asks > PROMPT_ROWS_IN_A_STEP):
                    later.append(pending.popleft())
                    continue
                prompt_rows += asks
            took = _took_ahead(r)
            pending.popleft()
            finished = [f for f in finished if f is not r.session]  # it computes its own
            if took is not None:
                state = took
            else:
                _drop_ahead(r.session)  # a queued forward is recomputed in the shared one
                state = _Running(r)
            if state.done(target):  # its look-ahead was all it asked for
                answer(r, state.result(target, state.seconds))
                continue
            running.append(state)
            rows += len(state.tokens())
            longest = max(longest, len(state.tokens()))
        pending.extendleft(reversed(later))
        if not running:
            finished = []
            continue
        for session in finished:  # the rows to spare, in the order their rounds finished
            if not room():
                break
            if rows + 1 <= max_rows and target.grid_fits(len(running) + 1, longest):
                running.append(_Running(Round(session), looks_ahead=True))
                rows += 1
        finished = []
        if stepped is not None:
            stepped(len(running))
        running, finished, again, forward_ran = _step(target, running, forward_many, answer)
        if again:
            paused.extendleft(reversed(again))
            most_rounds = max(1, len(again) // 2)
        elif forward_ran and most_rounds is not None:
            most_rounds += 1


def _took_ahead(r: Round) -> _Running | None:
    """A plain round whose session has its next token computed already (`Session.ahead`)
    starts with that token committed, as `decode` would; None for other rounds."""
    session = r.session
    if r.drafts or session.ahead is None:
        return None
    ahead, session.ahead = session.ahead, None
    state = _Running(r, committed=[int(ahead.choice.item())], own_rows=1)
    state.all_rows = ahead.forward_rows
    if session.capture and ahead.rows is not None:
        state.rows.append(ahead.rows)
    return state


@dataclass(eq=False)
class _Running:
    """A round taking part in shared forwards: what it has committed so far."""

    round: Round
    committed: list[int] = field(default_factory=list)
    accepted: int = 0
    rows: list = field(default_factory=list)  # captured rows of each step
    seconds: float = 0.0  # wall time of the forwards it took part in
    own_rows: int = 0
    all_rows: int = 0  # rows of those forwards, every session's
    looks_ahead: bool = False  # no round: the next token of a session already answered
    draws: dict | None = None  # a sampled session's generator state before the round
    prompt_cached: int = 0  # a prompt's tokens in the cache so far

    def __post_init__(self):
        if not self.looks_ahead:
            self.draws = _draws(self.round.session)

    def done(self, target: Target) -> bool:
        if self.round.prompt is not None:
            return bool(self.committed)  # its first token
        return bool(self.committed) and (
            self.committed[-1] in target.eos_ids or len(self.committed) >= max(self.round.steps, 1)
        )

    def samples(self) -> bool:
        """Whether its step's choice is drawn from its session's generator, not greedy."""
        prompt = self.round.prompt
        if prompt is not None:
            return not prompt.sampling.greedy
        return self.round.session.rng is not None

    def tokens(self) -> np.ndarray:
        """This step's new tokens: the last token and drafts first, then the latest token; a
        prompt's all but its last, then its last."""
        prompt = self.round.prompt
        if prompt is not None:
            return np.array(_prompt_chunk(prompt.prompt_ids, self.prompt_cached))
        if self.committed:
            return np.array([self.committed[-1]])
        return np.array([self.round.session.last_token, *self.round.drafts])

    def result(self, target: Target, seconds: float) -> VerifyResult | PrefillResult:
        if self.round.prompt is not None:
            return self._prefilled(target)
        session, tokens = self.round.session, self.committed
        kept = None
        if self.rows:
            kept = _mx(_joined(self.rows, 0)).astype(session.rows_dtype)
            mx.eval(kept)
        session.commit(tokens, tokens[-1] in target.eos_ids, kept)
        share = self.own_rows / self.all_rows
        return VerifyResult(tokens, self.accepted, session.finished, kept, seconds, share)

    def _prefilled(self, target: Target) -> PrefillResult:
        session, ask = self.round.session, self.round.prompt
        first = self.committed[0]
        session.position = len(ask.prompt_ids) + 1
        session.last_token = first
        session.finished = first in target.eos_ids
        rows = None
        if self.rows:
            rows = _mx(_joined(self.rows, 0)).astype(ask.rows_dtype)
            mx.eval(rows)
        return PrefillResult(session, first, rows, self.seconds, in_steps=True)


def _step(
    target: Target, running: list[_Running], forward_many, answer
) -> tuple[list[_Running], list[Session], list[_Running], bool]:
    """One shared forward: every running round's tokens, then each one's verdict; answers the
    rounds that finish, and a round whose verdict fails with its error (the session as it was
    before the round; the others go on). Returns those still running, the sessions of the
    rounds answered that may look ahead in the next step (`Round.ahead_in_company`) if others
    run on, where the forward itself failed with company (other rounds or look-ahead rows),
    its rounds to go on (their sessions as they were before this step, the look-aheads
    dropped; a round alone is answered with the error), and whether the forward ran. A
    look-ahead row leaves its choice as its session's `Session.ahead`.
    forward_many's logits and rows are numpy (the CPU kernels) or MLX arrays."""
    start = time.perf_counter()
    capture = frozenset().union(*(s.round.session.capture for s in running))
    segments = [_segment(s) for s in running]
    done: list[_Running] = []
    failed: list[_Running] = []
    judged = False  # verdicts taken: past this, the step is no longer undone as a whole
    generators = [_draws(s.round.session) for s in running]  # a failed step puts them back
    try:
        outs = forward_many(segments, capture)
        on_device = _device_draws(running, outs)
        on_host = [s.samples() and d is None for s, d in zip(running, on_device, strict=True)]
        prompts = [s.round.prompt is not None for s in running]  # a draw from its last row
        choices, drawn = _step_choices(outs, on_host, last_only=prompts, device_draws=on_device)
        seconds = time.perf_counter() - start  # every session's logits computed by now
        step_rows = sum(len(segment.token_ids) for segment in segments)
        judged = True
        for state, segment, (logits, outputs), choice, host in zip(
            running, segments, outs, choices, drawn, strict=True
        ):
            try:
                if _take_step(target, state, len(segment.token_ids),
                              logits if host is None else host, outputs, choice, seconds,
                              step_rows):  # fmt: skip
                    done.append(state)
            except Exception as exc:  # noqa: BLE001 - this session's verdict; the others go on
                _undo(state)
                failed.append(state)
                if not state.looks_ahead:
                    answer(state.round, exc)
    except Exception as exc:  # noqa: BLE001 - the error of the sessions in this forward
        rounds = [state for state in running if not state.looks_ahead]
        if not judged and rounds and len(running) > 1:  # each loses this step's rows only
            for state, generator in zip(running, generators, strict=True):
                _undo_step(state)
                _restore_draws(state.round.session, generator)
            return [], [], rounds, False
        for state in running:
            _undo(state)
            if not state.looks_ahead:
                answer(state.round, exc)
        return [], [], [], False
    except BaseException:
        for state in running:
            _undo(state)
        raise
    looking = []
    for state in done:
        if state.looks_ahead:
            continue
        answer(state.round, state.result(target, state.seconds))
        r = state.round
        plain = not r.drafts and r.session.rng is None  # greedy: a look-ahead is its choice
        if r.ahead_in_company and plain and not r.session.finished:
            looking.append(r.session)
    ended = done + failed
    still = [s for s in running if all(s is not d for d in ended)]
    return still, looking, [], True


def _take_step(
    target: Target, state: _Running, own_rows: int, logits, outputs, choice, seconds: float,
    step_rows: int,
) -> bool:  # fmt: skip
    """A round's verdict on its rows of a shared forward: what it commits (a verify's accepted
    drafts, a tree's kept path moved into place, a plain step's token) or, for a look-ahead,
    its session's next choice. True when the round is done."""
    r = state.round
    captured = None
    if r.session.capture:
        captured = _joined([outputs[j] for j in r.session.capture], -1)
    if r.prompt is not None:
        return _prompt_step(state, own_rows, logits, captured, choice, seconds)
    if state.looks_ahead:
        rows = None if captured is None else _mx(captured)
        nxt = mx.array(np.asarray(choice, dtype=np.int32).reshape(1))
        r.session.ahead = Ahead(nxt, rows, step_rows)
        return True
    state.seconds += seconds
    state.own_rows += own_rows
    state.all_rows += step_rows
    drafts = [] if state.committed else r.drafts
    if r.parents is not None:  # a tree: the path kept moves into place
        greedy = None if choice is None else choice.tolist()
        acceptance, path = _accept_tree(target, r.session, r.drafts, r.parents, logits, greedy)
        state.committed, state.accepted = acceptance.committed, acceptance.num_accepted
        keep = [0, *(i + 1 for i in path)]
        _compact(r.session.cache, r.session.position - 1, keep)
        mx.eval([c.state for c in r.session.cache])
        if captured is not None:
            state.rows.append(_mx(captured)[mx.array(keep)])
        return True
    if r.session.rng is None or choice is not None:  # greedy, or drawn on the device
        acceptance = accept_greedy(drafts, choice.tolist(), target.eos_ids)
    else:  # its draws from its own generator, in the order they come alone
        probs = r.draft_probs if drafts else None
        acceptance = _accept_sampled(target, r.session, drafts, probs, _float32_rows(logits))
    if drafts:  # a verify: one step, its accepted prefix kept
        state.committed, state.accepted = acceptance.committed, acceptance.num_accepted
        kept = 1 + acceptance.num_accepted
        _rollback(r.session.cache, r.session.position - 1 + kept)
        if captured is not None:
            state.rows.append(captured[:kept])
        return True
    state.committed += acceptance.committed  # one token, as decode takes it
    if captured is not None:
        state.rows.append(captured)
    return state.done(target)


def _prompt_step(state: _Running, rows: int, logits, captured, choice, seconds: float) -> bool:
    """A prompt's part of a shared step: a chunk of its tokens into the cache, or its last
    token and the first token after it (greedy, or drawn from a generator seeded as `prefill`
    seeds it). True when it is done."""
    state.seconds += seconds
    if captured is not None:
        state.rows.append(captured)
    state.prompt_cached += rows
    session, ask = state.round.session, state.round.prompt
    if state.prompt_cached < len(ask.prompt_ids):
        return False
    if ask.sampling.greedy:
        state.committed = [int(choice[-1])]
    else:
        first, session.rng = _first_drawn(logits, ask.sampling, ask.seed)
        state.committed = [first]
    return True


def _segment(state: _Running) -> Segment:
    """A running round's part of the next shared forward: a tree's nodes at their depths,
    each seeing its ancestors alone."""
    r = state.round
    if r.parents is None or state.committed:
        return Segment(state.tokens(), r.session.cache)
    layout = TreeLayout(r.parents, r.session.position - 1)
    return Segment(state.tokens(), r.session.cache, layout.positions(), layout.sees())


def _accept_tree(target: Target, session: Session, draft_ids, parents, logits, greedy_ids):
    """The path of a tree the target follows and what it commits: by its greedy choices at
    every node (`greedy_ids`), or for a sampled session by speculative sampling from its
    generator."""
    if session.rng is None:
        return accept_tree_greedy(draft_ids, parents, greedy_ids, target.eos_ids)
    dist = _float32_rows(logits)
    return accept_tree_sampled(
        draft_ids,
        parents,
        lambda i: target_distribution(dist[i], session.sampling),
        session.rng,
        target.eos_ids,
    )


def _step_choices(
    outs: list,
    sampled: list[bool],
    also: list = (),
    last_only: list[bool] | None = None,
    device_draws: list | None = None,
) -> tuple[list, list]:
    """A shared forward's greedy choices per session (None for one sampled on the host),
    evaluated with the sampled sessions' logits and the arrays in `also`: over a pooled
    forward's every row at once (`SessionOutputs.every_logits`: a few operations and one copy
    to the host a step), else session by session (`_greedy_choices`). Sessions with a
    (temperature, uniform) in `device_draws` get the token drawn from their last row on the
    device in the same evaluation (`verifier_svc.device_draws`). Also each host-sampled session's
    logits as float32 numpy (None for the others; its last row alone where `last_only`),
    copied to the host together: a copy a session cost a wait for the device each on a GPU."""
    device_draws = device_draws or [None] * len(sampled)
    chosen = [s or d is not None for s, d in zip(sampled, device_draws, strict=True)]
    drawn = [x for (x, _), s in zip(outs, sampled, strict=True) if s]
    lasts = [o for o, s in zip(last_only or [False] * len(sampled), sampled, strict=True) if s]
    on_host, to_host = _drawn_rows(drawn, lasts)
    tokens = _drawn_on_device(outs, device_draws)
    pending = [on_host, *([tokens] if tokens is not None else []), *also]
    every = getattr(outs, "every_logits", None)
    if every is None or all(chosen):
        kept = [x for (x, _), c in zip(outs, chosen, strict=True) if not c]
        greedy = iter(_greedy_choices(kept, pending))
        choices = [None if c else next(greedy) for c in chosen]
    else:
        together = _greedy_next(every)
        mx.eval(together, pending)
        flat = np.array(together).reshape(-1)
        ends = np.cumsum([len(x) for x, _ in outs]).tolist()
        choices = [None if c else flat[end - len(x) : end]
                   for (x, _), c, end in zip(outs, chosen, ends, strict=True)]  # fmt: skip
    if tokens is not None:
        device = iter(np.array(tokens).reshape(-1, 1))
        choices = [next(device) if d is not None else c
                   for c, d in zip(choices, device_draws, strict=True)]  # fmt: skip
    host = iter(to_host())
    return choices, [next(host) if s else None for s in sampled]


def _drawn_on_device(outs: list, device_draws: list) -> mx.array | None:
    """The tokens drawn from the last row of each session with a (temperature, uniform),
    lazy (`_drawn`); None when there is none."""
    asked = [(x[-1:], d) for (x, _), d in zip(outs, device_draws, strict=True) if d is not None]
    if not asked:
        return None
    return _drawn([row for row, _ in asked], [d for _, d in asked])


def _device_draws(running: list, outs: list) -> list:
    """(temperature, uniform) for each round whose step is one plain draw (a step without
    drafts of a session sampling by temperature alone: `device_draws`), its generator's
    uniform taken now as the host's draw would take it; None for the others."""
    made = []
    for state, (logits, _) in zip(running, outs, strict=True):
        r = state.round
        plain = (
            r.prompt is None
            and not state.looks_ahead
            and r.session.rng is not None
            and not r.drafts
            and r.parents is None
            and _draws_on_device(r.session.sampling, logits.shape[-1])
        )
        made.append((r.session.sampling.temperature, r.session.rng.random()) if plain else None)
    return made


def _drawn_rows(drawn: list, last_only: list[bool], join: bool | None = None):
    """The sampled sessions' logits bound for the host: the MLX ones cast to float32, to
    evaluate with the step (a list), and a function giving each session's float32 numpy rows
    once they are evaluated. On a GPU each copy waits for the device, so the rows go over
    joined in one; on the CPU a copy is a memcpy, and joining them would be one more
    (`join`: None chooses by the device)."""
    wanted = [x[-1:] if last else x for x, last in zip(drawn, last_only, strict=True)]
    device = [x.astype(mx.float32) for x in wanted if not isinstance(x, np.ndarray)]
    joined = len(device) > 1 and (_on_gpu() if join is None else join)
    pending = [mx.concatenate(device)] if joined else device

    def to_host() -> list[np.ndarray]:
        if joined:
            bounds = np.cumsum([len(x) for x in device])[:-1]
            copies = iter(np.split(np.array(pending[0]), bounds))
        else:
            copies = (np.array(x) for x in pending)
        return [x.astype(np.float32, copy=False) if isinstance(x, np.ndarray) else next(copies)
                for x in wanted]  # fmt: skip

    return pending, to_host


def _greedy_choices(logits: list, drawn: list = ()) -> list[mx.array]:
    """Each session's greedy choices, evaluated: float32 numpy logits (the CPU kernels') all in
    one pass on the host where no row holds a near-tie, else each as `_greedy_next` takes them
    in one evaluation (one wait for the device a step), with the sampled sessions' MLX logits
    and any other arrays to evaluate (`drawn`) in it too."""
    pending = [x for x in drawn if not isinstance(x, np.ndarray)]  # MLX arrays, or lists of them
    if logits and all(isinstance(x, np.ndarray) and x.dtype == np.float32 for x in logits):
        together = greedy_on_host(np.concatenate(logits) if len(logits) > 1 else logits[0])
        if together is not None:
            mx.eval(pending)
            bounds = np.cumsum([len(x) for x in logits])[:-1]
            return [mx.array(part) for part in np.split(together, bounds)]
    choices = [_greedy_next(_mx(x)) for x in logits]
    mx.eval(choices, pending)
    return choices


def _undo(state: _Running) -> None:
    """A failed step leaves the session as it was before the round (or the look-ahead), its
    generator's draws too."""
    session = state.round.session
    if state.looks_ahead:
        session.ahead = None
    _restore_draws(session, state.draws)
    _rollback(session.cache, session.position - 1)


def _undo_step(state: _Running) -> None:
    """A shared forward that failed before any verdict: its session's cache as it was before
    the step (a look-ahead's dropped); the round's progress stands."""
    session = state.round.session
    if state.looks_ahead:
        session.ahead = None
    if state.round.prompt is not None:
        cached = state.prompt_cached
    else:
        cached = session.position - 1 + len(state.committed)
    _rollback(session.cache, cached)


def _alone(target: Target, r: Round) -> VerifyResult | PrefillResult | Exception:
    if r.prompt is not None:  # into the cache its round opened, as `prefill` would open it
        return _prefill_alone(target, r.prompt, r.session.cache)
    try:
        if r.parents is not None:
            return verify_tree(target, r.session, r.drafts, r.parents)
        if r.drafts:
            return verify(target, r.session, r.drafts, r.draft_probs)
        return decode(target, r.session, r.steps, look_ahead=r.look_ahead)
    except Exception as exc:  # noqa: BLE001 - this session's error, not the others'
        return exc


def _mx(values) -> mx.array:
    """An MLX array of numpy output (the CPU kernels'), MLX output as it is (lazy)."""
    return values if isinstance(values, mx.array) else mx.array(values)


def _joined(parts: list, axis: int):
    if any(isinstance(p, mx.array) for p in parts):
        return mx.concatenate([_mx(p) for p in parts], axis=axis)
    return np.concatenate(parts, axis=axis)


def _merged(results: list[VerifyResult]) -> VerifyResult:
    parts = [r.rows for r in results if r.rows is not None]
    rows = _joined(parts, axis=0) if parts else None
    if isinstance(rows, mx.array):
        # evaluated on this (the MLX) thread: the reply is encoded on another, which has no
        # stream to run a lazy graph on
        mx.eval(rows)
    return VerifyResult(
        [t for r in results for t in r.committed],
        sum(r.num_accepted for r in results),
        results[-1].finished,
        rows,
        sum(r.compute_s for r in results),
    )


def _committed(session: Session, acceptance, rows, start: float) -> VerifyResult:
    """Advance the session past the committed tokens and report the round."""
    session.commit(acceptance.committed, acceptance.finished, rows)
    return VerifyResult(
        acceptance.committed,
        acceptance.num_accepted,
        acceptance.finished,
        rows,
        time.perf_counter() - start,
    )


def _compact(cache: list, base: int, keep: list[int]) -> None:
    """Move the KV rows of forward indices `keep` (ascending) to base.. and drop the rest."""
    if keep != list(range(len(keep))):
        rows = [base + i for i in keep]
        by_mlx = []  # layers whose rows move through MLX
        for c in cache:
            if isinstance(c, PooledCache):
                c.move_rows(rows, base)
            elif not _moved_on_host(c, rows, base):
                by_mlx.append(c)
        if by_mlx:
            arrays = [a for c in by_mlx for a in (c.keys, c.values)]
            # each position from itself; a session's layers' caches grow alike, one length
            order = np.arange(arrays[0].shape[2], dtype=np.int32)
            order[base : base + len(rows)] = rows
            moved = _moved_rows(arrays, mx.array(order))
            for c, keys, values in zip(by_mlx, moved[::2], moved[1::2], strict=True):
                c.keys, c.values = keys, values
    _rollback(cache, base + len(keep))


@mx.compile
def _moved_rows(arrays: list[mx.array], order: mx.array) -> list[mx.array]:
    """Each KV array [B, heads, T, D] with position t taken from position order[t]: one gather
    an array, in one compiled call for every layer. On a GPU a gather and a slice assignment
    for keys and for values in each of 30 layers (~240 small kernels with the assignments'
    copies) cost a tree's verify ~2.7 ms where its forward took ~4 (H100, `verify_cost.py
    --trees 3 --accept`, docs/gpu.md, run AW); the same in one compiled call took as long."""
    return [mx.take(a, order, axis=2) for a in arrays]


def _moved_on_host(c, rows: list[int], base: int) -> bool:
    """Move a layer's kept rows within its own buffers, in place, where those are host memory
    that the CPU kernels write through numpy (float32 on the CPU device). Through MLX, as a
    gather and a slice assignment for keys and for values in each layer (before `_moved_rows`),
    a verify of a tree of 3 that kept a moved path of 2 drafts took 27.3 ms against 22.8 in
    place on this project's 2-core host (`benchmarks/verify_cost.py --trees 3 --accept`);
    evaluating the gathers first, so the assignments could reuse their buffers, did not
    shorten it."""
    if type(c) is not KVCache or c.keys is None or c.keys.dtype != mx.float32:
        return False
    if mx.default_device() != mx.cpu:
        return False
    keys, values = np.asarray(c.keys), np.asarray(c.values)
    if not (keys.flags.carray and values.flags.carray):  # a copy, or not writable
        return False
    stop = base + len(rows)
    keys[..., base:stop, :] = keys[..., rows, :]  # the gather copies first: overlap is safe
    values[..., base:stop, :] = values[..., rows, :]
    return True


def verify_tree(
    target: Target, session: Session, draft_ids: list[int], parents: list[int]
) -> VerifyResult:
    """One forward over the tree; keep the longest accepted root-to-leaf path, its KV rows
    compacted into place, and return hidden rows for the committed positions only."""
    start = time.perf_counter()
    check_parents(parents, len(draft_ids))
    _drop_ahead(session)  # a tree forwards its root with the drafts
    base = session.position - 1
    tokens = mx.array([session.last_token, *draft_ids], dtype=mx.int32)
    draws = _draws(session)
    try:
        logits, rows = target.forward_tree(tokens, parents, session.cache, session.capture)
        greedy = _greedy_ids(logits) if session.rng is None else None
        acceptance, path = _accept_tree(target, session, draft_ids, parents, logits, greedy)
        keep = [0, *(i + 1 for i in path)]
        _compact(session.cache, base, keep)
        if rows is not None:
            rows = rows[mx.array(keep)].astype(session.rows_dtype)
        mx.eval([c.state for c in session.cache], *([rows] if rows is not None else []))
    except BaseException:
        _rollback(session.cache, base)
        _restore_draws(session, draws)
        raise
    return _committed(session, acceptance, rows, start)


class TreeUnsupported(RuntimeError):
    pass
