"""The verifier's warm-up: every round shape runs once, and nothing of it leaks into sessions."""

import pytest

from specd.models.load import load_target
from verifier_svc.engine import Target, decode, prefill
from verifier_svc.warmup import full_warmup, warm_up

PROMPT = [3, 40, 41, 42, 43, 40, 41, 42, 50, 60, 70]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return Target(load_target(str(tiny_model_dir), dtype="float32"))


def greedy(target, n=12):
    result = prefill(target, PROMPT)
    return [result.first_token, *decode(target, result.session, n).committed]


def test_full_warmup_runs_every_size_and_changes_no_output(target, monkeypatch):
    before = greedy(target)
    chains, trees = set(), set()
    real_forward, real_tree = Target.forward, Target.forward_tree

    def forward(self, token_ids, cache, capture=()):
        if self._sink.mask is None:
            chains.add(token_ids.size)
        return real_forward(self, token_ids, cache, capture)

    def forward_tree(self, token_ids, parents, cache, capture):
        trees.add(token_ids.size)
        return real_tree(self, token_ids, parents, cache, capture)

    monkeypatch.setattr(Target, "forward", forward)
    monkeypatch.setattr(Target, "forward_tree", forward_tree)
    calls = full_warmup(target, max_draft_tokens=5, long_context=80)
    monkeypatch.undo()
    assert calls > 0
    assert set(range(1, 7)) <= chains  # a verify of every size up to max_draft_tokens + 1
    assert target.supports_trees(target.new_cache())
    assert set(range(2, 7)) <= trees
    assert greedy(target) == before


def test_modes(target):
    assert warm_up(target, 4, "minimal").mode == "minimal"
    assert warm_up(target, 4, "auto").mode == "minimal"  # a CPU
    with pytest.raises(ValueError, match="unknown warm-up 'all'"):
        warm_up(target, 4, "all")


def test_the_flags_offer_the_modes_warm_up_takes():
    from specd.cli import build_parser
    from specd.models.load import WARMUP_MODES

    for service in ("verifier", "drafter"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", service, "--warmup", "all"])
        for mode in WARMUP_MODES:
            assert build_parser().parse_args(["serve", service, "--warmup", mode]).warmup == mode


def test_the_long_context_stays_inside_the_models_limit(target, monkeypatch):
    import verifier_svc.warmup as warmup

    prompts = []
    real_prefill = warmup.prefill

    def prefill(target, prompt_ids, *args, **kwargs):
        prompts.append(len(prompt_ids))
        return real_prefill(target, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(warmup, "prefill", prefill)
    monkeypatch.setattr(target.loaded, "max_context", 120)
    full_warmup(target, max_draft_tokens=5, long_context=2112)
    assert max(prompts) == 120 - 4 * 6 - 8
