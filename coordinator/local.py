"""In-process ports: the same round loop with no gRPC, for tests and for measuring the split."""

from __future__ import annotations

import uuid

from coordinator.rounds import Drafted, Opened, Verified


class LocalVerifier:
    def __init__(self, target):
        from verifier_svc import engine  # only the in-process mode needs the engine

        self._engine = engine
        self.target = target
        self.sessions = {}

    async def open(self, prompt_ids, capture_layers, sampling) -> Opened:
        from verifier_svc.sampling import SamplingConfig

        config, seed = SamplingConfig(), None
        if sampling is not None:
            config = SamplingConfig.from_proto(sampling)
            seed = sampling.seed if sampling.HasField("seed") else None
        result = self._engine.prefill(
            self.target, list(prompt_ids), tuple(capture_layers), sampling=config, seed=seed
        )
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = result.session
        return Opened(
            session_id, result.first_token, result.session.finished, result.rows, result.compute_s
        )

    async def verify(
        self, session_id, position, draft_ids, draft_probs, draft_parents=None, plain_steps=0
    ) -> Verified:
        session = self.sessions[session_id]
        if position != session.position:
            raise RuntimeError(f"position {position} != session position {session.position}")
        if plain_steps > 1:
            r = self._engine.decode(self.target, session, plain_steps)
        elif draft_parents:
            r = self._engine.verify_tree(self.target, session, list(draft_ids), draft_parents)
        else:
            r = self._engine.verify(self.target, session, list(draft_ids), draft_probs)
        return Verified(r.committed, r.num_accepted, r.finished, r.rows, r.compute_s, r.share)

    async def close(self, session_id) -> None:
        self.sessions.pop(session_id, None)


class LocalDrafter:
    def __init__(self, proposer):
        self.proposer = proposer
        self.capture_layers = tuple(proposer.capture_layers)
        self.accepts_speculative_ids = proposer.accepts_speculative_ids
        self.sends_draft_probs = proposer.sends_draft_probs
        self.sessions = {}

    async def open(self, context_ids, rows) -> str:
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = self.proposer.open(list(context_ids), rows)
        return session_id

    async def draft(
        self, session_id, position, new_ids, rows, k, sampling, speculative_ids=(), tree=None
    ) -> Drafted:
        state = self.sessions[session_id]
        self.proposer.extend(state, list(new_ids), rows)
        p = self.proposer.propose(state, k, sampling, list(speculative_ids), tree)
        return Drafted(p.ids, p.probs, 0.0, p.parents, p.scores)

    async def close(self, session_id) -> None:
        self.sessions.pop(session_id, None)
