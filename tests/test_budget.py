"""The draft tree budgeted across the heads, prompt lookup and the datastore (mlx_stream/budget.py)."""

import itertools

import numpy as np
import pytest

from mlx_stream.budget import PRIORS, BudgetDrafter, head_values, plan_budget
from mlx_stream.cost import StepCosts
from mlx_stream.speculation import candidate_trees


def test_plan_budget_is_the_best_plan_when_cost_depends_on_the_node_count():
    rng = np.random.default_rng(0)
    for _ in range(200):
        values = [sorted(rng.random(rng.integers(0, 5)), reverse=True) for _ in range(3)]
        slope = rng.uniform(0.02, 0.4)
        cost = lambda c, s=slope: 1.0 + s * sum(c)  # noqa: E731
        got = plan_budget(values, cost)
        best = max(
            (1 + sum(sum(v[:k]) for v, k in zip(values, ks))) / cost(ks)
            for ks in itertools.product(*(range(len(v) + 1) for v in values))
        )
        assert (1 + sum(sum(v[:k]) for v, k in zip(values, got))) / cost(got) == pytest.approx(best)
    assert plan_budget([[0.9, 0.8, 0.1], [0.5]], lambda c: 1 + 0.2 * sum(c)) == [2, 1]
    assert plan_budget([[0.05]], lambda c: 1 + 0.2 * sum(c)) == [0]  # nothing pays
    assert plan_budget([[], []], lambda c: 1.0) == [0, 0]


def test_step_costs_interpolate_and_add_the_heads_drafting():
    c = StepCosts({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.1}, t1_ms=100.0, draft_ms={1: 10.0, 3: 30.0})
    assert c.forward(1) == 1.0 and c.forward(3) == pytest.approx(1.2) and c.forward(16) == pytest.approx(3.7)
    assert c.step([0, 2]) == pytest.approx(1.2)  # chains cost only the forward
    assert c.step([3, 1]) == pytest.approx(c.forward(5) + 0.3)


def test_head_values_of_the_shipped_heads():
    from mlx_stream.heads import load_heads
    from mlx_stream.loader import default_heads_path

    heads = load_heads(default_heads_path("smollm2-135m-instruct"))
    cands = head_values(candidate_trees(heads))
    assert [t.size - 1 for t, _ in cands] == list(range(1, 16))
    values = [v for _, v in cands]
    assert values == sorted(values, reverse=True) and 0.4 < values[0] < 0.6
    taus = heads.config.tree_taus
    assert 1 + values[0] == pytest.approx(taus["0"])


@pytest.fixture()
def budget_model(tiny, tmp_path, monkeypatch):
    from mlx_stream.heads import new_heads

    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path / "cache"))
    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=5, architecture="hydra")
    model.heads.config.tree = "0"
    model.heads.config.tree_taus = {"0": 1.5, "0;0,0": 1.8, "0;1;0,0": 1.9}
    return model, tok


def test_budgeted_decoding_is_lossless_and_mixes_sources(budget_model):
    from helpers import mlx_lm_greedy, ours

    from mlx_stream.datastore import Datastore
    from mlx_stream.speculation import make_drafter

    model, tok = budget_model
    costs = StepCosts({1: 1.0, 2: 1.05, 4: 1.15, 8: 1.35, 16: 1.75, 32: 2.55}, t1_ms=10.0)
    for prompt in ("Speculative decoding drafts several tokens", "The quick brown fox"):
        ids = tok.encode(prompt)
        ref = list(mlx_lm_greedy(model.backbone, tok, ids, 40))
        wrong = Datastore.from_sequences([[(t + 1) % 50 for t in ref], ref[::-1]] * 2)
        for store in (Datastore.from_sequences([ref] * 2), wrong, None):
            d = BudgetDrafter(
                model,
                costs,
                make_drafter(model, "0", 0),
                candidates=candidate_trees(model.heads),
                store=store,
            )
            got, _ = ours(model, tok, ids, 40, drafter=d)
            assert got == ref
        got, _ = ours(model, tok, ids, 40, tree="budget")  # measured costs, cached for this device
        assert got == ref
    # the right store is drafted and accepted: far fewer forward passes than heads alone
    d = BudgetDrafter(
        model,
        costs,
        make_drafter(model, "0", 0),
        candidates=candidate_trees(model.heads),
        store=Datastore.from_sequences([ref] * 2),
    )
    _, rs = ours(model, tok, ids, 40, drafter=d)
    _, plain = ours(model, tok, ids, 40, tree="0", prompt_lookup=0)
    assert rs[-1].forward_passes < plain[-1].forward_passes / 2
    assert d.acceptance("store", 2) > PRIORS["store"][0]  # its chain was accepted where drafted


def test_budget_proposes_both_chains_and_learns_their_acceptance(budget_model):
    import mlx.core as mx

    from mlx_stream.datastore import Datastore
    from mlx_stream.speculation import make_drafter

    model, tok = budget_model
    costs = StepCosts({1: 1.0, 2: 1.02, 32: 1.62}, t1_ms=10.0)
    store = Datastore.from_sequences([[7, 8, 30, 31, 32, 33]] * 3)
    d = BudgetDrafter(
        model,
        costs,
        make_drafter(model, "0", 0),
        candidates=candidate_trees(model.heads),
        store=store,
        num_draft=4,
    )
    hidden = mx.zeros((model.args.hidden_size,))
    ctx = [
        5,
        7,
        8,
        20,
        21,
        22,
        23,
        9,
        7,
        8,
    ]  # the context's copy: 20 21 (a 2-token match); the store's: 30 31 ..
    tree, drafts = d.propose(hidden, ctx, max_depth=8)
    toks = np.array(drafts).tolist()
    # the heads' 3-node tree (cheap nodes), the copy (2 tokens), the store's chain while p^k pays
    assert tree.size == 1 + 3 + 2 + 3
    assert [toks[i - 1] for i in range(1, tree.size) if tree.depths[i] == 1][-2:] == [20, 30]
    # the step emits the store's continuation: its estimate rises, the copy's falls
    before = (d.acceptance("store", 2), d.acceptance("context", 2))
    node_tokens = [8] + toks
    d.observe(tree, node_tokens, [30, 31, 32, 33, 1])
    assert d.acceptance("store", 2) > before[0] and d.acceptance("context", 2) < before[1]
    # expensive nodes: the budget keeps only what pays (nothing here: tiny values, costly nodes)
    dear = BudgetDrafter(
        model,
        StepCosts({1: 1.0, 2: 1.9, 32: 31.0}, 10.0),
        make_drafter(model, "0", 0),
        candidates=candidate_trees(model.heads),
    )
    tree, _ = dear.propose(hidden, [1, 2, 3], max_depth=8)
    assert tree.size == 1


def test_budget_learns_what_steps_cost_and_tries_drafting_again(budget_model):
    import mlx.core as mx

    from mlx_stream.speculation import make_drafter

    model, tok = budget_model
    costs = StepCosts({1: 1.0, 2: 1.05, 32: 2.0}, t1_ms=10.0)
    d = BudgetDrafter(model, costs, make_drafter(model, "0", 0), candidates=candidate_trees(model.heads))
    hidden, ctx = mx.zeros((model.args.hidden_size,)), [1, 2, 3]
    assert d.propose(hidden, ctx, max_depth=8)[0].size == 4  # the heads' three nodes pay at these costs
    assert d.cost_scale == 1.0
    for _ in range(3):
        d.observe_time(1, 0.020)  # plain steps take 20 ms
    for _ in range(4):  # drafting steps take 3x what c(N) predicts
        tree, _ = d.propose(hidden, ctx, max_depth=8)
        d.observe_time(tree.size, 0.060 * costs.forward(tree.size))
    assert d.cost_scale == pytest.approx(3.0)
    assert d.propose(hidden, ctx, max_depth=8)[0].size == 1  # nothing pays now
    for _ in range(4 * 32):  # plain steps only: the drafting times are forgotten one by one
        d.observe_time(1, 0.020)
    assert d.cost_scale == 1.0 and d.propose(hidden, ctx, max_depth=8)[0].size == 4
