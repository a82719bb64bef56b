"""Prefill, verify, rollback and capture on a tiny random model, against plain mlx-lm."""

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from specd.models.load import load_target
from verifier_svc.engine import Target, decode, prefill, verify, verify_tree
from verifier_svc.sampling import SamplingConfig

PROMPT = [3, 40, 41, 42, 43, 40, 41, 42, 50, 60, 70]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return Target(load_target(str(tiny_model_dir), dtype="float32"))


def plain_greedy(target, prompt, n):
    out = []
    for token, _ in generate_step(mx.array(prompt), target.model, max_tokens=n):
        out.append(token)
        if token in target.eos_ids:
            break
    return out


def run_rounds(target, prompt, n, propose):
    """Speculate with `propose(context, reference_len) -> drafts` until n tokens or EOS."""
    result = prefill(target, prompt)
    session, out = result.session, [result.first_token]
    while len(out) < n and not session.finished:
        drafts = propose(prompt + out)
        r = verify(target, session, drafts)
        out.extend(r.committed)
        assert session.cache[0].offset == session.position - 1
    return out[:n] if not session.finished else out


def assert_plain_output_and_rows(target, out, reference, rows, layers):
    """The output is plain greedy decoding's, and the rows sent round by round equal one
    forward over the prompt and the output. Decode forwards may run on numpy (specd.cpu.llama), the
    reference on MLX: float32 rounding only."""
    assert out[: len(reference)] == reference[: len(out)]
    got = mx.concatenate(rows, axis=0)
    _, full = target.forward(mx.array((PROMPT + out)[: got.shape[0]]), target.new_cache(), layers)
    assert mx.allclose(got, full, atol=5e-4).item()


def test_verify_matches_plain_greedy_for_any_drafts(target):
    n = 48
    reference = plain_greedy(target, PROMPT, n)
    rng = random.Random(0)
    vocab = target.identity.vocab_size

    def oracle(context):  # the right continuation, always accepted
        done = len(context) - len(PROMPT)
        return reference[done : done + 4]

    def garbage(context):
        return [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]

    def mixed(context):
        drafts = oracle(context)
        if drafts and rng.random() < 0.5:
            drafts[rng.randrange(len(drafts))] = rng.randrange(vocab)
        return drafts

    for propose in (oracle, garbage, mixed):
        out = run_rounds(target, PROMPT, n, propose)
        assert out[: len(reference)] == reference[: len(out)], propose.__name__
        assert len(out) >= min(n, len(reference))


def test_rejected_tail_is_rolled_back(target):
    session = prefill(target, PROMPT).session
    before = session.cache[0].offset
    r = verify(target, session, [0, 0, 0, 0, 0])  # token 0 is never the argmax here? any is ok
    kept = 1 + r.num_accepted
    assert session.cache[0].offset == before + kept
    assert session.position == len(PROMPT) + 1 + len(r.committed)


def test_captured_rows_equal_full_forward(target):
    layers = (0, 1)
    result = prefill(target, PROMPT, capture=layers, rows_dtype=mx.float32)
    session = result.session
    assert result.rows.shape == (len(PROMPT), 2 * target.identity.hidden_size)
    rows = [result.rows]
    tokens = list(PROMPT) + [result.first_token]
    for drafts in ([7, 8, 9], [], [1]):
        r = verify(target, session, drafts)
        assert r.rows.shape[0] == 1 + r.num_accepted
        rows.append(r.rows)
        tokens.extend(r.committed)
    got = mx.concatenate(rows, axis=0)  # rows for every position the cache holds
    cache = target.new_cache()
    _, full = target.forward(mx.array(tokens[: got.shape[0]]), cache, layers)
    # decode forwards run on numpy (specd.cpu.llama), the reference on MLX: float32 rounding only
    assert mx.allclose(got, full, atol=5e-4).item()


def test_failed_round_leaves_session_unchanged(target, monkeypatch):
    session = prefill(target, PROMPT).session
    offset, position = session.cache[0].offset, session.position

    def boom(*a, **k):
        raise RuntimeError("simulated failure in the middle of a round")

    monkeypatch.setattr("verifier_svc.engine.accept_greedy", boom)
    with pytest.raises(RuntimeError):
        verify(target, session, [1, 2, 3])
    assert (session.cache[0].offset, session.position) == (offset, position)


def test_decode_bursts_equal_plain_greedy_and_keep_rows(target):
    layers = (0, 1)
    n = 40
    reference = plain_greedy(target, PROMPT, n)
    result = prefill(target, PROMPT, capture=layers, rows_dtype=mx.float32)
    session, out, rows = result.session, [result.first_token], [result.rows]
    for steps in [1, 3, 8, 2, 5, 16, 16]:
        r = decode(target, session, steps)
        assert len(r.committed) == steps or r.finished
        assert r.num_accepted == 0 and r.rows.shape[0] == len(r.committed)
        assert session.cache[0].offset == session.position - 1
        out += r.committed
        rows.append(r.rows)
        if r.finished:
            break
    assert_plain_output_and_rows(target, out, reference, rows, layers)


def test_decode_stops_after_eos_and_drops_the_queued_forward(tiny_model_dir):
    target = Target(load_target(str(tiny_model_dir), dtype="float32"))
    reference = plain_greedy(target, PROMPT, 30)
    stop = next(i for i in range(4, 30) if reference[i] not in reference[:i])
    target.eos_ids = frozenset({reference[stop]})
    session = prefill(target, PROMPT).session
    r = decode(target, session, 25)
    assert r.committed == reference[1 : stop + 1]
    assert r.finished and session.finished
    assert session.cache[0].offset == session.position - 1 == len(PROMPT) + stop


def test_seeded_sampling_decode_equals_one_token_rounds(target):
    config = SamplingConfig(temperature=1.0)
    one = prefill(target, PROMPT, sampling=config, seed=7).session
    burst = prefill(target, PROMPT, sampling=config, seed=7).session
    by_one = [t for _ in range(12) for t in verify(target, one, []).committed]
    by_burst = decode(target, burst, 5).committed + decode(target, burst, 7).committed
    assert by_burst == by_one


def test_a_failing_sampled_burst_leaves_the_session_as_it_was(target, monkeypatch):
    import verifier_svc.engine as engine

    config = SamplingConfig(temperature=1.0)
    session = prefill(target, PROMPT, sampling=config, seed=3).session
    before = (session.cache[0].offset, session.position, session.last_token)
    real, calls = engine.verify, {"n": 0}

    def fails_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated failure inside a burst")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "verify", fails_third)
    with pytest.raises(RuntimeError):
        decode(target, session, 5)
    assert (session.cache[0].offset, session.position, session.last_token) == before
    monkeypatch.setattr(engine, "verify", real)
    retried = decode(target, session, 5).committed
    fresh = prefill(target, PROMPT, sampling=config, seed=3).session
    assert retried == decode(target, fresh, 5).committed  # the same draws as if never tried


def _offset_matches(session):
    """The cache holds the committed tokens, and last_token too when a look-ahead is queued."""
    return session.cache[0].offset == session.position - 1 + (session.ahead is not None)


@pytest.mark.parametrize("gemv_rows", [None, 0], ids=["default", "mlx-forwards"])
def test_look_ahead_rounds_equal_plain_greedy_and_keep_rows(tiny_model_dir, gemv_rows):
    target = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows)
    layers = (0, 1)
    n = 60
    reference = plain_greedy(target, PROMPT, n)
    result = prefill(target, PROMPT, capture=layers, rows_dtype=mx.float32)
    session, out, rows = result.session, [result.first_token], [result.rows]
    rng = random.Random(1)
    vocab = target.identity.vocab_size
    # bursts that leave a forward queued, then every kind of call that must take it up
    for kind in ["burst", "drafts", "burst", "garbage", "one", "burst", "empty", "burst",
                 "tree", "burst", "burst", "drafts"]:  # fmt: skip
        done = len(out) - 1
        if kind == "burst":
            r = decode(target, session, rng.randint(1, 5), look_ahead=True)
            assert session.ahead is not None or r.finished
        elif kind == "one":
            r = decode(target, session, 1)
        elif kind == "empty":
            r = verify(target, session, [])
        elif kind == "tree":
            ids = [reference[done + 1], rng.randrange(vocab), reference[done + 2]]
            r = verify_tree(target, session, ids, [-1, -1, 0])
        else:
            drafts = reference[done + 1 : done + 4]
            if kind == "garbage":
                drafts = [rng.randrange(vocab) for _ in range(3)]
            r = verify(target, session, drafts)
        assert kind == "burst" or session.ahead is None
        assert _offset_matches(session)
        assert r.rows.shape[0] == len(r.committed)
        out += r.committed
        rows.append(r.rows)
        if r.finished:
            break
    assert_plain_output_and_rows(target, out, reference, rows, layers)


def test_look_ahead_is_dropped_after_an_eos(tiny_model_dir):
    target = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0)
    reference = plain_greedy(target, PROMPT, 30)
    stop = next(i for i in range(4, 30) if reference[i] not in reference[:i])
    target.eos_ids = frozenset({reference[stop]})
    session = prefill(target, PROMPT).session
    r = decode(target, session, 2, look_ahead=True)
    assert session.ahead is not None and _offset_matches(session)
    while not r.finished:
        r = decode(target, session, 3, look_ahead=True)
    assert session.ahead is None
    assert session.cache[0].offset == session.position - 1 == len(PROMPT) + stop


def test_a_failed_round_after_a_look_ahead_leaves_the_committed_tokens(target, monkeypatch):
    reference = plain_greedy(target, PROMPT, 12)
    session = prefill(target, PROMPT).session
    decode(target, session, 3, look_ahead=True)
    position = session.position

    def boom(*a, **k):
        raise RuntimeError("simulated failure in the middle of a round")

    monkeypatch.setattr("verifier_svc.engine.accept_greedy", boom)
    with pytest.raises(RuntimeError):
        verify(target, session, reference[4:6])
    assert session.position == position and session.ahead is None
    assert session.cache[0].offset == position - 1
    monkeypatch.undo()
    assert decode(target, session, 4).committed == reference[4:8]


@pytest.mark.parametrize("gemv_rows", [None, 0])  # the default backends; MLX alone
def test_a_prefill_a_layer_at_a_time_gives_the_same_numbers(tiny_model_dir, gemv_rows):
    """prefill_steps(sliced) runs a long prompt's forward in steps (a server runs other
    rounds between them): on MLX one decoder layer per step, on the CPU kernels one chunk of
    the rows they take; the same KV, rows and first token, bit for bit."""
    from verifier_svc.engine import prefill_steps

    target = Target(load_target(str(tiny_model_dir), "float32"), gemv_rows=gemv_rows)
    assert target.slices_prefill
    prompt = [(7 * i + 3) % 90 + 3 for i in range(300)]
    whole = prefill(target, prompt, capture=(0, 1), rows_dtype=mx.float32)
    steps = prefill_steps(target, prompt, (0, 1), mx.float32)
    taken = 0
    while True:
        try:
            next(steps)
            taken += 1
        except StopIteration as done:
            sliced = done.value
            break
    if target.cpu_layers is None:
        assert taken == len(target.model.layers)
    else:  # a step before each chunk but the first; the prompt's last token goes alone
        assert taken == -(-(len(prompt) - 1) // target.prefill_chunk) - 1 > 0
    assert sliced.first_token == whole.first_token
    assert mx.array_equal(sliced.rows, whole.rows).item()
    for a, b in zip(sliced.session.cache, whole.session.cache, strict=True):
        assert a.offset == b.offset
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state, strict=True))


def _log_prob_argmax(logits: np.ndarray) -> np.ndarray:
    x = mx.array(logits)
    return np.array(mx.argmax(x - mx.logsumexp(x, axis=-1, keepdims=True), axis=-1))


def test_greedy_choices_on_the_host_equal_the_log_prob_argmax():
    """Without the log-probabilities, the host's argmax is mlx-lm's greedy choice wherever the
    top logit leads; a near-tie or a maximum that is not finite is left to MLX."""
    from verifier_svc.engine import _greedy_next, greedy_on_host

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((64, 5000)) * 6).astype(np.float32)
    fast = greedy_on_host(logits)
    assert fast is not None and np.array_equal(fast, _log_prob_argmax(logits))
    # two logits one float32 step apart: the later one is larger, but their log-probabilities
    # (near -9.4, where float32's steps are 16 times wider) round to one value, so mlx-lm's
    # argmax takes the earlier one
    tie = np.zeros((1, 20000), dtype=np.float32)
    tie[0, 2] = 0.5
    tie[0, 5] = np.nextafter(np.float32(0.5), np.float32(1.0))
    assert tie.argmax() == 5 and _log_prob_argmax(tie).tolist() == [2]
    assert greedy_on_host(tie) is None
    assert np.array(_greedy_next(mx.array(tie))).tolist() == _log_prob_argmax(tie).tolist()
    for bad in (np.inf, np.nan):
        odd = logits[:2].copy()
        odd[1, 7] = bad
        assert greedy_on_host(odd) is None
    assert np.array(_greedy_next(mx.array(logits[:3]))).tolist() == fast[:3].tolist()


def test_greedy_choices_of_a_shared_forward_equal_each_sessions_own():
    """The sessions' numpy logits taken in one pass, or each its own way where one holds a
    near-tie (mlx-lm's choice for it, the host's for the others)."""
    from verifier_svc.engine import _greedy_choices, _greedy_next

    rng = np.random.default_rng(1)
    parts = [(rng.standard_normal((n, 20000)) * 6).astype(np.float32) for n in (1, 3, 1)]
    tie = parts[1].copy()
    tie[1] = 0.0
    tie[1, 2] = 0.5
    tie[1, 5] = np.nextafter(np.float32(0.5), np.float32(1.0))
    for logits in (parts, [parts[0], tie, parts[2]]):
        got = [np.array(c).tolist() for c in _greedy_choices(logits)]
        want = [np.array(_greedy_next(mx.array(x))).tolist() for x in logits]
        assert got == want
    assert got[1][1] == 2
