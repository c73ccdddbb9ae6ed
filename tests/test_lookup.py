"""Prompt lookup: the n-gram match, the chain beside the heads' tree, and the loop with it."""

import numpy as np
import pytest
from helpers import SelfDrafter, assert_greedy_identical, mlx_lm_greedy, ours

from mlx_stream import stream_generate
from mlx_stream.drafters import LookupDrafter, NoDrafter, propose
from mlx_stream.drafters.lookup import append_chain, copy_from, lookup_length, match_suffix, prompt_lookup
from mlx_stream.heads import new_heads
from mlx_stream.tree import build_tree, no_drafts, sparse
from mlx_stream.verify import verify_greedy


def test_latest_match_of_the_longest_suffix_wins():
    #       0  1  2  3  4  5  6  7  8  9 10
    toks = [5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6]
    # 2-gram (5, 6) occurs at 0 and 4: the latest is copied from index 6
    assert match_suffix(toks, 3, 2) == (2, 6)
    assert copy_from(toks, 6, 3) == [8, 2, 9]
    # a 3-gram match beats a later 2-gram match
    toks = [1, 5, 6, 7, 3, 9, 5, 6, 4, 1, 5, 6]
    assert match_suffix(toks, 3, 2) == (3, 3)
    assert match_suffix(toks, 2, 2) == (2, 8)
    assert match_suffix(toks, 6, 1) == (3, 3)


def test_the_copy_grows_with_the_match():
    assert [lookup_length(n, 10) for n in range(1, 8)] == [0, 2, 4, 6, 8, 10, 10]
    assert lookup_length(4, 3) == 3
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 3, 4]  # (3, 4) matched: copy 2 tokens
    assert prompt_lookup(toks, 10) == [5, 6]
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 2, 3, 4]  # (2, 3, 4) matched: copy 4
    assert prompt_lookup(toks, 10) == [5, 6, 7, 8]
    assert prompt_lookup(toks, 3) == [5, 6, 7]


def test_no_match_and_limits():
    assert prompt_lookup([1, 2, 3, 4], 4) == []
    assert match_suffix([1, 2, 3, 4]) == (0, -1)
    assert prompt_lookup([1, 2], 4) == []
    assert prompt_lookup([], 4) == []
    assert prompt_lookup([1, 2, 1, 2], 0) == []
    assert prompt_lookup([4, 1, 2, 3, 1, 2], 2, min_ngram=1) == [3, 1]
    assert match_suffix([4, 1, 2, 3, 2], 3, 1) == (1, 3)
    assert prompt_lookup([4, 1, 2, 3, 2], 5, min_ngram=1) == []  # a 1-token match copies nothing
    for bad in [
        dict(num_draft=-1),
        dict(num_draft=2, min_ngram=0),
        dict(num_draft=2, max_ngram=1, min_ngram=2),
    ]:
        with pytest.raises(ValueError):
            prompt_lookup([1, 2, 1, 2], **bad)


def test_a_loop_is_continued_past_the_end_of_the_context():
    # period 1 and period 3: the copy runs into the end and keeps repeating
    assert prompt_lookup([9, 4, 4, 4, 4, 4, 4], 5) == [4, 4, 4, 4, 4]
    assert copy_from([8, 1, 2, 3, 1, 2, 3, 1, 2], 6, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert copy_from(np.array([8, 1, 2, 3, 1, 2, 3, 1, 2]), 6, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert prompt_lookup([8, 1, 2, 3, 1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]


def test_append_chain_adds_a_branch_whose_shape_needs_no_tokens():
    tree = build_tree([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    base = np.array([10, 11, 20, 21, 30])  # the base drafts, in its node order
    chain_ = np.array([40, 41, 42])
    merged, take = append_chain(tree, 3)
    assert merged.size == tree.size + 3
    assert set(tree.choices) < set(merged.choices)
    assert {(2,), (2, 0), (2, 0, 0)} == set(merged.choices) - set(tree.choices)
    fill = dict(zip(merged.choices, np.concatenate([base, chain_])[take].tolist()))
    assert all(fill[c] == t for c, t in zip(tree.choices, base.tolist()))  # base nodes keep their tokens
    assert [fill[(2,)], fill[(2, 0)], fill[(2, 0, 0)]] == [40, 41, 42]
    # a root with gaps in its ranks: the chain takes the next free one
    merged, take = append_chain(build_tree([(0,), (2,)]), 1)
    assert (3,) in merged.choices and merged.size == 4
    assert append_chain(no_drafts(), 2)[0].choices == ((0,), (0, 0))


def test_greedy_verification_keeps_the_longest_of_equal_siblings():
    # the heads drafted 7 (node 1); the chain 7, 8, 9 hangs beside it (nodes 2, 3, 4)
    t, take = append_chain(build_tree([(0,)]), 3)
    toks = [1] + np.concatenate([[7], [7, 8, 9]])[take].tolist()
    targets = {1: 7, 7: 8, 8: 9, 9: 5}
    path, nxt = verify_greedy(t, toks, [targets[x] for x in toks])
    assert [toks[i] for i in path] == [1, 7, 8, 9] and nxt == 5
    # equal lengths: the later sibling (the chain) is kept, so the drafter credits it
    targets = {1: 7, 7: 3, 8: 9, 9: 5}
    path, nxt = verify_greedy(t, toks, [targets[x] for x in toks])
    assert len(path) == 2 and path[1] == 2 and nxt == 3
    # the heads' branch is longer: it wins although it comes first
    t = build_tree([(0,), (1,), (0, 0), (0, 0, 0)])
    toks = [1, 7, 7, 8, 9]  # node 2 (rank 1) repeats node 1's token but has no children
    path, nxt = verify_greedy(t, toks, [7, 8, 3, 9, 4])
    assert path == [0, 1, 3, 4] and nxt == 4


def test_coupled_verification_with_equal_siblings_emits_the_plain_draws():
    from mlx_stream.verify import sample_index, verify_coupled

    rng = np.random.default_rng(0)
    t, take = append_chain(build_tree([(0,), (0, 0)]), 3)  # heads: a, b; chain: a, b', c
    V = 5
    for _ in range(300):
        probs = rng.dirichlet(np.ones(V) * 0.3, size=t.size)
        u = rng.random(t.depth + 1)
        heads, chain_ = rng.integers(0, V, 2), rng.integers(0, V, 3)
        chain_[0] = heads[0]
        toks = [0] + np.concatenate([heads, chain_])[take].tolist()
        path, nxt = verify_coupled(t, toks, probs, u)
        # the emitted tokens are the draws along the path, each with its depth's uniform
        emitted = [toks[i] for i in path[1:]] + [nxt]
        for d, i in enumerate(path):
            assert emitted[d] == sample_index(probs[i], u[d])
        # and no other branch accepts more
        for leaf in range(t.size):
            p = [int(x) for x in [0] + [j for j in t.paths[leaf]]]
            ok = all(toks[p[k + 1]] == sample_index(probs[p[k]], u[k]) for k in range(len(p) - 1))
            assert not ok or len(p) <= len(path)


def test_propose_grafts_only_when_the_context_repeats(tiny):
    model, tok = tiny
    d = LookupDrafter(NoDrafter(), num_draft=3)
    h = np.zeros(model.args.hidden_size, dtype=np.float32)
    t, drafts = propose(d, h, [4, 5, 6, 7], 8)
    assert t.size == 1 and drafts.size == 0
    t, drafts = propose(d, h, [4, 5, 6, 7, 8, 9, 4, 5, 6], 8)  # 3-token match: 3 of 4 allowed
    assert t.size == 4 and drafts.tolist() == [7, 8, 9]
    t, drafts = propose(d, h, [4, 5, 6, 7, 8, 9, 4, 5, 6], 2)  # at most max_depth deep
    assert t.size == 3 and drafts.tolist() == [7, 8]
    # with heads: base=False leaves the heads' tree out, the chain stays
    model.heads = new_heads(model.backbone, tok, 2, scale=0.5, seed=3, architecture="hydra")
    from mlx_stream.drafters import HeadsDrafter

    hd = LookupDrafter(HeadsDrafter(model, sparse(2)), num_draft=3)
    ctx = [4, 5, 6, 7, 8, 9, 4, 5, 6]
    hs = np.random.default_rng(0).normal(size=model.args.hidden_size).astype(np.float32)
    import mlx.core as mx

    t, drafts = propose(hd, mx.array(hs), ctx, 8, base=False)
    assert t.size == 4 and drafts.tolist() == [7, 8, 9]  # the chain alone (deeper than the heads may go)
    t, drafts = propose(hd, mx.array(hs), ctx, 8)
    base, bd = propose(hd.base, mx.array(hs), ctx, 8)
    node_tokens = [ctx[-1]] + drafts.tolist()
    paths = [[node_tokens[i] for i in p] for p in t.paths]
    assert [7, 8, 9] in paths and t.size == base.size + 3
    base_tokens = [ctx[-1]] + bd.tolist()
    assert all([base_tokens[i] for i in p] in paths for p in base.paths)  # the heads' tree is kept
    with pytest.raises(ValueError):
        LookupDrafter(NoDrafter(), num_draft=0)


PROMPTS = ["The quick brown fox", "Speculative decoding drafts", "0123 café", "heads, trees!"]


def test_greedy_identity_with_prompt_lookup(tiny):
    model, tok = tiny
    for p in PROMPTS:
        ids = tok.encode(p)
        ref = mlx_lm_greedy(model, tok, ids, 48)
        got, rs = ours(model, tok, ids, 48, prompt_lookup=4, adaptive=False)  # lookup alone (no heads)
        assert got == ref
        # the tiny random model loops, so the copies are accepted: ~4 drafts per step
        assert sum(r.accepted for r in rs) >= 30 and rs[-1].tau > 3.5
        model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=3, architecture="hydra")
        for tree in ("0", sparse(3)):
            got, rs = ours(model, tok, ids, 48, tree=tree, adaptive=False)  # heads + lookup (the default)
            assert_greedy_identical(model, ids, got, ref)
            assert rs[-1].tau > 3.5
            got, rs = ours(model, tok, ids, 48, tree=tree, prompt_lookup=0, adaptive=False)
            assert_greedy_identical(model, ids, got, ref)
        model.heads = None


def test_seeded_sampling_with_prompt_lookup_is_plain_sampling(spread_dir):
    from mlx_stream import load

    model, tok = load(str(spread_dir), dtype="float32")
    ids = tok.encode("a b a b a b a")
    accepted = 0
    for seed in range(6):
        for kw in (dict(temp=1.0), dict(temp=0.7, top_k=5)):
            plain, _ = ours(model, tok, ids, 24, seed=seed, **kw)
            spec, rs = ours(model, tok, ids, 24, seed=seed, prompt_lookup=3, adaptive=False, **kw)
            assert spec == plain
            accepted += sum(r.accepted for r in rs)
            d = LookupDrafter(SelfDrafter(model, build_tree([(0,), (1,)])), num_draft=3)
            spec, _ = ours(model, tok, ids, 24, seed=seed, drafter=d, **kw)
            assert spec == plain
    assert accepted > 0  # copies were accepted, so the grafted branches were verified


def test_bad_prompt_lookup(tiny):
    model, tok = tiny
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_lookup"):
            next(stream_generate(model, tok, "hi", prompt_lookup=bad))


def test_chains_that_are_not_accepted_stop_being_drafted(tiny):
    model, _ = tiny
    d = LookupDrafter(NoDrafter(), num_draft=4, explore_every=4)
    h = np.zeros(model.args.hidden_size, dtype=np.float32)
    ctx = [4, 5, 6, 7, 8, 9, 4, 5, 6]
    drafted = []
    for _step in range(24):
        t, drafts = propose(d, h, ctx, 8)
        drafted.append(t.size > 1)
        d.observe(t, [6] + drafts.tolist(), [1])  # nothing accepted: the target said 1
    assert d.accept_rate < d.min_accept
    # from the prior (0.25), four misses in a row bring the rate below 0.1; then one try in 4 matches
    assert all(drafted[:4]) and not drafted[4] and sum(drafted[12:]) == 3
    for _step in range(8):  # the copies start being accepted: drafting resumes
        t, drafts = propose(d, h, ctx, 8)
        if t.size > 1:
            d.observe(t, [6] + drafts.tolist(), drafts.tolist() + [2])
    t, _ = propose(d, h, ctx, 8)
    assert t.size > 1 and d.accept_rate >= d.min_accept
    # a tree the drafter did not propose (a plain step) is ignored
    rate = d.accept_rate
    d.observe(build_tree([]), [6], [7])
    assert d.accept_rate == rate


class _Fixed:
    """A static drafter with fixed drafts (for the gate's bookkeeping)."""

    capture = None

    def __init__(self, choices, drafts):
        self.tree = build_tree(choices)
        self._drafts = drafts

    def draft(self, hidden, tokens, mid=None, cache=None):
        import mlx.core as mx

        return mx.array(self._drafts, dtype=mx.int32)


def test_the_gate_credits_only_tokens_the_chain_adds():
    ctx = [4, 5, 6, 7, 8, 9, 4, 5, 6]  # the chain copies 7, 8, 9
    d = LookupDrafter(
        _Fixed([(0,)], [7]), num_draft=3, prior=0.5, decay=1.0, min_accept=0.0
    )  # rate: the last step
    t, drafts = propose(d, None, ctx, 8)
    toks = [6] + drafts.tolist()
    assert t.size == 5 and sorted(toks[1:]) == [7, 7, 8, 9]
    d.observe(t, toks, [7, 3])  # the head's 7 alone would have been accepted: the chain added nothing
    assert d.accept_rate == 0.0
    t, drafts = propose(d, None, ctx, 8)
    d.observe(t, [6] + drafts.tolist(), [7, 8, 5])  # one token more than the head's branch
    assert d.accept_rate == pytest.approx(1 / 3)
    d = LookupDrafter(_Fixed([(0,)], [1]), num_draft=3, decay=1.0)  # the head drafts something else
    t, drafts = propose(d, None, ctx, 8)
    d.observe(t, [6] + drafts.tolist(), [7, 8, 9, 4])
    assert d.accept_rate == 1.0


def test_may_chain_after_answers_before_the_next_token_is_known(tiny):
    # the loop queues a plain step on a token still being computed only where no chain can
    # follow: no repeated suffix yet, or a gate that would skip the chain (counted as a skip)
    d = LookupDrafter(NoDrafter(), num_draft=3, explore_every=3)
    assert not d.may_chain_after([4, 5, 6, 7])
    assert d.may_chain_after([4, 5, 6, 7, 8, 4, 5])  # "4 5" repeats: a chain may follow
    d.rates["context"] = 0.0  # the gate closed: skipped twice, then the third try goes through
    assert not d.may_chain_after([4, 5, 6, 7, 8, 4, 5]) and not d.may_chain_after([4, 5, 6, 7, 8, 4, 5])
    assert d._skipped["context"] == 2 and d.may_chain_after([4, 5, 6, 7, 8, 4, 5])
    # a suffix that matches ending at the next token extends one that matches here
    ctx = [1, 2, 3, 9, 1, 2]
    assert prompt_lookup(ctx + [3], 3) and LookupDrafter(NoDrafter()).may_chain_after(ctx)


def test_queued_plain_steps_with_prompt_lookup_keep_the_output(tiny):
    # prompt lookup alone: every step without a chain is plain, queued on the token still
    # being computed unless a chain may follow it; the output is plain decoding's
    model, tok = tiny
    ids = tok.encode("one two one two one two three")
    ref = mlx_lm_greedy(model, tok, ids, 64)
    got, rs = ours(model, tok, ids, 64, drafter=LookupDrafter(NoDrafter(), num_draft=4))
    assert_greedy_identical(model, ids, got, ref)
    for s in (1, 2):
        got, rs = ours(model, tok, ids, 40, temp=1.0, seed=s, drafter=LookupDrafter(NoDrafter(), num_draft=4))
        assert sum(r.drafted == 0 for r in rs) >= 2 and any(r.drafted for r in rs)  # both kinds
        assert got == ours(model, tok, ids, 40, temp=1.0, seed=s)[0]
