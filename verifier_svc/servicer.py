"""gRPC adapter for the verifier engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from specd import __version__, metrics, wire
from specd.models.load import device_kind, load_target, tokenizer_files
from specd.service import (
    Batch,
    FailedPrecondition,
    InvalidArgument,
    MlxThread,
    ResourceExhausted,
    ServiceError,
    SessionTable,
    Unavailable,
    check_sampling_params,
    check_token_ids,
    process_stats,
    rpc,
    stream_of,
)
from specd.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_svc.config import GPU_MODES, VerifierConfig
from verifier_svc.engine import (
    PrefillResult,
    PromptToPrefill,
    Round,
    Session,
    Target,
    TreeUnsupported,
    advance,
    decode,
    half_weights_pay,
    prefill_many,
    prefill_steps,
    prompt_round,
    rounds_stream,
    verify,
    verify_tree,
)
from verifier_svc.kv_pool import PooledCache
from verifier_svc.load_log import LoadStats
from verifier_svc.sampling import SamplingConfig
from verifier_svc.tree import check_parents
from verifier_svc.warmup import WarmupReport, warm_up_served

ROWS_DTYPES = {
    "": mx.float16,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}

log = logging.getLogger("specd.verifier")


def check_layers(layers, num_layers: int) -> tuple[int, ...]:
    layers = tuple(layers)
    if any(not 0 <= i < num_layers for i in layers) or len(set(layers)) != len(layers):
        raise InvalidArgument(
            f"capture_layers {list(layers)} must be distinct layer indices in [0, {num_layers})"
        )
    return layers


def check_sampling(params) -> SamplingConfig:
    check_sampling_params(params)
    return SamplingConfig.from_proto(params)


def check_draft_probs(tensor, drafts: list[int], vocab_size: int) -> np.ndarray | None:
    """The drafter's q rows [k, V]: absent means one-hot drafts."""
    if wire.is_empty(tensor):
        return None
    q = wire.decode_numpy(tensor, ndim=2).astype(np.float64)
    if q.shape != (len(drafts), vocab_size):
        raise InvalidArgument(
            f"draft_probs has shape {list(q.shape)}, expected "
            f"[{len(drafts)}, {vocab_size}] (one row per draft token)"
        )
    if not np.isfinite(q).all() or (q < 0).any() or not np.allclose(q.sum(1), 1, atol=1e-2):
        raise InvalidArgument("draft_probs rows must be finite, non-negative and sum to 1")
    if drafts and (q[np.arange(len(drafts)), drafts] <= 0).any():
        raise InvalidArgument("a draft token has probability 0 in its own draft_probs row")
    return q / q.sum(axis=1, keepdims=True)


class PromptAsked(NamedTuple):
    """An OpenSession's prompt, opened as rows of the batched rounds' steps."""

    ask: PromptToPrefill


def _caller(item) -> int | None:
    """Who asked a batched round (`Batch.key`): its session; None for a prompt opened in the
    steps, whose caller comes back as its session's rounds, so no round waits for it (a key
    for prompts would make every lone session's rounds wait `Batch.gather_s` for half a
    second after each prompt)."""
    return None if isinstance(item, PromptAsked) else id(item[0])


class RoundAsked(NamedTuple):
    """A Verify call's round, as the batched rounds take it."""

    session: Session
    position: int
    drafts: list[int]
    plain_steps: int
    draft_probs: np.ndarray | None = None
    parents: list[int] | None = None


def on_gpu(mode: str, option: str) -> bool:
    """An auto|on|off option whose auto means: where MLX runs the target on a GPU."""
    if mode not in GPU_MODES:
        raise ValueError(f"unknown {option} {mode!r}; choose one of {', '.join(GPU_MODES)}")
    return device_kind() == "gpu" if mode == "auto" else mode == "on"


INLINE_MAX_STEPS = 4  # the coordinator's default decode burst (~0.25 s of forwards)


def target_for(config: VerifierConfig) -> Target:
    """The target as the verifier serves it: its dtype, numpy forwards, float16-held weights
    and row-by-row forwards as configured."""
    half = config.half_weights and half_weights_pay(config.dtype, config.gemv_rows)
    loaded = load_target(config.model, config.dtype, config.cache_dir, half)
    return Target(
        loaded,
        config.gemv_rows,
        row_forwards=on_gpu(config.row_forwards, "row-forwards"),
        compiled_forwards=on_gpu(config.compiled_forwards, "compiled-forwards"),
        kv_pool=on_gpu(config.kv_pool, "kv-pool"),
        pool_alone=config.kv_pool == "on",
        compiled_pooled=on_gpu(config.compiled_pooled, "compiled-pooled"),
        pool_kernel=config.pool_kernel,
        prefix_cache_bytes=config.prefix_cache_bytes,
    )


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, config: VerifierConfig, mlx_thread: MlxThread):
        for flag, value in (("--prefill-between-steps", config.prefill_between_steps),
                            ("--prefill-in-steps", config.prefill_in_steps)):  # fmt: skip
            if value and config.max_kv_bytes is not None:
                raise ValueError(
                    f"{flag} with --max-kv-memory: a prompt prefilled beside running rounds "
                    "can grow the KV pool past the limit those rounds were checked against; "
                    "pass one of them"
                )
        self.config = config
        self.mlx = mlx_thread
        self.target: Target | None = None
        self.warmup: WarmupReport | None = None
        self.look_ahead = False  # decided at load
        self.prefill_in_steps = 0  # decided at load: the longest prompt opened in the steps
        self.sessions = SessionTable(config.max_sessions, config.session_idle_timeout_s)
        self.load_stats = LoadStats()
        # prompts opened at once are prefilled together where sessions are pooled
        self._prefills = Batch(self._prefill_many)
        self._rounds = Batch(  # by session
            self._rounds_many,
            key=_caller,
            run_stream=self._rounds_stream,
            held_job_steps=config.prefill_between_steps or None,
        )

    async def load(self) -> None:
        self.target = await self.mlx.run(self._load_and_warm)

    def _load_and_warm(self) -> Target:
        target, self.warmup = warm_up_served(self.config, lambda: target_for(self.config))
        # a queued forward pays where the device runs it while Python goes on
        self.look_ahead = on_gpu(self.config.look_ahead, "look-ahead") and target.forwards_queue
        self.prefill_in_steps = self.config.prompts_in_steps(target.pool_attends_in_place)
        return target

    def kv_bytes(self) -> int:
        """Bytes the open sessions' KV caches hold (allocated, not just filled)."""
        target = self.target
        pooled = 0 if target is None or target.kv_pool is None else target.kv_pool.nbytes
        own = sum(
            layer.nbytes
            for session in self.sessions.values()
            for layer in session.cache
            if not isinstance(layer, PooledCache)
        )
        return pooled + own  # the pool: every slot's share, open or free

    def prefix_cache_bytes(self) -> int:
        """Bytes of prompts' KV the prefix cache holds (not counted by `kv_bytes`)."""
        target = self.target
        return 0 if target is None or target.prefix_cache is None else target.prefix_cache.nbytes

    def _ensure_kv_room(self) -> None:
        limit = self.config.max_kv_bytes
        if limit is None:
            return
        held = self.kv_bytes()
        if held >= limit:
            raise ResourceExhausted(
                f"the {len(self.sessions)} open sessions' KV caches hold {_mib(held)}, at or past "
                f"the limit (--max-kv-memory) of {_mib(limit)}; close finished sessions or raise "
                "the limit"
            )

    def _ready(self) -> Target:
        if self.target is None:
            raise Unavailable("the verifier is still loading its model; retry shortly")
        return self.target

    @property
    def max_context(self) -> int:
        return self.config.max_context or self._ready().loaded.max_context

    def _prefill_many(self, asks: list) -> list:
        started = time.perf_counter()
        results = prefill_many(self._ready(), asks)
        done = sum(not isinstance(result, BaseException) for result in results)
        self.load_stats.prefilled(done, time.perf_counter() - started)
        return results

    def _advance(self, steps):
        """One job of a prompt's prefill (its next layer, or all of it)."""
        started = time.perf_counter()
        result = advance(steps)
        self.load_stats.prefilled(int(result is not None), time.perf_counter() - started)
        return result

    @rpc
    async def GetInfo(self, request, context):
        target = self._ready()
        ident = target.identity
        return verifier_pb2.VerifierInfo(
            model=common_pb2.ModelIdentity(
                name=ident.name,
                fingerprint=ident.fingerprint,
                vocab_size=ident.vocab_size,
                hidden_size=ident.hidden_size,
                num_layers=ident.num_layers,
                eos_token_ids=ident.eos_token_ids,
            ),
            dtype=target.loaded.dtype,
            device=device_kind(),
            max_sessions=self.config.max_sessions,
            max_context=self.max_context,
            max_draft_tokens=self.config.max_draft_tokens,
            process=process_stats(len(self.sessions)),
            version=__version__,
            weight_bytes=target.weight_bytes,
        )

    @rpc
    async def GetTokenizer(self, request, context):
        return verifier_pb2.TokenizerFiles(files=tokenizer_files(self._ready().loaded.path))

    @rpc
    async def OpenSession(self, request, context):
        target = self._ready()
        ident = target.identity
        prompt = check_token_ids(request.prompt_ids, ident.vocab_size, "prompt_ids")
        if not prompt:
            raise InvalidArgument("prompt_ids is empty; a session needs at least one token")
        if len(prompt) + 1 > self.max_context:
            raise ResourceExhausted(
                f"prompt of {len(prompt)} tokens exceeds the context limit {self.max_context}"
            )
        layers = check_layers(request.capture_layers, ident.num_layers)
        if request.rows_dtype not in ROWS_DTYPES:
            raise InvalidArgument(
                f"rows_dtype {request.rows_dtype!r} is not one of float16, bfloat16, float32"
            )
        sampling = check_sampling(request.sampling)
        seed = request.sampling.seed if request.sampling.HasField("seed") else None
        self.sessions.ensure_room()
        self._ensure_kv_room()
        # a long prompt with other sessions open runs a decoder layer per job, their rounds
        # in between; otherwise the whole prefill is one job
        sliced = 0 < self.config.prefill_slice_tokens < len(prompt) and len(self.sessions) > 0
        rows_dtype = ROWS_DTYPES[request.rows_dtype]
        ask = PromptToPrefill(prompt, layers, rows_dtype, sampling, seed)
        if target.kv_pool is not None and len(prompt) <= self.prefill_in_steps:
            result = await self.mlx.run_batched(self._rounds, PromptAsked(ask))
        elif target.kv_pool is not None and not sliced:  # with the prompts opening beside it
            result = await self.mlx.run_batched(self._prefills, ask)
        else:
            steps = prefill_steps(target, prompt, layers, rows_dtype, sampling, seed, sliced)
            while (result := await self.mlx.run(self._advance, steps)) is None:
                pass
        session_id = self.sessions.add(result.session)
        return verifier_pb2.OpenSessionResponse(
            session_id=session_id,
            first_token=result.first_token,
            finished=result.session.finished,
            position=result.session.position,
            hidden_rows=_rows(result.rows),
            compute_s=result.compute_s,
        )

    @rpc
    async def Verify(self, request, context):
        target = self._ready()
        session = self.sessions.get(request.session_id)
        drafts = check_token_ids(request.draft_ids, target.identity.vocab_size, "draft_ids")
        if len(drafts) > self.config.max_draft_tokens:
            raise InvalidArgument(
                f"{len(drafts)} draft tokens; the limit (--max-draft-tokens) "
                f"is {self.config.max_draft_tokens}"
            )
        probs = check_draft_probs(request.draft_probs, drafts, target.identity.vocab_size)
        parents = None
        if request.draft_parents:
            if probs is not None:
                raise InvalidArgument("draft trees take one-hot drafts: send no draft_probs")
            try:
                parents = check_parents(list(request.draft_parents), len(drafts))
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        steps = request.plain_steps
        if steps < 0 or steps > self.config.max_draft_tokens:
            raise InvalidArgument(
                f"plain_steps {steps} must be in [0, {self.config.max_draft_tokens}] "
                "(the limit is --max-draft-tokens)"
            )
        if steps > 1 and drafts:
            raise InvalidArgument("plain_steps > 1 takes no drafts: send them in their own call")
        arrived = self.load_stats.arrived(session.last_answer_s)
        if target.shares_forwards:
            # chains, plain steps and trees, greedy or sampled: the sessions waiting together
            # share forwards
            asked = RoundAsked(session, request.position, drafts, steps, probs, parents)
            # on a CPU a lone session's short call runs on this thread (run_batched's inline)
            result = await self.mlx.run_batched(
                self._rounds, asked, inline=steps <= INLINE_MAX_STEPS
            )
        else:
            # a few forwards may run on the event loop; a longer burst goes to the worker, so
            # health checks and other sessions' calls are not held up for seconds
            run = self.mlx.run_round if steps <= INLINE_MAX_STEPS else self.mlx.run
            result = await run(
                self._verify_in_order, target, session, request.position, drafts, probs,
                parents, steps,
            )  # fmt: skip
        session.last_answer_s = self.load_stats.answered(len(result.committed), arrived,
                                                         result.compute_s)  # fmt: skip
        return verifier_pb2.VerifyResponse(
            committed_ids=result.committed,
            num_accepted=result.num_accepted,
            finished=result.finished,
            hidden_rows=_rows(result.rows),
            position=session.position,
            compute_s=result.compute_s,
            forward_share=result.share,
        )

    VerifyStream = stream_of(Verify)

    def _check_round(self, session: Session, position: int, drafts: int, steps: int = 1) -> None:
        # checked on the MLX thread, so two calls for one session cannot both pass
        if session.finished:
            raise FailedPrecondition("session is finished (EOS committed); close it")
        if position != session.position:
            raise FailedPrecondition(
                f"position {position} does not match the session's {session.position}; "
                "the caller is out of sync (retried or reordered call)"
            )
        if session.position + drafts > self.max_context:
            raise ResourceExhausted(f"context would exceed the limit of {self.max_context} tokens")
        self._check_pool_growth(session, max(drafts, steps) + 1)  # + 1: a queued look-ahead

    def _check_pool_growth(self, session: Session, tokens: int) -> None:
        """A pooled session's round that would grow the pool (every slot at once) past
        --max-kv-memory is refused; so is the round of a session on caches of its own, with
        others open, whose move into the pool (`engine.rounds_stream` moves it once its rounds
        have company) would pass the limit. The session keeps what it has committed."""
        pool, limit = self._ready().kv_pool, self.config.max_kv_bytes
        if pool is None or limit is None:
            return
        length = session.position + tokens
        if isinstance(session.cache[0], PooledCache):
            slots, own, what = pool.slots, 0, "this round would grow the KV pool"
        elif len(self.sessions) > 1 and all(type(c) is KVCache for c in session.cache):
            slots, own = pool.slots_with_one_more, sum(c.nbytes for c in session.cache)
            what = "moving this session into the KV pool beside the others would grow it"
        else:
            return  # alone, it keeps its own caches
        allocated = max(1, session.cache[0].keys.shape[2]) if own else 1
        held = pool.nbytes
        grown = pool.bytes_at(length, slots, token_bytes=own // allocated)
        if grown > held and self.kv_bytes() - held - own + grown > limit:
            raise ResourceExhausted(
                f"{what} from {_mib(held)} to {_mib(grown)} (its {slots} slots all to {length} "
                f"tokens), past the limit (--max-kv-memory) of {_mib(limit)}; close sessions, "
                "send fewer tokens a call or raise the limit"
            )

    def _plain_steps(self, session: Session, asked: int) -> int:
        """As many as fit in the context; at least one passed `_check_round`."""
        return min(max(asked, 1), self.max_context - session.position + 1)

    def _looks_ahead(self, session: Session, steps: int) -> bool:
        return self.look_ahead and session.position + steps < self.max_context

    def _rounds_many(self, items: list) -> list:
        """Rounds of the sessions waiting together: a result, or the error to answer with, for
        each `RoundAsked`; `_rounds_stream` with no more arriving."""
        answers: dict[int, object] = {}
        self._rounds_stream(items, list, lambda item, result: answers.setdefault(id(item), result))
        return [answers[id(item)] for item in items]

    def _rounds_stream(self, items: list, more, answer) -> None:
        """`_rounds_many` continuously (an MlxThread stream batch): each `RoundAsked` answered
        the step its round finishes, the rounds queued meanwhile joining the forwards
        (`engine.rounds_stream`). A second call for a session whose round is running waits
        until that round is answered, then joins as a new one."""
        later: list = []
        running: set[int] = set()  # sessions with a round in this stream
        items_of: dict[int, tuple] = {}  # id(Round) -> its item

        def rounds_of(new: list) -> list[Round]:
            rounds = []
            ready = [item for item in later if id(item[0]) not in running]
            later[:] = [item for item in later if id(item[0]) in running]
            for item in ready + new:
                if isinstance(item, PromptAsked):
                    try:
                        r = prompt_round(self._ready(), item.ask)
                    except Exception as exc:  # noqa: BLE001 - this prompt's error, not the batch's
                        answer(item, exc)
                        continue
                    items_of[id(r)] = item
                    rounds.append(r)
                    continue
                session, position, drafts, asked, probs, parents = item
                if id(session) in running:
                    later.append(item)
                    continue
                try:
                    self._check_round(session, position, len(drafts), asked)
                except ServiceError as exc:
                    answer(item, exc)
                    continue
                running.add(id(session))
                steps = 1 if drafts else self._plain_steps(session, asked)
                greedy_plain = not drafts and session.rng is None  # may queue its next forward
                ahead = greedy_plain and self._looks_ahead(session, steps)
                fits = greedy_plain and session.position + steps < self.max_context
                r = Round(session, drafts, steps, ahead, ahead_in_company=fits, draft_probs=probs,
                          parents=parents)  # fmt: skip
                items_of[id(r)] = item
                rounds.append(r)
            return rounds

        def answered(r: Round, result) -> None:
            running.discard(id(r.session))
            if isinstance(result, PrefillResult):
                if result.in_steps:
                    self.load_stats.opened_in_steps()
                else:  # run alone: nothing to share with
                    self.load_stats.prefilled(1, result.compute_s)
            if isinstance(result, TreeUnsupported):
                result = FailedPrecondition(f"{result}; draft chains instead")
            answer(items_of.pop(id(r)), result)

        rounds_stream(self._ready(), rounds_of(items), lambda: rounds_of(more()), answered,
                      self._stepped)  # fmt: skip
        if later:
            for item, result in zip(later, self._rounds_many(later), strict=True):
                answer(item, result)

    def _stepped(self, sessions: int) -> None:
        metrics.DECODE_BATCH.observe(sessions)
        self.load_stats.stepped(sessions)

    async def log_load_forever(self, log) -> None:
        """Every --log-stats seconds, a line of what the verifier did, when it did anything."""
        while True:
            await asyncio.sleep(self.config.log_stats_s)
            interval = self.load_stats.take()
            if interval.calls or interval.forwards or interval.prefill_jobs:
                log.info("%s", interval.line(len(self.sessions), self.kv_bytes()))
                prefixes = self.target.prefix_cache if self.target else None
                if prefixes is not None and interval.prefill_jobs:
                    log.info("%s", prefixes.summary())

    def _verify_in_order(
        self, target: Target, session: Session, position: int, drafts, probs, parents=None,
        plain_steps: int = 0,
    ):  # fmt: skip
        self._check_round(session, position, len(drafts), plain_steps)
        if plain_steps > 1 or (not drafts and parents is None and session.rng is None):
            steps = self._plain_steps(session, plain_steps)
            return decode(target, session, steps, look_ahead=self._looks_ahead(session, steps))
        if parents is None:
            return verify(target, session, drafts, probs)
        try:
            return verify_tree(target, session, drafts, parents)
        except TreeUnsupported as exc:
            raise FailedPrecondition(f"{exc}; draft chains instead") from None

    @rpc
    async def CloseSession(self, request, context):
        session = self.sessions.pop(request.session_id)
        self._rounds.forget(id(session))  # its rounds are not waited for any more
        target = self.target
        if target is not None and target.prefix_cache is not None:
            # on the MLX thread after any round of it queued there, and before any prompt
            # opened after this answer; not awaited: the caller's stream ends meanwhile
            with contextlib.suppress(RuntimeError):  # the MLX thread is shutting down
                kept = self.mlx.submit(target.keep_session, session)
                kept.add_done_callback(_log_failed_keep)
        return common_pb2.CloseSessionResponse()


def _log_failed_keep(kept) -> None:
    if not kept.cancelled() and kept.exception() is not None:
        log.error("keeping a closed session's KV for its next turn failed: %r", kept.exception())


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _rows(rows) -> common_pb2.Tensor | None:
    return wire.encode(rows) if rows is not None else None
