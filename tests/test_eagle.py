"""EAGLE-style draft layer ("eagle" heads): construction, the drafter's cache and tree
masks against a plain causal recomputation, lossless decoding."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_greedy_identical, mlx_lm_greedy, ours
from mlx.utils import tree_flatten

from mlx_stream.drafters import EagleDrafter, propose
from mlx_stream.heads import load_heads, new_heads, save_heads
from mlx_stream.tree import chain, parse_tree, sparse

K = 3
TREE = "0;1;2;0,0;0,1;1,0;0,0,0;1,0,0"


@pytest.fixture()
def eagle(tiny):
    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, K, architecture="eagle", scale=0.3, seed=5)
    return model, tok


def test_new_eagle_heads_copy_the_top_layer_and_round_trip(tiny, tmp_path):
    """A fresh draft layer is the backbone's top layer with its residual branches' output
    projections at zero and the input projection [I 0]: it first predicts the backbone's
    own next token at every position (as a fresh hydra head does)."""
    model, tok = tiny
    heads = new_heads(model.backbone, tok, K, architecture="eagle", seed=1)
    top = dict(tree_flatten(model.backbone.model.layers[-1].parameters()))
    mine = dict(tree_flatten(heads.eagle.layer.parameters()))
    zeroed = {"self_attn.o_proj.weight", "mlp.down_proj.weight"}
    assert mine.keys() == top.keys()
    assert all(mx.array_equal(mine[k], top[k]) for k in top if k not in zeroed)
    assert all(not mine[k].any() for k in zeroed)
    fresh = new_heads(model.backbone, tok, K, architecture="eagle", seed=1, copy_top_layer=False)
    q = "self_attn.q_proj.weight"
    assert not mx.array_equal(dict(tree_flatten(fresh.eagle.layer.parameters()))[q], top[q])
    assert mx.array_equal(fresh.eagle.norm.weight, mx.ones_like(fresh.eagle.norm.weight))
    ids = mx.array(tok.encode("The quick brown fox jumps over the lazy dog"))
    f = model.backbone.model(ids[None])  # (1, L, H) final features
    for h in (heads, fresh):
        g = h.eagle.sequence(f[:, :-1], model.embed(ids[1:])[None])
        assert mx.array_equal(mx.argmax(model.project(g), -1), mx.argmax(model.project(f[:, :-1]), -1))
    back = load_heads(save_heads(heads, tmp_path / "h"))
    assert back.autoregressive and back.config.layer_spec == heads.config.layer_spec
    for (k, a), (_, b) in zip(tree_flatten(heads.parameters()), tree_flatten(back.parameters())):
        assert mx.array_equal(a, b), k


def _reference_children(model, feats, tokens, node_path, log_probs=False):
    """Top-k children of a node, recomputed as one causal sequence of entries: the
    verified entries [f_i; e(x_{i+1})], then the node's ancestors' entries
    [f^ that drafted them; e(token)] in order (no tree mask, no cache)."""
    draft = model.heads.eagle
    r = len(tokens) - 1
    f = feats[:r]
    e = model.embed(mx.array(tokens[1 : r + 1]))
    out = draft.sequence(f[None], e[None])[0]
    fhat = out[-1]
    for tok in node_path:
        f = mx.concatenate([f, fhat[None]])
        e = mx.concatenate([e, model.embed(mx.array([tok]))])
        out = draft.sequence(f[None], e[None])[0]
        fhat = out[-1]
    logits = model.project(fhat)
    if log_probs:
        return np.array(logits - mx.logsumexp(logits))
    return np.argsort(-np.array(logits))


def test_drafts_equal_a_causal_recomputation_step_after_step(eagle):
    """The drafter keeps its cache in step with the accepted path and fills the tree
    through masks; every node must be what a plain causal pass over its own path gives.
    (Weights at scale 1: at the fixture's 0.3 the ranks did not change when a node's entry
    lost its ancestors' entries from its mask.)"""
    model, tok = eagle
    model.heads = new_heads(model.backbone, tok, K, architecture="eagle", scale=1.0, seed=5)
    tree = parse_tree(TREE, K)
    ids = tok.encode("The quick brown fox jumps over")
    seq = list(mlx_lm_greedy(model.backbone, tok, ids, 12))
    tokens_all = ids + seq
    feats = model.backbone.model(mx.array(tokens_all)[None])[0]  # final hidden states, every position
    drafter = EagleDrafter(model, tree)
    r = len(ids)  # the first call sees the whole prompt
    prev = 0
    for accepted in (0, 2, 1, 0, 3):  # pretend the loop accepted this many drafts each step
        tokens = tokens_all[: r + 1]
        hidden = feats[prev:r]
        t, drafts = propose(drafter, hidden, tokens, K)
        drafts = drafts.tolist()
        for i in range(1, t.size):
            path = t.paths[i]  # the node's ancestors from the root's first child, then itself
            parent_path = [drafts[j - 1] for j in path[:-1]]
            ref = _reference_children(model, feats, tokens, parent_path)
            assert drafts[i - 1] == int(ref[int(t.ranks[i])]), (accepted, i)
        prev, r = r, r + accepted + 1
    assert drafter.cache.offset >= r - 1  # verified entries plus the last call's speculative ones


@pytest.mark.parametrize(
    "tree,fuse",
    [
        (chain(K), ()),
        (sparse(K), ()),
        (TREE, ()),
        (chain(K), (0, 1)),
        (TREE, (0, 1)),
        ("dynamic:6,3", (0, 1)),
    ],
)
def test_greedy_identity_with_eagle_heads(eagle, tree, fuse):
    """Output stays the backbone's; fused heads (EAGLE-3) get their fused features
    through prefill and every step (the drafter refuses any other width)."""
    model, tok = eagle
    if fuse:
        model.heads = new_heads(
            model.backbone, tok, K, architecture="eagle", scale=0.3, seed=5, fuse_layers=fuse
        )
    for prompt in ("The quick brown fox", "Speculative decoding drafts several tokens"):
        ids = tok.encode(prompt)
        ref = mlx_lm_greedy(model.backbone, tok, ids, 48)
        got, _ = ours(model, tok, ids, 48, tree=tree)
        assert_greedy_identical(model, ids, got, ref)


def test_eagle_needs_a_llama_family_backbone(tmp_path):
    from mlx_stream.heads.eagle import layer_spec

    class NotLlama:
        model_type = "opt"

        class args:
            model_type = "opt"

    with pytest.raises(ValueError, match="llama-family"):
        layer_spec(NotLlama())


@pytest.mark.parametrize("through", ["written out", "drafting forward"])
def test_training_time_test_steps_see_what_drafting_sees(eagle, through):
    """Unroll step k at entry i must equal a plain causal pass over the real entries up
    to i - k + 1 followed by the chain's own entries (what a depth-k node's entry reads):
    both unrolls, ours written out and any layer's through its drafting forward (the
    batch's sequences side by side in one cache: another sequence in the batch must not
    change a sequence's entries)."""
    from mlx_stream.train.eagle import unrolled_entries, unrolled_features

    model, tok = eagle
    draft = model.heads.eagle
    ids = tok.encode("The quick brown fox jumps over the lazy dog again and again")
    F = model.backbone.model(mx.array(ids)[None])[0][:-1]  # f_0 .. f_{L-2}
    X = mx.array(ids[1:])  # x_{i+1}
    E = model.embed(X)
    if through == "written out":
        outs = unrolled_features(draft, F[None], E[None], 3)
    else:
        other = mx.random.normal(F.shape, key=mx.random.key(1))
        outs = unrolled_entries(draft, mx.stack([other, F]), mx.stack([E[::-1], E]), 3)
        outs = [o[1:] for o in outs]
    for k in (2, 3):
        for i in (k - 1, 5, len(ids) - 2):
            a = i - k + 1  # the last real entry the chain starts from
            f, e = F[: a + 1], E[: a + 1]
            g = draft.sequence(f[None], e[None])[0][-1]
            for j in range(a + 1, i + 1):  # the chain's own entries up to i
                f = mx.concatenate([f, g[None]])
                e = mx.concatenate([e, E[j : j + 1]])
                g = draft.sequence(f[None], e[None])[0][-1]
            assert mx.allclose(outs[k - 1][0, i], g, atol=1e-4), (k, i)
    assert mx.allclose(outs[0][0], draft.sequence(F[None], E[None])[0], atol=1e-5)


def test_train_eagle_learns_a_tiny_corpus(eagle):
    """A few hundred steps on a handful of sequences: held-out (= training) top-1 at
    depth 1 rises well above a fresh layer's, and depth 2 trained by the unrolled step."""
    from mlx_stream.train.eagle import evaluate_eagle, sequence_features, train_eagle

    model, tok = eagle
    rows = [
        {"prompt": "Count:", "completion": " one two three four five six seven eight nine ten"},
        {"prompt": "Letters:", "completion": " a b c d e f g h i j k l m n o p"},
    ] * 4
    seqs = sequence_features(model, tok, rows)
    assert len(seqs) == 8 and seqs[0].feats.shape == (len(seqs[0].ids) - 1, model.args.hidden_size)
    before, _, _ = evaluate_eagle(model, model.heads, seqs, 2)
    rep = train_eagle(model, model.heads, seqs, epochs=60, lr=3e-3, steps=2, warmup=5, log=lambda s: None)
    after, top5, ranks = evaluate_eagle(model, model.heads, seqs, 2)
    assert after[0] > max(0.8, before[0] + 0.3) and after[1] > 0.6, (before, after)
    assert ranks.shape[1] == 2 and rep["positions"] > 0


@pytest.mark.parametrize("fuse", [(), (0, 1)])
def test_replay_of_eagle_heads_matches_the_loop(eagle, fuse):
    """eval-heads --replay with eagle heads (prompt states from a teacher-forced prefill,
    the path's states after each step; fused heads: every state from one teacher-forced
    pass with the layers' inputs) gives the loop's tokens and passes per prompt."""
    from mlx_stream.bench import Decoding, decode_items
    from mlx_stream.train.eagle import sequence_features, train_eagle
    from mlx_stream.train.replay import replay_items

    model, tok = eagle
    if fuse:
        model.heads = new_heads(
            model.backbone, tok, K, architecture="eagle", scale=0.3, seed=5, fuse_layers=fuse
        )
    from mlx_stream.prompts import prompt_ids

    prompts = ("Count:", "Count: one two", "The quick brown")
    # self-distilled rows: the backbone's own greedy answers, which the layer learns to draft
    rows = [
        {"prompt": p, "completion": tok.decode(mlx_lm_greedy(model.backbone, tok, prompt_ids(tok, p), 24))}
        for p in prompts
    ]
    seqs = sequence_features(model, tok, rows * 3, fuse_layers=fuse)
    train_eagle(model, model.heads, seqs, epochs=60, lr=3e-3, warmup=5, log=lambda s: None)
    items = [{"prompt": p, "group": "g", "category": "c"} for p in prompts]
    for tree in ("0;1;0,0;0,0,0", "0", "dynamic:4,2"):
        got = replay_items(model, tok, items, 24, tree=tree, prompt_lookup=0)
        ref = decode_items(model, tok, items, Decoding(24, tree, 0))
        assert [(r["tokens"], r["forward_passes"]) for r in got] == [
            (pytest.approx(r["tokens"]), r["forward_passes"]) for r in ref
        ], tree
    assert sum(r["tokens"] for r in got) > 1.2 * sum(r["forward_passes"] for r in got)


def test_select_dynamic_tree_keeps_the_best_connected_candidates():
    from mlx_stream.drafters import select_dynamic_tree

    # root children 0 (-0.1), 1 (-1.0), 2 (-3.0); under 0: 3 (-0.3), 4 (-2.0); under 1: 5 (-1.2)
    vals = np.array([-0.1, -1.0, -3.0, -0.3, -2.0, -1.2])
    pars = np.array([-1, -1, -1, 0, 0, 1])
    rks = np.array([0, 1, 2, 0, 1, 0])
    paths, picked = select_dynamic_tree(vals, pars, rks, 5)
    assert picked == [0, 3, 1, 5] and paths == [(0,), (0, 0), (1,), (1, 0)]
    assert select_dynamic_tree(vals, pars, rks, 2) == ([(0,)], [0])
    assert len(select_dynamic_tree(vals, pars, rks, 50)[1]) == 6  # fewer candidates than the budget
    # a tie between a parent and its child (probability 1) keeps the parent first
    paths, picked = select_dynamic_tree(np.array([-0.5, -0.5]), np.array([-1, 0]), np.array([0, 0]), 3)
    assert paths == [(0,), (0, 0)]
    # a child whose parent missed the cut is skipped, not orphaned
    paths, _ = select_dynamic_tree(
        np.array([-1.0, -0.2, -0.9]), np.array([-1, -1, 0]), np.array([0, 1, 0]), 3
    )
    assert paths == [(1,), (0,)]


@pytest.mark.parametrize("budget,width", [(8, 3), (9, 2)])
def test_dynamic_tree_drafts_equal_a_causal_recomputation(eagle, budget, width):
    """EAGLE-2's dynamic tree: every node is its parent's rank-r child under a plain causal
    pass over its own path, its cumulative draft log-probability is the one that pass
    gives (cache, positions and masks of the expanded entries), and the tree fills its
    budget."""
    from mlx_stream.drafters import DynamicTreeDrafter

    model, tok = eagle
    ids = tok.encode("The quick brown fox jumps over")
    seq = list(mlx_lm_greedy(model.backbone, tok, ids, 14))
    tokens_all = ids + seq
    feats = model.backbone.model(mx.array(tokens_all)[None])[0]
    drafter = DynamicTreeDrafter(model, budget=budget, width=width)
    r, prev, depths = len(ids), 0, set()
    for accepted in (0, 2, 1, 3):
        tokens = tokens_all[: r + 1]
        t, drafts = propose(drafter, feats[prev:r], tokens, K)
        drafts = drafts.tolist()
        assert t.size == budget and t.depth <= K
        depths.add(t.depth)
        for i in range(1, t.size):
            path = t.paths[i]
            ref = _reference_children(model, feats, tokens, [drafts[j - 1] for j in path[:-1]])
            assert drafts[i - 1] == int(ref[int(t.ranks[i])]), (accepted, i)
            value = sum(
                _reference_children(model, feats, tokens, [drafts[j - 1] for j in path[:m]], True)[
                    drafts[path[m] - 1]
                ]
                for m in range(len(path))
            )
            assert abs(float(drafter.values[i - 1]) - value) < 1e-4, (accepted, i)
        prev, r = r, r + accepted + 1
    assert K in depths  # the deepest level's entries (ancestors' entries in their mask) ran
    t, _ = propose(drafter, feats[prev:r], tokens_all[: r + 1], 1)  # depth limit
    assert t.depth == 1 and t.size == width + 1  # the root's children only
    t, d = propose(drafter, feats[r : r + 1], tokens_all[: r + 2], K, base=False)
    assert t.size == 1 and d.size == 0 and drafter._committed == r  # recorded for later, not run
    tokens = tokens_all[: r + 3]
    t, drafts = propose(drafter, feats[r + 1 : r + 2], tokens, K)
    assert drafter._committed == r + 2  # the plain step's position entered with this one's
    for i in range(1, t.size):
        path = t.paths[i]
        ref = _reference_children(model, feats, tokens, [int(drafts[j - 1]) for j in path[:-1]])
        assert int(drafts[i - 1]) == int(ref[int(t.ranks[i])]), i


@pytest.mark.parametrize("spec", ["dynamic:6,3", "dynamic:4"])
def test_greedy_identity_with_a_dynamic_tree(eagle, spec):
    model, tok = eagle
    for prompt in ("The quick brown fox", "Speculative decoding drafts several tokens"):
        ids = tok.encode(prompt)
        ref = mlx_lm_greedy(model.backbone, tok, ids, 48)
        for lookup in (0, 8):
            got, rs = ours(model, tok, ids, 48, tree=spec, prompt_lookup=lookup, adaptive=False)
            assert_greedy_identical(model, ids, got, ref)
            assert max(r.drafted for r in rs) >= 3


def test_seeded_sampling_with_a_dynamic_tree_is_plain_sampling(eagle):
    model, tok = eagle
    ids = tok.encode("The quick brown fox")
    for seed in range(4):
        spec, _ = ours(model, tok, ids, 24, temp=1.0, seed=seed, tree="dynamic:6,3", adaptive=False)
        heads, model.heads = model.heads, None
        try:
            plain, _ = ours(model, tok, ids, 24, temp=1.0, seed=seed)
        finally:
            model.heads = heads
        assert spec == plain, seed


def test_dynamic_tree_specs_are_checked(eagle, tiny_dir):
    from mlx_stream import load
    from mlx_stream.speculation import check_tree_spec, make_drafter, resolve_tree

    model, tok = eagle
    for bad in (
        "dynamic",
        "dynamic:1",
        "dynamic:0",
        "dynamic:8,0",
        "dynamic:x",
        "dynamic:4,2,0",
        "dynamic:4,2,1,1",
        "dynamic:auto,0",
    ):
        with pytest.raises(ValueError, match="dynamic tree spec"):
            check_tree_spec(bad)
    from mlx_stream.speculation import dynamic_spec

    assert dynamic_spec("dynamic:8") == (8, 4, 0) and dynamic_spec("dynamic:auto,3,2") == (0, 3, 2)
    assert make_drafter(model, "dynamic:8,2,2", prompt_lookup=0).depth == 2  # EAGLE-2's depth
    assert make_drafter(model, "dynamic:3,2,2", prompt_lookup=0).depth == 2
    assert make_drafter(model, "dynamic:8,2", prompt_lookup=0).depth == K
    with pytest.raises(ValueError, match=f"at most {K}"):
        make_drafter(model, f"dynamic:8,2,{K + 1}")
    with pytest.raises(ValueError, match="static tree"):
        resolve_tree(model, "dynamic:8")
    from mlx_stream.drafters import DynamicTreeDrafter

    assert DynamicTreeDrafter(model, budget=3).depth == 2  # no deeper level could enter the tree
    assert DynamicTreeDrafter(model, budget=30).depth == K
    hydra, tok2 = load(str(tiny_dir), dtype="float32")
    hydra.heads = new_heads(hydra.backbone, tok2, K, architecture="hydra", scale=0.3, seed=5)
    with pytest.raises(ValueError, match="needs eagle heads"):
        make_drafter(hydra, "dynamic:8")


def test_dynamic_auto_takes_the_budget_that_pays_on_this_device(eagle, tmp_path, monkeypatch):
    """dynamic:auto: N is the size of the candidate tree with the best tau / cost here
    (auto_tree, measured and cached), and a plain step when no tree pays."""
    from mlx_stream.drafters import DynamicTreeDrafter
    from mlx_stream.speculation import auto_tree, make_drafter

    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path / "cache"))
    model, tok = eagle
    model.heads.config.tree_taus = {"0": 1.05, "0;1;0,0": 40.0}  # made-up taus that dwarf any cost
    drafter = make_drafter(model, "dynamic:auto,3", prompt_lookup=0)
    assert isinstance(drafter, DynamicTreeDrafter) and (drafter.budget, drafter.width) == (4, 3)
    assert drafter.budget == auto_tree(model)[0].size
    ids = tok.encode("The quick brown fox")
    got, _ = ours(model, tok, ids, 24, tree="dynamic:auto")
    assert got == mlx_lm_greedy(model.backbone, tok, ids, 24)
    model.heads.config.tree_taus = {"0;1;2;0,0;0,1;1,0;0,0,0": 1.001}  # 7 drafts, almost never accepted
    plain = make_drafter(model, "dynamic:auto", prompt_lookup=0)
    assert not isinstance(plain, DynamicTreeDrafter) and plain.tree.size == 1


FUSE = (0, 1)  # the tiny backbone's layers whose inputs fused heads read (EAGLE-3's low / middle)


def _fused_feats(model, tokens):
    # every position's fused feature: the final hidden state, then the inputs of FUSE
    h, mids = model.family.prefill_hidden(model.backbone, mx.array(tokens), model.make_cache(), capture=FUSE)
    return mx.concatenate([h, mids], axis=-1)


def test_fused_features_start_as_the_final_feature_and_round_trip(tiny, tmp_path):
    """EAGLE-3's fused features: a fresh fusion is [I 0 0] (the heads first draft as
    unfused heads do); the tree forward's captured inputs equal the prefill's; the fused
    width is checked; fuse_layers round-trip."""
    from mlx_stream.models.llama import tree_hidden

    model, tok = tiny
    plain = new_heads(model.backbone, tok, K, architecture="eagle", seed=1)
    fused = new_heads(model.backbone, tok, K, architecture="eagle", seed=1, fuse_layers=FUSE)
    ids = tok.encode("The quick brown fox jumps over the lazy dog")
    feats = _fused_feats(model, ids)
    H = model.args.hidden_size
    assert feats.shape == (len(ids), 3 * H)
    e = model.embed(mx.array(ids[1:]))[None]
    a = plain.eagle.sequence(feats[None, :-1, :H], e)
    b = fused.eagle.sequence(feats[None, :-1], e)
    assert mx.allclose(a, b, atol=1e-5)
    L = len(ids)
    h, mids = tree_hidden(
        model.backbone,
        mx.array(ids),
        mx.arange(L),
        mx.tril(mx.ones((L, L), dtype=mx.bool_)),
        model.make_cache(),
        capture=FUSE,
    )
    assert mx.allclose(mx.concatenate([h, mids], axis=-1), feats, atol=1e-4)
    trained = new_heads(model.backbone, tok, K, architecture="eagle", scale=1.0, seed=3, fuse_layers=FUSE)
    for j in (1, 2):  # each fused layer's input matters once the fusion is trained
        cut = feats.at[:, j * H : (j + 1) * H].multiply(0.0)
        assert not mx.allclose(trained.eagle.features(feats), trained.eagle.features(cut), atol=1e-3), j
    back = load_heads(save_heads(fused, tmp_path / "h"))
    assert back.config.fuse_layers == list(FUSE)
    for (k, x), (_, y) in zip(tree_flatten(fused.parameters()), tree_flatten(back.parameters())):
        assert mx.array_equal(x, y), k
    model.heads = fused
    with pytest.raises(ValueError, match="wide features"):
        EagleDrafter(model, chain(K)).draft(feats[:, :H], ids)
    with pytest.raises(ValueError, match="fuse_layers"):
        new_heads(model.backbone, tok, K, architecture="eagle", fuse_layers=(99,))


def test_fused_drafts_equal_a_causal_recomputation(tiny):
    """With fused features, every node equals a plain causal pass over its own path whose
    verified entries read the fused features and whose drafted entries read the layer's
    own predictions (weights at scale 1, so every weight of the fusion matters)."""
    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, K, architecture="eagle", scale=1.0, seed=7, fuse_layers=FUSE)
    tree = parse_tree(TREE, K)
    ids = tok.encode("The quick brown fox jumps over")
    tokens_all = ids + list(mlx_lm_greedy(model.backbone, tok, ids, 10))
    feats = _fused_feats(model, tokens_all)
    drafter = EagleDrafter(model, tree)
    r, prev = len(ids), 0
    for accepted in (0, 2, 1, 3):
        tokens = tokens_all[: r + 1]
        t, drafts = propose(drafter, feats[prev:r], tokens, K)
        drafts = drafts.tolist()
        fused = model.heads.eagle.features(feats)  # (L, H): what a verified entry reads
        for i in range(1, t.size):
            parent_path = [drafts[j - 1] for j in t.paths[i][:-1]]
            ref = _reference_children(model, fused, tokens, parent_path)
            assert drafts[i - 1] == int(ref[int(t.ranks[i])]), (accepted, i)
        prev, r = r, r + accepted + 1


def test_train_fused_eagle_learns_and_unrolls_like_drafting(tiny):
    """Fused sequence features are the final hidden states then the layers' inputs; the
    unrolled steps read the fused feature at real entries only; training learns."""
    from mlx_stream.train.eagle import evaluate_eagle, sequence_features, train_eagle, unrolled_features

    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, K, architecture="eagle", scale=0.3, seed=5, fuse_layers=FUSE)
    rows = [
        {"prompt": "Count:", "completion": " one two three four five six seven eight nine ten"},
        {"prompt": "Letters:", "completion": " a b c d e f g h i j k l m n o p"},
    ] * 4
    seqs = sequence_features(model, tok, rows, fuse_layers=FUSE)
    ref = _fused_feats(model, seqs[0].ids.tolist())[:-1]
    assert np.allclose(seqs[0].feats.astype(np.float32), np.array(ref), atol=2e-2)
    draft = model.heads.eagle
    F, ids = mx.array(seqs[0].feats.astype(np.float32))[None], seqs[0].ids.tolist()
    E = model.embed(mx.array(ids[1:]))[None]
    outs = unrolled_features(draft, F, E, 2)
    i = 5  # step 2 at entry i: real entries up to i - 1 (fused), then its own prediction
    f = draft.features(F[0, :i])
    g = draft.sequence(f[None], E[:, :i])[0][-1]
    g2 = draft.sequence(mx.concatenate([f, g[None]])[None], E[:, : i + 1])[0][-1]
    assert mx.allclose(outs[1][0, i], g2, atol=1e-4)
    before, _, _ = evaluate_eagle(model, model.heads, seqs, 2)
    train_eagle(model, model.heads, seqs, epochs=60, lr=3e-3, steps=2, warmup=5, log=lambda s: None)
    after, _, _ = evaluate_eagle(model, model.heads, seqs, 2)
    assert after[0] > max(0.8, before[0] + 0.3) and after[1] > 0.6, (before, after)


def test_the_backlog_joins_contiguous_positions_only_and_keeps_the_latest_past_its_limit():
    from mlx_stream.drafters.base import Backlog

    rows = mx.arange(12, dtype=mx.float32).reshape(12, 1)  # row i: position i's feature
    b = Backlog(limit=4)
    b.add(rows[0:2], 2)
    b.add(rows[2:3], 3)
    assert b.take(rows[3:4], 4).tolist() == rows[0:4].tolist() and b.size == 0
    b.add(rows[4:6], 6)
    b.add(rows[8:9], 9)  # a gap (positions 6, 7 never recorded): only the later ones wait
    assert b.size == 1
    assert b.take(rows[10:11], 11).tolist() == rows[10:11].tolist()  # not next to them: alone
    b.add(rows[0:3], 3)
    b.add(rows[3:6], 6)  # past the limit: the latest 4
    assert b.size == 4 and b.take(rows[6:7], 7).tolist() == rows[2:7].tolist()
