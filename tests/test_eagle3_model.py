"""EAGLE-3 head: checkpoint formats, the training unroll equals drafting, tree proposals."""

from __future__ import annotations

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest

from drafter_svc.eagle3.cpu_head import CpuHead
from drafter_svc.eagle3.draft import Eagle3Drafter
from drafter_svc.eagle3.model import (
    CheckpointError,
    Eagle3Config,
    Eagle3Head,
    load_head,
    save_head,
)
from drafter_svc.eagle3.train import ttt_forward
from drafter_svc.proposal import TreeShape

H, V, VD = 32, 50, 20


def tiny_head(seed: int = 0, norm_before_residual: bool = False) -> Eagle3Head:
    cfg = Eagle3Config(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        draft_vocab_size=VD,
        capture_layers=(0, 1, 2),
        norm_before_residual=norm_before_residual,
        target_fingerprint="abc",
    )
    mx.random.seed(seed)
    head = Eagle3Head(cfg)
    # scale up so the random head's argmax is decisive
    head.update(
        {
            "lm_head": {"weight": head.lm_head.weight * 8},
            "fc": {"weight": head.fc.weight * 2},
        }
    )
    draft_ids = np.sort(np.random.default_rng(seed).choice(V, VD, replace=False))
    head.d2t = mx.array(draft_ids - np.arange(VD), dtype=mx.int64)
    mx.eval(head.parameters())
    return head


@pytest.fixture(params=["mlx", "cpu"])
def make_drafter(request):
    """Eagle3Drafter with the head's forwards in MLX, or on the CPU kernels where they run."""

    def make(head, embedding):
        if request.param == "mlx":
            return Eagle3Drafter(head, embedding)
        cpu_head = CpuHead.attach(head, embedding)
        if cpu_head is None:
            pytest.skip("the compiled kernels were not built")
        return Eagle3Drafter(head, embedding, cpu_head)

    return make


def sample_inputs(seed: int = 1, t: int = 12):
    rng = np.random.default_rng(seed)
    embedding = mx.array(rng.normal(size=(V, H)).astype(np.float32))
    rows = mx.array(rng.normal(size=(t, 3 * H)).astype(np.float32))
    tokens = rng.integers(0, V, size=t + 1).tolist()
    return embedding, rows, tokens


@pytest.mark.parametrize(
    "fmt, norm_before_residual",
    [("eagle", False), ("speculators", False), ("speculators", True)],
)
def test_format_round_trip_gives_same_logits(tmp_path, fmt, norm_before_residual):
    head = tiny_head(norm_before_residual=norm_before_residual)
    save_head(head, tmp_path, fmt=fmt, dtype=mx.float32)
    loaded, extras = load_head(tmp_path)
    assert extras == {}
    assert loaded.config.capture_layers == (0, 1, 2)
    assert loaded.config.norm_before_residual == norm_before_residual
    assert loaded.config.target_fingerprint == "abc"
    embedding, rows, tokens = sample_inputs()
    a = ttt_forward(head, embedding[mx.array(tokens[1:])], rows, 2)
    b = ttt_forward(loaded, embedding[mx.array(tokens[1:])], rows, 2)
    assert np.allclose(np.array(a), np.array(b), atol=1e-5)
    assert np.array_equal(np.array(head.d2t), np.array(loaded.d2t))


def test_published_eagle_names_and_aux_layer_numbering(tmp_path):
    """A SpecForge-style checkpoint: no specd section, aux ids count layer inputs."""
    head = tiny_head()
    save_head(head, tmp_path, fmt="eagle", dtype=mx.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["specd"]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_head(tmp_path)
    assert loaded.config.capture_layers == (0, 1, 2)  # outputs of the layers before
    assert loaded.config.target_fingerprint == ""


def test_bad_checkpoints_are_refused_with_reasons(tmp_path):
    head = tiny_head()
    save_head(head, tmp_path, fmt="eagle", dtype=mx.float32)
    weights = mx.load(str(tmp_path / "model.safetensors"))
    del weights["midlayer.hidden_norm.weight"]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="hidden_norm"):
        load_head(tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_head(tmp_path / "missing")


def test_training_unroll_equals_drafting_with_the_same_tokens(make_drafter):
    """Pass j at position i of the training-time test must be the j-th step of a chain drafted
    from committed position i-j, with the same input tokens."""
    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=12)
    steps = 3
    trained = np.array(ttt_forward(head, embedding[mx.array(tokens[1:])], rows, steps))
    drafter = make_drafter(head, embedding)
    for root in (0, 3, 8):
        state = drafter.open(tokens[: root + 2], rows[: root + 1])
        assert drafter.ready(state)
        hidden = mx.array(state.last_hidden)
        keys, values = mx.array(state.keys[None]), mx.array(state.values[None])
        for j in range(steps):
            i = root + j
            got = np.array(head.logits(hidden))
            assert np.allclose(got, trained[j, i], atol=1e-4), (root, j)
            emb = embedding[mx.array([tokens[i + 2]])][None]
            out, (k, v) = head.step(emb, hidden[None, None], i + 1, (keys, values), None)
            keys = mx.concatenate([keys, k], axis=2)
            values = mx.concatenate([values, v], axis=2)
            hidden = out[0, -1]


def test_incremental_extend_equals_one_open(make_drafter):
    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    whole = drafter.open(tokens[:11], rows[:10])
    parts = drafter.open(tokens[:4], rows[:3])
    drafter.extend(parts, tokens[4:7], rows[3:6])
    drafter.extend(parts, tokens[7:11], rows[6:10])
    assert parts.entries == whole.entries == 10
    assert np.allclose(np.array(parts.keys), np.array(whole.keys), atol=1e-5)
    assert np.allclose(np.array(parts.last_hidden), np.array(whole.last_hidden), atol=1e-5)


def test_state_holds_committed_context_only(make_drafter):
    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    state = drafter.open(tokens[:6], rows[:5])
    before = (state.entries, np.array(state.keys), list(state.tokens))
    drafter.chain(state, 5)
    drafter.tree(state, TreeShape(total_tokens=10, depth=4, top_k=3))
    assert state.entries == before[0] and state.tokens == before[2]
    assert np.array_equal(np.array(state.keys), before[1])


def test_drafting_past_speculative_ids_continues_the_chain(make_drafter):
    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    state = drafter.open(tokens[:8], rows[:7])
    chain = drafter.chain(state, 5).ids
    # fed the chain's own first drafts, the head continues where the chain went on
    assert drafter.chain(state, 3, after=chain[:2]).ids == chain[2:5]
    other = [(chain[0] + 1) % head.config.vocab_size]
    assert drafter.chain(state, 2, after=other).ids != []  # any token can be drafted past
    assert state.entries == 7 and state.tokens == tokens[:8]  # nothing of it is kept


def _chain_and_probabilities(head, embedding, state, k: int):
    """The chain of k drafted step by step with the head's own modules, and the probability
    the head gave each draft."""
    keys, values = mx.array(state.keys[None]), mx.array(state.values[None])
    hidden, position, d2t = mx.array(state.last_hidden), state.entries, np.array(head.d2t)
    ids, probs = [], []
    for _ in range(k):
        logits = head.logits(hidden)
        best = int(mx.argmax(logits).item())
        probs.append(float(mx.softmax(logits, axis=-1, precise=True)[best].item()))
        ids.append(best + int(d2t[best]))
        emb = embedding[mx.array([ids[-1]])][None]
        out, (k_new, v_new) = head.step(emb, hidden[None, None], position, (keys, values), None)
        keys = mx.concatenate([keys, k_new], axis=2)
        values = mx.concatenate([values, v_new], axis=2)
        hidden, position = out[0, -1], position + 1
    return ids, probs


def _drafter_of_all_sizes(make_drafter):
    """A drafter whose head gives drafts probabilities of all sizes, its state, and the chain
    of 6 with each draft's probability."""
    head = tiny_head()
    head.update({"lm_head": {"weight": head.lm_head.weight / 6}})
    mx.eval(head.parameters())
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    state = drafter.open(tokens[:8], rows[:7])
    return drafter, state, *_chain_and_probabilities(head, embedding, state, 6)


def test_a_chain_ends_before_a_draft_the_head_is_unsure_of(make_drafter):
    drafter, state, ids, probs = _drafter_of_all_sizes(make_drafter)
    assert drafter.chain(state, 6).ids == ids
    assert drafter.chain(state, 6, p_min=0.0).ids == ids
    cuts = set()
    # thresholds halfway between the probabilities, clear of their float32 rounding
    levels = sorted({0.0, *probs[1:], 1.0})
    for p_min in [(a + b) / 2 for a, b in itertools.pairwise(levels) if b - a > 1e-4]:
        if not 0 < p_min < 1:
            continue
        cut = next((j for j in range(1, 6) if probs[j] < p_min), 6)
        assert drafter.chain(state, 6, p_min=p_min).ids == ids[:cut], (p_min, probs)
        cuts.add(cut)
    assert len(cuts) > 1  # the thresholds cut the chain at different drafts
    assert len(drafter.chain(state, 6, p_min=0.999).ids) >= 1  # the first draft always goes


def test_tree_with_one_child_per_node_is_the_chain(make_drafter):
    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    state = drafter.open(tokens[:8], rows[:7])
    chain = drafter.chain(state, 4)
    tree = drafter.tree(state, TreeShape(total_tokens=4, depth=4, top_k=1))
    assert tree.ids == chain.ids
    assert tree.parents == [-1, 0, 1, 2]


def test_a_one_child_tree_is_drafted_as_the_chain_it_is(make_drafter):
    from drafter_svc.eagle3.proposer import Eagle3Options, Eagle3Proposer

    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    proposer = Eagle3Proposer(drafter, Eagle3Options(), "test")
    state = drafter.open(tokens[:8], rows[:7])
    chain = drafter.chain(state, 3)
    narrow = proposer.propose(state, 3, tree=TreeShape(total_tokens=16, depth=5, top_k=1))
    single = proposer.propose(state, 3, tree=TreeShape(total_tokens=1, depth=5, top_k=4))
    assert narrow.ids == chain.ids and narrow.parents is None  # verified as a plain chain
    assert single.ids == chain.ids[:1] and single.parents is None


def test_a_one_child_tree_ends_where_the_chain_ends_at_the_heads_doubt(make_drafter):
    from drafter_svc.eagle3.proposer import Eagle3Options, Eagle3Proposer

    drafter, state, _, probs = _drafter_of_all_sizes(make_drafter)
    p_min = (min(probs[1:]) + max(probs[1:])) / 2  # cuts the chain before some later draft
    cut = next(j for j in range(1, 6) if probs[j] < p_min)
    proposer = Eagle3Proposer(drafter, Eagle3Options(draft_p_min=p_min), "test")
    narrow = proposer.propose(state, 6, tree=TreeShape(total_tokens=16, depth=6, top_k=1))
    assert narrow.ids == drafter.chain(state, 6, p_min=p_min).ids
    assert len(narrow.ids) == cut < 6


def test_tree_is_ancestor_closed_parents_first_within_budget(make_drafter):
    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    state = drafter.open(tokens[:8], rows[:7])
    tree = drafter.tree(state, TreeShape(total_tokens=12, depth=5, top_k=3))
    assert len(tree.ids) == 12
    assert all(p < i for i, p in enumerate(tree.parents))
    assert sum(p == -1 for p in tree.parents) >= 1
    siblings = {}
    for i, p in enumerate(tree.parents):
        siblings.setdefault(p, []).append(tree.ids[i])
    assert all(len(set(s)) == len(s) for s in siblings.values())  # no duplicate children
    assert_likeliest_line_first(tree.parents, tree.scores)


def test_a_probability_floor_keeps_the_trees_likelier_nodes_alone(make_drafter):
    """--tree-min-prob: the tree is the whole tree's nodes of path probability at the floor or
    above (its first draft always), the same tokens under the same parents, so a floor changes
    which rows are verified and nothing else."""
    import math

    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    state = drafter.open(tokens[:8], rows[:7])
    shape = TreeShape(total_tokens=12, depth=4, top_k=3)
    whole = drafter.tree(state, shape)
    logp = whole.scores  # each node's path log-probability, as sent
    assert len(logp) == len(whole.ids) == 12
    sizes = set()
    for prob in sorted({math.exp(x) for x in logp}):
        cut = drafter.tree(state, shape, min_prob=prob * 0.999)
        kept = [i for i in range(len(whole.ids)) if i == 0 or logp[i] >= math.log(prob * 0.999)]
        assert cut.ids == [whole.ids[i] for i in kept]
        assert cut.parents == [-1 if whole.parents[i] < 0 else kept.index(whole.parents[i])
                               for i in kept]  # fmt: skip
        sizes.add(len(cut.ids))
    assert len(sizes) > 3
    assert drafter.tree(state, shape, min_prob=0.999).ids == whole.ids[:1]


def test_tree_nodes_match_a_plain_chain_along_each_path(make_drafter):
    """The drafter's tree attention: the best child of every node equals what a chain drafted
    along that node's path would propose next."""
    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=10)
    drafter = make_drafter(head, embedding)
    state = drafter.open(tokens[:8], rows[:7])
    tree = drafter.tree(state, TreeShape(total_tokens=40, depth=3, top_k=3))
    ids, parents = tree.ids, tree.parents

    def path(i):
        out = []
        while i >= 0:
            out.append(ids[i])
            i = parents[i]
        return out[::-1]

    for node in range(len(ids)):
        children = [c for c, p in enumerate(parents) if p == node]
        if not children:
            continue
        # replay the node's path as forced chain steps and compare the argmax
        hidden = mx.array(state.last_hidden)
        keys, values = mx.array(state.keys[None]), mx.array(state.values[None])
        position = state.entries
        for token in path(node):
            emb = embedding[mx.array([token])][None]
            out, (k, v) = head.step(emb, hidden[None, None], position, (keys, values), None)
            keys = mx.concatenate([keys, k], axis=2)
            values = mx.concatenate([values, v], axis=2)
            hidden = out[0, -1]
            position += 1
        best = int(mx.argmax(head.logits(hidden)).item())
        best_target = int(best + np.array(head.d2t)[best])
        assert ids[children[0]] == best_target


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_cpu_forwards_match_mlx(norm_before_residual):
    """The head on numpy and the compiled kernels: the same entries, hidden rows and drafts as
    in MLX, for a long open (MLX's sgemm either way), extends of a few rows, chains and
    trees."""
    head = tiny_head(norm_before_residual=norm_before_residual)
    embedding, rows, tokens = sample_inputs(t=40)
    cpu_head = CpuHead.attach(head, embedding)
    if cpu_head is None:
        pytest.skip("the compiled kernels were not built")
    on_mlx, on_cpu = Eagle3Drafter(head, embedding), Eagle3Drafter(head, embedding, cpu_head)
    # 20 rows open past MAX_ROWS (MLX either way); the extends run on the CPU kernels
    states = [d.open(tokens[:21], rows[:20]) for d in (on_mlx, on_cpu)]
    for start, stop in ((21, 24), (24, 25), (25, 41)):
        for drafter, state in zip((on_mlx, on_cpu), states, strict=True):
            drafter.extend(state, tokens[start:stop], rows[start - 1 : stop - 1])
        a, b = states
        assert a.entries == b.entries == stop - 1
        assert np.allclose(a.keys, b.keys, atol=1e-5) and np.allclose(a.values, b.values, atol=1e-5)
        assert np.allclose(a.last_hidden, b.last_hidden, atol=1e-4)
        assert on_mlx.chain(a, 6).ids == on_cpu.chain(b, 6).ids
        past = on_mlx.chain(a, 2).ids
        assert on_mlx.chain(a, 4, after=past).ids == on_cpu.chain(b, 4, after=past).ids
        shape = TreeShape(total_tokens=12, depth=4, top_k=3)
        trees = on_mlx.tree(a, shape), on_cpu.tree(b, shape)
        assert trees[0].ids == trees[1].ids and trees[0].parents == trees[1].parents


def test_cpu_forwards_need_a_head_size_the_kernels_take():
    cfg = tiny_head().config
    cfg.num_attention_heads, cfg.num_key_value_heads = 8, 4  # head size 4
    embedding, _, _ = sample_inputs()
    assert CpuHead.attach(Eagle3Head(cfg), embedding) is None


def test_a_padded_batch_trains_on_what_each_conversation_alone_would():
    """ttt_forward over conversations padded to one length: every real position's logits
    equal those of the conversation alone (causal attention keeps padding out)."""
    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=14)
    lengths = (13, 7, 10)
    width = max(lengths)
    emb = mx.zeros((len(lengths), width, embedding.shape[-1]))
    feats = mx.zeros((len(lengths), width, rows.shape[-1]))
    for b, n in enumerate(lengths):
        emb[b, :n] = embedding[mx.array(tokens[1 : n + 1])]
        feats[b, :n] = rows[:n]
    batched = np.array(ttt_forward(head, emb, feats, 3))
    assert batched.shape[:3] == (3, len(lengths), width)
    for b, n in enumerate(lengths):
        alone = np.array(ttt_forward(head, embedding[mx.array(tokens[1 : n + 1])], rows[:n], 3))
        assert np.allclose(batched[:, b, :n], alone, atol=1e-4), b


class _NoMlx:
    """Stands for `mlx.core` where a module must not use it: any use fails the test."""

    class array:  # noqa: N801 - isinstance checks pass through; making one fails
        def __new__(cls, *args, **kwargs):
            raise AssertionError("an MLX array made in a round on the host")

    def __getattr__(self, name):
        raise AssertionError(f"mx.{name} used in a round on the host")


def test_a_round_on_the_host_head_runs_no_mlx_op(monkeypatch):
    """On a GPU an MLX op of the drafter's would wait behind the verifier's forwards: with
    the head on the host, the rows a round receives stay numpy and the round runs no MLX op."""
    from drafter_svc.eagle3 import cpu_head as cpu_head_module
    from drafter_svc.eagle3 import draft as draft_module
    from specd.cpu import llama as llama_module

    head = tiny_head()
    embedding, rows, tokens = sample_inputs(t=12)
    host = CpuHead.attach(head, embedding)
    if host is None:
        pytest.skip("the compiled kernels were not built")
    by_mlx_rows = Eagle3Drafter(head, embedding, host)
    by_numpy_rows = Eagle3Drafter(head, embedding, host)
    expected = by_mlx_rows.open(tokens[:8], rows[:7])
    state = by_numpy_rows.open(tokens[:8], np.array(rows[:7]))
    by_mlx_rows.extend(expected, tokens[8:10], rows[7:9])
    for module in (draft_module, cpu_head_module, llama_module):
        monkeypatch.setattr(module, "mx", _NoMlx())
    by_numpy_rows.extend(state, tokens[8:10], np.array(rows[7:9]))
    drafts = by_numpy_rows.chain(state, 4).ids
    monkeypatch.undo()
    assert isinstance(state.pending_rows, np.ndarray | None)
    assert drafts == by_mlx_rows.chain(expected, 4).ids and len(drafts) == 4


def assert_likeliest_line_first(parents, scores):
    """Depth-first: a node's first child follows it; siblings likeliest first."""
    children = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    for node, kids in children.items():
        if node >= 0:
            assert kids[0] == node + 1
        assert [scores[k] for k in kids] == sorted((scores[k] for k in kids), reverse=True)
