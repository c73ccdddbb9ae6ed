"""The multi-token-prediction modules inside a checkpoint (DeepSeek-V3's MLA + MoE layers,
GLM-4.5's partial-rotary, q/k-normed MoE layers): tiny random checkpoints written here from
mlx-lm's own classes, the MTP module in Hugging Face naming (experts unstacked, MLA's
``kv_b_proj`` whole) so the target's own ``sanitize`` reads it; the drafter's logits at every
drafting step against a sequential reference written from the published definition; lossless
decoding with every tree kind."""

from __future__ import annotations

import importlib
import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import assert_greedy_identical, check_fine_tuning, mlx_lm_greedy, ours
from mlx.utils import tree_flatten, tree_map
from test_any_model import BASE
from test_any_model import MODELS as ANY

from mlx_stream import load, stream_generate
from mlx_stream.cache import make_tree_cache
from mlx_stream.drafters.eagle import EagleDrafter
from mlx_stream.tree import chain

L = 2  # target layers; the MTP module is stored as layer L
GLM = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32)
GLM |= dict(first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
GLM |= dict(
    rope_theta=1e4, rope_scaling=None, use_qk_norm=True, attention_bias=False, partial_rotary_factor=0.5
)
MODELS = {"deepseek_v3": ANY["deepseek_v3"][1], "glm4_moe": GLM | {"tie_word_embeddings": False}}


def _hf_block(block: dict, args) -> dict:
    # mlx-lm's names of one decoder layer back to the checkpoint's (what sanitize undoes)
    out = {}
    for k, v in block.items():
        if ".switch_mlp." in k:
            for e in range(v.shape[0]):
                out[k.replace(".switch_mlp.", f".experts.{e}.")] = v[e]
        elif k.endswith("self_attn.embed_q.weight"):
            wv = block[k.replace("embed_q", "unembed_out")]
            kv = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)
            out[k.replace("embed_q", "kv_b_proj")] = kv.reshape(-1, args.kv_lora_rank)
        elif not k.endswith("self_attn.unembed_out.weight"):
            out[k] = v
    return out


def write_checkpoint(path, model_type: str, tok_dir, seed: int = 0):
    """A target of L layers and its MTP module (layer L), as a published checkpoint: returns
    (folder, the module's own weights in mlx-lm's naming, the full (L + 1)-layer model)."""
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    path.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, path / f)
    V = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    cfg = dict(BASE, model_type=model_type, vocab_size=V) | MODELS[model_type]
    args = mod.ModelArgs.from_dict(cfg | {"num_hidden_layers": L + 1})
    mx.random.seed(seed)
    full = mod.Model(args)
    full.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, full.parameters()))
    mx.eval(full.parameters())
    params = dict(tree_flatten(full.parameters()))
    at = f"model.layers.{L}."
    target = {k: v for k, v in params.items() if not k.startswith(at)}
    rng = np.random.default_rng(seed)
    H = BASE["hidden_size"]
    own = {
        "enorm.weight": mx.array(1 + 0.1 * rng.standard_normal(H), dtype=mx.float32),
        "hnorm.weight": mx.array(1 + 0.1 * rng.standard_normal(H), dtype=mx.float32),
        "eh_proj.weight": mx.array(rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H), dtype=mx.float32),
        "shared_head.norm.weight": mx.array(1 + 0.1 * rng.standard_normal(H), dtype=mx.float32),
    }
    block = {k[len(at) :]: v for k, v in params.items() if k.startswith(at)}
    mtp = {at + k: v for k, v in (_hf_block(block, args) | own).items()}
    mtp[at + "embed_tokens.weight"] = params["model.embed_tokens.weight"]  # the published copies
    mtp[at + "shared_head.head.weight"] = params["lm_head.weight"]
    # mlx-lm's deepseek_v3 sanitize drops only "model.layers.61" (the real model's): this tiny one's
    # module sits in a file mlx-lm's model*.safetensors glob skips; the index maps both files
    files = {"model-00001-of-00002.safetensors": target}
    files["mtp.safetensors" if model_type == "deepseek_v3" else "model-00002-of-00002.safetensors"] = mtp
    for name, w in files.items():
        mx.save_safetensors(str(path / name), w)
    wmap = {k: name for name, w in files.items() for k in w}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (path / "config.json").write_text(
        json.dumps(cfg | {"num_hidden_layers": L, "num_nextn_predict_layers": 1, "eos_token_id": 0})
    )
    return path, own, full


@pytest.fixture(scope="module", params=list(MODELS))
def ckpt(request, tiny_dir, tmp_path_factory):
    return request.param, *write_checkpoint(
        tmp_path_factory.mktemp("mtp") / request.param, request.param, tiny_dir
    )


def _rms(x, w, eps=BASE["rms_norm_eps"]):
    return mx.fast.rms_norm(x, mx.array(w), eps)


def reference(full, own, hs, toks):
    """The published definition, sequentially over the whole context (no cache, no tree):
    z_i = eh_proj([enorm(e(x_{i+1})); hnorm(h_i)]), h'_i = block(z_i) causally, logits =
    lm_head(shared_head.norm(h'_i)); the block is the full model's layer L itself."""
    e = full.model.embed_tokens(toks)
    z = (
        mx.concatenate([_rms(e, own["enorm.weight"]), _rms(hs, own["hnorm.weight"])], -1)
        @ own["eh_proj.weight"].T
    )
    T = hs.shape[0]
    h = full.model.layers[L](z[None], mx.tril(mx.ones((T, T), dtype=mx.bool_)), None)[0]
    return h, full.lm_head(_rms(h, own["shared_head.norm.weight"]))


def test_drafted_logits_equal_a_sequential_reference_at_every_step(ckpt):
    model_type, path, own, full = ckpt
    model, tok = load(str(path), heads="mtp", dtype="float32")
    assert model.heads.config.mtp["layer_index"] == L and model.heads.config.tree == "0;0,0;0,0,0"
    ids = tok.encode("The quick brown fox jumps over")
    hs = full.model.embed_tokens(mx.array(ids))  # the target's final hidden states, from its first L layers
    mask = mx.tril(mx.ones((len(ids), len(ids)), dtype=mx.bool_))
    for layer in full.model.layers[:L]:
        hs = layer(hs[None], mask, None)[0]
    hs = full.model.norm(hs)
    h_loop = model.family.prefill_hidden(model.backbone, mx.array(ids), make_tree_cache(model.backbone))[0]
    np.testing.assert_allclose(np.array(h_loop), np.array(hs), atol=1e-4)
    root = int(mx.argmax(full.lm_head(hs[-1])).item())
    depth = 3
    drafter = EagleDrafter(model, chain(depth))
    seen, real = [], drafter._logits
    drafter._logits = lambda f: seen.append(real(f)) or seen[-1]
    drafts = drafter.draft(h_loop, ids + [root]).tolist()
    toks, ctx, worst = ids[1:] + [root], hs, 0.0
    for d in range(depth):
        h, logits = reference(full, own, ctx, mx.array(toks))
        got, want = np.array(seen[d]).reshape(-1), np.array(logits[-1])
        worst = max(worst, float(np.abs(got - want).max()))
        assert drafts[d] == int(np.argmax(want)), (model_type, d)
        ctx, toks = mx.concatenate([ctx, h[-1:]]), toks + [drafts[d]]  # the module's output fed back
    print(f"\n{model_type}: max |dlogit| over {depth} MTP drafting steps {worst:.2e}")
    assert worst < 1e-3 * max(1.0, float(np.abs(want).max())), worst


def fit(model, tok, steps=200, lr=3e-3, temp=0.0, texts=4, prompts=None):
    """A few hundred Adam steps distilling the target into the MTP module (its training
    objective: the entry (h_i, x_{i+1}) predicts the target's x_{i+2}) on the target's own
    text, so its drafts are sometimes accepted (random weights draft nothing it keeps)."""
    import mlx.optimizers as optim
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    seqs = []
    for prompt in prompts or ("The quick brown fox", "Speculative decoding drafts several tokens", "0123"):
        ids = tok.encode(prompt)
        for seed in range(texts if temp else 1):  # sampled texts (temp > 0): what sampling drafts for
            mx.random.seed(seed)
            gen = mlx_lm.stream_generate(model.backbone, tok, ids, max_tokens=96, sampler=make_sampler(temp))
            seqs.append(ids + [r.token for r in gen])
    n = min(len(s) for s in seqs)
    S = mx.array([s[:n] for s in seqs])
    feats = mx.stack(
        [model.family.prefill_hidden(model.backbone, row, make_tree_cache(model.backbone))[0] for row in S]
    )
    F, E = feats[:, :-2], model.embed(S[:, 1:-1])
    P = mx.softmax(model.project(feats[:, 1:-1]), axis=-1)  # the target's distribution of x_{i+2}
    layer = model.heads.eagle

    def loss(m):
        return -(P * nn.log_softmax(model.project(m.head_input(m.sequence(F, E))), axis=-1)).sum(-1).mean()

    opt, step = optim.Adam(learning_rate=lr), nn.value_and_grad(layer, loss)
    for _ in range(steps):
        _, g = step(layer)
        opt.update(layer, g)
        mx.eval(layer.parameters(), opt.state)


def test_sequence_entries_equal_the_entries_drafting_makes(ckpt):
    from mlx_lm.models.cache import KVCache

    _, path, _, _ = ckpt
    model, tok = load(str(path), heads="mtp", dtype="float32")
    ids = tok.encode("The quick brown fox jumps")
    h = model.family.prefill_hidden(model.backbone, mx.array(ids), make_tree_cache(model.backbone))[0]
    f, e = h[:-1], model.embed(mx.array(ids[1:]))
    whole = model.heads.eagle.sequence(f[None], e[None])[0]
    cache = KVCache()
    one = [
        model.heads.eagle(f[i : i + 1], e[i : i + 1], mx.array([i]), None, cache) for i in range(len(ids) - 1)
    ]
    np.testing.assert_allclose(np.array(whole), np.array(mx.concatenate(one)), atol=1e-4)


def test_greedy_identity_with_the_checkpoints_mtp_module(ckpt):
    model_type, path, _, _ = ckpt
    model, tok = load(str(path), heads="mtp", dtype="float32")
    fit(model, tok)
    trees = [None, "dynamic:6,3", "0;1;0,0;0,1"]
    accepted = dict.fromkeys(map(str, trees), 0)
    for prompt in ("The quick brown fox", "Speculative decoding drafts several tokens"):
        ids = tok.encode(prompt)
        ref = mlx_lm_greedy(model.backbone, tok, ids, 64)
        assert len(ref) >= 32, len(ref)  # past the tree's depth many times over
        for tree in trees:
            got, rs = ours(model, tok, ids, 64, tree=tree, adaptive=False, prompt_lookup=0)
            assert_greedy_identical(model, ids, got, ref)
            assert max(r.drafted for r in rs) >= 2, tree
            accepted[str(tree)] += sum(r.accepted for r in rs)
    print(f"\n{model_type}: accepted MTP drafts per tree over 2 x 64 tokens {accepted}")
    assert all(a > 0 for a in accepted.values()), accepted  # partial acceptance: both paths
    ids = tok.encode("The quick brown fox")
    got, _ = ours(model, tok, ids, 64)  # the defaults: adaptive speculation, prompt lookup
    assert_greedy_identical(model, ids, got, mlx_lm_greedy(model.backbone, tok, ids, 64))


def test_seeded_sampling_with_mtp_is_plain_sampling(ckpt):
    _, path, _, _ = ckpt
    plain, tok = load(str(path), heads=None, dtype="float32")
    model, _ = load(str(path), heads="mtp", dtype="float32")
    fit(model, tok, steps=100)
    ids = tok.encode("The quick brown fox")
    for seed in range(3):
        for tree in (None, "dynamic:6,3"):
            spec, _ = ours(model, tok, ids, 24, temp=1.0, seed=seed, tree=tree, adaptive=False)
            assert spec == ours(plain, tok, ids, 24, temp=1.0, seed=seed)[0], (seed, tree)


def test_a_quantized_target_drafts_with_a_quantized_module(tiny_dir, tmp_path):
    from mlx_stream import SpeculativeModel
    from mlx_stream.drafters.mtp import load_mtp
    from mlx_stream.heads import backbone_fingerprint

    path, _, _ = write_checkpoint(tmp_path / "q", "glm4_moe", tiny_dir)
    model, tok = load(str(path), heads=None, dtype="float32")
    nn.quantize(model.backbone, group_size=32, bits=8, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    heads = load_mtp(path, model.backbone, backbone_fingerprint(model.backbone, tok))
    assert heads.config.mtp["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert isinstance(heads.eagle.layer.self_attn.q_proj, nn.QuantizedLinear)
    ids = tok.encode("The quick brown fox")
    got, rs = ours(SpeculativeModel(model.backbone, heads), tok, ids, 32, adaptive=False, prompt_lookup=0)
    assert_greedy_identical(model, ids, got, mlx_lm_greedy(model.backbone, tok, ids, 32))
    assert max(r.drafted for r in rs) >= 2


def test_a_loaded_mtp_module_saves_and_reloads_in_our_format(ckpt, tmp_path):
    from mlx_lm.models.cache import KVCache

    from mlx_stream.heads import backbone_fingerprint, load_heads, save_heads

    _, path, _, _ = ckpt
    model, tok = load(str(path), heads="mtp", dtype="float32")
    orig = model.heads
    again = load_heads(save_heads(orig, tmp_path / "ours"), backbone_fingerprint(model.backbone, tok))
    assert again.config.mtp == orig.config.mtp
    H = BASE["hidden_size"]
    f, e, pos = mx.random.normal((3, H)), mx.random.normal((3, H)), mx.arange(3)
    a = orig.eagle(f, e, pos, None, KVCache())
    b = again.eagle(f, e, pos, None, KVCache())
    np.testing.assert_array_equal(np.array(a), np.array(b))


def test_train_fine_tunes_the_checkpoints_mtp_module_from_its_own_weights(ckpt, tmp_path):
    # through the target's own decoder layer (DeepSeek-V3: MLA + MoE; GLM-4.5: partial rotary)
    from test_cli import run

    _, path, _, _ = ckpt
    check_fine_tuning(path, "mtp", tmp_path, run)


def test_checkpoints_without_mtp_modules_are_refused_with_what_to_do(ckpt, tiny_dir, tmp_path):
    from test_cli import run

    with pytest.raises(ValueError, match="no multi-token-prediction modules"):
        load(str(tiny_dir), heads="mtp", dtype="float32")
    model_type, path, _, _ = ckpt
    # as mlx_lm.convert leaves it: the config still names the modules, the weights are gone
    converted = tmp_path / "converted"
    shutil.copytree(path, converted)
    (converted / "model.safetensors.index.json").unlink()
    for f in converted.glob("*.safetensors"):
        if f.name != "model-00001-of-00002.safetensors":
            f.unlink()
    with pytest.raises(ValueError, match="original Hugging Face checkpoint"):
        load(str(converted), heads="mtp", dtype="float32")
    r = run("generate", "--model", str(path), "--heads", "mtp", "--max-tokens", "8", "-p", "hello")
    assert r.returncode == 0, r.stderr
    r = run("generate", "--model", str(converted), "--heads", "mtp", "--max-tokens", "8", "-p", "hello")
    assert (
        r.returncode != 0 and "original Hugging Face checkpoint" in r.stderr and "Traceback" not in r.stderr
    )


N_CHI = 3_000  # runs of the chi-square test


@pytest.mark.slow  # a chi-square test: minutes (make test-all)
def test_sampling_with_mtp_follows_the_plain_distribution(tiny_dir, tmp_path):
    """The joint distribution of the first 3 sampled tokens (T = 0.7, top_p = 0.9) with a
    fitted DeepSeek-V3 MTP module drafting its default chain, against plain decoding's
    exact probabilities (tests/test_sampling.py's bins and test)."""
    from test_sampling import TOKENS, chi_square, exact_bins, sample_outcomes

    from mlx_stream.sampling import SamplingParams
    from mlx_stream.speculation import make_drafter

    path, _, _ = write_checkpoint(tmp_path / "ds", "deepseek_v3", tiny_dir, seed=2)
    model, tok = load(str(path), heads="mtp", dtype="float32")
    fit(model, tok, steps=300, temp=0.7, texts=16, prompts=("The quick",))
    ids = tok.encode("The quick")
    kw = {"temp": 0.7, "top_p": 0.9}
    drafter = make_drafter(model, None, prompt_lookup=0)
    # drafts are accepted (and rejected): the test sees both (~10% of drafts here: this tiny
    # target's text at T = 0.7 is nearly random, yet hundreds of acceptances over the runs)
    accepted = [
        sum(
            r.accepted for r in stream_generate(model, tok, ids, max_tokens=64, drafter=drafter, seed=s, **kw)
        )
        for s in range(4)
    ]
    assert sum(accepted) >= 8, accepted
    bins = exact_bins(model, tok, ids, SamplingParams(**kw), [], N_CHI)
    counts = sample_outcomes(model, tok, ids, kw, [], N_CHI, drafter=drafter, max_tokens=TOKENS + 1)
    stat, p, dof = chi_square(counts, bins, N_CHI)
    print(f"\nDeepSeek-V3 MTP, chain of 3, T=0.7, top_p=0.9: chi2 {stat:.1f}, dof {dof}, p {p:.3f}")
    assert len(bins) >= 20
    assert p > 0.01, f"sampling with MTP differs from plain sampling (chi2 {stat:.1f}, p {p:.2e})"


# --- Qwen3-Next's layout: ``mtp.*`` beside a recurrent hybrid ------------------------------

QWEN_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def write_qwen3_next_checkpoint(path, tok_dir, model_type: str = "qwen3_next", seed: int = 0):
    """A tiny Qwen3-Next target (Gated DeltaNet and full-attention layers, MoE), or a dense
    Qwen3.5 (``qwen3_5``: the vision-language wrapper of the same text model), and its MTP
    module in the published layout: ``mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc,
    norm}`` and a full-attention decoder layer under ``mtp.layers.0.`` in Hugging Face naming
    (experts unstacked, zero-centred norms: the checkpoint stores w where the model scales by
    1 + w). Returns (folder, the module's norms and fc as the model applies them, its block
    in mlx-lm's naming, the target's text model)."""
    from test_any_model import RECURRENT

    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    path.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, path / f)
    V = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    text = dict(BASE, model_type=model_type, vocab_size=V) | RECURRENT["qwen3_next"]
    if model_type == "qwen3_5":  # (dense: its sanitize stacks no experts)
        text |= {"num_experts": 0}
        cfg, args = {"model_type": model_type, "text_config": text}, mod.TextModelArgs.from_dict(text)
        layer_cls = mod.DecoderLayer
    else:
        cfg, args, layer_cls = text, mod.ModelArgs.from_dict(text), mod.Qwen3NextDecoderLayer
    mx.random.seed(seed)
    target = mod.Model(mod.ModelArgs.from_dict(cfg))
    at = max(i for i in range(args.num_hidden_layers) if (i + 1) % args.full_attention_interval == 0)
    block = layer_cls(args, at)
    for m in (target, block):
        m.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, m.parameters()))
    mx.eval(target.parameters(), block.parameters())
    rng = np.random.default_rng(seed)
    H = BASE["hidden_size"]
    stored = {n: mx.array(0.1 * rng.standard_normal(H), dtype=mx.float32) for n in ("e", "h", "o")}
    fc = mx.array(rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H), dtype=mx.float32)
    hf_block = _hf_block(dict(tree_flatten(block.parameters())), args)
    mtp = {
        "mtp.layers.0." + k: (v - 1.0 if ("." + k).endswith(QWEN_NORMS) else v) for k, v in hf_block.items()
    }
    mtp |= {
        "mtp.pre_fc_norm_embedding.weight": stored["e"],
        "mtp.pre_fc_norm_hidden.weight": stored["h"],
        "mtp.norm.weight": stored["o"],
        "mtp.fc.weight": fc,
    }
    # (the target in mlx-lm's naming, which its sanitize passes as it is; the module in a file
    # mlx-lm's model*.safetensors glob skips, as a converted folder would not have it)
    files = {
        "model-00001-of-00001.safetensors": dict(tree_flatten(target.parameters())),
        "mtp.safetensors": mtp,
    }
    for name, w in files.items():
        mx.save_safetensors(str(path / name), w)
    wmap = {k: name for name, w in files.items() for k in w}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    if model_type == "qwen3_5":
        cfg = cfg | {"text_config": text | {"mtp_num_hidden_layers": 1}, "eos_token_id": 0}
    else:
        cfg = cfg | {"mtp_num_hidden_layers": 1, "eos_token_id": 0}
    (path / "config.json").write_text(json.dumps(cfg))
    applied = {"enorm": 1.0 + stored["e"], "hnorm": 1.0 + stored["h"], "norm": 1.0 + stored["o"], "fc": fc}
    return path, applied, block, getattr(target, "language_model", target)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def qwen_ckpt(request, tiny_dir, tmp_path_factory):
    return write_qwen3_next_checkpoint(
        tmp_path_factory.mktemp("qwen") / request.param, tiny_dir, request.param
    )


def test_qwen3_next_mtp_drafts_equal_a_sequential_reference(qwen_ckpt):
    """Qwen3-Next's (and Qwen3.5's) own MTP module over its hybrid target: the drafted logits at every step
    equal the published definition computed sequentially (fc over [norm_e(e); norm_h(h)], the
    full-attention block, norm, the target's head), depth after depth."""
    path, w, block, target = qwen_ckpt
    model, tok = load(str(path), heads="mtp", dtype="float32")
    assert model.family.recurrent and model.heads.config.mtp["layer_class"] == type(block).__name__
    ids = tok.encode("The quick brown fox jumps over")
    hs = model.family.prefill_hidden(model.backbone, mx.array(ids), make_tree_cache(model.backbone))[0]
    np.testing.assert_allclose(np.array(hs), np.array(target.model(mx.array([ids]))[0]), atol=1e-4)
    root = int(mx.argmax(target.lm_head(hs[-1])).item())
    drafter = EagleDrafter(model, chain(3))
    seen, real = [], drafter._logits
    drafter._logits = lambda f: seen.append(real(f)) or seen[-1]
    drafts = drafter.draft(hs, ids + [root]).tolist()
    eps = BASE["rms_norm_eps"]
    toks, ctx, worst = ids[1:] + [root], hs, 0.0
    for d in range(3):
        e = target.model.embed_tokens(mx.array(toks))
        z = mx.concatenate([mx.fast.rms_norm(e, w["enorm"], eps), mx.fast.rms_norm(ctx, w["hnorm"], eps)], -1)
        T = z.shape[0]
        h = block((z @ w["fc"].T)[None], mx.tril(mx.ones((T, T), dtype=mx.bool_)), None)[0]
        want = np.array(target.lm_head(mx.fast.rms_norm(h, w["norm"], eps))[-1])
        got = np.array(seen[d]).reshape(-1)
        worst = max(worst, float(np.abs(got - want).max()))
        assert drafts[d] == int(np.argmax(want)), d
        ctx, toks = mx.concatenate([ctx, h[-1:]]), toks + [drafts[d]]
    print(f"\n{type(target).__module__}: max |dlogit| over 3 MTP drafting steps {worst:.2e}")
    assert worst < 1e-3 * max(1.0, float(np.abs(want).max())), worst


def test_qwen3_next_mtp_drafts_losslessly_and_fine_tunes(qwen_ckpt, tmp_path):
    """Fitted to its target, the module's chains on the hybrid are accepted in part and the
    output stays plain mlx-lm's (greedy) and seeded plain sampling; `mlx-stream train
    --init-heads mtp` fine-tunes it from its own weights."""
    from test_cli import run

    path = qwen_ckpt[0]
    plain, tok = load(str(path), heads=None, dtype="float32")
    model, _ = load(str(path), heads="mtp", dtype="float32")
    fit(model, tok, steps=150)
    accepted = 0
    for prompt in ("The quick brown fox", "Speculative decoding drafts several tokens"):
        ids = tok.encode(prompt)
        ref = mlx_lm_greedy(model.backbone, tok, ids, 64)
        got, rs = ours(model, tok, ids, 64, adaptive=False, prompt_lookup=0)
        assert_greedy_identical(model, ids, got, ref)
        assert max(r.drafted for r in rs) == 3
        accepted += sum(r.accepted for r in rs)
    assert accepted > 0
    ids = tok.encode("The quick brown fox")
    for seed in range(2):
        spec, _ = ours(model, tok, ids, 24, temp=1.0, seed=seed, adaptive=False)
        assert spec == ours(plain, tok, ids, 24, temp=1.0, seed=seed)[0], seed
    check_fine_tuning(path, "mtp", tmp_path, run)
