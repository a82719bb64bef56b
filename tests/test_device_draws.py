"""Draws on the device for sampled sessions' plain steps (`verifier_svc.device_draws`): the
host's draw (`sampling.sample` on `target_distribution`) from the same uniforms, up to a
running sum's rounding at a boundary."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from verifier_svc.device_draws import draw, drawable_on_device
from verifier_svc.sampling import SamplingConfig, sample, target_distribution


class _Uniform:
    """A generator whose next draw is the given uniform, as `sample` takes one."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


def test_device_draws_are_the_hosts_from_the_same_uniforms():
    rng = np.random.default_rng(0)
    vocab, draws = 3000, 2000
    for temperature in (0.5, 1.0, 1.7):
        logits = (3.0 * rng.standard_normal(vocab)).astype(np.float32)
        uniforms = rng.random(draws).astype(np.float32)
        got = np.array(
            draw(
                mx.array(np.broadcast_to(logits, (draws, vocab))),
                mx.full((draws,), temperature, dtype=mx.float32),
                mx.array(uniforms),
            )
        )
        p = target_distribution(logits, SamplingConfig(temperature))
        want = np.array([sample(p, _Uniform(float(u))) for u in uniforms])
        differ = np.flatnonzero(got != want)
        assert len(differ) <= draws // 500  # only at boundaries of the running sum
        for i in differ:  # neighbours: no probability between the two tokens
            low, high = sorted((got[i], want[i]))
            assert p[low + 1 : high].sum() < 1e-5
        # the draws follow p: the likeliest tokens come about as often as p says
        top = int(np.argmax(p))
        assert abs(np.mean(got == top) - p[top]) < 4 * np.sqrt(p[top] / draws) + 1e-3


def test_a_device_draw_never_takes_a_token_of_probability_zero():
    logits = np.zeros(64, dtype=np.float32)
    logits[5] = logits[9] = 50.0  # at temperature 0.1 every other token underflows to 0
    rows = mx.array(np.broadcast_to(logits, (4, 64)))
    # 1.0: a uniform whose product with the total rounds up to it, passing every sum
    uniforms = mx.array([0.0, 0.4999, 0.75, 1.0], dtype=mx.float32)
    got = np.array(draw(rows, mx.full((4,), 0.1, dtype=mx.float32), uniforms)).tolist()
    assert got == [5, 5, 9, 9]


def test_only_unfiltered_sampling_is_drawn_on_the_device():
    assert drawable_on_device(SamplingConfig(temperature=0.7), 100)
    assert drawable_on_device(SamplingConfig(temperature=0.7, top_p=1.0, top_k=100), 100)
    assert not drawable_on_device(SamplingConfig(), 100)  # greedy
    assert not drawable_on_device(SamplingConfig(temperature=0.7, top_p=0.9), 100)
    assert not drawable_on_device(SamplingConfig(temperature=0.7, top_k=20), 100)
    assert not drawable_on_device(SamplingConfig(temperature=0.7, min_p=0.05), 100)


def test_served_plain_draws_follow_the_targets_distribution(tiny_model_dir, monkeypatch):
    """A prompt's first token and the next, each drawn by MLX as a GPU's engine draws them,
    come as often as the target's own distribution gives them (chi-square over 600 seeds)."""
    from stats import chi_square

    from specd.models.load import load_target
    from verifier_svc import engine
    from verifier_svc.engine import Target, decode, prefill

    drawn_by_mlx = []
    monkeypatch.setattr(engine, "_on_gpu", lambda: True)
    monkeypatch.setattr(engine, "draw", lambda *a: drawn_by_mlx.append(1) or draw(*a))

    sampling = SamplingConfig(temperature=1.5)
    target = Target(load_target(str(tiny_model_dir), dtype="float32"))
    prompt = [5, 17, 33, 2, 41, 9]
    model = target.model
    first_p = target_distribution(np.array(model(mx.array([prompt]))[0, -1]), sampling)
    firsts = np.flatnonzero(first_p > 1e-9)
    rows = np.array(model(mx.array([[*prompt, int(t)] for t in firsts]))[:, -1])
    second_p = sum(first_p[t] * target_distribution(row, sampling)
                   for t, row in zip(firsts, rows, strict=True))  # fmt: skip
    firsts_drawn, seconds_drawn = [], []
    for seed in range(600):
        opened = prefill(target, prompt, sampling=sampling, seed=seed)
        firsts_drawn.append(opened.first_token)
        seconds_drawn.append(decode(target, opened.session, 1).committed[0])
    assert len(drawn_by_mlx) == 1200
    for drawn, p in ((firsts_drawn, first_p), (seconds_drawn, second_p)):
        observed = np.bincount(drawn, minlength=len(p))
        stat, crit, df = chi_square(observed, p / p.sum())
        assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f} (df {df})"


def test_a_cpu_draws_on_the_host(tiny_model_dir, monkeypatch):
    """On a CPU the host's float64 draw is the faster: MLX draws nothing there."""
    from specd.models.load import load_target
    from verifier_svc import engine
    from verifier_svc.engine import Target, decode, prefill

    monkeypatch.setattr(engine, "device_kind", lambda: "cpu")
    monkeypatch.setattr(engine, "draw", lambda *a: pytest.fail("drew by MLX on a CPU"))
    target = Target(load_target(str(tiny_model_dir), dtype="float32"))
    opened = prefill(target, [5, 17, 33], sampling=SamplingConfig(temperature=0.8), seed=1)
    assert len(decode(target, opened.session, 3).committed) == 3
