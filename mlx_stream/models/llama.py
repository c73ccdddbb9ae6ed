"""Tree forward for the llama family of mlx-lm models (llama, mistral, qwen2, qwen3).

mlx-lm's modules are reused as they are (same weights, same projections); only the
attention is re-assembled so that each tree node gets its own position and sees only
its ancestors. Rotary embeddings take a per-batch-row offset, so the N tree nodes
are moved onto the batch axis for ``rope``: node i is rotated by exactly
``offset + depth[i]``, bitwise as in sequential decoding.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def _attention(attn, x, positions, mask, cache):
    B, N, _ = x.shape  # B == 1
    q = attn.q_proj(x).reshape(B, N, attn.n_heads, -1)
    k = attn.k_proj(x).reshape(B, N, attn.n_kv_heads, -1)
    v = attn.v_proj(x).reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    # nodes on the batch axis: (N, H, 1, D), one rope offset per node
    q = attn.rope(q.reshape(N, attn.n_heads, 1, -1), offset=positions)
    k = attn.rope(k.reshape(N, attn.n_kv_heads, 1, -1), offset=positions)
    q = q.reshape(B, N, attn.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, N, D)
    k = k.reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    k, v = cache.update_and_fetch(k, v)  # (B, Hkv, S, D), S = prefix + N
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))


def tree_hidden(backbone, tokens: mx.array, positions: mx.array, mask, cache) -> mx.array:
    """Final (normed) hidden states of the tree nodes, ``(N, hidden_size)``.

    ``mask`` is ``None`` for a single node, else a bool ``(N, S)`` array over the
    cached prefix plus the tree (S = cache offset + N).
    """
    inner = backbone.model
    h = inner.embed_tokens(tokens[None])  # (1, N, H)
    for layer, c in zip(inner.layers, cache):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), positions, mask, c)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return inner.norm(h)[0]


def prefill_hidden(backbone, tokens: mx.array, cache) -> mx.array:
    """Final hidden states of a causal prefill, ``(L, hidden_size)`` (mlx-lm's own forward)."""
    return backbone.model(tokens[None], cache=cache)[0]


def project(backbone, hidden: mx.array) -> mx.array:
    """The backbone's output projection: hidden ``(..., H)`` -> logits ``(..., V)``."""
    if getattr(backbone.args, "tie_word_embeddings", False) or not hasattr(backbone, "lm_head"):
        return backbone.model.embed_tokens.as_linear(hidden)
    return backbone.lm_head(hidden)
