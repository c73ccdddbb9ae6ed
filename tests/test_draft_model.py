"""A separate draft model (issue 37, first step): lossless greedy and seeded sampled output,
its own KV cache kept equal to the accepted tokens, and the tokenizer check."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import make_tiny_model_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from mlx_stream import load

    root = tmp_path_factory.mktemp("draft")
    target, tok = load(str(make_tiny_model_dir(root / "t", embed_scale=0.26)), heads=None, dtype="float32")
    other, dtok = load(
        str(make_tiny_model_dir(root / "d", seed=1, embed_scale=0.26)), heads=None, dtype="float32"
    )
    return target, tok, other, dtok


def _run(target, tok, **kw):
    from mlx_stream import stream_generate

    out, last = [], None
    for r in stream_generate(target, tok, "The quick brown", max_tokens=32, **kw):
        out += r.tokens
        last = r
    return out, last


@pytest.mark.parametrize("width,budget,depth,expand", [(1, 4, 3, 1), (2, 8, 4, 2), (3, 10, 4, 1)])
def test_draft_model_output_equals_plain(pair, width, budget, depth, expand):
    from mlx_stream.drafters.draft_model import (
        DraftCache,
        DraftModel,
        DraftModelDrafter,
        check_draft_tokenizer,
    )

    target, tok, other, dtok = pair
    vocab = check_draft_tokenizer(tok, dtok, target.args.vocab_size, other.args.vocab_size)
    for draft, min_tau in ((target, depth + 0.5), (other, 1.0)):  # itself: near K + 1 tokens a pass
        plain, _ = _run(target, tok)
        dc = DraftCache(DraftModel(draft.backbone, vocab))
        drafter = DraftModelDrafter(dc, budget, width, depth, p_min=0.0, expand=expand)
        got, last = _run(target, tok, drafter=drafter)
        assert got == plain
        if draft is target and width == 1:
            assert last.tau >= min_tau
        for seed in range(3):
            ref, _ = _run(target, tok, temp=1.0, seed=seed)
            dc = DraftCache(DraftModel(draft.backbone, vocab))
            got, _ = _run(
                target,
                tok,
                temp=1.0,
                seed=seed,
                drafter=DraftModelDrafter(dc, budget, width, depth, p_min=0.0, expand=expand),
            )
            assert got == ref


def test_each_depth_expands_as_many_nodes_as_the_device_feeds_cheaply(pair):
    """expand=1: one node fed per depth (a chain's draft cost), its siblings verified too;
    expand=width: EAGLE-2's top-k expansion. expand_for reads the calibrated node costs."""
    from mlx_stream.drafters.draft_model import EXPAND_COST, DraftCache, DraftModel, DraftModelDrafter

    target, tok, _, _ = pair
    ids = tok.encode("The quick brown")
    for expand, parents_per_depth in ((1, 1), (3, 3)):
        draft = DraftModel(target.backbone, target.args.vocab_size)
        drafter = DraftModelDrafter(DraftCache(draft), 40, 3, 4, p_min=0.0, expand=expand)
        tree, drafts = drafter.propose(None, ids, 4)
        assert tree.size == 1 + 3 + 3 * 3 * parents_per_depth and drafts.shape == (tree.size - 1,)
        for d in range(2, 5):  # the nodes of depth d hang under this many depth d-1 nodes
            parents = {p[:-1] for p in tree.paths if len(p) == d}
            assert len(parents) == parents_per_depth
    with pytest.raises(ValueError, match="expand"):
        DraftModelDrafter(DraftCache(draft), 8, 2, 4, expand=3)
    assert draft.expand_for(4) == 4  # not measured: EAGLE-2's top-k
    draft.calibration = {"node_costs": {"2": 1.1, "4": 3.9}}  # 2 nodes nearly free, 4 not
    assert draft.expand_for(4) == 2 and draft.expand_for(1) == 1
    draft.calibration = {"node_costs": {"2": 2.0, "4": 4.0}}  # kernels that do not batch
    assert draft.expand_for(4) == 1 and EXPAND_COST < 2.0
    from mlx_stream import plan_drafting

    plan = plan_drafting(target, tree="dynamic:16,4", draft_model=draft)
    assert (plan.budget, plan.width, plan.expand) == (16, 4, 1)
    assert plan_drafting(target, tree="dynamic:16,4,2", draft_model=draft).depth == 2  # EAGLE-2's depth
    assert plan_drafting(target, draft_model=draft, num_draft_tokens=3).expand == 1
    draft.calibration = None
    assert plan_drafting(target, tree="dynamic:16,4", draft_model=draft).expand == 4


def test_p_min_stops_drafting_where_the_draft_is_unsure(pair):
    # the target drafting for itself on a model whose top token has ~0.5 of the mass: every
    # draft is accepted, so tau counts the tokens drafted per step
    from mlx_stream.drafters.draft_model import P_MIN, DraftCache, DraftModel, DraftModelDrafter

    target, tok, _, _ = pair
    plain, _ = _run(target, tok)
    taus = {}
    for p_min in (0.0, P_MIN, 0.99):
        dc = DraftCache(DraftModel(target.backbone, target.args.vocab_size))
        got, last = _run(target, tok, drafter=DraftModelDrafter(dc, 4, 1, 3, p_min=p_min), adaptive=False)
        assert got == plain  # where drafting stops never changes the output
        taus[p_min] = last.tau
    assert taus[0.0] >= 3.5  # the full depth, all accepted
    assert taus[0.99] <= 2.0  # the first depth only: the draft is never that sure
    assert taus[0.99] <= taus[P_MIN] <= taus[0.0]


def test_draft_cache_matches_a_fresh_prefill(pair):
    from mlx_stream.drafters.draft_model import DraftCache, DraftModel

    target, tok, other, _ = pair
    dm = DraftModel(other.backbone, target.args.vocab_size)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    dc = DraftCache(dm)
    dc.sync(ids[:8])
    # speculative entries written and dropped, then accepted, rejected and extended contexts
    dc.forward(
        mx.array(ids[8:11], dtype=mx.int32),
        mx.array([8, 9, 10], dtype=mx.int32),
        mx.ones((3, 11), dtype=mx.bool_),
    )
    dc.rewind()
    for ctx in (ids[:11], ids[:9] + [ids[2]], ids[:12]):
        got = dc.sync(ctx)
        fresh = DraftCache(dm).sync(ctx)
        assert dc.layers[0].offset == len(ctx)
        assert mx.allclose(got, fresh, atol=1e-4).item()


def _draft_tree(dc, held, a, b):
    # two depths of a tree after `held` tokens: entries 0, 1 = a[0], b[0] (children of the
    # last token), entries 2, 3 = a[1] (child of entry 0), b[1] (child of entry 1)
    i32 = lambda x: mx.array(x, dtype=mx.int32)  # noqa: E731
    one = mx.ones((2, held), dtype=mx.bool_)
    dc.forward(
        i32([a[0], b[0]]),
        i32([held, held]),
        mx.concatenate([one, mx.eye(2, dtype=mx.bool_)], 1),
        i32([-1, -1]),
    )
    seen = mx.concatenate([mx.eye(2, dtype=mx.bool_), mx.eye(2, dtype=mx.bool_)], 1)
    dc.forward(i32([a[1], b[1]]), i32([held + 1] * 2), mx.concatenate([one, seen], 1), i32([0, 1]))


def test_draft_cache_keeps_the_accepted_path_of_its_speculative_entries(pair):
    """After a tree step the draft's entries on the accepted path are kept, not fed again
    (as mlx-lm trims its draft cache), and its next logits still equal a fresh prefill's,
    whichever branch, depth or divergence the target accepted."""
    from mlx_stream.drafters.draft_model import DraftCache, DraftModel

    target, tok, other, _ = pair
    dm = DraftModel(other.backbone, target.args.vocab_size)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    x, y = ids[20], ids[21]
    contexts = (
        ids[:12],  # both depths of the first branch accepted, then the target's token
        ids[:8] + [x, y, ids[3]],  # the second branch, both depths
        ids[:8] + [x, ids[5]],  # the second branch, one depth
        ids[:8] + [ids[5], ids[6]],  # nothing accepted
        ids[:6] + [x],  # a shorter context (another prompt)
    )
    for ctx in contexts:
        dc = DraftCache(dm)
        dc.sync(ids[:8])
        _draft_tree(dc, 8, ids[8:10], [x, y])
        got = dc.sync(ctx)
        assert dc.layers[0].offset == len(ctx) and dc.tokens == ctx
        assert mx.allclose(got, DraftCache(dm).sync(ctx), atol=1e-4).item(), ctx
    # the kept entries are the ones the tree step wrote (moved, not computed again)
    dc = DraftCache(dm)
    dc.sync(ids[:8])
    _draft_tree(dc, 8, ids[8:10], [x, y])
    layer = dc.layers[-1]
    layer.keys[..., 8 + 3, :] = 7.0  # entry 3 (y after x), marked
    dc.sync(ids[:8] + [x, y, ids[3]])
    assert (layer.keys[..., 8 + 1, :] == 7.0).all().item()  # now the slot after x


def test_a_draft_with_another_tokenizer_is_refused(pair, tmp_path):
    from mlx_stream import load
    from mlx_stream.drafters.draft_model import check_draft_tokenizer

    target, tok, _, _ = pair
    small, stok = load(str(make_tiny_model_dir(tmp_path / "s", vocab=300)), heads=None, dtype="float32")
    with pytest.raises(ValueError, match="differs from the target's at token id"):
        check_draft_tokenizer(tok, stok, target.args.vocab_size, small.args.vocab_size)


def test_stream_generate_drafts_with_a_draft_model_and_its_cache_follows_a_chat(pair, tmp_path):
    """draft_model= in stream_generate and ChatSession: lossless (tree, chain, prompt lookup
    joined), the draft's cache kept in the prompt cache across turns, bad arguments refused."""
    from mlx_stream import ChatSession, PromptCache, load_draft, stream_generate
    from mlx_stream.drafters import LookupDrafter
    from mlx_stream.drafters.draft_model import DraftModelDrafter

    target, tok, other, dtok = pair
    draft = load_draft((other.backbone, dtok), target, tok, calibrate=False)
    plain, _ = _run(target, tok)
    for kw in ({}, {"num_draft_tokens": 3}, {"tree": "dynamic:6,3"}, {"prompt_lookup": 0}):
        got, last = _run(target, tok, draft_model=draft, **kw)
        assert got == plain, kw
        assert last.forward_passes < len(got) or kw.get("prompt_lookup") == 0  # it drafted
    itself = load_draft((target.backbone, tok), target, tok, calibrate=False, p_min=0.0)  # full depth
    got, last = _run(target, tok, draft_model=itself, num_draft_tokens=3, adaptive=False)
    assert got == plain and last.tau >= 3.5  # the target drafting for itself: ~K + 1 tokens a pass
    # the model's own draft model (load(..., draft_model=)) is the default; False turns it off
    target.draft_model = itself
    try:
        pc = PromptCache(target)
        got, _ = _run(target, tok, prompt_cache=pc)
        assert got == plain and pc.draft is not None and pc.draft.draft is itself
        assert pc.draft.tokens == pc.tokens[: len(pc.draft.tokens)]  # the draft follows the accepted tokens
        _, off = _run(target, tok, draft_model=False, prompt_lookup=0)
        assert off.tau == 1.0  # no heads, no draft model: plain
        chat = ChatSession(target, tok, max_tokens=12, temp=0.0)
        for turn in ("Hello there", "And again"):
            "".join(r.text for r in chat.send(turn))
        assert (
            chat.cache.draft is not None
            and chat.cache.draft.tokens == chat.cache.tokens[: len(chat.cache.draft.tokens)]
        )
    finally:
        target.draft_model = None
    with pytest.raises(ValueError, match="num_draft_tokens"):
        next(stream_generate(target, tok, "hi", num_draft_tokens=2))
    with pytest.raises(ValueError, match="num_draft_tokens must be"):
        next(stream_generate(target, tok, "hi", draft_model=draft, num_draft_tokens=0))
    with pytest.raises(ValueError, match="max_kv_size"):
        next(stream_generate(target, tok, "hi", draft_model=draft, max_kv_size=64))
    with pytest.raises(TypeError, match="DraftModel"):
        next(stream_generate(target, tok, "hi", draft_model=other))
    with pytest.raises(ValueError, match="draft model drafts its own tree"):
        next(stream_generate(target, tok, "hi", draft_model=draft, tree="0;1"))
    from mlx_stream.speculation import make_drafter

    d = make_drafter(target, draft_model=draft)
    assert isinstance(d, LookupDrafter) and isinstance(d.base, DraftModelDrafter)


N_CHI = 3_000  # runs of the draft-model chi-square test


@pytest.mark.slow  # a chi-square test: minutes (make test-all)
def test_sampling_with_a_draft_model_follows_the_plain_distribution(spread_dir):
    """The joint distribution of the first 3 sampled tokens (T = 0.7, top_p = 0.9) with a
    3-bit copy of the target drafting a tree, against plain decoding's exact
    probabilities (tests/test_sampling.py's bins and test)."""
    import mlx.nn as nn
    from test_sampling import TOKENS, chi_square, exact_bins, sample_outcomes

    from mlx_stream import load, load_draft
    from mlx_stream.drafters.draft_model import DraftCache, DraftModelDrafter
    from mlx_stream.sampling import SamplingParams

    model, tok = load(str(spread_dir), heads=None, dtype="float32")
    copy, _ = load(str(spread_dir), heads=None, dtype="float32")
    nn.quantize(copy.backbone, group_size=32, bits=3)  # a real draft: close to the target, not equal
    draft = load_draft((copy.backbone, tok), model, tok, calibrate=False)
    ids = tok.encode("The quick")
    kw = {"temp": 0.7, "top_p": 0.9}
    drafter = DraftModelDrafter(DraftCache(draft), budget=6, width=2, depth=3)
    accepted = sum(r.accepted for r in stream_generate_all(model, tok, ids, drafter, kw))
    assert accepted >= 5  # drafts are accepted (and rejected): the test sees both
    bins = exact_bins(model, tok, ids, SamplingParams(**kw), [], N_CHI)
    counts = sample_outcomes(model, tok, ids, kw, [], N_CHI, drafter=drafter, max_tokens=TOKENS + 1)
    stat, p, dof = chi_square(counts, bins, N_CHI)
    print(f"\ndraft model, T=0.7, top_p=0.9: chi2 {stat:.1f}, dof {dof}, p {p:.3f}")
    assert len(bins) >= 20
    assert p > 0.01, f"sampling with a draft model differs from plain sampling (chi2 {stat:.1f}, p {p:.2e})"


def stream_generate_all(model, tok, ids, drafter, kw):
    from mlx_stream import stream_generate

    return list(stream_generate(model, tok, ids, max_tokens=40, drafter=drafter, seed=0, **kw))


@pytest.mark.slow  # 3-bit kernels are slow on this CPU: ~1-2 min
@pytest.mark.real
def test_real_model_with_a_3_bit_copy_as_draft_is_lossless_greedy_and_seeded(real):
    """The default model (float32) with a 3-bit copy of itself drafting (a real draft with
    partial acceptance): greedy output is plain mlx-lm's, seeded sampled output is seeded
    plain output token for token."""
    import mlx.nn as nn
    from helpers import mlx_lm_greedy

    from mlx_stream import load, load_draft, stream_generate

    model, tok = real
    copy, _ = load("smollm2-135m-instruct", heads="none", dtype="float32")
    nn.quantize(copy.backbone, group_size=64, bits=3)
    draft = load_draft((copy.backbone, tok), model, tok, calibrate=False)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True
    )

    def run(**kw):
        out, last = [], None
        for last in stream_generate(model, tok, ids, max_tokens=32, adaptive=False, **kw):
            out += last.tokens
        return out, last

    got, last = run(draft_model=draft)
    assert got == list(mlx_lm_greedy(model.backbone, tok, ids, 32))
    assert last.forward_passes < len(got)  # some drafts were accepted
    for seed in (0, 1):
        plain, _ = run(draft_model=False, prompt_lookup=0, temp=0.7, seed=seed)
        assert run(draft_model=draft, temp=0.7, seed=seed)[0] == plain


def test_expected_speedup_and_the_chosen_depth():
    from mlx_stream.calibrate import best_depth, expected_speedup, tree_budget
    from mlx_stream.cost import StepCosts

    flat = StepCosts({1: 1.0, 32: 1.0}, t1_ms=10.0)  # a GPU-like c(N)
    assert expected_speedup(1.0, 0.0, 3, flat) == pytest.approx(4.0)  # K + 1 tokens for one forward
    assert expected_speedup(0.5, 0.1, 2, flat) == pytest.approx(1.75 / 1.2)
    assert best_depth(0.9, 0.05, flat)[0] >= 4  # a good cheap draft drafts deep
    steep = StepCosts({1: 1.0, 2: 1.3, 32: 10.0}, t1_ms=10.0)  # a CPU-like c(N)
    k, s = best_depth(0.2, 0.5, steep)
    assert k == 0 and s < 1.0  # a weak, dear draft does not pay: plain
    assert tree_budget(3, flat) == 7 and tree_budget(3, steep) == 4  # siblings only where nodes are cheap


def test_calibration_and_self_drafting_choose_by_measurement(pair, tmp_path, monkeypatch):
    """calibrate_draft: the target as its own draft agrees everywhere; self_draft: a layer
    subset sharing the target's weights, cached per device; both lossless."""
    import mlx.core as mx

    from mlx_stream import load_draft
    from mlx_stream.calibrate import calibrate_draft, layer_subset, self_draft, subset_candidates

    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path / "cache"))
    target, tok, other, dtok = pair
    n = len(target.backbone.model.layers)
    full = layer_subset(target.backbone, range(n))
    x = mx.array([[5, 6, 7, 8]])
    assert mx.array_equal(full(x), target.backbone(x)).item()
    half = layer_subset(target.backbone, [0, n - 1])
    assert half.model.layers[0] is target.backbone.model.layers[0]  # shared, not copied
    with pytest.raises(ValueError, match="increasing"):
        layer_subset(target.backbone, [1, 0])
    assert all(len(k) < 30 for k in subset_candidates(30)) and len(subset_candidates(30)) >= 5
    itself = load_draft((target.backbone, tok), target, tok, calibrate=False)
    info = calibrate_draft(target, tok, itself)
    # r: the same model timed twice (sub-millisecond forwards, another test worker on the other core)
    assert info["alpha"] == 1.0 and not info["cached"] and 0.25 < info["r"] < 4.0
    assert set(info["node_costs"]) == {"2", "4"} and all(c > 0 for c in info["node_costs"].values())
    assert calibrate_draft(target, tok, itself)["cached"]
    other_draft = load_draft((other.backbone, dtok), target, tok, calibrate=False)
    assert not calibrate_draft(target, tok, other_draft)[
        "cached"
    ]  # another draft of the same shape: its own entry
    with pytest.raises(ValueError, match="no layer subset"):
        self_draft(target, tok)  # 2 layers: nothing to skip
    from mlx_stream import load

    deep, dtok8 = load(str(make_tiny_model_dir(tmp_path / "deep", layers=8, embed_scale=0.26)), heads=None)
    draft, sinfo = self_draft(deep, dtok8)
    assert len(sinfo["candidates"]) >= 3 and draft.name.startswith("self")
    assert all(0.0 <= c["alpha"] <= 1.0 and c["r"] > 0 for c in sinfo["candidates"])
    assert len(draft.backbone.model.layers) < 8
    assert draft.backbone.model.embed_tokens is deep.backbone.model.embed_tokens  # shared weights
    plain, _ = _run(deep, dtok8)
    got, _ = _run(deep, dtok8, draft_model=draft, num_draft_tokens=2)
    assert got == plain
    got, _ = _run(deep, dtok8, draft_model=draft)  # as calibrated (plain where it does not pay)
    assert got == plain
    same = load_draft("self", deep, dtok8)
    assert same.calibration["cached"] and same.name == draft.name


def test_an_explicit_chain_drafts_at_every_step_even_where_the_calibration_declined(pair):
    """Issue 48: num_draft_tokens=K (--num-draft-tokens K) drafts a chain of K at every
    step, as mlx-lm's does: neither the calibration's "does not pay" (depth 0) nor adaptive
    speculation turns it off; adaptive=True asks for the policy explicitly."""
    from mlx_stream import load_draft, stream_generate
    from mlx_stream.speculation import plan_drafting

    target, tok, other, dtok = pair
    draft = load_draft((other.backbone, dtok), target, tok, calibrate=False, p_min=0.0)
    draft.depth = 0  # what a calibration that expects no gain on this device sets
    assert plan_drafting(target, draft_model=draft).kind == "none"  # as calibrated: plain
    plain, _ = _run(target, tok)
    rs = list(
        stream_generate(
            target,
            tok,
            "The quick brown",
            max_tokens=32,
            draft_model=draft,
            num_draft_tokens=2,
            prompt_lookup=0,
        )
    )
    assert [t for r in rs for t in r.tokens] == plain
    steps = rs[1:-1]  # the first comes from the prefill; the last may be cut by max_tokens
    assert steps and all(r.drafted == 2 for r in steps), [r.drafted for r in rs]
