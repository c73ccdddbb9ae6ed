"""Published DFlash block drafters: tiny checkpoints in z-lab's layout (the target's
output head) and speculators' (an own head over a draft vocabulary), written here with
random weights, read as "dflash" heads; the block's logits at every drafting step, after
context entries appended step by step, against a plain torch implementation written from
the published definition over Hugging Face transformers' hidden states; lossless decoding
with chains and trees."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import make_tiny_model_dir
from helpers import assert_greedy_identical, check_backlog, mlx_lm_greedy, ours
from test_eagle3 import _hf_aux

from mlx_stream import load
from mlx_stream.cache import make_tree_cache
from mlx_stream.drafters.dflash import DFlashDrafter
from mlx_stream.tree import chain, parse_tree

L_TARGET = 8
H, HEADS, KV, HD, FF = 64, 4, 2, 16, 96
THETA = 1e6
BLOCK, MASK = 6, 3
N_LAYERS = 2
# layout -> (architectures, speculators-style, ids as the config names them, own head)
LAYOUTS = {
    "z-lab": (["DFlashDraftModel"], False, [1, 3, 5], False),
    "speculators": (["DFlashSpeculator"], True, [2, 4, 6], True),
}


def aux_inputs(layout):
    _, spec, ids, _ = LAYOUTS[layout]
    return list(ids) if spec else [i + 1 for i in ids]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("df") / "target", layers=L_TARGET, tied=False)


def write_dflash(path, layout, V, seed=0, hidden=H, vocab=None):
    archs, spec_style, ids, own_head = LAYOUTS[layout]
    rng = np.random.default_rng(seed)

    def w(*shape, s=1.0):
        return (rng.standard_normal(shape) * s / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"fc.weight": w(H, 3 * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": w(HEADS * HD, H),
            p + "self_attn.k_proj.weight": w(KV * HD, H),
            p + "self_attn.v_proj.weight": w(KV * HD, H),
            p + "self_attn.o_proj.weight": w(H, HEADS * HD, s=0.5),
            p + "self_attn.q_norm.weight": norm(HD),
            p + "self_attn.k_norm.weight": norm(HD),
            p + "mlp.gate_proj.weight": w(FF, H),
            p + "mlp.up_proj.weight": w(FF, H),
            p + "mlp.down_proj.weight": w(H, FF, s=0.5),
        }
    layer = {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "intermediate_size": FF,
        "rms_norm_eps": 1e-6,
        "rope_theta": THETA,
        "vocab_size": vocab or V,
    }
    if own_head:
        Vd = V // 2
        keep = np.sort(rng.choice(V, Vd, replace=False))
        t["lm_head.weight"] = w(Vd, H, s=8.0)
        t["d2t"] = (keep - np.arange(Vd)).astype(np.int64)
    if spec_style:
        cfg = {
            "architectures": archs,
            "speculators_model_type": "dflash",
            "transformer_layer_config": layer,
            "block_size": BLOCK,
            "mask_token_id": MASK,
            "aux_hidden_state_layer_ids": ids,
            "draft_vocab_size": V // 2,
        }
    else:
        cfg = {**layer, "architectures": archs, "block_size": BLOCK}
        cfg["dflash_config"] = {"target_layer_ids": ids, "mask_token_id": MASK}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    save_file(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in t.items()}, str(path / "model.safetensors")
    )
    return path, {k: torch.from_numpy(np.array(v)) for k, v in t.items()}


# --- an independent reference: the published definition in plain torch -----------------


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos):  # (T, h, d) at positions pos (T,): rotate-half
    d = x.shape[-1]
    inv = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]
    cos = torch.cat([ang.cos()] * 2, -1).float()[:, None]
    sin = torch.cat([ang.sin()] * 2, -1).float()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _kv(W, p, z, pos):
    k = _rms((z @ W[p + "self_attn.k_proj.weight"].T).view(len(z), KV, HD), W[p + "self_attn.k_norm.weight"])
    return _rope(k, pos), (z @ W[p + "self_attn.v_proj.weight"].T).view(len(z), KV, HD)


def _kv(W, p, z, pos):
    k = _rms((z @ W[p + "self_attn.k_proj.weight"].T).view(len(z), KV, HD), W[p + "self_attn.k_norm.weight"])
    return _rope(k, pos), (z @ W[p + "self_attn.v_proj.weight"].T).view(len(z), KV, HD)


def torch_block(W, aux, block_emb, start):
    """DFlash's block forward (z-lab's / speculators' Qwen3DFlashDecoderLayer): context
    entries hidden_norm(fc(aux)) at positions 0..P-1, the block at start.. start + B - 1,
    attending over both with no mask; returns the normed block outputs (B, H)."""
    c = _rms(aux @ W["fc.weight"].T, W["hidden_norm.weight"])
    P, B = c.shape[0], block_emb.shape[0]
    pos_c, pos_b = torch.arange(P), start + torch.arange(B)
    x = block_emb
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        hn = _rms(x, W[p + "input_layernorm.weight"])
        q = _rope(
            _rms(
                (hn @ W[p + "self_attn.q_proj.weight"].T).view(B, HEADS, HD), W[p + "self_attn.q_norm.weight"]
            ),
            pos_b,
        )

        kc, vc = _kv(W, p, c, pos_c)  # the context entries: no input_layernorm
        kb, vb = _kv(W, p, hn, pos_b)
        K = torch.cat([kc, kb]).repeat_interleave(HEADS // KV, 1)
        Vv = torch.cat([vc, vb]).repeat_interleave(HEADS // KV, 1)
        att = (torch.einsum("thd,shd->hts", q, K) / HD**0.5).softmax(-1)
        o = torch.einsum("hts,shd->thd", att, Vv).reshape(B, HEADS * HD) @ W[p + "self_attn.o_proj.weight"].T
        x = x + o
        g = _rms(x, W[p + "post_attention_layernorm.weight"])
        up = torch.nn.functional.silu(g @ W[p + "mlp.gate_proj.weight"].T) * (
            g @ W[p + "mlp.up_proj.weight"].T
        )
        x = x + up @ W[p + "mlp.down_proj.weight"].T
    return _rms(x, W["norm.weight"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_logits_equal_a_torch_reference_as_the_context_grows(target_dir, tmp_path, layout):
    plain, tok = load(str(target_dir), heads=None, dtype="float32")
    path, W = write_dflash(tmp_path / layout, layout, plain.args.vocab_size, seed=3)
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    aux = aux_inputs(layout)
    assert model.heads.config.architecture == "dflash" and list(model.heads.config.fuse_layers) == aux
    seq = tok.encode("The quick brown fox jumps over the lazy dog")
    h, mids = model.family.prefill_hidden(model.backbone, mx.array(seq), make_tree_cache(model.backbone), aux)
    feats = mx.concatenate([h, mids], axis=-1)
    hf_aux = _hf_aux(target_dir, seq, aux)
    emb = torch.from_numpy(np.array(model.backbone.model.embed_tokens.weight))
    head = (
        W["lm_head.weight"]
        if "lm_head.weight" in W
        else torch.from_numpy(np.array(model.backbone.lm_head.weight))
    )
    drafter = DFlashDrafter(model, chain(BLOCK - 1))
    seen, real = [], drafter._logits
    drafter._logits = lambda out: seen.append(real(out)) or seen[-1]
    worst, done = 0.0, 0
    assert len(seq) >= 7
    for r in (3, 4, len(seq) - 1):  # the root at r: positions done..r-1 are handed over, as the loop does
        drafts = drafter.draft(feats[done:r], seq[: r + 1]).tolist()
        done = r
        block = torch.tensor([seq[r]] + [MASK] * (BLOCK - 1))
        want = torch_block(W, hf_aux[:r], emb[block], r)[1:] @ head.T
        got = np.array(seen[-1])
        worst = max(worst, float(np.abs(got - want.numpy()).max()))
        ids = want.argmax(-1).numpy()
        if "d2t" in W:
            ids = ids + W["d2t"].numpy()[ids]
        assert drafts == ids.tolist(), (layout, r)
    print(f"\n{layout}: max |dlogit| over 3 steps x {BLOCK - 1} positions {worst:.2e}")
    assert worst < 2e-4, worst


def fit(model, tok, steps=150, lr=3e-3, temp=0.0):
    """Distil the target into the block drafter: each anchor r of the target's greedy text
    holds a block [x_r, mask...] over the context entries before r, position j learning the
    target's distribution of x_{r+j} (a few hundred Adam steps; random weights draft nothing
    the target keeps)."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.models.cache import KVCache

    aux = list(model.heads.config.fuse_layers)
    d = model.heads.dflash
    examples = []
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    texts = []
    for prompt in ("The quick brown fox", "Speculative decoding drafts several tokens", "0123"):
        ids = tok.encode(prompt)
        for seed in range(3 if temp else 1):  # sampled texts (temp > 0): what sampling drafts for
            mx.random.seed(seed)
            gen = mlx_lm.stream_generate(model.backbone, tok, ids, max_tokens=64, sampler=make_sampler(temp))
            texts.append((ids, ids + [r.token for r in gen]))
    for ids, seq in texts:
        h, mids = model.family.prefill_hidden(
            model.backbone, mx.array(seq), make_tree_cache(model.backbone), aux
        )
        probs = mx.softmax(model.project(h), axis=-1)  # row i: the target's distribution of x_{i+1}
        if model.heads.config.draft_vocab_size:
            probs = probs[:, model.heads.draft_ids]
        feats = mx.concatenate([h, mids], axis=-1)
        for r in range(len(ids), len(seq) - BLOCK, 5):
            block = mx.array([seq[r]] + [MASK] * (BLOCK - 1))
            examples.append((feats[:r], block, r, probs[r : r + BLOCK - 1]))

    def loss(m):
        total = 0.0
        for f, block, r, P in examples:
            caches = [KVCache() for _ in m.layers]
            m.commit(m.context(f), 0, caches)
            out = m.block(model.embed(block), r, caches)[1:]
            logits = m.lm_head(out) if "lm_head" in m else model.project(out)
            total = total - (P * nn.log_softmax(logits, axis=-1)).sum(-1).mean()
        return total / len(examples)

    opt, step = optim.Adam(learning_rate=lr), nn.value_and_grad(d, loss)
    for _ in range(steps):
        _, g = step(d)
        opt.update(d, g)
        mx.eval(d.parameters(), opt.state)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_identity_with_a_published_dflash(target_dir, tmp_path, layout):
    plain, tok = load(str(target_dir), heads=None, dtype="float32")
    path, _ = write_dflash(tmp_path / layout, layout, plain.args.vocab_size, seed=1)
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    fit(model, tok, steps=40)
    trees = [None, "chain:3", "0;1;0,0;1,0;0,0,0"]
    accepted = dict.fromkeys(map(str, trees), 0)
    for prompt in ("The quick brown fox", "Speculative decoding drafts several tokens"):
        ids = tok.encode(prompt)
        ref = mlx_lm_greedy(model.backbone, tok, ids, 64)
        for tree in trees:
            got, rs = ours(model, tok, ids, 64, tree=tree, adaptive=False, prompt_lookup=0)
            assert_greedy_identical(model, ids, got, ref)
            accepted[str(tree)] += sum(r.accepted for r in rs)
    print(f"\n{layout}: accepted drafts per tree over 2 x 64 tokens {accepted}")
    assert all(a > 0 for a in accepted.values()), accepted
    ids = tok.encode("The quick brown fox")
    got, _ = ours(model, tok, ids, 64)  # the defaults: adaptive speculation, prompt lookup
    assert_greedy_identical(model, ids, got, mlx_lm_greedy(model.backbone, tok, ids, 64))


def test_a_plain_steps_positions_enter_the_context_with_the_next_drafted_step(target_dir, tmp_path):

    model, tok = load(str(target_dir), heads=None, dtype="float32")
    path, _ = write_dflash(tmp_path / "df", "speculators", model.args.vocab_size, seed=3)
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    check_backlog(model, tok, lambda: DFlashDrafter(model, parse_tree("0;1;0,0;1,0", 3)))


def test_seeded_sampling_with_a_published_dflash_is_plain_sampling(target_dir, tmp_path):
    plain, tok = load(str(target_dir), heads=None, dtype="float32")
    path, _ = write_dflash(tmp_path / "d", "speculators", plain.args.vocab_size, seed=2)
    model, _ = load(str(target_dir), heads=str(path), dtype="float32")
    fit(model, tok, steps=40)
    ids = tok.encode("The quick brown fox")
    for seed in range(4):
        for tree in (None, "0;1;0,0"):
            spec, _ = ours(model, tok, ids, 24, temp=1.0, seed=seed, tree=tree, adaptive=False)
            base, _ = ours(plain, tok, ids, 24, temp=1.0, seed=seed)
            assert spec == base, (seed, tree)


def test_a_dflash_for_another_target_or_tree_is_refused(target_dir, tmp_path):
    plain, tok = load(str(target_dir), heads=None, dtype="float32")
    V = plain.args.vocab_size
    for name, kw, word in (("vocab", {"vocab": V + 16}, "vocabulary"), ("width", {"hidden": 2 * H}, "wide")):
        path, _ = write_dflash(tmp_path / name, "z-lab", V, **kw)
        with pytest.raises(ValueError, match=word):
            load(str(target_dir), heads=str(path), dtype="float32")
    small = make_tiny_model_dir(tmp_path / "small", layers=4, tied=False)
    path, _ = write_dflash(tmp_path / "ok", "speculators", V)
    with pytest.raises(ValueError, match="layers"):
        load(str(small), heads=str(path), dtype="float32")
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    for tree, word in (("budget", "static tree"), ("dynamic:6", "eagle"), (chain(BLOCK), "shallower")):
        with pytest.raises(ValueError, match=word):
            ours(model, tok, tok.encode("hi"), 4, tree=tree)


N_CHI = 3_000


@pytest.mark.slow  # a chi-square test: minutes (make test-all)
def test_sampling_with_a_published_dflash_follows_the_plain_distribution(tmp_path):
    """The joint distribution of the first 3 sampled tokens (T = 0.7, top_p = 0.9) with a
    fitted DFlash drafter filling a tree, against plain decoding's exact probabilities
    (tests/test_sampling.py's bins and test)."""
    from test_sampling import TOKENS, chi_square, exact_bins, sample_outcomes

    from mlx_stream import stream_generate
    from mlx_stream.sampling import SamplingParams
    from mlx_stream.tree import parse_tree

    target = make_tiny_model_dir(tmp_path / "spread", layers=L_TARGET, tied=False, head_scale=0.4)
    plain, tok = load(str(target), heads=None, dtype="float32")
    path, _ = write_dflash(tmp_path / "d", "z-lab", plain.args.vocab_size, seed=4)
    model, tok = load(str(target), heads=str(path), dtype="float32")
    fit(model, tok, steps=100, lr=1e-2, temp=0.7)
    ids = tok.encode("The quick")
    kw = {"temp": 0.7, "top_p": 0.9}
    drafter = DFlashDrafter(model, parse_tree("0;1;0,0;1,0", BLOCK - 1))
    runs = [stream_generate(model, tok, ids, max_tokens=64, drafter=drafter, seed=s, **kw) for s in range(4)]
    assert sum(r.accepted for run in runs for r in run) >= 5  # accepted and rejected: the test sees both
    bins = exact_bins(model, tok, ids, SamplingParams(**kw), [], N_CHI)
    counts = sample_outcomes(model, tok, ids, kw, [], N_CHI, drafter=drafter, max_tokens=TOKENS + 1)
    stat, p, dof = chi_square(counts, bins, N_CHI)
    print(f"\nDFlash, a 5-node tree, T=0.7, top_p=0.9: chi2 {stat:.1f}, dof {dof}, p {p:.3f}")
    assert len(bins) >= 20
    assert p > 0.01, f"sampling with DFlash differs from plain sampling (chi2 {stat:.1f}, p {p:.2e})"
