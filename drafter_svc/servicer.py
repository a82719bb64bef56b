"""gRPC adapter for the proposers."""

from __future__ import annotations

import time
from dataclasses import dataclass

from drafter_svc.proposal import Proposer, TreeShape
from specd import wire
from specd.service import (
    FailedPrecondition,
    InvalidArgument,
    MlxThread,
    ResourceExhausted,
    SessionTable,
    check_token_ids,
    check_tree_request,
    process_stats,
    rpc,
    stream_of,
)
from specd.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc


@dataclass
class DraftSession:
    state: object  # the proposer's own per-session state: accepted context only
    position: int  # context length the state covers


def _rows(tensor):
    """Hidden rows as numpy: a proposer that drafts on the host never touches the device."""
    return None if wire.is_empty(tensor) else wire.decode_numpy(tensor, ndim=2)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(
        self,
        proposer,
        config,
        mlx_thread: MlxThread,
        target_fingerprint: str = "",
        vocab_size: int = 0,
    ):
        self.proposer = proposer
        self.config = config
        self.mlx = mlx_thread
        self.target_fingerprint = target_fingerprint
        self.vocab_size = vocab_size
        self.sessions = SessionTable(
            config.max_sessions, config.session_idle_timeout_s, "drafter session"
        )

    def _check_ids(self, ids, what: str) -> list[int]:
        return check_token_ids(ids, self.vocab_size or 2**31 - 1, what)

    @rpc
    async def GetInfo(self, request, context):
        proposer = self.proposer
        return drafter_pb2.DrafterInfo(
            kind=proposer.kind,
            target_fingerprint=self.target_fingerprint,
            capture_layers=proposer.capture_layers,
            default_draft_tokens=proposer.default_draft_tokens,
            max_draft_tokens=proposer.max_draft_tokens,
            sends_draft_probs=self.proposer.sends_draft_probs,
            process=process_stats(len(self.sessions)),
            params=self.proposer.params(),
            vocab_size=self.vocab_size,
            accepts_speculative_ids=proposer.accepts_speculative_ids,
            default_tree=_tree_proto(proposer.default_tree),
            drafts_trees=_drafts_trees(proposer),
            max_tree_tokens=self.config.max_tree_tokens if _drafts_trees(proposer) else 0,
            text_driven=proposer.text_driven,
        )

    @rpc
    async def OpenSession(self, request, context):
        context_ids = self._check_ids(request.context_ids, "context_ids")
        if not context_ids:
            raise InvalidArgument("context_ids is empty; send the prompt and the first token")
        if len(context_ids) > self.config.max_context:
            raise ResourceExhausted(
                f"context of {len(context_ids)} tokens exceeds the drafter's "
                f"limit {self.config.max_context}"
            )
        self.sessions.ensure_room()
        rows = _rows(request.hidden_rows)
        if self.proposer.capture_layers and len(context_ids) > 1 and rows is None:
            raise InvalidArgument(
                f"the {self.proposer.kind} drafter needs hidden_rows of target layers "
                f"{list(self.proposer.capture_layers)} for the context positions"
            )
        try:
            state = await self.mlx.run(self.proposer.open, context_ids, rows)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        session_id = self.sessions.add(DraftSession(state, len(context_ids)))
        return drafter_pb2.DraftOpenResponse(session_id=session_id)

    @rpc
    async def Draft(self, request, context):
        session = self.sessions.get(request.session_id)
        new_ids = self._check_ids(request.new_ids, "new_ids")
        k = request.num_draft_tokens or self.proposer.default_draft_tokens
        if not 0 < k <= self.proposer.max_draft_tokens:
            raise InvalidArgument(
                f"num_draft_tokens {request.num_draft_tokens} must be in "
                f"[0, {self.proposer.max_draft_tokens}] (0: the default)"
            )
        if request.position != session.position + len(new_ids):
            raise FailedPrecondition(
                f"position {request.position} != {session.position} + {len(new_ids)} new ids; "
                "re-open the session from the committed tokens"
            )
        if request.position > self.config.max_context:
            raise ResourceExhausted(
                f"context exceeds the drafter's limit {self.config.max_context}"
            )
        speculative = self._check_ids(request.speculative_ids, "speculative_ids")
        if speculative and not self.proposer.accepts_speculative_ids:
            raise InvalidArgument(
                f"the {self.proposer.kind} drafter cannot draft past "
                "uncommitted tokens; send no speculative_ids"
            )
        if len(speculative) > self.proposer.max_draft_tokens:
            raise InvalidArgument(
                f"{len(speculative)} speculative_ids; at most "
                f"{self.proposer.max_draft_tokens} (the drafter's --max-draft-tokens)"
            )
        tree = self._tree_shape(request)
        rows = _rows(request.hidden_rows)
        if self.proposer.capture_layers and new_ids and rows is None:
            raise InvalidArgument(
                f"the {self.proposer.kind} drafter needs hidden_rows of target layers "
                f"{list(self.proposer.capture_layers)} for the positions verified since the "
                "last call"
            )
        start = time.perf_counter()
        try:
            proposal = await self.mlx.run_round(
                self._extend_and_propose, session, new_ids, rows, k, request.sampling,
                speculative, tree,
            )  # fmt: skip
        except ValueError as exc:  # rows of the wrong width or count
            raise InvalidArgument(str(exc)) from None
        return drafter_pb2.DraftResponse(
            draft_ids=proposal.ids,
            draft_probs=wire.encode(proposal.probs) if proposal.probs is not None else None,
            compute_s=time.perf_counter() - start,
            draft_parents=proposal.parents or (),
            draft_scores=proposal.scores or (),
        )

    DraftStream = stream_of(Draft)

    def _tree_shape(self, request):
        """None: the proposer's default; a TreeShape (total 0 = a chain) when asked."""
        if not request.HasField("tree"):
            return None
        t = request.tree
        drafts_trees = _drafts_trees(self.proposer)
        check_tree_request(t, self.proposer.kind, drafts_trees, self.config.max_tree_tokens)
        return TreeShape(t.total_tokens, t.depth, t.top_k)

    def _extend_and_propose(
        self, session: DraftSession, new_ids, rows, k, sampling, speculative=(), tree=None
    ):
        self.proposer.extend(session.state, new_ids, rows)
        session.position += len(new_ids)
        return self.proposer.propose(session.state, k, sampling, speculative, tree)

    @rpc
    async def CloseSession(self, request, context):
        self.sessions.pop(request.session_id)
        return common_pb2.CloseSessionResponse()


def _drafts_trees(proposer: Proposer) -> bool:
    return proposer.default_tree is not None


def _tree_proto(shape) -> common_pb2.TreeShape | None:
    # sent with total 0 too: trees a request asks of a chain-default drafter take its depth and
    # fan-out
    if shape is None:
        return None
    return common_pb2.TreeShape(
        total_tokens=shape.total_tokens, depth=shape.depth, top_k=shape.top_k
    )
