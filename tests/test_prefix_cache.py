"""Prompts' KV kept for later prompts that begin alike (verifier_svc.prefix_cache)."""

import mlx.core as mx
import numpy as np
import pytest
from test_half import quantized_dir  # noqa: F401 - a fixture

from specd.cpu.row_products import pairs_supported
from specd.models.load import load_target
from verifier_svc.engine import Target, decode, prefill
from verifier_svc.prefix_cache import MIN_REUSED_TOKENS, Prefix, PrefixCache

LAYERS, KV_HEADS, DIM = 2, 1, 8


def _prefix(tokens, capture=(), rows=True) -> Prefix:
    n = len(tokens)
    kv = tuple(np.full((KV_HEADS, n, DIM), i, np.float32) for i in range(LAYERS))
    kept = np.arange(n * 4, dtype=np.float32).reshape(n, 4) if capture and rows else None
    return Prefix(np.asarray(tokens, np.int32), kv, kv, kept, tuple(capture))


def test_the_longest_stored_beginning_is_found_leaving_the_last_token():
    cache = PrefixCache(1 << 20)
    base = list(range(100, 120))
    assert cache.add(_prefix(base[:12]))
    assert cache.add(_prefix(base[:9] + [7, 7, 7]))
    found = cache.find(base[:16])
    assert found.length == 12 and found.keys[0].shape == (KV_HEADS, 12, DIM)
    # a prompt that is all stored still leaves its last token to compute
    assert cache.find(base[:12]).length == 11
    assert cache.find([1, 2, 3] + base) is None  # no stored beginning
    short = base[: MIN_REUSED_TOKENS - 1] + [5, 5, 5]
    assert cache.find(short) is None  # too short a match to pay
    assert cache.stats.hits == 2 and cache.stats.tokens_reused == 23


def test_an_entry_extended_by_a_new_one_is_replaced_and_a_covered_one_not_stored():
    cache = PrefixCache(1 << 20)
    tokens = list(range(30))
    assert cache.add(_prefix(tokens[:10]))
    assert cache.add(_prefix(tokens[:20]))
    assert len(cache) == 1 and cache.find(tokens + [1]).length == 20
    assert not cache.add(_prefix(tokens[:15]))  # the stored one covers it
    assert len(cache) == 1 and cache.nbytes == _prefix(tokens[:20]).nbytes


def test_the_least_recently_used_go_first_within_the_size():
    one = _prefix(list(range(10)))
    cache = PrefixCache(3 * one.nbytes)
    prompts = [[k] * 10 for k in range(1, 5)]
    for p in prompts[:3]:
        assert cache.add(_prefix(p))
    assert cache.find(prompts[0] + [0]) is not None  # used: the second is now the oldest
    assert cache.add(_prefix(prompts[3]))
    assert cache.find(prompts[1] + [0]) is None and cache.find(prompts[0] + [0]) is not None
    assert len(cache) == 3 and cache.nbytes <= cache.capacity_bytes and cache.stats.evicted == 1
    assert not PrefixCache(10).add(one)  # larger than the whole cache


def test_rows_for_a_drafter_come_only_from_an_entry_that_captured_the_same_layers():
    cache = PrefixCache(1 << 20)
    tokens = list(range(50, 70))
    cache.add(_prefix(tokens, capture=(0, 1)))
    assert cache.find(tokens + [1], capture=(0, 2), rows_dtype=np.float32) is None
    assert cache.find(tokens + [1], capture=(0, 1), rows_dtype=np.float16) is None
    found = cache.find(tokens + [1], capture=(0, 1), rows_dtype=np.float32)
    assert found.rows.shape == (20, 4)
    assert cache.find(tokens + [1]).rows is None  # no capture asked: the KV alone
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.stats.lookups == 0
    with pytest.raises(ValueError, match="positive size"):
        PrefixCache(0)


def _prompts():
    shared = [3, 40, 41, 42, 43, 40, 41, 42, 50, 60, 70, 80] * 3  # 36 tokens: past one chunk
    return shared + [90, 91, 92, 93, 94], shared + [95, 96, 97]


@pytest.mark.parametrize("capture", [(), (0, 1)])
def test_a_reused_prefix_is_the_prefill_it_replaces_bit_for_bit(quantized_dir, capture):  # noqa: F811
    """Where rows are exact (CPU layers, paired products), a prompt that begins with a stored
    one gives the cold prefill's first token, KV, rows and greedy continuation."""
    if not pairs_supported():
        pytest.skip("this CPU has no paired products: reuse is not exact, and is off by default")
    first, second = _prompts()
    loaded = load_target(str(quantized_dir), "float32", half_weights=True)
    warm = Target(loaded, prefix_cache_bytes=None)
    cold = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    assert warm.prefix_reuse_exact and warm.prefix_cache is not None and cold.prefix_cache is None
    prefill(warm, first, capture)
    got, want = prefill(warm, second, capture), prefill(cold, second, capture)
    assert warm.prefix_cache.stats.tokens_reused == 36
    assert got.first_token == want.first_token
    if capture:
        assert mx.array_equal(got.rows, want.rows)
    for a, b in zip(got.session.cache, want.session.cache, strict=True):
        assert a.offset == b.offset == len(second)
        assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])
        assert mx.array_equal(a.values[..., : a.offset, :], b.values[..., : b.offset, :])
    assert decode(warm, got.session, 12).committed == decode(cold, want.session, 12).committed


def test_reuse_is_on_by_default_only_where_it_is_exact(quantized_dir, monkeypatch):  # noqa: F811
    import specd.cpu.llama as cpu_llama

    def served(half: bool = True, **kw) -> Target:
        return Target(load_target(str(quantized_dir), "float32", half_weights=half), **kw)

    float32_weights = served(half=False, prefix_cache_bytes=None)
    assert not float32_weights.prefix_reuse_exact and float32_weights.prefix_cache is None
    monkeypatch.setattr(cpu_llama, "pairs_supported", lambda: False)
    inexact = served(prefix_cache_bytes=None)
    assert not inexact.prefix_reuse_exact and inexact.prefix_cache is None
    asked = served(prefix_cache_bytes=1 << 20)  # a size given: on, exact or not
    assert asked.prefix_cache.capacity_bytes == 1 << 20


def test_the_flag_sets_the_size_or_turns_it_off_and_benches_turn_it_off():
    from coordinator.bench import timing_prefills
    from specd.cli import build_parser
    from specd.options import flag_values
    from verifier_svc.config import VerifierConfig

    def config(*flags):
        parsed = build_parser().parse_args(["serve", "verifier", *flags])
        return VerifierConfig(**flag_values(parsed, VerifierConfig))

    assert config().prefix_cache_bytes is None
    assert config("--prefix-cache", "64MiB").prefix_cache_bytes == 64 << 20
    assert config("--prefix-cache", "0").prefix_cache_bytes == 0
    assert config("--prefix-cache", "off").prefix_cache_bytes == 0
    with pytest.raises(SystemExit):
        config("--prefix-cache", "lots")
    assert timing_prefills(["--log-stats", "1"]) == ["--log-stats", "1", "--prefix-cache", "0"]
    assert timing_prefills(["--prefix-cache", "1GiB"]) == ["--prefix-cache", "1GiB"]
    assert timing_prefills(["--prefix-cache=1GiB"]) == ["--prefix-cache=1GiB"]


def test_the_served_target_takes_the_configured_size(quantized_dir):  # noqa: F811
    from verifier_svc.config import VerifierConfig
    from verifier_svc.servicer import target_for

    served = target_for(VerifierConfig(model=str(quantized_dir), prefix_cache_bytes=2 << 20))
    assert served.prefix_cache.capacity_bytes == 2 << 20
    assert (
        target_for(VerifierConfig(model=str(quantized_dir), prefix_cache_bytes=0)).prefix_cache
        is None
    )


@pytest.mark.parametrize("capture", [(), (0, 1)])
def test_a_closed_sessions_tokens_serve_the_next_turn(quantized_dir, capture):  # noqa: F811
    """A chat's next request begins with the last one's prompt and reply: the verifier keeps a
    closed session's KV (and the rows it sent a drafter), and the next prompt prefills only
    what follows it: the same first token and rows as a cold prefill where reuse is exact."""
    import asyncio

    from sessions import RpcContext

    from specd import wire
    from specd.service import MlxThread
    from specd.v1 import common_pb2, verifier_pb2
    from verifier_svc.config import VerifierConfig
    from verifier_svc.servicer import VerifierServicer

    prompt = _prompts()[0]

    async def next_turn():
        mlx, ctx = MlxThread(), RpcContext()
        config = VerifierConfig(
            model=str(quantized_dir), warmup="minimal", prefix_cache_bytes=8 << 20
        )
        verifier = VerifierServicer(config, mlx)
        await verifier.load()

        def opening(ids):
            return verifier_pb2.OpenSessionRequest(prompt_ids=ids, capture_layers=capture)

        try:
            opened = await verifier.OpenSession(opening(prompt), ctx)
            sid, position, said = opened.session_id, opened.position, [*prompt, opened.first_token]
            # a round of plain steps, then one with drafts (the second path rows come by)
            for fields in ({"plain_steps": 6}, {"draft_ids": [40, 41]}):
                ask = verifier_pb2.VerifyRequest(session_id=sid, position=position, **fields)
                replied = await verifier.Verify(ask, ctx)
                position, said = replied.position, [*said, *replied.committed_ids]
            await verifier.CloseSession(common_pb2.CloseSessionRequest(session_id=sid), ctx)
            stats = verifier.target.prefix_cache.stats
            before = stats.tokens_reused
            again = await verifier.OpenSession(opening([*said, 40, 41]), ctx)
            rows = wire.decode(again.hidden_rows) if capture else None
            return said, stats.tokens_reused - before, again.first_token, rows
        finally:
            mlx.shutdown()

    said, reused, first, rows = asyncio.run(next_turn())
    assert reused == len(said) - 1  # the reply's last token was never in the cache
    if pairs_supported():
        cold = Target(load_target(str(quantized_dir), "float32", half_weights=True))
        want = prefill(cold, [*said, 40, 41], capture)
        assert first == want.first_token
        if capture:
            assert np.array_equal(rows, np.array(want.rows))
