"""A draft tree through mlx-lm's own model code (issue 49): tiny random models from
mlx-lm's own ``ModelArgs``/``Model`` classes, no weights. Every node's logits equal a
sequential forward over its path; after keeping one path, the next tree equals it too."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map

from mlx_stream.cache import TreeKVCache, make_tree_cache
from mlx_stream.models import family
from mlx_stream.models.generic import Generic, rope_slots

BASE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    rms_norm_eps=1e-5,
    head_dim=16,
    max_position_embeddings=4096,
)
WINDOW = 4  # the sliding window of the windowed models: the prefix (11 tokens) runs past it
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# model_type -> what it covers, and the settings beside BASE
MODELS = {
    "llama": ("GQA, Llama-3 rope", dict(rope_scaling=LLAMA3, tie_word_embeddings=False)),
    "qwen3_moe": (
        "MoE, q/k norm",
        dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
        | dict(moe_intermediate_size=32, norm_topk_prob=True, rope_theta=1e4, tie_word_embeddings=False),
    ),
    "phi3": (
        "fused qkv, longrope",
        dict(
            rope_scaling={"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8},
            original_max_position_embeddings=64,
        ),
    ),
    "olmo2": ("q/k norm over all heads", dict(rope_theta=1e4, attention_bias=False)),
    "gemma3_text": (
        "sliding window every other layer",
        dict(sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16)
        | dict(rope_local_base_freq=1e4, rope_global_base_freq=1e6),
    ),
    "cohere": (
        "layer norm, logit scale, q/k norm",
        dict(layer_norm_eps=1e-5, logit_scale=0.0625, use_qk_norm=True),
    ),
    "deepseek_v3": (
        "MLA, YaRN rope, MoE",
        dict(moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2)
        | dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8)
        | dict(first_k_dense_replace=1, n_group=1, topk_group=1, rope_scaling=YARN),
    ),
    "gpt_oss": (
        "sliding window, attention sinks, MoE",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=7.0)
        | dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_theta=1.5e5),
    ),
    "starcoder2": ("layer norm, biases", dict(norm_epsilon=1e-5, rope_theta=1e4)),
    "smollm3": ("NoPE layers", dict(no_rope_layer_interval=2, rope_theta=1e4)),
    "gemma4_text": (
        "sliding window, shared-KV layers, per-layer inputs, logit softcapping",
        dict(num_hidden_layers=4, num_kv_shared_layers=2, sliding_window=WINDOW, sliding_window_pattern=2)
        | dict(global_head_dim=32, hidden_size_per_layer_input=16, final_logit_softcapping=30.0),
    ),
    "qwen3_vl": (
        "vision-language wrapper (the text model under language_model)",
        dict(rope_theta=1e4, tie_word_embeddings=True),
    ),
}

PREFIX = list(range(1, 12))
TOKENS = [20, 30, 31, 40, 41, 42]  # root; 30 and 31 under it; 40 under 30, 41 under 40; 42 under 31
PARENTS = [-1, 0, 0, 1, 3, 2]


def tiny(model_type: str, vocab: int = BASE["vocab_size"], seed: int = 0, **over):
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    cfg = dict(BASE, model_type=model_type, vocab_size=vocab, vocab_size_per_layer_input=vocab)
    args = mod.ModelArgs.from_dict(cfg | MODELS[model_type][1] | over)
    mx.random.seed(seed)
    model = mod.Model(args)
    # weights 4x mlx-lm's initialisation: logits spread wide enough that random models have no near-ties
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def tree(parents):
    n = len(parents)
    depths, anc = np.zeros(n, dtype=np.int64), np.eye(n, dtype=bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        anc[i] |= anc[parents[i]]
    return depths, anc


def tree_logits(model, tokens, depths, anc, cache):
    n = cache[0].offset
    mask = mx.concatenate([mx.ones((len(depths), n), dtype=mx.bool_), mx.array(anc)], axis=1)
    return family(model).tree_forward(model, tokens, mx.array(n + depths, dtype=mx.int32), mask, cache)[0]


def sequential(model, tokens):
    return model(mx.array(tokens)[None])[0, -1]


# Measured: 0.0 with MLX's own BLAS; up to 6.5e-5 with OpenBLAS preloaded (its blocking
# differs with the matmul's shape). A wrong position or mask gives 3-15.
ATOL = 1e-3


def same(a, b) -> bool:
    return bool(mx.allclose(a, b, rtol=0, atol=ATOL)) and int(a.argmax()) == int(b.argmax())


@pytest.mark.parametrize("model_type", MODELS, ids=[f"{k} ({v[0]})" for k, v in MODELS.items()])
def test_tree_logits_equal_sequential_through_the_models_own_code(model_type):
    model = tiny(model_type)
    assert model_type == "smollm3" or rope_slots(model)  # the positions pass through rope
    depths, anc = tree(PARENTS)
    cache = make_tree_cache(model)
    model(mx.array(PREFIX)[None], cache=cache)
    logits = tree_logits(model, mx.array(TOKENS), depths, anc, cache)
    for i in range(len(TOKENS)):
        path = [t for t, a in zip(TOKENS, anc[i]) if a]
        assert same(logits[i], sequential(model, PREFIX + path)), (model_type, i)
    # keep the path root -> 1 -> 3 -> 4, then a second tree from its last node
    start = len(PREFIX)
    for c in cache:
        c.keep(start, [0, 1, 3, 4])
    kept = PREFIX + [TOKENS[i] for i in (0, 1, 3, 4)]
    nxt = [50, 60, 61]
    depths, anc = tree([-1, 0, 0])
    logits = tree_logits(model, mx.array(nxt), depths, anc, cache)
    for i in range(3):
        path = [t for t, a in zip(nxt, anc[i]) if a]
        assert same(logits[i], sequential(model, kept + path)), (model_type, "after keep", i)
    # the model's own modules are back, and it decodes causally again
    assert not any(type(m[k]).__name__ == "NodeRoPE" for m, k in rope_slots(model))
    cache = make_tree_cache(model)
    model(mx.array(PREFIX)[None], cache=cache)
    assert same(model(mx.array([7])[None], cache=cache)[0, -1], sequential(model, PREFIX + [7]))


class _NoWindow(TreeKVCache):
    def make_mask(self, N, return_array=False, window_size=None):
        return super().make_mask(N, return_array=return_array)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_a_tree_mask_that_ignores_the_sliding_window_is_caught(model_type):
    """The check above can fail: past the window, a mask that is not narrowed to it gives
    other logits than a sequential forward."""
    model = tiny(model_type)
    depths, anc = tree(PARENTS)
    cache = [_NoWindow() for _ in make_tree_cache(model)]
    model(mx.array(PREFIX)[None], cache=cache)
    logits = tree_logits(model, mx.array(TOKENS), depths, anc, cache)
    assert not same(logits[0], sequential(model, PREFIX + TOKENS[:1]))


class _CacheOffsetRope(nn.Module):
    # a rotary embedding that a tree forward cannot reach (its class name is not *RoPE), as
    # in a model that computes positions from cache.offset by itself: every node is rotated
    # at the cache's end
    def __init__(self, rope):
        super().__init__()
        object.__setattr__(self, "rotate", rope)  # not a child module: out of the tree forward's reach

    def __call__(self, x, offset=0):
        return self.rotate(x, offset=offset)


def test_the_self_check_turns_trees_off_for_a_forward_it_cannot_run():
    model = tiny("llama")
    assert Generic(model).trees is None  # (llama.py runs llama itself; the generic path can too)
    m, k = rope_slots(model)[0]  # one layer out of reach: the others still position nodes
    m[k] = _CacheOffsetRope(m[k])
    fam = Generic(model)
    assert fam.trees is not None and "differ from sequential decoding" in fam.trees
    cache = make_tree_cache(model)
    with pytest.raises(ValueError, match="draft trees are off"):
        fam.tree_forward(model, mx.array(TOKENS), mx.arange(6), mx.ones((6, 6), dtype=mx.bool_), cache)
    # one node at a time still decodes as the model does
    logits, _, _ = fam.prefill_forward(model, mx.array(PREFIX), cache)
    assert same(logits, sequential(model, PREFIX))
    step = fam.tree_forward(model, mx.array([7]), mx.array([len(PREFIX)]), None, cache)[0][0]
    assert same(step, sequential(model, PREFIX + [7]))


# -- the decode loop on these models, against plain mlx-lm

LOOP = [
    "qwen3_moe",
    "phi3",
    "gemma3_text",
    "gpt_oss",
    "deepseek_v3",
    "cohere",
    "smollm3",
    "gemma4_text",
    "qwen3_vl",
]
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


@pytest.fixture(scope="module")
def tok(tiny_dir):
    import mlx_lm

    return mlx_lm.load(str(tiny_dir))[1]


def loop_model(model_type, vocab, seed=1, noise=0.0, **over):
    # seed 1: every model here writes 160 tokens from PROMPT before its end-of-text token
    from mlx_stream import SpeculativeModel

    model = tiny(model_type, vocab=vocab, seed=seed, **over)
    if noise:  # a draft model: the target's weights, perturbed
        mx.random.seed(seed + 1)
        model.update(
            tree_map(
                lambda p: p + noise * mx.random.normal(p.shape) if p.ndim == 2 else p, model.parameters()
            )
        )
        mx.eval(model.parameters())
    return SpeculativeModel(model)


@pytest.mark.parametrize("model_type", LOOP)
def test_greedy_output_equals_plain_mlx_lm_with_every_drafter(model_type, tok):
    """Plain decoding, a draft tree from the target itself (every node accepted often),
    prompt lookup, fresh stream heads, a fresh EAGLE-3-style draft layer (fused layer
    inputs, dynamic tree) and a draft model (chain and tree), each 40 tokens
    past a sliding window of 4: token for token plain mlx-lm's; and seeded sampling with
    them equal to seeded plain sampling."""
    from helpers import SelfDrafter, assert_greedy_identical, mlx_lm_greedy, ours

    from mlx_stream import SpeculativeModel, load_draft
    from mlx_stream.heads import new_heads
    from mlx_stream.tree import parse_tree

    vocab = len(tok.vocab)
    model = loop_model(model_type, vocab)
    assert model.family.trees is None or model.family.__name__.endswith("llama")
    ids = tok.encode(PROMPT)
    ref = mlx_lm_greedy(model.backbone, tok, ids, 40)
    runs = {
        "plain": ours(model, tok, ids, 40, prompt_lookup=0, adaptive=False),
        "self tree": ours(
            model, tok, ids, 40, drafter=SelfDrafter(model, parse_tree("0;1;0,0;0,1;0,0,0", 3))
        ),
        "lookup": ours(model, tok, ids, 40, prompt_lookup=2, adaptive=False),
    }
    heads = new_heads(model.backbone, tok, num_heads=3, seed=1, scale=0.02)
    runs["heads"] = ours(
        SpeculativeModel(model.backbone, heads), tok, ids, 40, tree="0;1;0,0", adaptive=False
    )
    # an EAGLE-3-style draft layer over the final state and two lower layers' inputs (fresh)
    eagle = new_heads(model.backbone, tok, num_heads=3, architecture="eagle", fuse_layers=(0, 1), seed=1)
    runs["eagle"] = ours(
        SpeculativeModel(model.backbone, eagle), tok, ids, 40, tree="dynamic:6,3", adaptive=False
    )
    draft = load_draft((loop_model(model_type, vocab, noise=0.01).backbone, tok), model, tok, calibrate=False)
    runs["draft chain"] = ours(model, tok, ids, 40, draft_model=draft, num_draft_tokens=3, adaptive=False)
    runs["draft tree"] = ours(model, tok, ids, 40, draft_model=draft, tree="dynamic:6,3", adaptive=False)
    for name, (got, _) in runs.items():
        assert assert_greedy_identical(model, ids, got, ref) in ("equal", "tie"), name
    passes = {name: responses[-1].forward_passes for name, (got, responses) in runs.items()}
    assert passes["self tree"] < passes["plain"] and passes["draft chain"] < passes["plain"], passes
    assert sum(r.drafted for r in runs["eagle"][1]) > 0  # it drafts (fresh, random model: rarely right)
    # seeded sampling (T = 0.8): each drafter draws exactly what plain decoding draws
    plain = ours(model, tok, ids, 24, temp=0.8, seed=7, prompt_lookup=0, adaptive=False)[0]
    for kw in (
        {"drafter": SelfDrafter(model, parse_tree("0;1;0,0", 2))},
        {"prompt_lookup": 2},
        {"draft_model": draft, "num_draft_tokens": 3},
    ):
        assert ours(model, tok, ids, 24, temp=0.8, seed=7, adaptive=False, **kw)[0] == plain, kw


def test_a_model_with_learned_positions_decodes_plainly_and_refuses_drafting(tok):
    """gpt2 adds learned position embeddings at the cache's offset, which a tree forward
    cannot move per node: the self-check turns trees off; plain decoding still equals
    mlx-lm's, and drafting is refused in one line naming why."""
    from helpers import assert_greedy_identical, mlx_lm_greedy, ours
    from mlx_lm.models import gpt2

    from mlx_stream import SpeculativeModel, stream_generate

    cfg = dict(model_type="gpt2", n_ctx=512, n_embd=64, n_head=4, n_layer=2, n_positions=512)
    mx.random.seed(0)
    backbone = gpt2.Model(
        gpt2.ModelArgs.from_dict(cfg | dict(layer_norm_epsilon=1e-5, vocab_size=len(tok.vocab)))
    )
    backbone.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, backbone.parameters()))
    model = SpeculativeModel(backbone)
    assert model.family.trees is not None and "no rotary embedding module" in model.family.trees
    ids = tok.encode(PROMPT)
    got, _ = ours(model, tok, ids, 40, adaptive=False)
    assert assert_greedy_identical(model, ids, got, mlx_lm_greedy(backbone, tok, ids, 40)) in ("equal", "tie")
    with pytest.raises(ValueError, match="decodes plainly only: .*no rotary embedding module"):
        next(stream_generate(model, tok, PROMPT, prompt_lookup=2))


@pytest.mark.parametrize("model_type", ["gemma3_text", "deepseek_v3"])
def test_stream_heads_train_on_a_frozen_backbone_and_draft_for_it(model_type, tok, tmp_path):
    """Residual heads trained on the states captured where the model's own code enters its
    output projection (features of what the backbone writes) learn each offset, and drafting
    with them in the loop keeps plain mlx-lm's output while taking several tokens a pass."""
    from helpers import assert_greedy_identical, mlx_lm_greedy, ours

    from mlx_stream import SpeculativeModel
    from mlx_stream.heads import new_heads
    from mlx_stream.train import TrainConfig, build_features_from_ids, train_heads

    model = loop_model(model_type, len(tok.vocab))
    # what the backbone itself writes after a few prompts: the heads learn to draft it
    prompts = [[11 + 7 * s, 42, 97 + s] for s in range(8)]
    seqs = [(p + mlx_lm_greedy(model.backbone, tok, p, 48), 1) for p in prompts]
    feats = build_features_from_ids(model, seqs, tmp_path / "f", 3, dtype="float32")
    heads = new_heads(model.backbone, tok, 3)
    cfg = TrainConfig(num_heads=3, epochs=150, batch_size=64, lr=3e-3, warmup=10, checkpoint_every=0)
    report = train_heads(model, heads, feats, tmp_path / "run", cfg, valid=feats, progress=False)
    assert min(report["valid"]["top1"]) > 0.85, report["valid"]
    ids = prompts[0]
    ref = mlx_lm_greedy(model.backbone, tok, ids, 40)
    got, rs = ours(SpeculativeModel(model.backbone, heads), tok, ids, 40, tree="0;0,0;0,0,0", adaptive=False)
    assert assert_greedy_identical(model, ids, got, ref) in ("equal", "tie")
    assert rs[-1].tau > 2.0, rs[-1].tau  # the trained heads draft what the backbone writes


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_sliding_window_layers_stay_bounded_and_exact_past_their_eviction(model_type, tok):
    """160 tokens with a window of 4: the windowed layers drop what no token can see again
    (every 64 entries past the window), drafts are rewound across those drops, and the
    output is still plain mlx-lm's (whose rotating cache is exact for plain decoding)."""
    from helpers import SelfDrafter, assert_greedy_identical, mlx_lm_greedy, ours

    from mlx_stream import PromptCache, load_draft
    from mlx_stream.cache import WindowKVCache
    from mlx_stream.tree import parse_tree

    model = loop_model(model_type, len(tok.vocab))
    ids = tok.encode(PROMPT)
    ref = mlx_lm_greedy(model.backbone, tok, ids, 160)
    draft = load_draft(
        (loop_model(model_type, len(tok.vocab), noise=0.01).backbone, tok), model, tok, calibrate=False
    )
    for kw in (
        {"drafter": SelfDrafter(model, parse_tree("0;1;0,0;0,0,0", 3))},
        {"draft_model": draft, "num_draft_tokens": 3},
    ):
        pc = PromptCache(model)
        got, _ = ours(model, tok, ids, 160, prompt_cache=pc, adaptive=False, **kw)
        assert assert_greedy_identical(model, ids, got, ref) in ("equal", "tie"), kw
        assert len(ref) == 160
        windows = [c for c in pc.layers if isinstance(c, WindowKVCache)]
        assert windows and all(c.dropped > 0 for c in windows)
        # what they hold: the window, the slack before a drop, a step's tree; not all 200+ tokens
        assert max(c.offset - c.dropped for c in windows) <= WINDOW + 64 + 8 and windows[0].offset > 160


RECURRENT = {
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    | dict(shared_expert_intermediate_size=32, mlp_only_layers=[], norm_topk_prob=True, rope_theta=1e4)
    | dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    | dict(linear_conv_kernel_dim=4, partial_rotary_factor=0.5, full_attention_interval=2)
    | dict(tie_word_embeddings=False, attention_bias=False),
    "mamba2": dict(num_heads=4, state_size=16, conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True)
    | dict(time_step_rank=8, time_step_limit=(0.0, float("inf")), layer_norm_epsilon=1e-5)
    | dict(tie_word_embeddings=False),
}


@pytest.mark.parametrize("model_type", RECURRENT)
def test_recurrent_models_decode_plainly_and_reuse_their_state(model_type, tok):
    """Layers with a recurrent state (Gated DeltaNet, Mamba-2) cannot be trimmed: such a
    model decodes through our loop with its own recurrent caches, equal to plain mlx-lm
    (greedy, and seeded sampling repeating itself), a prompt that continues the cache reuses
    its state, one that departs from it starts over, and a chat runs turn after turn
    (drafting on them: tests/test_hybrids.py)."""
    from helpers import assert_greedy_identical, mlx_lm_greedy, ours

    from mlx_stream import ChatSession, PromptCache, SpeculativeModel

    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(1)
    backbone = mod.Model(
        mod.ModelArgs.from_dict(
            dict(BASE, model_type=model_type, vocab_size=len(tok.vocab)) | RECURRENT[model_type]
        )
    )
    backbone.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, backbone.parameters()))
    model = SpeculativeModel(backbone)
    assert model.family.recurrent and model.family.trees is None  # drafts verified by rows
    ids = tok.encode(PROMPT)
    got, _ = ours(model, tok, ids, 48)
    assert assert_greedy_identical(model, ids, got, mlx_lm_greedy(backbone, tok, ids, 48)) in ("equal", "tie")
    once, _ = ours(model, tok, ids, 24, temp=0.8, seed=3)
    assert ours(model, tok, ids, 24, temp=0.8, seed=3)[0] == once
    # a prompt that continues the cache reuses its state; one that departs from it starts over
    pc = PromptCache(model)
    ours(model, tok, ids, 12, prompt_cache=pc)
    held = list(pc.tokens)
    for more in (held + tok.encode(" and again"), ids[:5] + tok.encode(" other")):
        got, rs = ours(model, tok, more, 12, prompt_cache=pc)
        assert rs[-1].cached_tokens == (len(held) if more[: len(held)] == held else 0)
        assert assert_greedy_identical(model, more, got, mlx_lm_greedy(backbone, tok, more, 12)) in (
            "equal",
            "tie",
        )
        held = list(pc.tokens)
    chat = ChatSession(model, tok, max_tokens=12, temp=0.0)
    for turn in ("Hello there", "And again"):
        assert list(chat.send(turn))
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2


def test_a_recurrent_model_that_ignores_its_caches_lengths_decodes_plainly_only(tok):
    """mlx-lm's Mamba (v1) advances its state over every token of a call (no ``lengths``):
    the load-time check finds a tree's logits off, so it decodes plainly, equal to mlx-lm,
    and drafting is refused in one line naming why."""
    from helpers import assert_greedy_identical, mlx_lm_greedy, ours

    from mlx_stream import SpeculativeModel, stream_generate

    mod = importlib.import_module("mlx_lm.models.mamba")
    mx.random.seed(1)
    args = dict(BASE, model_type="mamba", vocab_size=len(tok.vocab)) | RECURRENT["mamba2"]
    args |= dict(intermediate_size=128, conv_kernel=4, use_conv_bias=True, time_step_rank=8, use_bias=False)
    backbone = mod.Model(mod.ModelArgs.from_dict(args))
    backbone.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, backbone.parameters()))
    model = SpeculativeModel(backbone)
    assert not model.family.recurrent and "does not honour its cache's lengths" in model.family.trees
    ids = tok.encode(PROMPT)
    got, _ = ours(model, tok, ids, 24)
    assert assert_greedy_identical(model, ids, got, mlx_lm_greedy(backbone, tok, ids, 24)) in ("equal", "tie")
    with pytest.raises(ValueError, match="decodes plainly only: this model uses ArraysCache"):
        next(stream_generate(model, tok, PROMPT, prompt_lookup=2))


def test_self_speculative_drafting_on_a_model_of_the_generic_path(tok, tmp_path, monkeypatch):
    """``draft_model="self"`` (a calibrated subset of the target's layers) on qwen3_moe:
    lossless and drafting; on gemma3_text (caches laid out by layer) refused in one line."""
    from helpers import mlx_lm_greedy, ours

    from mlx_stream import load_draft

    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path / "cache"))
    model = loop_model("qwen3_moe", len(tok.vocab))
    ids = tok.encode(PROMPT)
    got, rs = ours(model, tok, ids, 40, draft_model=load_draft("self", model, tok), num_draft_tokens=2)
    assert got == mlx_lm_greedy(model.backbone, tok, ids, 40) and rs[-1].tau > 1.2
    with pytest.raises(ValueError, match="lays out its caches by layer"):
        load_draft("self", loop_model("gemma3_text", len(tok.vocab)), tok)


def test_bounded_and_quantized_caches_and_prompt_cache_files_on_a_generic_model(tok, tmp_path):
    """What works on the llama family works through the generic path (qwen3_moe):
    ``max_kv_size`` (plain and with a draft tree) and ``kv_bits`` equal mlx-lm's same
    settings, and a prompt-cache file saved and loaded continues as a cold start does."""
    import mlx_lm
    from helpers import SelfDrafter, ours

    from mlx_stream import cache_prompt, load_prompt_cache, save_prompt_cache
    from mlx_stream.tree import parse_tree

    model = loop_model("qwen3_moe", len(tok.vocab), head_dim=32)  # a width KV quantization groups fit
    ids = tok.encode(PROMPT)

    def theirs(**kw):
        out = []
        for r in mlx_lm.stream_generate(model.backbone, tok, mx.array(ids), max_tokens=40, **kw):
            if r.finish_reason == "stop" and r.token in tok.eos_token_ids:
                break
            out.append(r.token)
        return out

    bounded = theirs(max_kv_size=16)
    assert ours(model, tok, ids, 40, max_kv_size=16, prompt_lookup=0, adaptive=False)[0] == bounded
    tree = SelfDrafter(model, parse_tree("0;1;0,0", 2))
    assert ours(model, tok, ids, 40, max_kv_size=16, drafter=tree, adaptive=False)[0] == bounded
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}
    assert ours(model, tok, ids, 40, prompt_lookup=0, adaptive=False, **kv)[0] == theirs(**kv)
    suffix = tok.encode(" and then", add_special_tokens=False)
    path = save_prompt_cache(tmp_path / "p.safetensors", cache_prompt(model, tok, ids), "tiny-moe", tok)
    cold, _ = ours(model, tok, ids + suffix, 24)
    warm, rs = ours(model, tok, ids + suffix, 24, prompt_cache=load_prompt_cache(path, model, tok))
    assert warm == cold and rs[-1].cached_tokens == len(ids)
