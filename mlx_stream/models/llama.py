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

from .projected import projected

FAMILY = ("llama", "mistral", "qwen2", "qwen3")
CHAIN_OFFSETS = True  # tree_forward takes a chain's positions as its root's (see tree_hidden)


def _queue_every(backbone) -> int:
    # On the CPU backend a tree forward is queued (mx.async_eval) every 2 layers while the
    # host records the rest of its graph, so recording (~5-7 ms of a ~70 ms step for
    # SmolLM2-135M) overlaps computing: drafting steps 7-10% faster here
    # (docs/benchmarks.md, "Pipelined steps"). Where a layer's work is as cheap as
    # submitting it (narrow models: a tiny random model's step is ~1 ms of op submission),
    # each extra submission only adds host time (~10% of such a step,
    # benchmarks/host_overhead.py). Not measured on a GPU, so not done there.
    wide = getattr(backbone.args, "hidden_size", 0) >= 512
    return 2 if wide and mx.default_device() == mx.cpu else 0


def _attention(attn, x, positions, mask, cache):
    B, N, _ = x.shape  # B == 1
    q = attn.q_proj(x).reshape(B, N, attn.n_heads, -1)
    k = attn.k_proj(x).reshape(B, N, attn.n_kv_heads, -1)
    v = attn.v_proj(x).reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    if N == 1 or not isinstance(positions, mx.array) or positions.ndim == 0:
        # one node, or a chain rotated from its root's position as mlx-lm rotates a sequence
        # (bitwise the same rotations): no reshapes (each op is host work on a fast device)
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=positions)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=positions)
    else:  # nodes on the batch axis: (N, H, 1, D), one rope offset per node
        q = attn.rope(q.reshape(N, attn.n_heads, 1, -1), offset=positions)
        k = attn.rope(k.reshape(N, attn.n_kv_heads, 1, -1), offset=positions)
        q = q.reshape(B, N, attn.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, N, D)
        k = k.reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    k, v = cache.update_and_fetch(k, v)  # (B, Hkv, S, D), S = prefix + N
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))


def _captured(capture) -> tuple[int, ...]:
    return () if capture is None else (capture,) if isinstance(capture, int) else tuple(capture)


def tree_hidden(backbone, tokens: mx.array, positions: mx.array, mask, cache, capture=None):
    """Final (normed) hidden states of the tree nodes and, with ``capture=l``, the
    hidden states entering layer ``l`` (what multi-stream attention heads read); with
    ``capture=(l1, l2, ...)``, those entering each of the layers, concatenated in that
    order (EAGLE-3's fused features).

    ``positions``: int32 ``(N,)`` each node's absolute position, or, for a chain (node i
    at depth i), the root's position as an int or a ``()`` int32 array (may be lazy).
    ``mask`` is ``None`` for a single node, else a bool ``(N, S)`` array over the
    cached prefix plus the tree (S = cache offset + N).

    Returns:
        ``(hidden, mid)``: ``hidden`` ``(N, hidden_size)``; ``mid`` ``(N, hidden_size)``
        (``(N, n x hidden_size)`` for n captured layers), or ``None`` without ``capture``.
    """
    inner, layers = backbone.model, _captured(capture)
    h = inner.embed_tokens(tokens[None])  # (1, N, H)
    caps = {}
    every = _queue_every(backbone)
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        if i in layers:
            caps[i] = h[0]
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), positions, mask, c)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if every and i % every == every - 1:
            mx.async_eval(h)
    mid = mx.concatenate([caps[i] for i in layers], axis=-1) if layers else None
    return inner.norm(h)[0], mid


def prefill_hidden(backbone, tokens: mx.array, cache, capture=None):
    """``(hidden, mid)`` of a causal prefill of L tokens, as :func:`tree_hidden`:
    ``hidden`` ``(L, hidden_size)`` (mlx-lm's own forward), ``mid`` ``None`` without
    ``capture``."""
    layers = _captured(capture)
    if not layers:
        return backbone.model(tokens[None], cache=cache)[0], None
    from mlx_lm.models.base import create_attention_mask

    inner = backbone.model
    h = inner.embed_tokens(tokens[None])
    mask = create_attention_mask(h, cache[0])  # as mlx-lm's LlamaModel.__call__
    caps = {}
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        if i in layers:
            caps[i] = h[0]
        h = layer(h, mask, c)
    return inner.norm(h)[0], mx.concatenate([caps[i] for i in layers], axis=-1)


def project(backbone, hidden: mx.array) -> mx.array:
    """The backbone's output projection: hidden ``(..., H)`` -> logits ``(..., V)``."""
    if getattr(backbone.args, "tie_word_embeddings", False) or not hasattr(backbone, "lm_head"):
        return backbone.model.embed_tokens.as_linear(hidden)
    return backbone.lm_head(hidden)


def embed(backbone, tokens: mx.array) -> mx.array:
    """The input embeddings of ``tokens``, ``(..., H)``."""
    return backbone.model.embed_tokens(tokens)


def output_layer(backbone):
    """The module holding the output projection's ``(V, H)`` weight (the embeddings when tied)."""
    if not getattr(backbone.args, "tie_word_embeddings", True) and hasattr(backbone, "lm_head"):
        return backbone.lm_head
    return backbone.model.embed_tokens


def state_size(backbone) -> int:
    """Width of the states the heads read (the final normed hidden state)."""
    return int(backbone.args.hidden_size)


def _stream_attention(attn, s, positions, keys, values, visible):
    # s: (B, T, K, H) stream inputs (normed); keys/values: (B, Hkv, S, D) main stream
    B, T, K, _ = s.shape
    nh, nkv = attn.n_heads, attn.n_kv_heads
    q = attn.q_proj(s).reshape(B * T * K, nh, 1, -1)
    k = attn.k_proj(s).reshape(B * T * K, nkv, 1, -1)
    v = attn.v_proj(s).reshape(B, T, K, nkv, -1)
    if hasattr(attn, "q_norm"):  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = attn.rope(q, offset=positions).reshape(B, T, K, nh, -1)  # stream j of t sits at t + j
    k = attn.rope(k, offset=positions).reshape(B, T, K, nkv, -1)
    D = q.shape[-1]
    rep = nh // nkv
    if rep > 1:
        keys, values = mx.repeat(keys, rep, axis=1), mx.repeat(values, rep, axis=1)
        k, v = mx.repeat(k, rep, axis=3), mx.repeat(v, rep, axis=3)
    q = q.transpose(0, 1, 3, 2, 4)  # (B, T, nh, K, D)
    main = (q.transpose(0, 2, 1, 3, 4).reshape(B, nh, T * K, D) * attn.scale) @ keys.swapaxes(-1, -2)
    main = main.reshape(B, nh, T, K, -1).transpose(0, 2, 1, 3, 4)  # (B, T, nh, K, S)
    main = mx.where(visible[:, :, None, None, :], main, -mx.inf)
    own = (q * attn.scale) @ k.transpose(0, 1, 3, 4, 2)  # (B, T, nh, K, K): stream j sees streams <= j
    own = mx.where(mx.tril(mx.ones((K, K), dtype=mx.bool_)), own, -mx.inf)
    S = main.shape[-1]
    p = mx.softmax(mx.concatenate([main, own], axis=-1).astype(mx.float32), axis=-1).astype(q.dtype)
    pm = p[..., :S].transpose(0, 2, 1, 3, 4).reshape(B, nh, T * K, S)
    out = (pm @ values).reshape(B, nh, T, K, D).transpose(0, 2, 1, 3, 4)  # (B, T, nh, K, D)
    out = out + p[..., S:] @ v.transpose(0, 1, 3, 2, 4)
    return attn.o_proj(out.transpose(0, 1, 3, 2, 4).reshape(B, T, K, -1))


def stream_hidden(
    backbone, heads, x: mx.array, positions: mx.array, kv, visible: mx.array, root: mx.array
) -> mx.array:
    """Multi-stream attention through the backbone's top N_s layers (frozen) with the
    heads' stream embeddings and stream-only adapters, or through the heads' trainable
    copies of those layers (``stream_copies``) (Bhendawade et al. 2024,
    sec. 3.1); see :class:`mlx_stream.heads.StreamHeads` ("msa").

    Args:
        x: ``(B, T, H)`` hidden states entering layer L - N_s at the positions that
            draft (one position at decode time; every position of a sequence batch in
            training).
        positions: int ``(B, T)`` the positions t of ``x``.
        kv: per top layer, ``(keys, values)`` of the main stream, ``(B, Hkv, S, D)``
            each, rotary embedding applied (from the KV cache, or from a causal pass
            of the top layers in training).
        visible: bool ``(B, T, S)``: which main-stream entries position t may attend to
            (``s <= t`` and not padding).
        root: int ``(B, T)`` the token x_{t+1} after each position (the tree's root).

    Returns:
        ``(K, B, T, H)`` the streams' final normed hidden states (stream j predicts
        token t+1+j).
    """
    cfg = heads.config
    K = cfg.num_heads
    if cfg.stream_copies:  # trainable copies, no adapters
        top, adapters = heads.layers, [None] * cfg.stream_layers
    else:
        top, adapters = (
            backbone.model.layers[len(backbone.model.layers) - cfg.stream_layers :],
            heads.adapters,
        )
    B, T, _ = x.shape
    e = heads.root(backbone.model.embed_tokens(root).astype(x.dtype))  # (B, T, H)
    s = (x + e)[:, :, None, :] + heads.streams.astype(x.dtype)  # (B, T, K, H)
    pos = (positions[:, :, None] + mx.arange(1, K + 1)[None, None, :]).reshape(-1)
    for layer, adapter, (keys, values) in zip(top, adapters, kv):
        if adapter is not None:
            s = adapter(s)
        s = s + _stream_attention(layer.self_attn, layer.input_layernorm(s), pos, keys, values, visible)
        s = s + layer.mlp(layer.post_attention_layernorm(s))
    return backbone.model.norm(s).transpose(2, 0, 1, 3)


def main_stream_kv(backbone, x: mx.array, num_layers: int) -> list:
    """Keys/values of the top ``num_layers`` layers over whole sequences (training):
    ``x`` ``(B, T, H)`` entering layer L - num_layers, right-padded; returns per layer
    ``(keys, values)``, ``(B, Hkv, T, D)``, rotary embedding applied (positions 0..T-1),
    as a KV cache would hold them."""
    from mlx_lm.models.cache import KVCache

    out = []
    h = x
    for layer in backbone.model.layers[len(backbone.model.layers) - num_layers :]:
        c = KVCache()
        h = layer(h, "causal", c)  # right padding: real positions never see pads
        out.append((c.keys[..., : x.shape[1], :], c.values[..., : x.shape[1], :]))
    return out


tree_forward, prefill_forward = projected(tree_hidden, prefill_hidden, project)
