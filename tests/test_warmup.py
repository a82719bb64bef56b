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


def _config(model, **kw):
    from verifier_svc.config import VerifierConfig

    return VerifierConfig(model=model, dtype="float32", max_draft_tokens=3, **kw)


def test_separate_runs_the_full_warmup_in_a_child_and_a_few_rounds_here(tiny_model_dir, target):
    from verifier_svc.servicer import target_for
    from verifier_svc.warmup import resolve_mode, warm_up_served

    assert resolve_mode("auto") == "minimal" and resolve_mode("separate") == "separate"
    config = _config(str(tiny_model_dir), warmup="separate")
    loads = []

    def load():
        loads.append(1)
        return target_for(config)

    served, report = warm_up_served(config, load)
    assert report.mode == "separate" and loads == [1]  # loaded here once, after the child
    # the child's whole warm-up, then a prefill, a burst, two verifies and trees of 2-4 here
    assert report.calls == full_warmup(target, 3) + 7 + 3
    assert greedy(served) == greedy(target)


def test_a_failed_separate_warmup_still_serves(tiny_model_dir, caplog):
    from verifier_svc.servicer import target_for
    from verifier_svc.warmup import warm_up_served

    # the child cannot load this model; the service loads the real one and goes on
    config = _config(str(tiny_model_dir / "missing"), warmup="separate")
    served, report = warm_up_served(config, lambda: target_for(_config(str(tiny_model_dir))))
    assert report.mode == "separate" and report.calls == 7 + 3  # trees of 2-4 nodes here too
    assert "separate process failed" in caplog.text
    assert len(greedy(served)) == 13


def test_the_serving_process_meets_a_prompt_and_a_served_burst(target, monkeypatch):
    """Each process loads a shape class's kernels at its first use: the serving process runs
    a prompt of a typical length and a look-ahead burst itself, not only a 3-token round."""
    from verifier_svc import warmup

    prompts, bursts = [], []
    real_prefill, real_decode = warmup.prefill, warmup.decode
    sampled = []
    monkeypatch.setattr(
        warmup,
        "prefill",
        lambda t, ids, *a, **k: (
            prompts.append(len(ids))
            or sampled.append(not k.get("sampling", warmup.SamplingConfig()).greedy)
            or real_prefill(t, ids, *a, **k)
        ),
    )
    monkeypatch.setattr(
        warmup, "decode", lambda t, s, n, **k: bursts.append((n, k)) or real_decode(t, s, n, **k)
    )
    assert warmup.serving_warmup(target) == 7
    assert 64 in prompts and (4, {"look_ahead": True}) in bursts
    assert any(sampled)  # a sampled prompt and step: a GPU's draws load their kernels here


def test_the_serving_process_draws_as_a_gpu_serves(target, monkeypatch):
    from verifier_svc import engine, warmup

    monkeypatch.setattr(engine, "_on_gpu", lambda: True)
    draws, draw = [], engine.draw
    monkeypatch.setattr(engine, "draw", lambda rows, *a: draws.append(len(rows)) or draw(rows, *a))
    warmup.serving_warmup(target)
    assert len(draws) >= 3  # the prompt's first token and two steps


def test_the_serving_process_meets_a_branching_tree_of_every_size(target, monkeypatch):
    """A compiled tree forward traces per node count in its own process: the serving process
    runs every size a round can send, each branching at its root."""
    from verifier_svc import warmup

    trees, real_verify_tree = [], warmup.verify_tree

    def recording(t, session, drafts, parents):
        trees.append(list(parents))
        return real_verify_tree(t, session, drafts, parents)

    monkeypatch.setattr(warmup, "verify_tree", recording)
    assert warmup.serving_warmup(target, 4) == 7 + 4
    assert [len(parents) + 1 for parents in trees] == [2, 3, 4, 5]
    assert all(parents[:2] == [-1, -1] for parents in trees[1:])


class _ExitsWhereUnpickled:
    """Stands in for a configuration; the child that unpickles it dies at once, as one killed
    for memory would."""

    def __reduce__(self):
        import os

        return os._exit, (9,)


def test_a_separate_warmup_child_killed_outright_does_not_hang_the_service(caplog):
    from verifier_svc.warmup import full_warmup_in_child

    assert full_warmup_in_child(_ExitsWhereUnpickled()) is None
    assert "separate process failed" in caplog.text
