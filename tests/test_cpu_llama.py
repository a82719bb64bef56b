"""Decode-sized Llama forwards on numpy (specd.cpu.llama) against MLX's own."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import make_tiny_model_dir

from specd.cpu import llama as cpu_llama
from specd.cpu.llama import DEFAULT_MAX_ROWS as CPU_MAX_ROWS
from specd.cpu.llama import ROPE_BLOCK, CpuLlama
from specd.models.load import load_target
from tests.sessions import (
    assert_sampled_rounds_share_and_equal_each_alone,
    assert_tree_rounds_share_and_equal_each_alone,
    greedy_after,
    mixed_sampled_rounds,
    recorded_on,
    run_rounds_alone,
)
from verifier_svc.engine import Target, _rollback, decode, prefill, verify_tree

PROMPT = [3, 40, 41, 42, 43, 40, 41, 42, 50, 60, 70]
VARIANTS = {
    "tied": {},
    "untied-with-biases": {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True},
    "traditional-rope": {"rope_traditional": True},
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def layer_parts(request, monkeypatch):
    """Every test twice: the layers' attention, norms, RoPE and SwiGLU in the compiled
    kernels, and in numpy (as where no C compiler built them)."""
    if request.param == "numpy":
        monkeypatch.setattr(cpu_llama, "layer_kernels", lambda: None)
    elif cpu_llama.layer_kernels() is None:
        pytest.fail("the compiled kernels were not built")
    return request.param


def _pair(path):
    """The same weights twice: all in MLX, and forwards of up to 16 tokens on numpy."""
    plain = Target(load_target(str(path), dtype="float32"), gemv_rows=0)
    fast = Target(load_target(str(path), dtype="float32"))
    return plain, fast


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("host") / request.param
    return _pair(make_tiny_model_dir(path, config_overrides=VARIANTS[request.param]))


def _prompt(length: int) -> list[int]:
    return np.random.default_rng(length).integers(3, 200, length).tolist()


def _check_close(got, want):
    got, want = np.array(got), np.array(want)
    assert np.allclose(got, want, rtol=1e-5, atol=2e-4), np.abs(got - want).max()


@pytest.mark.parametrize("context", [0, 11, ROPE_BLOCK - 2, 2 * ROPE_BLOCK - 1])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 16])
def test_forwards_match_mlx_and_leave_the_same_cache(pair, context, tokens):
    """Logits, captured rows, and the keys and values appended (which the next forward,
    an MLX one, reads), across RoPE tables and the cache's 256-row growth steps."""
    plain, fast = pair
    assert fast.cpu_layers is not None and plain.cpu_layers is None
    prompt, new = _prompt(context), list(range(7, 7 + tokens))
    caches = []
    for target in (plain, fast):
        cache = prefill(target, prompt).session.cache if prompt else target.new_cache()
        caches.append((cache, *target.forward(mx.array(new), cache, (0, 1))))
    (plain_cache, want_logits, want_rows), (fast_cache, got_logits, got_rows) = caches
    _check_close(got_logits, want_logits)
    _check_close(got_rows, want_rows)
    assert (np.array(got_logits).argmax(-1) == np.array(want_logits).argmax(-1)).all()
    assert fast_cache[0].offset == plain_cache[0].offset == context + tokens
    following = [plain.forward(mx.array([5, 6, 7, 8]), c)[0] for c in (plain_cache, fast_cache)]
    _check_close(following[1], following[0])


def decode_in_bursts(target, prompt=PROMPT) -> list[int]:
    """Greedy output over decode bursts of 1 to 16 tokens (numpy and MLX forwards alike)."""
    result = prefill(target, prompt)
    session, out = result.session, [result.first_token]
    for steps in [1, 3, 8, 2, 16, 16]:
        out += decode(target, session, steps).committed
    return out


def test_greedy_decoding_equals_mlx(pair):
    plain, fast = pair
    assert decode_in_bursts(plain) == decode_in_bursts(fast)


@pytest.mark.parametrize("parents", [[-1, -1], [-1, 0], [-1, -1, 0, 1, 1], [-1, 0, 1, 2, 3, 4, 5]])
def test_tree_forwards_match_mlx(pair, parents):
    """Ancestor-only visibility and depth positions, against MLX's masked tree forward."""
    plain, fast = pair
    drafts = [20 + i for i in range(len(parents))]
    out = []
    for target in (plain, fast):
        cache = prefill(target, PROMPT).session.cache
        out.append(target.forward_tree(mx.array([9, *drafts]), parents, cache, (0, 1)))
    _check_close(out[1][0], out[0][0])
    _check_close(out[1][1], out[0][1])


def test_small_forwards_and_trees_run_on_numpy(tiny_model_dir, monkeypatch):
    _, fast = _pair(tiny_model_dir)
    sizes = []
    real = CpuLlama.forward
    monkeypatch.setattr(
        CpuLlama,
        "forward",
        lambda self, ids, *a, **kw: sizes.append(len(ids)) or real(self, ids, *a, **kw),
    )
    session = prefill(fast, PROMPT).session
    assert sizes == [10, 1]  # prefill: all but the last token, then the last, as mlx-lm does
    sizes.clear()
    base = session.cache[0].offset
    for n in (1, 3, CPU_MAX_ROWS, CPU_MAX_ROWS + 1):
        fast.forward(mx.array([7] * n), session.cache)
        _rollback(session.cache, base)
    assert sizes == [1, 3, CPU_MAX_ROWS]
    verify_tree(fast, session, [7, 8], [-1, -1])
    verify_tree(fast, session, [7, 8, 9], [-1, -1, -1])
    assert sizes == [1, 3, CPU_MAX_ROWS, 3, 4]


def test_models_it_cannot_run_stay_in_mlx(tiny_model_dir, tmp_path):
    assert Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0).cpu_layers is None
    # weights not on numpy's gemv: nothing to read them with
    assert CpuLlama.attach(load_target(str(tiny_model_dir), dtype="float32").model) is None
    sliding = make_tiny_model_dir(
        tmp_path / "sliding",
        config_overrides={
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
        },
    )
    products_only = Target(load_target(str(sliding), dtype="float32"))
    assert products_only.cpu_layers is None and products_only.gemv_rows == 3


def test_a_default_it_could_not_use_falls_back_to_products(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(CpuLlama, "attach", classmethod(lambda cls, model: None))
    target = Target(load_target(str(tiny_model_dir), dtype="float32"))
    assert target.cpu_layers is None and target.gemv_rows == 3
    assert target.model.layers[0].inner.self_attn.q_proj._gemv.max_rows == 3


def test_a_failure_while_appending_leaves_every_layer_as_it_was(tiny_model_dir, monkeypatch):
    """Rollback trims all layers by the first one's length: they must agree after a failure
    in a later layer (the first one's keys and values already written)."""
    _, fast = _pair(tiny_model_dir)
    session = prefill(fast, PROMPT).session
    base = session.cache[0].offset
    calls = []
    for name in ("_attend", "_attend_compiled"):
        real = getattr(CpuLlama, name)

        def fail_on_second_layer(self, *args, real=real):
            calls.append(1)
            if len(calls) == 2:
                raise MemoryError("injected")
            return real(self, *args)

        monkeypatch.setattr(CpuLlama, name, fail_on_second_layer)
    with pytest.raises(MemoryError):
        fast.forward(mx.array([7, 8]), session.cache)
    assert [c.offset for c in session.cache] == [base] * len(session.cache)
    calls.append(1)  # no more failures
    # and the next forward gives what it gives on a session that never failed
    again = prefill(fast, PROMPT).session
    for cache in (session.cache, again.cache):
        fast.forward(mx.array([7, 8]), cache)
    np.testing.assert_array_equal(
        np.array(session.cache[1].keys[..., : base + 2, :]),
        np.array(again.cache[1].keys[..., : base + 2, :]),
    )


def test_several_sequences_in_one_forward_equal_each_alone(pair):
    """forward_many: each sequence's logits, captured rows and cache as its own forward gives
    (the products see more rows; each row's sums are its own)."""
    from specd.cpu.llama import Segment

    _, fast = pair
    layers = fast.cpu_layers
    contexts, news = [_prompt(5), _prompt(40), _prompt(17)], [[7], [8, 9, 10], [11]]

    def caches():
        out = []
        for ctx in contexts:
            cache = fast.new_cache()
            fast.forward(mx.array(ctx), cache)
            out.append(cache)
        return out

    together, alone = caches(), caches()
    segments = [Segment(np.array(t), c) for t, c in zip(news, together, strict=True)]
    many = layers.forward_many(segments, frozenset({0, 1}))
    for (logits, rows), new, cache in zip(many, news, alone, strict=True):
        want_logits, want_rows = layers.forward(np.array(new), cache, frozenset({0, 1}))
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert (logits.argmax(-1) == want_logits.argmax(-1)).all()
        for i in (0, 1):
            np.testing.assert_allclose(rows[i], want_rows[i], rtol=1e-5, atol=1e-5)
    for a, b in zip(together, alone, strict=True):
        assert a[0].offset == b[0].offset
        for la, lb in zip(a, b, strict=True):
            n = la.offset
            np.testing.assert_allclose(
                np.array(la.keys[..., :n, :]), np.array(lb.keys[..., :n, :]), atol=1e-5
            )


def test_rounds_of_several_sessions_at_once_equal_each_alone(pair):
    """rounds_many: the same tokens, accepted counts, rows and caches as verify or decode per
    session, for sessions of different lengths, bursts, drafts and captures; one stopping
    early leaves the others going."""
    from verifier_svc.engine import Round, rounds_many, verify

    _, fast = pair
    prompts = [_prompt(6), _prompt(30), _prompt(13), _prompt(9), _prompt(21)]
    captures = [(0, 1), (), (1,), (0, 1), (0,)]

    def sessions():
        return [prefill(fast, p, c).session for p, c in zip(prompts, captures, strict=True)]

    # drafts: the greedy continuation (accepted), a wrong one (rejected at once), mixed
    greedy = decode(fast, sessions()[3], 3).committed
    plans = [([], 4), ([], 1), ([], 6), (greedy, 1), ([greedy[0] + 1, 5, 6], 1)]
    alone_sessions = sessions()
    alone = [
        verify(fast, s, drafts) if drafts else decode(fast, s, steps)
        for s, (drafts, steps) in zip(alone_sessions, plans, strict=True)
    ]
    together_sessions = sessions()
    together = rounds_many(
        fast, [Round(s, d, k) for s, (d, k) in zip(together_sessions, plans, strict=True)]
    )
    assert together[3].num_accepted == 3 and together[4].num_accepted == 0
    for a, b in zip(alone, together, strict=True):
        assert (b.committed, b.num_accepted, b.finished) == (
            a.committed,
            a.num_accepted,
            a.finished,
        )
        if a.rows is None:
            assert b.rows is None
        else:
            _check_close(b.rows, a.rows)
    for got, want in zip(together_sessions, alone_sessions, strict=True):
        assert (got.position, got.last_token) == (want.position, want.last_token)
        assert got.cache[0].offset == want.cache[0].offset == got.position - 1
    # each round's part of the shared forwards it took part in: its rows (a verify 1 + drafts,
    # a plain round a row per token) over theirs, so drafts are priced as the rows they add
    first_rows = [1, 1, 1, 1 + len(greedy), 4]
    steps = [len(together[i].committed) for i in range(3)] + [1, 1]
    step_rows = [
        sum(first if k == 0 else 1 for first, n in zip(first_rows, steps, strict=True) if n > k)
        for k in range(max(steps))
    ]
    own = [first + n - 1 for first, n in zip(first_rows, steps, strict=True)]
    want = [mine / sum(step_rows[:n]) for mine, n in zip(own, steps, strict=True)]
    assert [r.share for r in together] == pytest.approx(want)
    assert all(a.share == 1.0 for a in alone)


def test_more_sessions_than_a_forward_takes_go_in_groups(pair, monkeypatch):
    from verifier_svc.engine import Round, rounds_many

    _, fast = pair
    monkeypatch.setattr(fast.cpu_layers, "max_rows", 4)
    prompts = [_prompt(5 + i) for i in range(5)]
    alone = [decode(fast, prefill(fast, p).session, 3).committed for p in prompts]
    calls = []
    real = type(fast.cpu_layers).forward_many

    def counted(self, segments, capture, *rest):
        calls.append(sum(len(s.token_ids) for s in segments))
        return real(self, segments, capture, *rest)

    monkeypatch.setattr(type(fast.cpu_layers), "forward_many", counted)
    rounds = [Round(prefill(fast, p).session, [], 3) for p in prompts]
    rounds[1].drafts, rounds[1].steps = [7, 8], 1  # three rows of a forward
    results = rounds_many(fast, rounds)
    assert [r.committed for n, r in enumerate(results) if n != 1] == alone[:1] + alone[2:]
    assert max(calls) <= 4


def test_cache_buffers_shared_with_other_arrays_are_copied_first(tiny_model_dir):
    """A cache holding a broadcast array (one buffer behind every row) gets buffers of its
    own before the forward writes its keys and values; the array it held stays as it was."""
    _, fast = _pair(tiny_model_dir)
    plain, shared = fast.new_cache(), fast.new_cache()
    fast.forward(mx.array([7]), plain)
    for layer in plain:
        layer.offset = 0
    zero = mx.zeros((1,), mx.float32)
    held = []
    for layer, ref in zip(shared, plain, strict=True):
        layer.keys = mx.broadcast_to(zero, ref.keys.shape)
        layer.values = mx.broadcast_to(zero, ref.values.shape)
        held.append(layer.keys)
    want = fast.forward(mx.array([7, 8]), plain)[0]
    got = fast.forward(mx.array([7, 8]), shared)[0]
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert all(not np.array(h).any() for h in held)


def _stream_with_a_second_round(fast, sa, sb, second, fail_at=None):
    """rounds_stream of A (2 steps, looking ahead in company) and B (6 steps); A's second
    round arrives once A's look-ahead has run. Returns ((round, answer) pairs, sessions per
    step, [the steps run when A's second round came] or [] if it never did)."""
    from verifier_svc.engine import Round, rounds_stream

    first = Round(sa, [], 2, ahead_in_company=True)
    answers, steps, seen = [], [], []

    def more():
        if any(r is first for r, _ in answers) and sa.ahead is not None and not seen:
            seen.append(len(steps))
            return [second]
        return []

    real = type(fast.cpu_layers).forward_many

    def forward_many(self, segments, capture, *rest):
        if len(steps) == fail_at:
            raise MemoryError("injected")
        return real(self, segments, capture, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(fast.cpu_layers), "forward_many", forward_many)
        rounds_stream(fast, [first, Round(sb, [], 6)], more,
                      lambda r, result: answers.append((r, result)), steps.append)  # fmt: skip
    return answers, steps, seen


def test_a_round_answered_while_others_run_computes_its_next_token(pair):
    """Round.ahead_in_company: the session takes a row in the next shared forward, its next
    round starts with that token, and the tokens are those of decoding alone."""
    from verifier_svc.engine import Round

    _, fast = pair
    pa, pb = _prompt(6), _prompt(9)
    want_a = decode(fast, prefill(fast, pa).session, 7).committed
    want_b = decode(fast, prefill(fast, pb).session, 6).committed
    sa, sb = prefill(fast, pa).session, prefill(fast, pb).session
    second = Round(sa, [], 3, ahead_in_company=True)
    answers, steps, seen = _stream_with_a_second_round(fast, sa, sb, second)
    assert seen == [3]  # its 2 steps, then its look-ahead
    got_a = [t for r, result in answers if r.session is sa for t in result.committed]
    assert got_a == want_a[:5]
    assert [result.committed for r, result in answers if r.session is sb] == [want_b]
    assert steps == [2] * 6  # A in every forward: 2 steps, its look-ahead, 2 more, look-ahead
    assert [result.share for _, result in answers] == [0.5, 0.5, 0.5]  # its rows of 2 a forward
    assert sa.ahead is not None and sa.cache[0].offset == sa.position
    assert decode(fast, sa, 2).committed == want_a[5:]


def test_a_failed_forward_drops_the_look_ahead_it_held(pair):
    from verifier_svc.engine import Round

    _, fast = pair
    pa, pb = _prompt(6), _prompt(9)
    want_a = decode(fast, prefill(fast, pa).session, 5).committed
    want_b = decode(fast, prefill(fast, pb).session, 6).committed
    sa, sb = prefill(fast, pa).session, prefill(fast, pb).session
    second = Round(sa, [], 3, ahead_in_company=True)
    answers, steps, seen = _stream_with_a_second_round(fast, sa, sb, second, fail_at=3)
    assert seen == []  # the step of A's look-ahead failed
    # B went on from the step that failed, alone
    assert next(v for r, v in answers if r.session is sb).committed == want_b
    assert sa.ahead is None and sa.cache[0].offset == sa.position - 1
    assert decode(fast, sa, 3).committed == want_a[2:]


def test_sampled_rounds_share_forwards_and_equal_each_alone(pair, monkeypatch):
    _, fast = pair
    calls = recorded_on(monkeypatch, fast.cpu_layers)
    assert_sampled_rounds_share_and_equal_each_alone(fast, calls)


def test_a_failed_shared_forward_leaves_a_sampled_session_and_its_draws_as_they_were(
    pair, monkeypatch
):
    """A sampled burst whose third and later steps fail (tried again with fewer a step, then
    alone): its generator is back where the round began, so the round run again draws what it
    would have drawn."""
    from verifier_svc.engine import Round, rounds_many

    _, fast = pair
    sessions, rounds = mixed_sampled_rounds(fast)
    burst = rounds[1]
    before = burst.session.rng.bit_generator.state
    _, fresh = mixed_sampled_rounds(fast)
    want = run_rounds_alone(fast, [fresh[1]])[0].committed
    real = type(fast.cpu_layers).forward_many
    calls = []

    def failing(self, segments, capture, *rest):
        calls.append(1)
        if len(calls) >= 3:
            raise MemoryError("the third forward")
        return real(self, segments, capture, *rest)

    monkeypatch.setattr(type(fast.cpu_layers), "forward_many", failing)
    results = rounds_many(fast, [rounds[0], burst])
    assert all(isinstance(r, MemoryError) for r in results)
    assert burst.session.rng.bit_generator.state == before
    assert burst.session.cache[0].offset == burst.session.position - 1
    monkeypatch.setattr(type(fast.cpu_layers), "forward_many", real)
    again = rounds_many(fast, [Round(burst.session, [], 5), Round(sessions[0], [], 4)])
    assert again[0].committed == want


def test_a_shared_forward_failing_once_mid_burst_goes_on_and_draws_what_it_would_alone(
    pair, monkeypatch
):
    """The third shared forward fails once: the rounds go on from their second step, fewer a
    step, and the sampled burst draws what it draws alone."""
    from verifier_svc.engine import rounds_many

    _, fast = pair
    _, rounds = mixed_sampled_rounds(fast)
    _, fresh = mixed_sampled_rounds(fast)
    want = [r.committed for r in run_rounds_alone(fast, fresh[:2])]
    real = type(fast.cpu_layers).forward_many
    calls = []

    def failing_once(self, segments, capture, *rest):
        calls.append(len(segments))
        outs = real(self, segments, capture, *rest)
        if len(calls) == 3:
            raise MemoryError("the third forward")
        return outs

    monkeypatch.setattr(type(fast.cpu_layers), "forward_many", failing_once)
    results = rounds_many(fast, rounds[:2])
    assert [r.committed for r in results] == want
    assert calls[2:4] == [2, 1]  # failed, then one round a step


def test_tree_rounds_share_forwards_and_equal_each_alone(pair, monkeypatch):
    _, fast = pair
    calls = recorded_on(monkeypatch, fast.cpu_layers)
    assert_tree_rounds_share_and_equal_each_alone(fast, calls)


def _failing_sampled_verify(target):
    """A sampled session and a verify of two drafts that fails after its first draw: the first
    draft, the target's likeliest, is all but certain to be kept (its drafter gave it a tiny
    probability), the second has probability 0 under its own drafter, which the acceptance
    refuses."""
    from verifier_svc.sampling import SamplingConfig

    vocab = target.identity.vocab_size
    prompt = _prompt(8)
    session = prefill(target, prompt, (0,), sampling=SamplingConfig(1.0), seed=4).session
    first = greedy_after(target, [*prompt, session.last_token], 1)[0]
    second = (first + 1) % vocab
    probs = np.full((2, vocab), 1.0 / (vocab - 1))
    probs[0, first], probs[1, second] = 1e-9, 0.0
    probs[0] /= probs[0].sum()
    return session, [first, second], probs


def test_a_sampled_round_that_fails_leaves_its_generator_as_it_was(pair):
    """Alone (`verify`) and in a shared forward, where the other session's round goes on."""
    from verifier_svc.engine import Round, rounds_many, verify

    _, fast = pair
    session, drafts, probs = _failing_sampled_verify(fast)
    before, position = session.rng.bit_generator.state, session.position
    with pytest.raises(ValueError, match="probability 0"):
        verify(fast, session, drafts, probs)
    assert session.rng.bit_generator.state == before
    assert session.position == position and session.cache[0].offset == position - 1

    session, drafts, probs = _failing_sampled_verify(fast)
    before = session.rng.bit_generator.state
    other = prefill(fast, _prompt(6)).session
    want = decode(fast, prefill(fast, _prompt(6)).session, 3).committed
    results = rounds_many(fast, [Round(session, drafts, 1, draft_probs=probs), Round(other, [], 3)])
    assert isinstance(results[0], ValueError)
    assert results[1].committed == want
    assert session.rng.bit_generator.state == before
    assert session.cache[0].offset == session.position - 1


def test_a_sampled_tree_that_fails_leaves_its_generator_as_it_was(pair, monkeypatch):
    from verifier_svc import engine
    from verifier_svc.sampling import SamplingConfig

    _, fast = pair
    session = prefill(fast, _prompt(8), sampling=SamplingConfig(1.0), seed=5).session
    before, position = session.rng.bit_generator.state, session.position

    def failing(cache, base, keep):
        raise MemoryError("moving the kept path")

    monkeypatch.setattr(engine, "_compact", failing)
    with pytest.raises(MemoryError):
        verify_tree(fast, session, [3, 4, 5], [-1, -1, 0])
    assert session.rng.bit_generator.state == before
    assert session.position == position and session.cache[0].offset == position - 1
