"""Client-facing Generate: tokenize, run rounds, detokenize, stream."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import grpc

from coordinator.adaptive import AdaptiveK, SpeculationCosts, TreeLimits
from coordinator.clients import DrafterClient, UpstreamError, VerifierClient
from coordinator.config import CoordinatorConfig
from coordinator.failover import VerifierPool
from coordinator.pairing import pairing_error
from coordinator.rounds import Plan, RoundStats, rounds_ahead, run_rounds
from coordinator.text import TextStream
from coordinator.tokenizer import load_served_tokenizer
from specd import metrics
from specd.prompts import encode_chat, encode_text
from specd.service import (
    FailedPrecondition,
    InvalidArgument,
    ServiceError,
    Unavailable,
    check_sampling_params,
    check_tree_request,
    process_stats,
    rpc,
    rpc_stream,
)
from specd.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("specd.coordinator")


def stats_message(stats: RoundStats) -> coordinator_pb2.GenerateStats:
    return coordinator_pb2.GenerateStats(
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        rounds=stats.rounds,
        drafted=stats.drafted,
        accepted=stats.accepted,
        tau=stats.tau,
        prefill_s=stats.prefill_s,
        draft_s=stats.draft_s,
        verify_s=stats.verify_s,
        coordinator_s=stats.coordinator_s,
        total_s=stats.total_s,
        verify_compute_s=stats.verify_compute_s,
        draft_compute_s=stats.draft_compute_s,
        drafter_failed=stats.drafter_failed,
        predrafted_rounds=stats.predrafted_rounds,
        round_overhead_median_s=stats.overhead_median_s,
        draft_calls=stats.draft_calls,
        beside_calls=stats.beside_calls,
        verify_calls=stats.verify_calls,
        forward_sessions=stats.forward_sessions,
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorConfig):
        self.config = config
        clients = [
            VerifierClient(
                address, config.verify_timeout_s, config.prefill_timeout_s, config.upstream
            )
            for address in config.verifier_addresses
        ]
        self.verifier = VerifierPool(clients, recovery_timeout_s=config.verifier_recovery_s)
        self.drafter = (
            DrafterClient(config.drafter, config.draft_timeout_s, config.upstream)
            if config.drafter
            else None
        )
        self.tokenizer = None
        self.verifier_info = None
        self.drafter_info = None
        self.pairing_error = ""
        self.costs = SpeculationCosts()  # learned across requests: one verifier, one drafter
        self.running = 0  # requests generating now
        self.on_ready = None  # async callback: the coordinator can serve (health SERVING)

    async def connect(self) -> bool:
        """Wait for a verifier, fetch the tokenizer, and pair with the drafter if it is up."""
        deadline = asyncio.get_running_loop().time() + self.config.connect_timeout_s
        next_note = 0.0
        while self.verifier_info is None:
            for index, client in enumerate(self.verifier.clients):
                try:
                    self.verifier_info = await client.info()
                    self.verifier.preferred = index
                    break
                except UpstreamError as err:
                    if err.code != grpc.StatusCode.UNAVAILABLE:
                        raise
            else:
                now = asyncio.get_running_loop().time()
                if now > deadline:
                    raise TimeoutError(
                        f"no verifier at {self.config.verifier} answered within "
                        f"{self.config.connect_timeout_s:.0f}s"
                    )
                if now >= next_note:  # a wrong address should not look like a slow start
                    log.info("waiting for a verifier at %s", self.config.verifier)
                    next_note = now + 30
                await asyncio.sleep(0.5)
        self.verifier.fingerprint = self.verifier_info.model.fingerprint
        files = await self.verifier.clients[self.verifier.preferred].tokenizer_files()
        self.tokenizer = load_served_tokenizer(
            files, self.verifier_info.model, self.config.cache_dir
        )
        # give a drafter started alongside a moment to come up; then serve without it
        deadline = asyncio.get_running_loop().time() + self.config.drafter_wait_s
        while (
            not await self._pair_drafter()
            and self.drafter is not None
            and not self.pairing_error
            and asyncio.get_running_loop().time() < deadline
        ):
            await asyncio.sleep(0.5)
        return not self.pairing_error

    async def _pair_drafter(self) -> bool:
        """Fetch the drafter's info and check it can serve this target; False if not usable."""
        if self.drafter is None:
            return False
        if self.drafter_info is None:
            try:
                self.drafter_info = await self.drafter.info()
            except UpstreamError as err:
                log.warning(
                    "drafter %s not reachable (%s); drafting off until it is",
                    self.drafter.address,
                    err.message,
                )
                return False
            self.pairing_error = pairing_error(self.verifier_info, self.drafter_info)
            if self.pairing_error:
                log.error("refusing to pair: %s", self.pairing_error)
        return not self.pairing_error

    def _prompt_ids(self, request) -> list[int]:
        which = request.WhichOneof("input")
        if which == "prompt":
            ids = encode_text(self.tokenizer, request.prompt)
        elif which == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise InvalidArgument("chat has no messages")
            try:
                ids = encode_chat(self.tokenizer, messages)
            except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
                raise InvalidArgument(f"chat template failed: {exc}") from None
        elif which == "prompt_ids":
            ids = list(request.prompt_ids.ids)
        else:
            raise InvalidArgument("set one of prompt, chat or prompt_ids")
        if not ids:
            raise InvalidArgument("the prompt is empty")
        return ids

    def _plan(self, request, drafter_info) -> Plan:
        max_tokens = request.max_tokens or self.config.default_max_tokens
        if max_tokens < 0:
            raise InvalidArgument(f"max_tokens must be positive, got {request.max_tokens}")
        sampling = request.sampling
        check_sampling_params(sampling)
        pinned = request.HasField("num_draft_tokens")
        if pinned and request.num_draft_tokens < 0:
            raise InvalidArgument(f"num_draft_tokens must be >= 0, got {request.num_draft_tokens}")
        info = drafter_info
        if info is None:  # no drafter, or it is down: plain decoding through the verifier
            return Plan(max_tokens, 0, sampling, decode_burst=self._decode_burst())
        k = request.num_draft_tokens if pinned else info.default_draft_tokens
        if k > info.max_draft_tokens:
            raise InvalidArgument(f"num_draft_tokens {k} must be in [0, {info.max_draft_tokens}]")
        # k follows measured timings, so a seeded sampling request keeps k fixed: the same
        # seed must give the same output
        seeded = sampling.temperature > 0 and sampling.HasField("seed")
        tree = request.tree if request.HasField("tree") else None
        if tree is not None:
            check_tree_request(tree, info.kind, info.drafts_trees, info.max_tree_tokens)
        shape = tree if tree is not None else info.default_tree
        adaptive = None
        if self.config.adaptive and k > 0 and not pinned and not seeded:
            if self._under_load():  # drafting off's rounds: no drafter session at all
                return Plan(max_tokens, 0, sampling, decode_burst=self._decode_burst())
            default_top_k = info.default_tree.top_k if info.HasField("default_tree") else 0
            limits = TreeLimits.of(shape, default_top_k)
            adaptive = AdaptiveK.for_session(self.costs, k, text_driven=info.text_driven,
                                             tree=limits)  # fmt: skip
        overlap = self.config.overlap_drafting and info.accepts_speculative_ids
        # pinned trees are cut at the prices the rounds measure; a seeded sample's are not, as
        # its draws must not follow timings
        tree_prices = None
        if self.config.priced_tree_cut and not seeded and TreeLimits.of(shape) is not None:
            tree_prices = self.costs.verify if adaptive is None else adaptive.costs.verify
        return Plan(
            max_tokens=max_tokens,
            num_draft_tokens=k,
            sampling=sampling,
            adaptive=adaptive,
            overlap=overlap,
            tree=tree,
            decode_burst=self._decode_burst(),
            # a guess beside a burst is matched as a chain: a tree drafter drafts before its
            # verify whatever its last answer was
            draft_beside_decode=self.config.draft_beside_decode and TreeLimits.of(shape) is None,
            tree_prices=tree_prices,
            under_load=self._under_load if adaptive is not None else None,
        )

    def _under_load(self) -> bool:
        """More requests run than --draft-max-requests (this one among them)."""
        limit = self.config.draft_max_requests
        return limit > 0 and self.running > limit

    def _decode_burst(self) -> int:
        # the verifier refuses more plain steps per call than drafts per call
        return max(1, min(self.config.decode_burst, self.verifier_info.max_draft_tokens))

    def _check_ready(self) -> None:
        if self.pairing_error:
            raise FailedPrecondition(self.pairing_error)
        if self.tokenizer is None:
            raise Unavailable("the coordinator is still connecting to its verifier")

    async def _info(self) -> coordinator_pb2.CoordinatorInfo:
        if self.verifier_info is not None:
            await self._pair_drafter()  # report the pairing as it is now
        info = coordinator_pb2.CoordinatorInfo(
            pairing_error=self.pairing_error,
            process=process_stats(),
            verifier_address=self.verifier.address,
            drafter_address=self.drafter.address if self.drafter else "",
        )
        info.verifier.CopyFrom(await self.verifier.info())
        if self.drafter is not None:
            info.drafter.CopyFrom(await self.drafter.info())
        return info

    @rpc
    async def GetInfo(self, request, context):
        return await self._info()

    @rpc
    async def SetDrafter(self, request, context):
        address = request.address.strip()
        if not address:
            raise InvalidArgument("address is empty: give the drafter's host:port, or 'none'")
        drafter, info = None, None
        if address != "none":
            drafter = DrafterClient(address, self.config.draft_timeout_s, self.config.upstream)
            try:
                info = await drafter.info()
            except UpstreamError as err:
                raise FailedPrecondition(
                    f"drafter {address} did not answer: {err.message}"
                ) from None
            error = pairing_error(self.verifier_info, info)
            if error:
                raise FailedPrecondition(error)
        # requests in flight keep the client they started with
        self.drafter, self.drafter_info, self.pairing_error = drafter, info, ""
        self.costs = SpeculationCosts()  # another drafter, other costs
        log.info("drafter set to %s (%s)", address, info.kind if info else "no drafting")
        if self.on_ready is not None:
            await self.on_ready()
        return await self._info()

    @rpc_stream
    async def Generate(self, request, context):
        async with aclosing(self.generate(request)) as messages:
            async for message in messages:
                yield message

    async def generate(self, request):
        """Stream GenerateResponse messages for a GenerateRequest (gRPC and HTTP share it).
        Closing it closes the generation's sessions at once."""
        finished = False
        try:
            async with aclosing(self._generate(request)) as messages:
                async for message in messages:
                    finished = bool(message.finish_reason)
                    yield message
        except ServiceError as err:
            metrics.REQUESTS.labels(err.code.name).inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            if not finished:
                metrics.REQUESTS.labels("cancelled").inc()
            raise

    async def _generate(self, request):
        self.running += 1
        try:
            async with aclosing(self._generate_counted(request)) as messages:
                async for message in messages:
                    yield message
        finally:
            self.running -= 1

    async def _generate_counted(self, request):
        self._check_ready()
        prompt_ids = self._prompt_ids(request)
        usable = await self._pair_drafter()
        self._check_ready()  # the drafter may just have turned out to be for another target
        drafter, drafter_info = self.drafter, self.drafter_info  # a swap now won't touch us
        plan = self._plan(request, drafter_info if usable else None)
        limit = self.verifier_info.max_context
        if len(prompt_ids) >= limit:
            raise InvalidArgument(
                f"the prompt is {len(prompt_ids)} tokens; the verifier's context limit is "
                f"{limit} tokens, with room for the reply: shorten the prompt"
            )
        if len(prompt_ids) + plan.max_tokens > limit:
            raise InvalidArgument(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({plan.max_tokens}) exceeds the "
                f"verifier's context limit of {limit} tokens; lower max_tokens to at most "
                f"{limit - len(prompt_ids)}"
            )
        text = TextStream(self.tokenizer.detokenizer, list(request.stop))
        eos_ids = set(self.verifier_info.model.eos_token_ids)
        stats, last = RoundStats(), None
        drafter = drafter if plan.num_draft_tokens > 0 else None
        rounds = rounds_ahead(run_rounds(self.verifier, drafter, prompt_ids, plan, stats))
        async with aclosing(rounds):
            async for new_ids, _finished in rounds:
                out = []
                for token in new_ids:
                    out.append(token)
                    last = token
                    if token in eos_ids or text.add(token):
                        break
                yield coordinator_pb2.GenerateResponse(text=text.take(), token_ids=out)
                if text.stopped:
                    break
        if stats.drafter_failed and drafter is self.drafter:
            self.drafter_info = None  # it may come back as another drafter: pair again
        reason = "stop" if text.stopped else "eos" if last in eos_ids else "length"
        metrics.observe_request(stats, reason)
        yield coordinator_pb2.GenerateResponse(
            text=text.finish(), finish_reason=reason, stats=stats_message(stats)
        )
