"""Published EAGLE-3 drafters: tiny checkpoints in each layout (SafeAILab/SpecForge
``midlayer.*`` in safetensors and in ``pytorch_model.bin``, vLLM speculators'
``layers.0.*``), written here with random weights, read as eagle heads; the drafter's
logits at every drafting step against a plain torch implementation written from the
published definition, over target features from Hugging Face transformers; lossless
decoding with every tree kind."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from conftest import make_tiny_model_dir
from helpers import assert_greedy_identical, check_backlog, check_fine_tuning, mlx_lm_greedy, ours

from mlx_stream import load, stream_generate
from mlx_stream.cache import make_tree_cache
from mlx_stream.drafters.eagle import EagleDrafter
from mlx_stream.tree import chain, parse_tree

L_TARGET = 8  # the default aux layers [2, L // 2, L - 3] = [2, 4, 5]
H, HEADS, KV, HD, FF = 64, 4, 2, 16, 96
THETA = 500000.0  # the layer's own rope base (the target's is 1e4)

# layout name -> (architectures, speculators-style, weight file, key prefix, options, explicit ids)
LAYOUTS = {
    "eagle": (["LlamaForCausalLMEagle3"], False, "model.safetensors", "", {}, None),
    "eagle-bin": (["LlamaForCausalLMEagle3"], False, "pytorch_model.bin", "model.", {}, [0, 3, 5]),
    "speculators": (
        ["Eagle3Speculator"],
        True,
        "model.safetensors",
        "",
        {"norm_before_residual": True, "fc_norm": True},
        [1, 3, 6],
    ),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    # untied: a greedy text of many tokens (a tied tiny model repeats one token)
    return make_tiny_model_dir(tmp_path_factory.mktemp("e3") / "target", layers=L_TARGET, tied=False)


def _weights(rng, V, Vd, n_aux, options, scale=0.3):
    def w(*shape, s=scale):
        return (rng.standard_normal(shape) * s / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {
        "fc.weight": w(H, n_aux * H, s=1.0),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HD, 2 * H, s=1.0),
        "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * H, s=1.0),
        "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * H, s=1.0),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HD),
        "midlayer.mlp.gate_proj.weight": w(FF, H, s=1.0),
        "midlayer.mlp.up_proj.weight": w(FF, H, s=1.0),
        "midlayer.mlp.down_proj.weight": w(H, FF),
        "norm.weight": norm(H),
        "lm_head.weight": w(Vd, H, s=8.0),  # peaked drafts: some are accepted
    }
    if options.get("fc_norm"):
        for j in range(n_aux):
            t[f"fc_norm.{j}.weight"] = norm(H)
    ids = np.sort(rng.choice(V, Vd, replace=False))
    t["d2t"] = (ids - np.arange(Vd)).astype(np.int64)
    t["t2d"] = np.isin(np.arange(V), ids)
    return t


def write_eagle3(path, layout, V, Vd=None, seed=0, hidden=H, vocab=None):
    """A tiny EAGLE-3 checkpoint folder for a V-token target; returns (path, torch weights)."""
    archs, spec_style, wfile, prefix, options, ids = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    Vd = Vd or V // 2
    n_aux = 3
    t = _weights(rng, V, Vd, n_aux, options)
    layer = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "intermediate_size": FF,
        "rms_norm_eps": 1e-5,
        "rope_theta": THETA,
        "max_position_embeddings": 512,
        "vocab_size": vocab or V,
        "num_hidden_layers": 1,
    }
    if spec_style:
        cfg = {
            "architectures": archs,
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": Vd,
            **options,
        }
        if ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = ids
        t = {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}
    else:
        cfg = {"architectures": archs, **layer, "draft_vocab_size": Vd}
        if ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {prefix + k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in t.items()}
    if wfile.endswith(".bin"):
        torch.save(tensors, path / wfile)
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(path / wfile))
    plain = {k.replace("layers.0.", "midlayer."): torch.from_numpy(np.array(v)) for k, v in t.items()}
    return path, plain, cfg


def aux_inputs(layout, n_layers):
    ids = LAYOUTS[layout][5]
    if ids is None:
        return [2, n_layers // 2, n_layers - 3]
    return [i + 1 for i in ids] if not LAYOUTS[layout][1] else list(ids)


# --- an independent reference: the published definition in plain torch -----------------


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos):  # (T, h, d), Llama's rotate-half rotary embedding at positions pos (T,)
    d = x.shape[-1]
    inv = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = (
        torch.cat([ang.cos()] * 2, -1).float()[:, None],
        torch.cat([ang.sin()] * 2, -1).float()[:, None],
    )
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class TorchEagle3:
    """EAGLE-3's draft layer as SafeAILab's cnets.py and speculators' Eagle3 layer define
    it, entry by entry over a growing causal sequence (a chain)."""

    def __init__(self, W, cfg):
        self.W, self.k, self.v = W, [], []
        self.nbr = bool(cfg.get("norm_before_residual", False))
        self.fc_norm = bool(cfg.get("fc_norm", False))

    def fc(self, aux):  # (T, 3 H_t) -> (T, H)
        if self.fc_norm:
            aux = torch.cat(
                [_rms(c, self.W[f"fc_norm.{j}.weight"]) for j, c in enumerate(aux.chunk(3, -1))], -1
            )
        return aux @ self.W["fc.weight"].T

    def step(self, x, tokens, emb, pos):
        """Entries (x (T, H), token embeddings) at positions pos; returns (h, logits)."""
        W, m = self.W, "midlayer."
        e = _rms(emb[tokens], W[m + "input_layernorm.weight"])
        hx = _rms(x, W[m + "hidden_norm.weight"])
        inp = torch.cat([e, hx], -1)
        T = x.shape[0]
        q = _rope((inp @ W[m + "self_attn.q_proj.weight"].T).view(T, HEADS, HD), pos)
        k = _rope((inp @ W[m + "self_attn.k_proj.weight"].T).view(T, KV, HD), pos)
        v = (inp @ W[m + "self_attn.v_proj.weight"].T).view(T, KV, HD)
        self.k.append(k)
        self.v.append(v)
        K, Vv = torch.cat(self.k), torch.cat(self.v)
        S = K.shape[0]
        K, Vv = K.repeat_interleave(HEADS // KV, 1), Vv.repeat_interleave(HEADS // KV, 1)
        att = torch.einsum("thd,shd->hts", q, K) / HD**0.5
        causal = torch.arange(S)[None] <= (S - T + torch.arange(T))[:, None]
        att = att.masked_fill(~causal[None], float("-inf")).softmax(-1)
        o = torch.einsum("hts,shd->thd", att, Vv).reshape(T, HEADS * HD) @ W[m + "self_attn.o_proj.weight"].T
        h = (hx if self.nbr else x) + o
        g = _rms(h, W[m + "post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(g @ W[m + "mlp.gate_proj.weight"].T) * (
            g @ W[m + "mlp.up_proj.weight"].T
        )
        h = h + mlp @ W[m + "mlp.down_proj.weight"].T
        return h, _rms(h, W["norm.weight"]) @ W["lm_head.weight"].T


def _hf_aux(target_dir, ids, layers):
    """The target's hidden states entering ``layers`` at each prompt position, from
    Hugging Face transformers (hidden_states[k] is layer k's input)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[k][0] for k in layers], -1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_drafted_logits_equal_a_torch_reference_at_every_step(target_dir, tmp_path, layout):
    model, tok = load(str(target_dir), heads=None, dtype="float32")
    V = model.args.vocab_size
    path, W, cfg = write_eagle3(tmp_path / layout, layout, V, seed=3)
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    heads = model.heads
    aux = aux_inputs(layout, L_TARGET)
    assert heads.config.eagle3 and list(heads.config.fuse_layers) == aux
    ids = tok.encode("The quick brown fox jumps over")
    # the loop's features of the prompt: final hidden state, then the fused layers' inputs
    h, mids = model.family.prefill_hidden(model.backbone, mx.array(ids), make_tree_cache(model.backbone), aux)
    feats = mx.concatenate([h, mids], axis=-1)
    hf_aux = _hf_aux(target_dir, ids, aux)
    np.testing.assert_allclose(np.array(mids), hf_aux.numpy(), atol=1e-4)  # the capture itself
    root = int(mx.argmax(model.project(h[-1])).item())
    depth = 5
    drafter = EagleDrafter(model, chain(depth))
    seen, real = [], drafter._logits
    drafter._logits = lambda f: seen.append(real(f)) or seen[-1]
    drafts = drafter.draft(feats, ids + [root]).tolist()
    # the reference: entries (aux_i, x_{i+1}) at positions i, then its own outputs fed back
    ref = TorchEagle3(W, cfg)
    emb = torch.from_numpy(np.array(model.backbone.model.embed_tokens.weight))
    d2t = W["d2t"]
    x = ref.fc(hf_aux)
    toks = torch.tensor(ids[1:] + [root])
    hh, logits = ref.step(x, toks, emb, torch.arange(len(ids)))
    worst = 0.0
    for d in range(depth):
        got = np.array(seen[d]).reshape(-1)
        want = logits[-1].numpy()
        worst = max(worst, float(np.abs(got - want).max()))
        j = int(np.argmax(want))
        assert drafts[d] == j + int(d2t[j]), (layout, d)
        hh, logits = ref.step(hh[-1:], torch.tensor([drafts[d]]), emb, torch.tensor([len(ids) + d]))
    print(f"\n{layout}: max |dlogit| over {depth} drafting steps {worst:.2e}")
    assert worst < 2e-4, worst


def fit(model, tok, steps=150, lr=3e-3, temp=0.0):
    """A few hundred Adam steps distilling the target into the published layer (EAGLE-3's
    first step: the entry (a_i, x_{i+1}) learns the target's distribution of x_{i+2},
    over the draft vocabulary) on the target's greedy text, so that its drafts are
    sometimes accepted, greedy and sampled (random weights draft nothing the target keeps)."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    seqs = []
    for prompt in ("The quick brown fox", "Speculative decoding drafts several tokens", "0123"):
        ids = tok.encode(prompt)
        for seed in range(4 if temp else 1):  # sampled texts (temp > 0): what sampling drafts for
            mx.random.seed(seed)
            gen = mlx_lm.stream_generate(model.backbone, tok, ids, max_tokens=96, sampler=make_sampler(temp))
            seqs.append(ids + [r.token for r in gen])
    n = min(len(s) for s in seqs)
    S = mx.array([s[:n] for s in seqs])
    aux = list(model.heads.config.fuse_layers)
    feats, probs = [], []
    for row in S:
        h, mids = model.family.prefill_hidden(model.backbone, row, make_tree_cache(model.backbone), aux)
        feats.append(mx.concatenate([h, mids], axis=-1))
        probs.append(mx.softmax(model.project(h[1:-1]), axis=-1))  # the target's, of x_{i+2}
    F, E, P = mx.stack(feats)[:, :-2], model.embed(S[:, 1:-1]), mx.stack(probs)
    if model.heads.config.draft_vocab_size:
        P = P[..., model.heads.draft_ids]  # (the mass outside the draft vocabulary is not learned)
    layer = model.heads.eagle

    def loss(m):
        return -(P * nn.log_softmax(m.logits(m.sequence(F, E)), axis=-1)).sum(-1).mean()

    opt, step = optim.Adam(learning_rate=lr), nn.value_and_grad(layer, loss)
    for _ in range(steps):
        _, g = step(layer)
        opt.update(layer, g)
        mx.eval(layer.parameters(), opt.state)


def test_sequence_entries_equal_the_entries_drafting_makes(target_dir, tmp_path):
    # the training forward (sequence) is the drafting forward (one entry at a time)
    from mlx_lm.models.cache import KVCache

    model, tok = load(str(target_dir), heads=None, dtype="float32")
    path, _, _ = write_eagle3(tmp_path / "s", "speculators", model.args.vocab_size)
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    ids = tok.encode("The quick brown fox jumps")
    aux = list(model.heads.config.fuse_layers)
    h, mids = model.family.prefill_hidden(model.backbone, mx.array(ids), make_tree_cache(model.backbone), aux)
    f, e = mx.concatenate([h, mids], -1)[:-1], model.embed(mx.array(ids[1:]))
    whole = model.heads.eagle.sequence(f[None], e[None])[0]
    cache = KVCache()
    one = [
        model.heads.eagle(f[i : i + 1], e[i : i + 1], mx.array([i]), None, cache) for i in range(len(ids) - 1)
    ]
    np.testing.assert_allclose(np.array(whole), np.array(mx.concatenate(one)), atol=1e-4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_identity_with_a_published_eagle3(target_dir, tmp_path, layout):
    model, tok = load(str(target_dir), heads=None, dtype="float32")
    V = model.args.vocab_size
    # the full vocabulary (d2t all zero) for one layout, a half-size draft vocabulary for the others
    path, _, _ = write_eagle3(tmp_path / layout, layout, V, Vd=V if layout == "eagle" else None, seed=1)
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    assert (model.heads.config.draft_vocab_size == 0) == (layout == "eagle")
    fit(model, tok)
    trees = [None, "dynamic:6,3", chain(3), "0;1;0,0;0,1;0,0,0"]
    accepted = dict.fromkeys(map(str, trees), 0)
    for prompt in ("The quick brown fox", "Speculative decoding drafts several tokens"):
        ids = tok.encode(prompt)
        ref = mlx_lm_greedy(model.backbone, tok, ids, 64)
        for tree in trees:
            got, rs = ours(model, tok, ids, 64, tree=tree, adaptive=False, prompt_lookup=0)
            assert_greedy_identical(model, ids, got, ref)
            assert max(r.drafted for r in rs) >= 3, tree
            accepted[str(tree)] += sum(r.accepted for r in rs)
    print(f"\n{layout}: accepted drafts per tree over 2 x 64 tokens {accepted}")
    assert all(a > 0 for a in accepted.values()), accepted  # partial acceptance: both paths
    ids = tok.encode("The quick brown fox")
    got, _ = ours(model, tok, ids, 64)  # the defaults: adaptive speculation, prompt lookup
    assert_greedy_identical(model, ids, got, mlx_lm_greedy(model.backbone, tok, ids, 64))


def test_a_plain_steps_positions_enter_the_layers_cache_with_the_next_drafted_step(target_dir, tmp_path):
    from mlx_stream.drafters.eagle import DynamicTreeDrafter

    model, tok = load(str(target_dir), heads=None, dtype="float32")
    path, _, _ = write_eagle3(tmp_path / "e3", "speculators", model.args.vocab_size, seed=3)
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    check_backlog(model, tok, lambda: EagleDrafter(model, parse_tree("0;1;0,0;1,0", 3)))
    dyn = DynamicTreeDrafter(model, budget=6, width=3)  # EAGLE-2's dynamic tree records likewise
    assert dyn.propose(mx.zeros((1, 4 * H)), [1, 2], 3, base=False)[0].size == 1
    assert dyn._backlog.size == 1 and dyn._committed == 0


def test_seeded_sampling_with_a_published_eagle3_is_plain_sampling(target_dir, tmp_path):
    plain_model, tok = load(str(target_dir), heads=None, dtype="float32")
    path, _, _ = write_eagle3(tmp_path / "e3", "speculators", plain_model.args.vocab_size, seed=2)
    model, _ = load(str(target_dir), heads=str(path), dtype="float32")
    fit(model, tok)
    ids = tok.encode("The quick brown fox")
    for seed in range(4):
        for tree in (None, chain(3)):
            spec, _ = ours(model, tok, ids, 24, temp=1.0, seed=seed, tree=tree, adaptive=False)
            plain, _ = ours(plain_model, tok, ids, 24, temp=1.0, seed=seed)
            assert spec == plain, (seed, tree)


def test_a_checkpoint_for_another_target_is_refused(target_dir, tmp_path):
    model, tok = load(str(target_dir), heads=None, dtype="float32")
    V = model.args.vocab_size
    cases = {
        "vocab": (dict(vocab=V + 16), "vocabulary"),
        "width": (dict(hidden=H * 2), "wide"),
    }
    for name, (kw, word) in cases.items():
        path, _, _ = write_eagle3(tmp_path / name, "eagle", V, **kw)
        with pytest.raises(ValueError, match=word):
            load(str(target_dir), heads=str(path), dtype="float32")
    small = make_tiny_model_dir(tmp_path / "small", layers=4, tied=False)  # explicit ids past its layers
    path, _, _ = write_eagle3(tmp_path / "ids", "speculators", V)
    with pytest.raises(ValueError, match="layers"):
        load(str(small), heads=str(path), dtype="float32")


N_CHI = 3_000  # runs of the chi-square test


@pytest.mark.slow  # a chi-square test: minutes (make test-all)
def test_sampling_with_a_published_eagle3_follows_the_plain_distribution(tmp_path):
    """The joint distribution of the first 3 sampled tokens (T = 0.7, top_p = 0.9) with a
    fitted EAGLE-3 layer drafting EAGLE-2's dynamic tree, against plain decoding's exact
    probabilities (tests/test_sampling.py's bins and test)."""
    from test_sampling import TOKENS, chi_square, exact_bins, sample_outcomes

    from mlx_stream.drafters.eagle import DynamicTreeDrafter
    from mlx_stream.sampling import SamplingParams

    target = make_tiny_model_dir(tmp_path / "spread", layers=L_TARGET, tied=False, head_scale=0.4)
    plain, tok = load(str(target), heads=None, dtype="float32")
    path, _, _ = write_eagle3(tmp_path / "e3", "speculators", plain.args.vocab_size, seed=4)
    model, tok = load(str(target), heads=str(path), dtype="float32")
    fit(model, tok, steps=300, temp=0.7)
    ids = tok.encode("The quick")
    kw = {"temp": 0.7, "top_p": 0.9}
    drafter = DynamicTreeDrafter(model, budget=6, width=3)
    rs = list(stream_generate(model, tok, ids, max_tokens=64, drafter=drafter, seed=0, **kw))
    assert sum(r.accepted for r in rs) >= 5  # drafts are accepted (and rejected): the test sees both
    bins = exact_bins(model, tok, ids, SamplingParams(**kw), [], N_CHI)
    counts = sample_outcomes(model, tok, ids, kw, [], N_CHI, drafter=drafter, max_tokens=TOKENS + 1)
    stat, p, dof = chi_square(counts, bins, N_CHI)
    print(f"\nEAGLE-3, dynamic tree, T=0.7, top_p=0.9: chi2 {stat:.1f}, dof {dof}, p {p:.3f}")
    assert len(bins) >= 20
    assert p > 0.01, f"sampling with EAGLE-3 differs from plain sampling (chi2 {stat:.1f}, p {p:.2e})"


def test_a_loaded_eagle3_saves_and_reloads_in_our_format(target_dir, tmp_path):
    from mlx_lm.models.cache import KVCache

    from mlx_stream.heads import backbone_fingerprint, load_heads, save_heads

    model, tok = load(str(target_dir), heads=None, dtype="float32")
    path, _, _ = write_eagle3(tmp_path / "e3", "eagle-bin", model.args.vocab_size, seed=5)
    model, tok = load(str(target_dir), heads=str(path), dtype="float32")
    orig = model.heads
    again = load_heads(save_heads(orig, tmp_path / "ours"), backbone_fingerprint(model.backbone, tok))
    assert again.config.eagle3 == orig.config.eagle3
    np.testing.assert_array_equal(np.array(again.draft_ids), np.array(orig.draft_ids))
    f, e, pos = mx.random.normal((3, 4 * H)), mx.random.normal((3, H)), mx.arange(3)
    a = orig.eagle.logits(orig.eagle(f, e, pos, None, KVCache()))
    b = again.eagle.logits(again.eagle(f, e, pos, None, KVCache()))
    np.testing.assert_array_equal(np.array(a), np.array(b))
    ids = tok.encode("The quick brown fox")
    got_a, _ = ours(model, tok, ids, 32, tree="dynamic:6,3", adaptive=False)
    model.heads = again
    got_b, _ = ours(model, tok, ids, 32, tree="dynamic:6,3", adaptive=False)
    assert got_a == got_b


def test_train_fine_tunes_a_published_eagle3_from_its_own_weights(target_dir, tmp_path):
    from test_cli import run

    model, _ = load(str(target_dir), heads=None, dtype="float32")
    path, _, _ = write_eagle3(tmp_path / "e3", "speculators", model.args.vocab_size, seed=1)
    check_fine_tuning(target_dir, str(path), tmp_path, run)


def test_fine_tuning_asks_for_the_eagle_architecture_and_refuses_dflash(target_dir, tmp_path):
    from test_cli import run
    from test_dflash import LAYOUTS as DFLASH_LAYOUTS
    from test_dflash import write_dflash

    model, _ = load(str(target_dir), heads=None, dtype="float32")
    path, _, _ = write_eagle3(tmp_path / "e3", "eagle", model.args.vocab_size)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "The quick", "completion": " brown fox jumps"}) + "\n")
    out = tmp_path / "out"
    args = ["--model", str(target_dir), "--out", str(out), "--data", str(data), "--init-heads", str(path)]
    r = run("train", *args, "--architecture", "hydra")
    assert r.returncode != 0 and "published EAGLE-3 drafter trains as an eagle layer" in r.stderr, r.stderr
    assert not (out / "heads").exists()
    dflash = write_dflash(tmp_path / "df", next(iter(DFLASH_LAYOUTS)), model.args.vocab_size)[0]
    r = run("train", *args[:-1], str(dflash))
    assert r.returncode != 0 and "DFlash block drafter; fine-tuning one is not supported" in r.stderr, (
        r.stderr
    )
    assert not (out / "heads").exists()
