"""Speculative sampling in forwards shared by many sessions keeps the target's distribution:
the token a verify commits first, for hundreds of seeded sessions verified together, against
the target's exact distribution."""

import mlx.core as mx
import numpy as np
from stats import chi_square

from specd.models.load import load_target
from tests.sessions import PROMPTS, SAMPLING, recorded_on
from verifier_svc.engine import Round, Target, prefill, rounds_many
from verifier_svc.sampling import target_distribution

SESSIONS = 600


def exact_second_token(model, prompt_ids) -> np.ndarray:
    """P(t2) = sum over t1 of p(t1 | prompt) p(t2 | prompt, t1): prefill samples t1, the
    verify commits t2 first."""
    last = np.array(model(mx.array([prompt_ids]))[0, -1], np.float64)
    p1 = target_distribution(last, SAMPLING)
    firsts = np.flatnonzero(p1 > 0)
    rows = np.array(model(mx.array([[*prompt_ids, int(t)] for t in firsts]))[:, -1], np.float64)
    return sum(
        p1[t] * target_distribution(row, SAMPLING) for t, row in zip(firsts, rows, strict=True)
    )


def test_sampled_verifies_in_shared_forwards_keep_the_target_distribution(
    tiny_model_dir, monkeypatch
):
    """Two prompts in turn, each session's first committed token against its own prompt's
    distribution: rows mixed up between the sessions of a forward would show."""
    target = Target(load_target(str(tiny_model_dir), dtype="float32"))  # the CPU kernels
    assert target.cpu_layers is not None
    prompts = [PROMPTS[2], PROMPTS[3]]
    expected = [exact_second_token(target.loaded.model, p) for p in prompts]
    vocab = target.identity.vocab_size
    # a drafter that half agrees: its rows half on the prompt's likeliest second token (then
    # on one other) and half uniform, each draft drawn from its row, so drafts are kept and
    # rejected both
    drafters = []
    for want in expected:
        probs = np.full((2, vocab), 0.5 / vocab)
        probs[[0, 1], [int(want.argmax()), 7]] += 0.5
        drafters.append(probs)
    draw = np.random.default_rng(0)
    rounds = []
    for n in range(SESSIONS):
        which = n % 2
        session = prefill(target, prompts[which], sampling=SAMPLING, seed=n).session
        drafts = [int(draw.choice(vocab, p=row)) for row in drafters[which]]
        rounds.append(Round(session, drafts, 1, draft_probs=drafters[which]))
    calls = recorded_on(monkeypatch, target.cpu_layers)
    results = rounds_many(target, rounds)
    sizes = [len(call) for call in calls]
    assert min(sizes) > 1 and sum(sizes) == SESSIONS  # every verify in a shared forward
    kept = np.array([r.num_accepted for r in results])
    assert 0.1 < (kept > 0).mean() < 0.9, "the drafts were all kept or all rejected"
    for which, want in enumerate(expected):
        firsts = [r.committed[0] for r in results[which::2]]
        observed = np.bincount(firsts, minlength=vocab)
        assert not observed[want == 0].any(), "a token outside the top-k was committed"
        stat, crit, df = chi_square(observed, want)
        print(f"prompt {which}: {len(firsts)} sessions, chi2 {stat:.1f} < {crit:.1f} (df {df})")
        assert stat < crit
