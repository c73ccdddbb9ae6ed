"""A draft tree through mlx-lm's own model code (issue 49): tiny random models from
mlx-lm's own ``ModelArgs``/``Model`` classes, no weights. Every node's logits equal a
sequential forward over its path; after keeping one path, the next tree equals it too."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from mlx_stream.models.generic import NodeMaskKVCache, rope_slots, tree_logits

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
}

PREFIX = list(range(1, 12))
TOKENS = [20, 30, 31, 40, 41, 42]  # root; 30 and 31 under it; 40 under 30, 41 under 40; 42 under 31
PARENTS = [-1, 0, 0, 1, 3, 2]


def tiny(model_type: str):
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    args = mod.ModelArgs.from_dict(dict(BASE, model_type=model_type, **MODELS[model_type][1]))
    mx.random.seed(0)
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
    cache = [NodeMaskKVCache() for _ in model.layers]
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
    cache = [NodeMaskKVCache() for _ in model.layers]
    model(mx.array(PREFIX)[None], cache=cache)
    assert same(model(mx.array([7])[None], cache=cache)[0, -1], sequential(model, PREFIX + [7]))


class _NoWindow(NodeMaskKVCache):
    def make_mask(self, N, return_array=False, window_size=None):
        return super().make_mask(N, return_array=return_array)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_a_tree_mask_that_ignores_the_sliding_window_is_caught(model_type):
    """The check above can fail: past the window, a mask that is not narrowed to it gives
    other logits than a sequential forward."""
    model = tiny(model_type)
    depths, anc = tree(PARENTS)
    cache = [_NoWindow() for _ in model.layers]
    model(mx.array(PREFIX)[None], cache=cache)
    logits = tree_logits(model, mx.array(TOKENS), depths, anc, cache)
    assert not same(logits[0], sequential(model, PREFIX + TOKENS[:1]))
