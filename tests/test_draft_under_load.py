"""The coordinator's --draft-max-requests: under load an adapted request calls no drafter."""

import asyncio
from types import SimpleNamespace

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.servicer import CoordinatorServicer
from specd.service import ServiceError
from specd.v1 import common_pb2, coordinator_pb2, drafter_pb2

NGRAM = drafter_pb2.DrafterInfo(
    kind="ngram", default_draft_tokens=4, max_draft_tokens=16, text_driven=True
)


def servicer(limit: int) -> CoordinatorServicer:
    async def made() -> CoordinatorServicer:  # its clients' channels want an event loop
        return CoordinatorServicer(CoordinatorConfig(draft_max_requests=limit))

    s = asyncio.run(made())
    s.verifier_info = SimpleNamespace(max_draft_tokens=16)
    return s


def test_a_request_arriving_while_the_limit_runs_gets_no_drafter():
    s = servicer(2)
    request = coordinator_pb2.GenerateRequest(prompt="hi", max_tokens=10)
    s.running = 2  # as _generate counts: this request and one other
    plan = s._plan(request, NGRAM)
    assert plan.num_draft_tokens == 4 and plan.adaptive is not None
    assert not plan.under_load()
    s.running = 3  # and it stops drafting while more than the limit run
    assert plan.under_load()
    plan = s._plan(request, NGRAM)
    assert plan.num_draft_tokens == 0 and plan.adaptive is None  # no drafter session at all


def test_a_lone_request_drafts_with_a_limit_of_one():
    s = servicer(1)
    s.running = 1
    plan = s._plan(coordinator_pb2.GenerateRequest(prompt="hi", max_tokens=10), NGRAM)
    assert plan.num_draft_tokens == 4 and not plan.under_load()


@pytest.mark.parametrize("pinned", ["num_draft_tokens", "seed"])
def test_pinned_k_and_seeded_sampling_draft_whatever_the_load(pinned):
    """A pinned k is the caller's; a seeded sample must not depend on the load."""
    s = servicer(1)
    s.running = 5
    request = coordinator_pb2.GenerateRequest(prompt="hi", max_tokens=10)
    if pinned == "seed":
        request.sampling.temperature, request.sampling.seed = 0.7, 3
    else:
        request.num_draft_tokens = 3
    plan = s._plan(request, NGRAM)
    assert plan.num_draft_tokens > 0 and plan.under_load is None


def test_no_limit_drafts_under_any_load():
    s = servicer(0)
    s.running = 1000
    plan = s._plan(coordinator_pb2.GenerateRequest(prompt="hi", max_tokens=10), NGRAM)
    assert plan.num_draft_tokens == 4 and not plan.under_load()


def test_running_requests_are_counted_out_when_they_fail():
    s = servicer(2)  # no tokenizer yet: every request is refused

    async def refused():
        with pytest.raises(ServiceError):
            async for _ in s.generate(coordinator_pb2.GenerateRequest(prompt="hi")):
                pass
        return s.running

    assert asyncio.run(refused()) == 0


def test_the_limit_is_an_option_refusing_negatives(capsys):
    from specd.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "coordinator", "--draft-max-requests", "-1"])
    assert "--draft-max-requests" in capsys.readouterr().err


EAGLE3_TREES = drafter_pb2.DrafterInfo(
    kind="eagle3", default_draft_tokens=6, max_draft_tokens=16, drafts_trees=True,
    max_tree_tokens=64, default_tree=common_pb2.TreeShape(total_tokens=15, depth=5, top_k=4),
)  # fmt: skip


def test_trees_are_cut_at_prices_unless_a_seeded_sample_or_the_flag_says_no():
    """The cut follows measured timings: a seeded sample's trees stay whole, its draws the
    same whatever the timings."""
    s = servicer(0)
    s.running = 1
    adapted = s._plan(coordinator_pb2.GenerateRequest(prompt="hi", max_tokens=10), EAGLE3_TREES)
    assert adapted.tree_prices is adapted.adaptive.costs.verify
    request = coordinator_pb2.GenerateRequest(prompt="hi", max_tokens=10, num_draft_tokens=6)
    pinned = s._plan(request, EAGLE3_TREES)
    assert pinned.adaptive is None and pinned.tree_prices is s.costs.verify
    request.sampling.temperature, request.sampling.seed = 0.7, 3
    assert s._plan(request, EAGLE3_TREES).tree_prices is None
    assert s._plan(coordinator_pb2.GenerateRequest(prompt="hi"), NGRAM).tree_prices is None
    s.config.priced_tree_cut = False
    assert s._plan(coordinator_pb2.GenerateRequest(prompt="hi"), EAGLE3_TREES).tree_prices is None


def test_a_drafter_drafting_trees_gets_no_guesses_beside_bursts():
    """A guess made beside a decode burst is matched as a chain: a request whose drafter
    drafts trees (its default, or the request's shape) asks before each verify."""
    s = servicer(0)
    s.running = 1
    chains = coordinator_pb2.GenerateRequest(prompt="hi", max_tokens=10)
    assert s._plan(chains, NGRAM).draft_beside_decode
    assert not s._plan(chains, EAGLE3_TREES).draft_beside_decode
    request = coordinator_pb2.GenerateRequest(prompt="hi", max_tokens=10, num_draft_tokens=4)
    request.tree.CopyFrom(common_pb2.TreeShape(total_tokens=8, depth=4, top_k=2))
    assert not s._plan(request, EAGLE3_TREES).draft_beside_decode
