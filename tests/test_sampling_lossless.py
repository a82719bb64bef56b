"""Speculative sampling keeps the target's distribution: a Markov-chain target and drafter,
the emitted tokens' marginals at each position against the exact ones."""

import numpy as np
import pytest
from stats import chi_square

from verifier_svc.accept import Acceptance
from verifier_svc.sampling import SamplingConfig, accept_sampled, sample, target_distribution

V = 12
STEPS = 4  # positions checked after the context
SAMPLES = 6000


def markov(seed: int, concentration: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(V, concentration), size=V)  # [V, V], row = next-token dist


TARGET_LOGITS = np.log(markov(1, 0.6))
DRAFT = markov(2, 0.6)  # a drafter that disagrees with the target


def wrong_accept(draft_ids, draft_probs, target_row, rng, eos_ids):
    """Deliberately wrong: keeps every draft it could have proposed (q(x) > 0)."""
    committed = list(draft_ids)
    committed.append(int(rng.choice(V, p=target_row(len(draft_ids)))))
    return Acceptance(committed, len(draft_ids), False)


def run(accept, k: int, cfg: SamplingConfig, one_hot: bool, seed: int = 0) -> np.ndarray:
    """Emitted tokens [SAMPLES, STEPS], each sequence starting from context token 0."""
    rng = np.random.default_rng(seed)
    target = np.stack([target_distribution(row, cfg) for row in TARGET_LOGITS])
    out = np.zeros((SAMPLES, STEPS), dtype=np.int64)
    for n in range(SAMPLES):
        seq = [0]
        while len(seq) <= STEPS:
            drafts, q_rows, prev = [], [], seq[-1]
            for _ in range(k):
                q = DRAFT[prev]
                token = int(q.argmax()) if one_hot else int(rng.choice(V, p=q))
                drafts.append(token)
                q_rows.append(q)
                prev = token
            context = [seq[-1], *drafts]
            result = accept(
                drafts,
                None if one_hot else np.stack(q_rows),
                lambda i, c=context: target[c[i]],
                rng,
                (),
            )
            seq.extend(result.committed)
        out[n] = seq[1 : STEPS + 1]
    return out, target


def marginals(target: np.ndarray) -> list[np.ndarray]:
    dist, out = np.eye(V)[0], []
    for _ in range(STEPS):
        dist = dist @ target
        out.append(dist)
    return out


def worst_fit(tokens: np.ndarray, target: np.ndarray):
    fits = []
    for step, expected in enumerate(marginals(target)):
        observed = np.bincount(tokens[:, step], minlength=V)
        assert not observed[expected == 0].any(), "emitted a token the filters exclude"
        fits.append(chi_square(observed, expected))
    return max(fits, key=lambda f: f[0] / f[1])


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-probs", "one-hot"])
def test_lossless_distribution_matches_target(k, one_hot):
    tokens, target = run(accept_sampled, k, SamplingConfig(temperature=1.0), one_hot, seed=k)
    stat, crit, df = worst_fit(tokens, target)
    print(f"correct sampler k={k} one_hot={one_hot}: chi2 {stat:.1f} < {crit:.1f} (df {df})")
    assert stat < crit


def resample_from_p(draft_ids, draft_probs, target_row, rng, eos_ids):
    """Subtly wrong: the right acceptance test, but a rejected draft is replaced by a sample
    from p instead of from normalize(max(0, p - q))."""
    committed = []
    for i, token in enumerate(draft_ids):
        p = target_row(i)
        q = 1.0 if draft_probs is None else draft_probs[i, token]
        if rng.random() * q < p[token]:
            committed.append(token)
            continue
        committed.append(int(rng.choice(V, p=p)))
        return Acceptance(committed, i, False)
    committed.append(int(rng.choice(V, p=target_row(len(draft_ids)))))
    return Acceptance(committed, len(draft_ids), False)


@pytest.mark.parametrize("wrong", [wrong_accept, resample_from_p], ids=lambda f: f.__name__)
@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-probs", "one-hot"])
def test_lossless_check_rejects_a_wrong_sampler(one_hot, wrong):
    tokens, target = run(wrong, 3, SamplingConfig(temperature=1.0), one_hot)
    stat, crit, df = worst_fit(tokens, target)
    print(
        f"wrong sampler {wrong.__name__} one_hot={one_hot}: chi2 {stat:.1f} > {crit:.1f} (df {df})"
    )
    assert stat > crit


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(0.7, top_k=4),
        SamplingConfig(1.3, top_p=0.8),
        SamplingConfig(1.0, min_p=0.1),
        SamplingConfig(0.9, top_k=6, top_p=0.9, min_p=0.05),
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_lossless_distribution_with_filters(cfg):
    tokens, target = run(accept_sampled, 3, cfg, one_hot=False, seed=7)
    stat, crit, df = worst_fit(tokens, target)
    assert stat < crit


def test_distribution_filters_match_their_definitions():
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    kept = lambda cfg: set(np.flatnonzero(target_distribution(logits, cfg)))  # noqa: E731
    assert kept(SamplingConfig(1.0, top_k=2)) == {0, 1}
    assert kept(SamplingConfig(1.0, top_p=0.7)) == {0, 1, 2}  # 0.4 + 0.25 < 0.7
    assert kept(SamplingConfig(1.0, min_p=0.3)) == {0, 1, 2}  # >= 0.12
    p = target_distribution(logits, SamplingConfig(0.5))
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    assert np.allclose(p, expected)


def reference_distribution(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """The definition, over the whole vocabulary: log-softmax, the filters as mlx-lm applies
    them (top-p by a full stable sort), then the temperature over what is left."""
    logprobs = logits.astype(np.float64) - logits.max()
    logprobs -= np.log(np.exp(logprobs).sum())
    keep = np.ones(logprobs.shape, dtype=bool)
    if 0 < cfg.top_p < 1:
        order = np.argsort(-logprobs, kind="stable")
        probs = np.exp(logprobs[order])
        keep[order[np.cumsum(probs) - probs >= cfg.top_p]] = False
    if cfg.min_p > 0:
        keep &= logprobs >= logprobs.max() + np.log(cfg.min_p)
    if 0 < cfg.top_k < len(logprobs):  # ties in index order, as top-p's stable sort
        keep &= np.isin(np.arange(len(logprobs)), np.argsort(-logprobs, kind="stable")[: cfg.top_k])
    scaled = np.where(keep, logprobs / cfg.temperature, -np.inf)
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(0.7),
        SamplingConfig(1.3),
        SamplingConfig(0.7, top_p=0.9),
        SamplingConfig(1.0, top_p=0.999999),  # past what the likely tokens hold: every token sorted
        SamplingConfig(0.7, top_k=40),
        SamplingConfig(0.7, top_k=3000),  # more than lie near the top: the whole vocabulary
        SamplingConfig(0.7, min_p=0.02),
        SamplingConfig(0.8, top_k=100, top_p=0.95, min_p=0.001),
    ],
    ids=["temp", "hot", "top_p", "top_p_whole", "top_k", "top_k_whole", "min_p", "all"],
)
@pytest.mark.parametrize("spread", [1.0, 6.0], ids=["flat", "peaked"])
def test_a_large_vocabulary_keeps_the_definitions_distribution(cfg, spread):
    """The served shortcuts (shifted logits, top-p sorting only likely tokens, top-k among the
    tokens near the top) give the definition's distribution on a vocabulary of 50,000."""
    logits = np.random.default_rng(3).standard_normal(50_000).astype(np.float32) * spread
    got, want = target_distribution(logits, cfg), reference_distribution(logits, cfg)
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-300)


def test_top_p_ties_follow_the_vocabulary_order():
    """Tokens of equal probability at top-p's edge are taken in index order, as a full stable
    sort takes them."""
    # a thousand unlikely tokens, so that only the likely ones are sorted
    logits = np.log(np.array([0.05] * 10 + [0.3, 0.2] + [1e-6] * 1000))
    cfg = SamplingConfig(1.0, top_p=0.58)
    got = target_distribution(logits, cfg)
    assert set(np.flatnonzero(got)) == {10, 11, 0, 1}  # 0.3 + 0.2 + 0.05 < 0.58, then one more
    assert np.array_equal(got > 0, reference_distribution(logits, cfg) > 0)


def test_top_k_and_top_p_break_ties_alike_so_they_always_leave_a_token():
    """Tied at the top: top-k takes the lowest index, as top-p's stable order does, so their
    intersection is never empty (it was with an unordered partition: a NaN distribution)."""
    logits = np.round(np.random.default_rng(0).standard_normal(300))  # 219, 247, 270 tie
    p = target_distribution(logits, SamplingConfig(1.0, top_k=1, top_p=1e-9))
    assert np.flatnonzero(p).tolist() == [219] and p[219] == 1.0
    two = target_distribution(logits, SamplingConfig(1.0, top_k=2))
    assert np.flatnonzero(two).tolist() == [219, 247]


def test_random_logits_and_settings_match_the_definition():
    """Masked (-inf) tokens, ties, tiny and large temperatures, every filter and their mixes:
    the served distribution is the definition's, and a draw never takes a token it excludes."""
    rng = np.random.default_rng(1)
    for _ in range(400):
        size = int(rng.choice([5, 300, 5000]))
        logits = rng.standard_normal(size).astype(np.float32) * rng.choice([0.1, 1, 5, 30])
        if rng.random() < 0.3:
            logits[rng.random(size) < 0.3] = -np.inf
            logits[0] = 0.0  # at least one token left
        if rng.random() < 0.3:
            logits = np.round(logits)
        cfg = SamplingConfig(
            float(rng.choice([1e-4, 0.3, 1.0, 3.0, 50.0])),
            int(rng.choice([0, 1, 2, 50, size - 1, size])),
            float(rng.choice([0.0, 1e-9, 0.5, 0.9, 0.999999, 1.0])),
            float(rng.choice([0.0, 1e-6, 0.1, 1.0])),
        )
        got, want = target_distribution(logits, cfg), reference_distribution(logits, cfg)
        assert np.isfinite(got).all() and np.array_equal(got > 0, want > 0), cfg
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-300)
        assert got[sample(got, rng)] > 0


@pytest.mark.parametrize("size", [7, 256, 1000, 49_152])
def test_sample_draws_each_token_at_its_probability(size):
    """sample() sums in blocks: every vocabulary size, blocks whole or not, draws by p, even
    unnormalised, and never a token of probability 0."""
    rng = np.random.default_rng(size)
    p = rng.dirichlet(np.full(size, 0.3)) * 3.0
    p[rng.choice(size, size // 3, replace=False)] = 0.0
    likely = np.argsort(-p)[:6]  # the six likeliest, and all others as one
    draws = np.array([sample(p, rng) for _ in range(6000)])
    assert (p[draws] > 0).all()
    observed = [*(np.sum(draws == t) for t in likely), np.sum(~np.isin(draws, likely))]
    expected = [*(p[likely] / p.sum()), 1 - p[likely].sum() / p.sum()]
    stat, crit, _ = chi_square(np.array(observed), np.array(expected))
    assert stat < crit


def test_sample_past_its_blocks_running_sum_keeps_to_tokens_that_can_be_drawn():
    """A block's total (summed pairwise) can pass its running sum's end by a rounding; a draw
    in between lands on the block's last token of probability > 0, not on a 0 after it."""

    class Top:
        def random(self):
            return np.nextafter(1.0, 0.0)

    rng = np.random.default_rng(0)
    for _ in range(1000):  # a block whose pairwise total rounds above its running sum
        p = rng.random(256) * 10.0 ** rng.integers(-8, 1, 256)
        p[-20:] = 0.0
        if p.sum() * Top().random() > np.cumsum(p)[-1]:
            break
    else:
        pytest.fail("no block that rounds so was found")
    assert sample(p, Top()) == int(np.flatnonzero(p)[-1])
