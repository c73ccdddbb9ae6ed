"""A published DFlash block drafter (z-lab's DFlash: block diffusion for speculative
decoding; vLLM ``speculators``' ``DFlashSpeculator``).

The target's hidden states at each verified position (the outputs of a few of its
layers, concatenated) are projected and normed once, ``c_i = hidden_norm(fc([a_i; ...]))``,
and become context entries of every draft layer: its keys ``k_norm(k_proj(c_i))`` and
values ``v_proj(c_i)``, rotated at position i, kept in a cache. One forward drafts a whole
block: the block's ``block_size`` positions r.. r + B - 1 hold the last verified token
(the root, at r) and ``mask_token_id`` after it, embedded with the target's embedding;
each of a few Qwen3-style layers attends from the block, without a causal mask, over the
context entries and the block itself; the final norm and the target's output head (or
the checkpoint's own over a draft vocabulary) give, at block position j >= 1, the
distribution of the token at r + j. So every depth's distribution comes from one pass,
independent of the tokens drafted before it (as stream heads' are).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .eagle import build_layer

#: the options of a published DFlash drafter (HeadConfig.dflash), with their defaults
DFLASH_OPTIONS = {"block_size": 16, "mask_token_id": 0, "target_hidden_size": 0, "layers": 1, "head": 0}


class DFlashDraft(nn.Module):
    """The weights and forward of a published DFlash drafter.

    Args:
        hidden_size: the layers' width H.
        spec: ``{"model_type": "qwen3", "args"}`` of its decoder layers (mlx-lm fields).
        fused: how many target layers' outputs the context entries read.
        options: :data:`DFLASH_OPTIONS`: ``layers`` (how many draft layers), ``head``
            (0: the target's output head; else the rows of the checkpoint's own).

    Raises:
        ValueError: unknown options.
    """

    def __init__(self, hidden_size: int, spec: dict, fused: int, options: dict):
        super().__init__()
        unknown = set(options) - set(DFLASH_OPTIONS)
        if unknown:
            raise ValueError(f"unknown DFlash options {sorted(unknown)}; known: {sorted(DFLASH_OPTIONS)}")
        opts = DFLASH_OPTIONS | dict(options)
        H = hidden_size
        Ht = int(opts["target_hidden_size"]) or H
        eps = float(spec["args"].get("rms_norm_eps", 1e-6))
        self.target_width, self.block_size = Ht, int(opts["block_size"])
        self.fc = nn.Linear(fused * Ht, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.layers = [build_layer(spec) for _ in range(int(opts["layers"]))]
        self.norm = nn.RMSNorm(H, eps=eps)
        if int(opts["head"]):
            self.lm_head = nn.Linear(H, int(opts["head"]), bias=False)

    def context(self, f: mx.array) -> mx.array:
        """The target's features ``(P, (1 + fused) H_t)`` (its final hidden state, then the
        captured layers' inputs, as the decode loop gives them) as context entries ``(P, H)``."""
        return self.hidden_norm(self.fc(f.astype(mx.float32)[..., self.target_width :]))

    def commit(self, c: mx.array, start: int, caches: list) -> None:
        """Append context entries ``c`` ``(P, H)`` at positions ``start..start + P - 1`` to
        each layer's cache (mlx-lm ``KVCache``s, one a layer)."""
        for layer, cache in zip(self.layers, caches):
            a = layer.self_attn
            k = a.k_proj(c).reshape(1, c.shape[0], a.n_kv_heads, -1)
            v = a.v_proj(c).reshape(1, c.shape[0], a.n_kv_heads, -1).transpose(0, 2, 1, 3)
            k = a.rope(a.k_norm(k).transpose(0, 2, 1, 3), offset=start)
            cache.update_and_fetch(k, v)

    def block(self, e: mx.array, start: int, caches: list) -> mx.array:
        """The block's outputs ``(B, H)`` (normed) for its embeddings ``e`` ``(B, H)`` at
        positions ``start..start + B - 1``, attending over the caches' context entries and
        the block (no causal mask); the caches are read, not written."""
        from mlx_lm.models.base import scaled_dot_product_attention

        x = e.astype(mx.float32)[None]
        B = x.shape[1]
        for layer, cache in zip(self.layers, caches):
            a, hn = layer.self_attn, layer.input_layernorm(x)
            q = a.q_norm(a.q_proj(hn).reshape(1, B, a.n_heads, -1)).transpose(0, 2, 1, 3)
            k = a.k_norm(a.k_proj(hn).reshape(1, B, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            v = a.v_proj(hn).reshape(1, B, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q, k = a.rope(q, offset=start), a.rope(k, offset=start)
            if cache.offset:
                k = mx.concatenate([cache.keys[..., : cache.offset, :], k], axis=2)
                v = mx.concatenate([cache.values[..., : cache.offset, :], v], axis=2)
            o = scaled_dot_product_attention(q, k, v, cache=None, scale=a.scale, mask=None)
            x = x + a.o_proj(o.transpose(0, 2, 1, 3).reshape(1, B, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x[0])
