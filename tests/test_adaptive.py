import pytest

from coordinator.adaptive import (
    AdaptiveK,
    LinearCost,
    RankAcceptance,
    SpeculationCosts,
    TreeLimits,
    best_trees,
    expected_tokens,
)


def test_linear_cost_recovers_a_line():
    cost = LinearCost(base=1.0, per_token=1.0)
    for _ in range(5):
        for n in (1, 3, 5, 9):
            cost.observe(n, 0.05 + 0.007 * n)
    assert cost.predict(1) == pytest.approx(0.057, rel=1e-6)
    assert cost.predict(12) == pytest.approx(0.05 + 0.084, rel=1e-6)


def test_linear_cost_with_one_n_keeps_the_prior_ratio():
    cost = LinearCost(base=0.06, per_token=0.006)
    cost.observe(1, 0.1)
    assert cost.predict(1) == pytest.approx(0.1)
    assert cost.predict(2) > cost.predict(1)


def test_sizes_seen_are_priced_by_their_own_mean_not_the_line():
    cost = LinearCost(base=0.06, per_token=0.006)
    for _ in range(10):  # a concave cost, as a CPU verify is: 1, 5 and 17 tokens
        for n, seconds in ((1, 0.060), (5, 0.095), (17, 0.130)):
            cost.observe(n, seconds)
    assert cost.predict(5) == pytest.approx(0.095)  # the line through all three says ~0.074
    assert cost.predict(1) == pytest.approx(0.060)
    line = cost.predict(9)  # not seen: from the fitted line
    assert 0.07 < line < 0.11
    once = LinearCost(base=0.06, per_token=0.006)
    for _ in range(5):
        once.observe(1, 0.06)
        once.observe(9, 0.11)
    once.observe(3, 0.5)  # one observation of a size is not yet trusted on its own
    assert once.predict(3) < 0.2


def test_expected_tokens():
    assert expected_tokens(0, 0.9) == 1
    assert expected_tokens(3, 0.0) == 1
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


def chooser(acceptance: float, trials: float = 50.0) -> AdaptiveK:
    costs = SpeculationCosts()
    for n in range(1, 10):  # the CPU measured in docs/history: 57 ms + ~6.5 ms a token
        costs.verify.observe(n, 0.057 + 0.0065 * (n - 1))
    return AdaptiveK(costs, k_max=8, successes=acceptance * trials, trials=trials)


def test_k_follows_acceptance():
    assert chooser(0.02).choose(100) == 0
    assert 1 <= chooser(0.5).choose(100) <= 4
    assert chooser(0.95).choose(100) == 8
    assert chooser(0.95).choose(3) == 3  # never past what is still wanted


def test_probes_after_rounds_without_drafts_and_learns():
    k = chooser(0.02)
    for _ in range(k.probe_every):
        assert k.choose(100) == 0
        k.observe(0, 0, 0)
    assert k.choose(100) == k.probe_tokens  # a cheap probe
    for _ in range(20):  # drafts start matching
        k.observe(8, 8, 8)
    assert k.acceptance > 0.9 and k.choose(100) == 8


def test_best_trees_take_nodes_by_path_product():
    chain = best_trees([0.5], budget=3, max_depth=8)  # one child per node: a chain
    assert [round(e, 3) for e, _, _ in chain] == [0.5, 0.75, 0.875]
    assert [(d, w) for _, d, w in chain] == [(1, 1), (2, 1), (3, 1)]
    wide = best_trees([0.4, 0.2], budget=3, max_depth=8)
    # the second-best root child (0.2) beats the best child's child (0.16), then the latter
    assert [round(e, 3) for e, _, _ in wide] == [0.4, 0.6, 0.76]
    assert [(d, w) for _, d, w in wide] == [(1, 1), (1, 2), (2, 2)]
    assert [d for _, d, _ in best_trees([0.9], budget=5, max_depth=2)] == [1, 2]  # depth-capped


def test_rank_acceptance_follows_the_kept_path():
    ranks = RankAcceptance([0.0] * 3, [0.0] * 3, decay=1.0)
    ids = [10, 11, 12, 20, 21]
    parents = [-1, -1, -1, 1, 1]  # three root children; two under the second
    ranks.observe_path(ids, parents, [11, 21, 99])  # 2nd child, then 2nd child, then a leaf
    assert ranks.hits == [0, 2, 0] and ranks.trials == [2, 2, 1]
    ranks.observe_path(ids, parents, [13, 5])  # no root child held the target's token
    assert ranks.hits == [0, 2, 0] and ranks.trials == [3, 3, 2]


def tree_chooser(p: list[float]) -> AdaptiveK:
    costs = SpeculationCosts()
    # this CPU's concave verify: 4 tokens ~1.3x one, 16 tokens ~1.85x (docs/history)
    for n, seconds in ((1, 0.060), (2, 0.071), (3, 0.075), (4, 0.078), (5, 0.080), (17, 0.111)):
        for _ in range(3):
            costs.verify.observe(n, seconds)
    for _ in range(3):
        costs.draft.observe(1, 0.004)
        costs.draft.observe(2, 0.006)
    limits = TreeLimits(total_tokens=16, depth=5, top_k=4, make=dict)
    ranks = RankAcceptance([x * 100 for x in p], [100.0] * len(p))
    return AdaptiveK(costs, k_max=5, tree=limits, ranks=ranks)


def test_trees_choose_their_size_from_rank_acceptance_and_cost():
    assert tree_chooser([0.05, 0.02, 0.01, 0.01]).choose(100) == 0  # nothing pays
    assert tree_chooser([0.05, 0.02, 0.01, 0.01]).tree_shape is None
    wide = tree_chooser([0.40, 0.20, 0.10, 0.08])  # the runners-up often right: go wide
    assert wide.choose(100) >= 1 and wide.tree_shape["top_k"] >= 2
    deep = tree_chooser([0.95, 0.01, 0.01, 0.01])  # the best guess nearly always right
    assert deep.choose(100) == 5 and deep.tree_shape["top_k"] == 1
    assert deep.choose(2) == 2 and deep.tree_shape["depth"] == 2  # never past what is wanted


def test_a_tree_probe_asks_for_a_tree_of_probe_tokens_nodes():
    k = tree_chooser([0.05, 0.02, 0.01, 0.01])
    for _ in range(k.probe_every):
        assert k.choose(100) == 0
        k.observe(0, 0, 0)
    assert k.choose(100) >= 1 and k.probing
    assert k.tree_shape["total_tokens"] == k.probe_tokens  # 1 node, not a 16-token tree


def _rounds_until_probe(k: AdaptiveK) -> int:
    waited = 0
    while k.choose(100) == 0:
        k.observe(0, 0, 0)
        waited += 1
    return waited


def test_rejected_probes_back_off_and_an_accepted_one_resets():
    k = chooser(0.02)
    waits = []
    for _ in range(5):
        waits.append(_rounds_until_probe(k))
        k.observe(k.probe_tokens, k.probe_tokens, 0)  # the probe is wholly rejected
    assert waits == [8, 16, 32, 64, 64]
    assert _rounds_until_probe(k) == 64
    k.successes, k.trials = 0.9 * k.break_even() * 50, 50.0  # near break-even again
    k.observe(k.probe_tokens, k.probe_tokens, 1)  # one draft accepted
    while k.choose(100):  # the estimate may now call for drafts; let it fall back
        k.observe(2, 2, 0)
    k.observe(0, 0, 0)
    assert _rounds_until_probe(k) == 7  # the wait is back to probe_every


def test_a_kept_probe_of_a_drafter_far_below_break_even_keeps_the_wait():
    """A one-draft probe is kept as often as the first draft is right (half the time for the
    EAGLE-3 head on an H200, where break-even is ~0.75): no reason to probe every 8 rounds,
    cutting plain bursts short."""
    k = chooser(0.02)
    for _ in range(4):
        _rounds_until_probe(k)
        k.observe(k.probe_tokens, k.probe_tokens, 0)
    assert _rounds_until_probe(k) == 64
    k.observe(k.probe_tokens, k.probe_tokens, 1)
    assert k.acceptance < k.hopeless_below * k.break_even()
    assert _rounds_until_probe(k) == 64
    tree = tree_chooser([0.05, 0.02, 0.01, 0.01])  # trees: a kept node still resets it
    _rounds_until_probe(tree)
    tree.observe(1, 1, 0)
    assert _rounds_until_probe(tree) == 16
    tree.observe(1, 1, 1)
    assert _rounds_until_probe(tree) == 8


def test_break_even_is_where_drafting_starts_to_pay():
    k = chooser(0.5)
    even = k.break_even()
    assert 0.05 < even < 0.5
    for acceptance, drafts in ((even * 0.97, False), (even * 1.03, True)):
        k.successes, k.trials = acceptance * 50, 50.0
        assert (k.choose(100) > 0) == drafts
    dear = chooser(0.5)
    for n in range(2, 10):  # a verify of several tokens dearer than what drafts could save
        for _ in range(2):
            dear.costs.verify.observe(n, 10.0)
            dear.costs.verify.observe(1, 0.057)  # a plain step's price kept fresh
    assert dear.break_even() == 1.0


def test_a_drafter_near_break_even_keeps_probing_after_a_rejected_probe():
    """The EAGLE-3 head on this CPU is right about half the time, near break-even: a rejected
    probe there must not stretch the wait to 64 rounds, as it does for a hopeless drafter."""
    k = chooser(0.5)
    k.successes, k.trials = 0.85 * k.break_even() * 50, 50.0  # just below break-even
    waits = []
    for _ in range(3):
        waited = 0
        while k.choose(100) == 0:
            k.observe(0, 0, 0)
            waited += 1
        waits.append(waited)
        k.observe(k.probe_tokens, k.probe_tokens, 0)
    assert waits == [8, 8, 8]


def test_empty_proposals_do_not_count_as_rejections():
    k = chooser(0.5)
    before = k.acceptance
    k.observe(8, 0, 0)
    assert k.acceptance == before


def test_new_sessions_start_from_the_drafters_recent_acceptance():
    costs = SpeculationCosts()
    first = AdaptiveK.for_session(costs, k_max=8)
    assert first.acceptance == pytest.approx(0.5)  # no evidence yet: the fixed prior
    for _ in range(4):  # a weak drafter: one draft in five accepted
        first.observe(asked=2, drafted=2, accepted=0)
    assert AdaptiveK.for_session(costs, k_max=8).acceptance == pytest.approx(0.5)  # 4 trials
    for _ in range(20):
        first.observe(asked=2, drafted=2, accepted=1)  # 1 accepted, then 1 rejected
        for _ in range(3):
            first.observe(asked=2, drafted=2, accepted=0)
    shared = costs.acceptance.successes / costs.acceptance.trials
    assert 0.1 < shared < 0.25
    later = AdaptiveK.for_session(costs, k_max=8)
    assert later.acceptance == pytest.approx(shared) and later.trials == 2.0
    # with an EAGLE-3 round's costs measured here (docs/history, 2026-11-30) a fresh
    # session of this drafter no longer drafts blindly
    for _ in range(5):
        costs.verify.observe(1, 0.059)
        costs.verify.observe(2, 0.070)
        costs.draft.observe(1, 0.0067)
    assert later.choose(100) == 0
    assert AdaptiveK(costs, k_max=8).choose(100) > 0  # the fixed prior would have


def test_a_session_of_a_drafter_far_below_break_even_starts_with_the_longest_wait():
    """A new chain session does not probe every 8 rounds anew when the drafter's recent
    sessions say its drafts are far from paying; near break-even it probes as before."""

    def priced(acceptance: float) -> SpeculationCosts:
        costs = chooser(0.5).costs  # a verify of n tokens: 57 ms + 6.5 ms a token
        costs.acceptance.successes, costs.acceptance.trials = acceptance * 50, 50.0
        return costs

    far = AdaptiveK.for_session(priced(0.02), k_max=8)
    assert far.acceptance < far.hopeless_below * far.break_even()
    assert _rounds_until_probe(far) == far.probe_every_max
    near = AdaptiveK.for_session(priced(0.9 * chooser(0.5).break_even()), k_max=8)
    assert _rounds_until_probe(near) == near.probe_every
    dear = chooser(0.5).costs
    for n in range(2, 10):  # drafts that could never pay at these prices
        for _ in range(2):
            dear.verify.observe(n, 10.0)
            dear.verify.observe(1, 0.057)
    dear.acceptance.successes, dear.acceptance.trials = 4.5, 9.0  # under min_trials
    assert AdaptiveK.for_session(dear, k_max=8).probe_wait == 0  # no history, no guess
    dear.acceptance.successes, dear.acceptance.trials = 25.0, 50.0
    assert AdaptiveK.for_session(dear, k_max=8).probe_wait == 64


def h200_costs(shared_acceptance: float) -> SpeculationCosts:
    """Prices like the served H200 rounds of run AJ (docs/gpu.md): a plain step 4.3 ms, a
    verify of drafts 2.5 ms dearer plus 0.8 ms a token, the head's chain 1.2 + 0.3 ms a draft
    (break-even ~0.72), and the drafter's recent sessions' acceptance."""
    costs = SpeculationCosts()
    for _ in range(3):
        for n in range(1, 8):
            costs.verify.observe(n, 0.0043 + 0.0008 * (n - 1) + (0.0025 if n > 1 else 0))
        for k in range(1, 7):
            costs.draft.observe(k, 0.0012 + 0.0003 * k)
    costs.acceptance.successes, costs.acceptance.trials = shared_acceptance * 50, 50.0
    return costs


def test_a_kept_probe_from_a_fresh_sessions_prior_keeps_the_long_wait():
    """The head right half the time on an H200: the session starts at the longest wait, and a
    kept first probe (which lifts a two-trial estimate from 0.5 to 0.67) leaves it there."""
    k = AdaptiveK.for_session(h200_costs(0.5), k_max=6)
    assert 0.65 < k.break_even() < 0.8 and k.probe_wait == k.probe_every_max
    assert _rounds_until_probe(k) == 64
    k.observe(k.probe_tokens, k.probe_tokens, 1)
    assert _rounds_until_probe(k) == 64
    text = AdaptiveK.for_session(h200_costs(0.5), k_max=6, text_driven=True)  # n-gram
    tree = AdaptiveK.for_session(h200_costs(0.5), k_max=6, tree=TreeLimits(16, 5, 4, dict))
    assert text.probe_wait == tree.probe_wait == 0  # both probe from the start as before


def test_tree_limits_come_from_a_shape_and_make_the_same_kind():
    from drafter_svc.proposal import TreeShape

    assert TreeLimits.of(None) is None and TreeLimits.of(TreeShape(total_tokens=0)) is None
    limits = TreeLimits.of(TreeShape(total_tokens=12, depth=0, top_k=0), default_top_k=3)
    assert (limits.total_tokens, limits.depth, limits.top_k) == (12, 0, 3)
    assert limits.make(total_tokens=2, depth=1, top_k=2) == TreeShape(2, 1, 2)


def test_a_slow_spell_does_not_keep_a_session_drafting_at_a_loss():
    # a spell of the host made plain steps cost 100 ms; afterwards they cost 16 ms and a
    # one-draft round 24 ms (+3.5 ms drafting) for 1.33 tokens: drafting loses
    costs = SpeculationCosts()
    for _ in range(60):
        costs.verify.observe(1, 0.100)
    k = AdaptiveK(costs, k_max=4, successes=0.33 * 50, trials=50.0)
    chosen = []
    for _ in range(80):
        chosen.append(k.choose(100))
        if chosen[-1] == 0:
            k.observe_plain(1)
            costs.verify.observe(1, 0.016)
        else:
            k.observe(chosen[-1], chosen[-1], 1 if k.acceptance > 0.3 else 0)
            costs.verify.observe(chosen[-1] + 1, 0.024 + 0.004 * (chosen[-1] - 1))
            costs.draft.observe(chosen[-1], 0.0035)
    assert chosen[0] > 0  # the stale 100 ms makes drafting look cheap at first
    first_plain = chosen.index(0)
    assert first_plain <= k.cost_probe_every  # a cost probe re-prices the plain step
    assert chosen[first_plain : first_plain + k.probe_every] == [0] * k.probe_every


def test_sizes_not_seen_lately_are_priced_by_the_line_again():
    cost = LinearCost(base=0.06, per_token=0.006, stale_after=5)
    for _ in range(3):
        cost.observe(1, 0.100)
    assert cost.predict(1) == pytest.approx(0.100)
    for _ in range(6):
        cost.observe(2, 0.024)
    assert cost.predict(1) < 0.05  # the line now; the old mean is stale
    for _ in range(3):
        cost.observe(1, 0.016)
    assert cost.predict(1) == pytest.approx(0.016)  # stale means restart from fresh ones


def test_a_priced_cut_keeps_the_nodes_worth_their_rows():
    import math

    from coordinator.adaptive import priced_cut

    # a verify of 1-2 tokens costs 10-11, of 3-4 tokens 19, of 5 or more 30 (the CPU kernels'
    # row groups); nodes listed parents first: 0 <- 1 <- 2, and 3, 4 children of the root
    scores = [math.log(p) for p in [0.9, 0.9 * 0.6, 0.9 * 0.6 * 0.5, 0.05, 0.02]]
    steps = {1: 10.0, 2: 11.0, 3: 19.0, 4: 19.0}

    def price(tokens):
        return steps.get(tokens, 30.0)

    # 1 + 0.9 over 11 beats 1 + 0.9 + 0.54 (+ 0.27) over 19, and the whole tree over 30
    assert priced_cut(scores, price) == [0]
    # a round that cost 20 already: the rows are cheap beside it, the likely line pays
    assert priced_cut(scores, price, paid=20.0) == [0, 1, 2]
    flat = priced_cut(scores, lambda tokens: 10.0)  # rows free: every node
    assert flat == [0, 1, 2, 3, 4]
    assert priced_cut(scores, lambda tokens: 10.0 * tokens) == []  # a row costs a token
    # a child tied with its parent comes after it, so the kept nodes hold their ancestors
    assert priced_cut([0.0, 0.0, 0.0], lambda tokens: 10.0 + tokens) == [0, 1, 2]
    assert priced_cut([0.0, 0.0, 0.0], lambda tokens: 10.0 + (tokens > 2) * 100.0) == [0]


def test_a_drafted_tree_is_cut_at_the_measured_prices_and_its_parents_renumbered():
    import math

    from coordinator.rounds import Drafted, cut_at_prices

    prices = LinearCost(base=0.06, per_token=0.006)
    for _ in range(4):  # every size priced by its own mean: 1-3 tokens cheap, more dear
        for tokens in range(1, 8):
            prices.observe(tokens, 0.010 if tokens <= 3 else 0.030)
    # root -> 0 (0.9) -> 2 (0.8); root -> 1 (0.3) -> 3; 0 -> 4; 2 -> 5
    parents = [-1, -1, 0, 1, 0, 2]
    probs = [0.9, 0.3, 0.9 * 0.8, 0.3 * 0.5, 0.9 * 0.1, 0.72 * 0.2]
    tree = Drafted([10, 11, 12, 13, 14, 15], None, 0.5, parents, [math.log(p) for p in probs])
    cut = cut_at_prices(tree, prices, paid=0.001)
    assert cut.ids == [10, 12] and cut.parents == [-1, 0]
    assert cut.scores == [tree.scores[0], tree.scores[2]] and cut.compute_s == 0.5
    chain = Drafted([10, 12, 14])  # no parents: a chain is never cut
    assert cut_at_prices(chain, prices, 0.001) is chain
    unscored = Drafted(tree.ids, None, 0.0, parents)  # a drafter that sends no scores
    assert cut_at_prices(unscored, prices, 0.001) is unscored
    sampled = Drafted(tree.ids, object(), 0.0, parents, tree.scores)  # q rows: kept whole
    assert cut_at_prices(sampled, prices, 0.001) is sampled
    # scores a drafter got wrong: too few, not finite, or a tree not listed parents first
    for scores in (tree.scores[:-1], [*tree.scores[:-1], math.nan]):
        bad = Drafted(tree.ids, None, 0.0, parents, scores)
        assert cut_at_prices(bad, prices, 0.001) is bad
    unordered = Drafted(tree.ids, None, 0.0, [-1, 2, 0, 1, 0, 2], tree.scores)
    assert cut_at_prices(unordered, prices, 0.001) is unordered
    # a child scored above its parent counts at its parent's score, so the kept nodes hold
    # their ancestors: node 2 (0.9) under node 0 (0.2) would otherwise be kept without it
    inverted = Drafted([10, 11, 12], None, 0.0, [-1, -1, 0], [math.log(0.2), -0.5, -0.1])
    cut = cut_at_prices(inverted, prices, 0.001)
    assert cut.ids == [10, 11] and cut.parents == [-1, -1]
    # adaptive k keeps a node, where the prices would keep none
    dear = LinearCost(base=0.06, per_token=0.006)
    for _ in range(4):
        for tokens in range(1, 8):
            dear.observe(tokens, 0.010 * tokens)
    assert cut_at_prices(tree, dear, 0.001).ids == []
    assert cut_at_prices(tree, dear, 0.001, least=1).ids == [10]
