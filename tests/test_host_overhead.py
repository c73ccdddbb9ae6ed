"""The loop's host work (issue 50): what was cut keeps its meaning. Oracle drafts queued on
the device equal the host's, a draft model's full-depth chain is its greedy continuation,
the sampling noise is keyed by (seed, position) and computed the same either way, adaptive
speculation keeps a useless drafter's cost near its budget, and a plain step beside a draft
model is queued ahead like any other."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model_dir
from helpers import mlx_lm_greedy

from mlx_stream.adaptive import SpeculationPolicy
from mlx_stream.drafters import OracleDrafter
from mlx_stream.sampling import GumbelNoise
from mlx_stream.tree import build_tree, chain, no_drafts


@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_drafts_queued_on_the_device_equal_the_hosts(wrong):
    cont = list(range(100, 140))
    tree = build_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    d = OracleDrafter(5, cont, tree, 384, wrong=wrong)
    for n in (6, 9, 30, 44, 60):  # tokens up to the root; past the continuation's end too
        host = d.draft(None, list(range(n))).tolist()
        assert d.draft_queued(None, None, length=n).tolist() == host
        shift = mx.array(2, dtype=mx.int32)  # a lazy length, as the loop passes for a queued step
        assert d.draft_queued(None, None, length=shift + (n - 2)).tolist() == host


def test_a_plain_tree_is_one_shared_object_and_truncation_is_cached():
    assert no_drafts() is no_drafts()
    t = chain(5)
    assert t.truncate(2) is t.truncate(2) and t.truncate(2) == chain(2) and t.truncate(9) is t


def test_sampling_noise_is_keyed_by_seed_and_position():
    a, b, other = GumbelNoise(1234, 50), GumbelNoise(1234, 50), GumbelNoise(1235, 50)
    rows = np.array(a.rows(10, 4))
    assert np.array_equal(rows, np.array(b.rows(10, 4)))  # the same seed and positions: the same noise
    assert np.array_equal(np.array(a.rows(12, 1))[0], rows[2])  # one row alone equals it in a block
    assert not np.array_equal(np.array(other.rows(10, 4)), rows)  # another seed: other noise
    assert len({tuple(r) for r in rows.round(6).tolist()}) == 4  # positions independent
    # standard Gumbel: mean ~0.5772, variance pi^2 / 6
    many = np.array(GumbelNoise(7, 4096).rows(0, 16)).ravel()
    assert abs(many.mean() - 0.5772) < 0.03 and abs(many.var() - np.pi**2 / 6) < 0.1


def _simulate(policy, tokens, t_draft, steps=400, t_plain=1.0):
    used = []
    for _ in range(steps):
        d = policy.use_drafts()
        policy.observe(d, t_draft if d else t_plain, tokens if d else 1)
        used.append(d)
    return used


@pytest.mark.parametrize("t_draft", [1.5, 3.5, 10.0])
def test_a_drafter_that_cannot_pay_costs_about_the_exploration_budget(t_draft):
    """Where a drafting step costs t_draft plain steps and accepts nothing (a useless draft
    model; any drafter whose tau cannot cover the host's work on a fast device), its tries
    cost about explore_budget (1%) of the time once two were timed (the old policy tried
    every 16 steps: 6-56% of the time here)."""
    used = _simulate(SpeculationPolicy(), 1, t_draft)
    assert used[:4] == [True, False, True, False] and not any(used[4:18])  # measured, then off
    lost = sum(used) * (t_draft - 1)  # plain steps' worth of time the tries cost
    # the budget, and the tries before it is known: two at the start, one explore_every later
    assert lost / len(used) <= 0.012 + 3 * (t_draft - 1) / len(used)
    # a drafter that pays is still found, and kept
    assert sum(_simulate(SpeculationPolicy(), 3, 1.5)[10:]) >= 380


def _simulate_queued(policy, tokens, t_draft, steps=400, t_plain=1.0):
    # as the pipelined loop asks: step i + 1 is decided before step i is observed
    used, pending = [], None
    for _ in range(steps):
        d = policy.use_drafts()
        if pending is not None:
            policy.observe(*pending)
        pending = (d, t_draft if d else t_plain, tokens if d else 1)
        used.append(d)
    return used


@pytest.mark.parametrize("catch_up", [0.0, 0.05])
def test_decided_a_step_ahead_a_useless_drafter_is_tried_twice_then_per_budget(catch_up):
    """With each step decided before the one before is observed (queued steps), the
    alternation still ends after one kept timing of each mode (drafting at steps 0 and 2
    only: a third try there costs ~3% of 200 tokens on a fast device); the next try comes
    after its loss over the budget (2.5 / 1%: 250 steps), or, where catching up with the
    plain steps (a draft model's prefill: 5% of a plain step per token) alone exceeds the
    budget, after ``max_explore`` steps."""
    policy = SpeculationPolicy(catch_up=catch_up)
    used = _simulate_queued(policy, 1, 3.5, steps=600)
    tries = [i for i, u in enumerate(used) if u]
    assert tries[:2] == [0, 2]
    assert 240 <= tries[2] <= 262 if catch_up == 0 else 500 <= tries[2] <= 520, tries
    assert sum(_simulate_queued(SpeculationPolicy(catch_up=catch_up), 3, 1.5)[10:]) >= 380  # one that pays


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from mlx_stream import load, load_draft

    root = tmp_path_factory.mktemp("overhead")
    target, tok = load(str(make_tiny_model_dir(root / "t", embed_scale=0.26)), heads=None, dtype="float32")
    draft = load_draft(
        str(make_tiny_model_dir(root / "d", seed=1, embed_scale=0.26)),
        target,
        tok,
        dtype="float32",
        calibrate=False,
    )
    return target, tok, draft


def test_a_draft_models_chain_is_its_greedy_continuation(pair):
    from mlx_stream.drafters.draft_model import DraftCache, DraftModelDrafter

    target, tok, draft = pair
    ids = tok.encode("The quick brown fox")
    from mlx_lm.generate import generate_step

    expect = [t for t, _ in generate_step(mx.array(ids), draft.backbone, max_tokens=4)]  # its greedy tokens
    drafter = DraftModelDrafter(DraftCache(draft), budget=5, width=1, depth=4, p_min=0.0, expand=1)
    tree, drafts = drafter.propose(None, ids, max_depth=4)
    assert tree == chain(4) and drafts.tolist() == expect
    tree, drafts = drafter.propose(None, ids, max_depth=2)  # the cache follows the tokens again
    assert tree == chain(2) and drafts.tolist() == expect[:2]


def test_plain_steps_beside_a_useless_draft_model_are_queued_and_lossless(pair):
    """Adaptive speculation turns a draft model that cannot pay off after one try; its plain
    steps are queued ahead (the pipeline counts them) and the output is plain decoding's."""
    from mlx_stream import stream_generate
    from mlx_stream.steps import StepPipeline

    target, tok, draft = pair
    ids = tok.encode("The quick brown fox")
    ref = mlx_lm_greedy(target, tok, ids, 64)
    queued = []
    real = StepPipeline.queue_after

    def counting(self, prev, tokens, depth):
        got = real(self, prev, tokens, depth)
        queued.append(got is not None)
        return got

    StepPipeline.queue_after = counting
    try:
        rs = list(stream_generate(target, tok, ids, max_tokens=64, draft_model=draft, prompt_lookup=0))
    finally:
        StepPipeline.queue_after = real
    assert [t for r in rs for t in r.tokens] == ref
    tries = sum(r.drafted > 0 for r in rs)
    assert tries <= 3 + sum(r.accepted > 0 for r in rs), [
        r.drafted for r in rs
    ]  # (a try that paid may repeat)
    assert sum(queued) >= len(rs) - 2 * tries - 3  # every plain step but those next to a try


def test_a_draft_models_prefill_rate_reaches_the_policy(pair):
    """The draft model's prefill of the prompt is timed (seconds per token): what each later
    try spends catching up with the tokens decoded plainly, which adaptive speculation
    counts; a useless draft model is then tried twice in 64 tokens, and the output is
    plain decoding's."""
    from mlx_stream import adaptive, stream_generate

    target, tok, draft = pair
    ids = tok.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 4))
    assert len(ids) >= 16
    ref = mlx_lm_greedy(target, tok, ids, 64)
    seen = []
    real = adaptive.SpeculationPolicy.use_drafts

    def recording(self):
        seen.append(self.catch_up)
        return real(self)

    adaptive.SpeculationPolicy.use_drafts = recording
    try:
        rs = list(stream_generate(target, tok, ids, max_tokens=64, draft_model=draft, prompt_lookup=0))
    finally:
        adaptive.SpeculationPolicy.use_drafts = real
    assert [t for r in rs for t in r.tokens] == ref
    assert seen and all(0 < c < 1 for c in seen[1:])  # a rate, set before the first drafting step is decided
    assert sum(r.drafted > 0 for r in rs) <= 2 + sum(r.accepted > 0 for r in rs)
