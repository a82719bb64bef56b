"""Sampling through the real services on a tiny random target: the distribution of generated
tokens with speculation equals the target's, and seeds reproduce."""

import mlx.core as mx
import numpy as np
import pytest
from stats import chi_square

from specd.client import CoordinatorClient, make_request
from specd.launch import Stack
from specd.models.load import load_target
from verifier_svc.sampling import SamplingConfig, target_distribution

# every printable byte twice: whatever the first token is, the n-gram drafter finds it earlier
PROMPT = "".join(map(chr, range(33, 127))) * 2
SAMPLING = SamplingConfig(temperature=1.5, top_k=40)
REQUESTS = 800


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with Stack(
        target=str(tiny_model_dir),
        drafter="ngram",
        drafter_args=["--ngram-min-n", "1"],
        log_dir=tmp_path_factory.mktemp("logs"),
    ) as s:
        yield s


def exact_second_token_distribution(model, prompt_ids):
    """P(t2) = sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), from full forwards."""
    last = np.array(model(mx.array([prompt_ids]))[0, -1], np.float64)
    p1 = target_distribution(last, SAMPLING)
    firsts = np.flatnonzero(p1 > 0)
    batch = mx.array([[*prompt_ids, int(t)] for t in firsts])
    rows = np.array(model(batch)[:, -1], np.float64)
    return sum(
        p1[t] * target_distribution(row, SAMPLING) for t, row in zip(firsts, rows, strict=True)
    )


def sample_many(client, prompt_ids, n, **kw):
    tokens, drafted = [], 0
    for seed in range(n):
        r = client.generate(
            make_request(
                prompt_ids=prompt_ids,
                max_tokens=4,
                temperature=SAMPLING.temperature,
                top_k=SAMPLING.top_k,
                seed=seed,
                **kw,
            )
        )
        tokens.append(r.token_ids)
        drafted += r.stats["drafted"]
    return tokens, drafted


def test_distribution_of_speculative_tokens_matches_target(stack, tiny_model_dir):
    target = load_target(str(tiny_model_dir), "float32")
    prompt_ids = target.tokenizer.encode(PROMPT)
    expected = exact_second_token_distribution(target.model, prompt_ids)
    client = CoordinatorClient(stack.coordinator)
    tokens, drafted = sample_many(client, prompt_ids, REQUESTS, num_draft_tokens=4)
    client.close()
    assert drafted > REQUESTS // 4, "the drafter barely took part; the test would prove little"
    # token 2 comes out of the first verify round, where drafts were accepted or rejected
    second = np.array([t[1] for t in tokens if len(t) > 1])
    observed = np.bincount(second, minlength=len(expected))
    assert not observed[expected == 0].any(), "a token outside top-k was emitted"
    stat, crit, df = chi_square(observed, expected)
    print(f"through services: {len(second)} samples, chi2 {stat:.1f} < {crit:.1f} (df {df})")
    assert stat < crit


def test_lossless_seed_reproducibility_through_stack(stack, tiny_model_dir):
    client = CoordinatorClient(stack.coordinator)
    request = dict(prompt=PROMPT, max_tokens=24, temperature=1.0)
    first = client.generate(make_request(seed=123, **request)).token_ids
    again = client.generate(make_request(seed=123, **request)).token_ids
    others = {tuple(client.generate(make_request(seed=s, **request)).token_ids) for s in range(5)}
    client.close()
    assert first == again
    assert len(others) > 1
