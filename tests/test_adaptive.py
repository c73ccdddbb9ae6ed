"""Adaptive speculation: drafts are sent only while they pay, output unchanged."""

import pytest
from helpers import mlx_lm_greedy, ours

from mlx_stream.adaptive import SpeculationPolicy
from mlx_stream.heads import new_heads


def simulate(policy, tokens_per_draft_step, steps, t_plain=1.0, t_draft=1.15):
    """Feed the policy a machine where a plain step takes t_plain, a drafting step
    t_draft and emits tokens_per_draft_step(i) tokens; returns which steps drafted."""
    used = []
    for i in range(steps):
        d = policy.use_drafts()
        policy.observe(d, t_draft if d else t_plain, tokens_per_draft_step(i) if d else 1)
        used.append(d)
    return used


@pytest.mark.parametrize("tau,low,high", [(1.05, 0.0, 0.1), (1.3, 0.85, 0.97), (2.0, 0.98, 1.0)])
def test_policy_drafts_only_when_tau_covers_the_cost(tau, low, high):
    used = simulate(SpeculationPolicy(), lambda i: tau, 400)
    assert low <= sum(used[20:]) / 380 <= high


def test_policy_follows_a_change_of_predictability():
    used = simulate(SpeculationPolicy(), lambda i: 2.0 if i < 100 or i >= 200 else 1.0, 300)
    assert all(used[20:100])
    assert sum(used[110:200]) <= 90 / 16 + 1  # plain, with a try every 16 steps
    assert all(used[200 + 2 * 16 :])  # back to drafting after at most two tries


def test_adaptive_loop_keeps_the_output_and_mixes_in_plain_steps(tiny):
    """The loop asks the policy every step: after the first drafting step comes a plain
    calibration step (whatever the timings), and the output is plain mlx-lm's."""
    model, tok = tiny
    ids = tok.encode("The quick brown fox")
    ref = mlx_lm_greedy(model, tok, ids, 60)
    model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=3)
    for tree in ("chain:3", "0;1;0,0"):
        # adaptive by default with the model's heads (prompt lookup off: it drafts whatever the policy says)
        got, rs = ours(model, tok, ids, 60, tree=tree, prompt_lookup=0)
        assert got == ref
        assert rs[1].drafted > 0 and rs[2].drafted == 0
        got, rs = ours(model, tok, ids, 60, tree=tree, adaptive=False, prompt_lookup=0)
        assert got == ref and all(r.drafted > 0 for r in rs[1:-1])
