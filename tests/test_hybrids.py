"""Recurrent hybrids (issue 52): tiny random models from mlx-lm's own classes whose layers
keep a recurrent state (Gated DeltaNet in qwen3_next, Mamba-2 in mamba2 and
granitemoehybrid, LFM2's short convolutions) beside attention layers. A draft tree is
verified in one forward whose recurrent layers run one batch row per node, row i reading
the path from the root to node i (:class:`~mlx_stream.cache.RecurrentCache`), so the state
after any accepted path is there without a replay: per-row states against sequential ones
for a chain and a tree, greedy identity with plain mlx-lm for every drafter with partial
acceptance, seeded sampling, a chat, a recurrent draft model, heads trained against a
hybrid, chains by default."""

from __future__ import annotations

import importlib
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_greedy_identical, mlx_lm_greedy, ours
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import ArraysCache
from test_any_model import BASE, RECURRENT

from mlx_stream import SpeculativeModel, load, load_draft, stream_generate
from mlx_stream.cache import RecurrentCache, keep_path, make_tree_cache
from mlx_stream.drafters import OracleDrafter
from mlx_stream.tree import chain, parse_tree

HYBRIDS = {
    "qwen3_next": RECURRENT["qwen3_next"],
    "mamba2": RECURRENT["mamba2"],
    "lfm2": dict(norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16)
    | dict(block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=96)
    | dict(
        layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4, tie_word_embeddings=False
    ),
    "granitemoehybrid": dict(attention_bias=False, embedding_multiplier=1.0, attention_multiplier=0.25)
    | dict(logits_scaling=1.0, residual_multiplier=1.0, rms_norm_eps=1e-5, num_hidden_layers=4)
    | dict(layer_types=["mamba", "attention", "mamba", "mamba"], shared_intermediate_size=96)
    | dict(mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4)
    | dict(mamba_n_groups=1, mamba_conv_bias=True, tie_word_embeddings=False),
}
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def hybrid(model_type: str, vocab: int, noise: float = 0.0):
    """A tiny random model (weights 4x mlx-lm's initialisation, as test_any_model's), or with
    ``noise`` a perturbed copy of it (a draft that agrees with it often)."""
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(1)
    cfg = dict(BASE, model_type=model_type, vocab_size=vocab) | HYBRIDS[model_type]
    m = mod.Model(mod.ModelArgs.from_dict(cfg))
    m.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, m.parameters()))
    if noise:
        mx.random.seed(2)
        m.update(
            tree_map(lambda p: p + noise * mx.random.normal(p.shape) if p.ndim == 2 else p, m.parameters())
        )
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load(str(tiny_dir), heads=None)[1]


def wrong_every(tokens, n, vocab):
    # a continuation with every n-th token wrong: drafts accepted in part
    return [t if i % n != n - 1 else (t + 1) % vocab for i, t in enumerate(tokens)]


def _paths(parents):
    out = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("model_type", list(HYBRIDS))
@pytest.mark.parametrize("parents", [[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 2, 1]], ids=["chain", "tree"])
def test_a_draft_step_holds_the_recurrent_state_after_every_nodes_path(model_type, parents, tok):
    """One verify forward over a chain of 5 or a 6-node tree: its logits are the sequential
    ones of each node's path, row i of each recurrent layer holds the state after node i's
    path, and keeping the path to the last node reads on as a sequential decode of it does."""
    V = len(tok.vocab)
    backbone = hybrid(model_type, V)
    fam = SpeculativeModel(backbone).family
    assert fam.trees is None and fam.recurrent, fam.trees
    rng = np.random.default_rng(0)
    n = len(parents)
    prefix, toks, more = rng.integers(0, V, 9).tolist(), rng.integers(0, V, n).tolist(), int(rng.integers(V))
    paths = _paths(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(paths):
        anc[i, p] = True
    depths = np.array([len(p) - 1 for p in paths])
    cache = make_tree_cache(backbone)
    fam.prefill_forward(backbone, mx.array(prefix), cache)
    mask = mx.concatenate([mx.ones((n, len(prefix)), dtype=mx.bool_), mx.array(anc)], axis=1)
    pos = mx.array(len(prefix) + depths, dtype=mx.int32)
    got = fam.tree_forward(backbone, mx.array(toks), pos, mask, cache)[0]
    recurrent = [i for i, c in enumerate(cache) if isinstance(c, RecurrentCache)]
    assert recurrent and all(cache[i].chain_rows == n for i in recurrent)
    worst_state = 0.0
    for i, p in enumerate(paths):
        seq = backbone.make_cache()
        want = backbone(mx.array([prefix + [toks[j] for j in p]]), cache=seq)[0, -1]
        np.testing.assert_allclose(np.array(got[i]), np.array(want), atol=1e-4 * float(mx.abs(want).max()))
        for li in recurrent:
            assert isinstance(seq[li], ArraysCache)
            for a, b in zip(cache[li].cache, seq[li].cache):
                worst_state = max(worst_state, float(mx.abs(a[i] - b[0]).max()))
    print(f"\n{model_type} {parents}: max |state row i - sequential| {worst_state:.1e}")
    assert worst_state < 1e-4
    kept = paths[-1]
    keep_path(cache, len(prefix), kept)
    assert all(
        cache[i].chain_rows == 0 and cache[i].tokens_read == len(prefix) + len(kept) for i in recurrent
    )
    nxt = fam.tree_forward(backbone, mx.array([more]), mx.array([len(prefix) + len(kept)]), None, cache)[0]
    want = backbone(mx.array([prefix + [toks[j] for j in kept] + [more]]))[0, -1]
    np.testing.assert_allclose(np.array(nxt[0]), np.array(want), atol=1e-4 * float(mx.abs(want).max()))


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_greedy_identity_and_seeded_sampling_with_drafts_on_hybrids(model_type, tok):
    """Chains of 1, 3 and 5 drafts and a 5-node tree accepted in part (an oracle with every
    4th token wrong),
    a recurrent draft model (a perturbed copy: chain and its calibrated depth), prompt lookup:
    greedy output identical to plain mlx-lm over 64 tokens; seeded sampling equal to seeded
    plain sampling with a chain and with the draft model."""
    V = len(tok.vocab)
    model = SpeculativeModel(hybrid(model_type, V))
    ids = tok.encode(PROMPT)
    ref = mlx_lm_greedy(model.backbone, tok, ids, 64)
    assert len(ref) == 64
    bad = wrong_every(ref, 4, V)
    for tree in (chain(1), chain(3), chain(5), parse_tree("0;1;0,0;1,0;0,0,0", 3)):
        got, rs = ours(model, tok, ids, 64, drafter=OracleDrafter(len(ids), bad, tree, V), adaptive=False)
        assert assert_greedy_identical(model, ids, got, ref) == "equal", tree.choices
        kept = sum(r.accepted for r in rs)
        assert 0 < kept < sum(r.drafted for r in rs), (tree.choices, kept)  # accepted in part
    draft = load_draft((hybrid(model_type, V, noise=0.01), tok), model, tok, calibrate=False)
    for kw in ({"num_draft_tokens": 3}, {}):
        got, rs = ours(model, tok, ids, 64, draft_model=draft, adaptive=False, **kw)
        assert assert_greedy_identical(model, ids, got, ref) == "equal", kw
        assert sum(r.accepted for r in rs) > 0, kw  # (its default chain stops below p_min: 1 or more)
        assert max(r.drafted for r in rs) == 3 or not kw
    got, _ = ours(model, tok, ids, 64, prompt_lookup=4)
    assert assert_greedy_identical(model, ids, got, ref) == "equal"
    for seed in range(2):
        plain, _ = ours(model, tok, ids, 24, temp=0.8, seed=seed)
        sampled = wrong_every(plain, 3, V)
        oracle = OracleDrafter(len(ids), sampled, chain(3), V)
        assert ours(model, tok, ids, 24, temp=0.8, seed=seed, drafter=oracle, adaptive=False)[0] == plain
        spec, _ = ours(model, tok, ids, 24, temp=0.8, seed=seed, draft_model=draft, num_draft_tokens=3)
        assert spec == plain, seed


def test_heads_draft_chains_by_default_and_trees_on_request(tok):
    """Random stream heads and an EAGLE-style layer on qwen3_next: their chain by default (a
    tree step reads N x N tokens in each recurrent mixer), a static tree, EAGLE-2's dynamic
    tree and prompt lookup's branch beside the heads on request: greedy output equal."""
    from mlx_stream.heads import new_heads

    V = len(tok.vocab)
    backbone = hybrid("qwen3_next", V)
    ids = tok.encode(PROMPT)
    ref = mlx_lm_greedy(backbone, tok, ids, 32)
    heads = SpeculativeModel(backbone, new_heads(backbone, tok, 3, seed=0, scale=0.02))
    eagle = SpeculativeModel(
        backbone, new_heads(backbone, tok, 3, architecture="eagle", fuse_layers=(0, 1), seed=1)
    )
    for model, kw, size in (
        (heads, {}, 4),
        (heads, {"tree": "0;1;0,0;1,0"}, 5),
        (heads, {"tree": "chain:2", "prompt_lookup": 4}, None),
        (eagle, {}, 4),
        (eagle, {"tree": "dynamic:6,3"}, 6),
    ):
        got, rs = ours(model, tok, ids, 32, adaptive=False, **kw)
        assert assert_greedy_identical(model, ids, got, ref) == "equal", kw
        assert size is None or max(r.drafted for r in rs) == size - 1, kw


def test_a_recurrent_draft_drafts_chains_for_an_attention_target(tok, tiny_dir):
    """A hybrid draft model beside a llama target: its calibrated tree is drafted as a chain
    (its recurrent state is kept per draft token and restored to the accepted one)."""
    from mlx_stream.speculation import plan_drafting

    model, _ = load(str(tiny_dir), heads=None, dtype="float32")
    draft = load_draft((hybrid("qwen3_next", len(tok.vocab)), tok), model, tok, calibrate=False)
    plan = plan_drafting(model, draft_model=draft)
    assert plan.width == 1 and plan.budget == plan.depth + 1
    ids = tok.encode(PROMPT)
    got, rs = ours(model, tok, ids, 48, draft_model=draft, adaptive=False)
    assert assert_greedy_identical(model, ids, got, mlx_lm_greedy(model.backbone, tok, ids, 48)) in (
        "equal",
        "tie",
    )
    assert max(r.drafted for r in rs) >= 2


def test_chat_turns_on_a_hybrid_with_a_draft_model_equal_plain_chat_turns(tok):
    # (a turn reuses the cached state where the transcript extends the cached tokens exactly;
    # where it does not, a recurrent state cannot be rewound and the turn starts over)
    from mlx_stream import ChatSession

    V = len(tok.vocab)
    model = SpeculativeModel(hybrid("qwen3_next", V))
    draft = load_draft((hybrid("qwen3_next", V, noise=0.01), tok), model, tok, calibrate=False)
    chat = ChatSession(model, tok, max_tokens=16, temp=0.0, draft_model=draft, num_draft_tokens=2)
    plain = ChatSession(model, tok, max_tokens=16, temp=0.0)
    accepted = 0
    for turn in ("Hello there", "And again", "Once more"):
        a, b = list(chat.send(turn)), list(plain.send(turn))
        assert "".join(r.text for r in a) == "".join(r.text for r in b), turn
        accepted += sum(r.accepted for r in a)
    assert accepted > 0


@pytest.mark.parametrize("model_type", ["qwen3_next", "lfm2"])
def test_a_prompt_that_continues_a_drafted_generation_reuses_its_state(model_type, tok):
    """After a generation drafted by a draft model (its last step's drafts dropped, the root's
    row kept), a prompt that continues the cached tokens prefills only what is new, and its
    output is still plain mlx-lm's."""
    from mlx_stream import PromptCache

    V = len(tok.vocab)
    model = SpeculativeModel(hybrid(model_type, V))
    draft = load_draft((hybrid(model_type, V, noise=0.01), tok), model, tok, calibrate=False)
    pc = PromptCache(model)
    ids, held = tok.encode(PROMPT), []
    for _ in range(3):
        got, rs = ours(model, tok, ids, 20, prompt_cache=pc, draft_model=draft, num_draft_tokens=3)
        assert rs[-1].cached_tokens == len(held)  # all the cached tokens reused (none the first time)
        want = mlx_lm_greedy(model.backbone, tok, ids, 20)
        assert assert_greedy_identical(model, ids, got, want) == "equal"
        assert sum(r.accepted for r in rs) > 0
        held = list(pc.tokens)
        assert held == ids + got[:-1]  # (the last token is the next step's root, not yet cached)
        ids = held + tok.encode(" and again")


def write_hybrid_dir(path, tiny_dir, model_type="qwen3_next"):
    """The hybrid as an mlx-lm model folder (config, weights, the tiny tokenizer)."""
    vocab = len(load(str(tiny_dir), heads=None)[1].vocab)
    backbone = hybrid(model_type, vocab)
    path.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / f, path / f)
    cfg = dict(BASE, model_type=model_type, vocab_size=vocab) | HYBRIDS[model_type]
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(backbone.parameters())))
    return path


def test_train_heads_against_a_hybrid_and_draft_with_them(tiny_dir, tmp_path):
    """`mlx-stream train` self-distils and trains hydra heads against a frozen qwen3_next
    (batched generation through its recurrent caches); they draft their chain, lossless."""
    from helpers import FINE_TUNE_WORDS
    from test_cli import run

    from mlx_stream.train.data import prompt_ids, read_jsonl

    target = write_hybrid_dir(tmp_path / "target", tiny_dir)
    rng = np.random.default_rng(0)
    kinds = [" ".join(rng.choice(FINE_TUNE_WORDS, 4)) for _ in range(5)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": kinds[i % 5]}) + "\n" for i in range(40)))
    out = tmp_path / "run"
    r = run("train", "--model", str(target), "--data", str(data), "--out", str(out), "--max-tokens", "48")
    assert r.returncode == 0, r.stderr
    model, tok = load(str(target), heads=str(out / "heads"), dtype="float32")
    accepted = 0
    for row in read_jsonl(out / "data" / "valid.jsonl")[:2]:
        ids = prompt_ids(tok, row["prompt"])
        got, rs = ours(model, tok, ids, 48, adaptive=False)
        assert (
            assert_greedy_identical(model, ids, got, mlx_lm_greedy(model.backbone, tok, ids, 48)) == "equal"
        )
        assert max(r.drafted for r in rs) >= model.heads.num_heads  # the heads' chain (lookup's beside it)
        accepted += sum(r.accepted for r in rs)
    assert accepted > 0


N_CHI = 2_000


@pytest.mark.slow  # a chi-square test: minutes (make test-all)
def test_sampling_on_a_hybrid_with_a_draft_model_follows_the_plain_distribution(tok):
    """The joint distribution of the first 3 sampled tokens (T = 0.7, top_p = 0.9) with a
    recurrent draft model's chains on qwen3_next against plain decoding's exact
    probabilities (tests/test_sampling.py's bins and test)."""
    from test_sampling import TOKENS, chi_square, exact_bins, sample_outcomes

    from mlx_stream.sampling import SamplingParams
    from mlx_stream.speculation import make_drafter

    V = len(tok.vocab)
    model = SpeculativeModel(hybrid("qwen3_next", V))  # (at T = 0.7 its top tokens: p 0.26, 0.25, 0.09)
    draft = load_draft((hybrid("qwen3_next", V, noise=0.01), tok), model, tok, calibrate=False)
    ids = tok.encode("The quick")
    kw = {"temp": 0.7, "top_p": 0.9}
    rs = list(
        stream_generate(model, tok, ids, max_tokens=64, draft_model=draft, num_draft_tokens=3, seed=0, **kw)
    )
    assert sum(r.accepted for r in rs) >= 5
    bins = exact_bins(model, tok, ids, SamplingParams(**kw), [], N_CHI)
    drafter = make_drafter(model, draft_model=draft, num_draft_tokens=3)
    counts = sample_outcomes(model, tok, ids, kw, [], N_CHI, drafter=drafter, max_tokens=TOKENS + 1)
    stat, p, dof = chi_square(counts, bins, N_CHI)
    print(
        f"\nqwen3_next, recurrent draft chain of 3, T=0.7, top_p=0.9: chi2 {stat:.1f}, dof {dof}, p {p:.3f}"
    )
    assert len(bins) >= 10
    assert p > 0.01, f"sampling on a hybrid differs from plain sampling (chi2 {stat:.1f}, p {p:.2e})"
