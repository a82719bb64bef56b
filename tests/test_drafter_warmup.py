"""A model drafter's warm-up: every draft shape once, and the session it used is not kept."""

import pytest
from tiny import make_tiny_dflash_dir, make_tiny_eagle3_dir

from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.server import make_proposer
from drafter_svc.warmup import _row_width, full_warmup, warm_up_drafter

CONTEXT = [3, 40, 41, 42, 43, 40, 41, 42, 50, 60, 70]


def _proposer(kind, weights, target, **options):
    config = DrafterConfig(**drafter_options(kind, weights=weights, **options), target=target)
    return make_proposer(config)


@pytest.fixture(scope="module", params=["eagle3", "eagle3-tree", "dflash"])
def proposer(request, tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("drafter") / "d"
    if request.param == "dflash":
        weights = make_tiny_dflash_dir(folder, tiny_model_dir)
        return _proposer("dflash", weights, str(tiny_model_dir))
    head = make_tiny_eagle3_dir(folder, tiny_model_dir)
    tree = {"tree_total_tokens": 6} if request.param == "eagle3-tree" else {}
    return _proposer("eagle3", head, str(tiny_model_dir), num_draft_tokens=3, **tree)


def test_full_warmup_meets_every_k_and_leaves_drafting_unchanged(proposer, monkeypatch):
    import mlx.core as mx

    rows = mx.ones((len(CONTEXT) - 1, _row_width(proposer)), dtype=mx.float16)
    before = proposer.propose(proposer.open(CONTEXT, rows), 3).ids
    asked = []
    real = type(proposer).propose

    def propose(self, state, k, sampling=None, speculative=(), tree=None):
        asked.append((k, len(speculative), None if tree is None else tree.total_tokens))
        return real(self, state, k, sampling, speculative, tree)

    monkeypatch.setattr(type(proposer), "propose", propose)
    calls = full_warmup(proposer, vocab_size=64, contexts=(12, 40))
    monkeypatch.undo()
    assert calls == len(asked)
    assert {k for k, _, _ in asked} >= set(range(1, proposer.max_draft_tokens + 1))
    if proposer.accepts_speculative_ids:
        assert {s for _, s, _ in asked} >= set(range(1, proposer.max_draft_tokens + 1))
    shape = getattr(proposer, "default_tree", None)
    if shape is not None and shape.total_tokens > 1:
        assert {t for _, _, t in asked} >= set(range(2, shape.total_tokens + 1))
    assert proposer.propose(proposer.open(CONTEXT, rows), 3).ids == before


def test_modes(proposer):
    assert warm_up_drafter(proposer, 64, "minimal") == ("minimal", 0, 0.0)
    assert warm_up_drafter(proposer, 64, "auto")[0] == "minimal"  # a CPU
    with pytest.raises(ValueError, match="unknown warm-up"):
        warm_up_drafter(proposer, 64, "everything")
