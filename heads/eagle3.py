"""A published EAGLE-3 draft layer (Li et al. 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test"), as SafeAILab's
``LlamaForCausalLMEagle3``, SpecForge's and vLLM ``speculators``' ``Eagle3Speculator``
define it.

The entry at position i reads the target's hidden states entering three of its layers
(low, middle, high) at i, concatenated and projected, ``x_i = fc([a_i; b_i; c_i])``
(optionally RMS-normed first: ``norm_before_fc`` over the concatenation, ``fc_norm``
per part), and the embedding of the next token x_{i+1}. One decoder layer whose query,
key and value projections read ``[input_layernorm(e); hidden_norm(x)]`` (2H wide), with
the residual taken from x (``hidden_norm(x)`` with ``norm_before_residual``), then the
layer's MLP: its output h_i is fed back as the next entry's x when drafting on
(``norm_output``: ``norm(h_i)`` is), and ``lm_head(norm(h_i))`` scores a draft
vocabulary of ``draft_vocab_size`` tokens, draft token j being target token
``j + d2t[j]``. The layer attends causally over its own KV cache of entries, rotated
with its own rotary settings.

Our own ``"eagle"`` heads (:class:`~mlx_stream.heads.eagle.EagleDraft`) differ: they
project ``[f; e]`` through ``fc`` before a standard decoder layer and score with the
backbone's output head. Both are drafted by :class:`mlx_stream.drafters.EagleDrafter`,
which calls the layer and then its :meth:`Eagle3Draft.logits`.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .eagle import build_layer

#: the options of a published EAGLE-3 layer (HeadConfig.eagle3), with their defaults
EAGLE3_OPTIONS = {
    "target_hidden_size": 0,  # the target's width H_t (0: the layer's own)
    "norm_before_residual": False,
    "norm_before_fc": False,
    "fc_norm": False,
    "norm_output": False,
    "fc_bias": False,
    "embed": False,  # the checkpoint carries its own input embedding
}


class Eagle3Draft(nn.Module):
    """The weights and forward of a published EAGLE-3 draft layer.

    Args:
        hidden_size: the layer's width H.
        spec: ``{"model_type", "args"}`` of its decoder layer (mlx-lm ``ModelArgs``
            fields: heads, head_dim, rope settings; ``llama`` or ``qwen3``), as
            :func:`~mlx_stream.heads.eagle.build_layer` takes.
        fused: how many target layers' inputs the entries read (3 in every published one).
        draft_vocab: the output head's rows (the draft vocabulary's size).
        options: :data:`EAGLE3_OPTIONS` (unknown keys are refused).

    Raises:
        ValueError: unknown options.
    """

    def __init__(self, hidden_size: int, spec: dict, fused: int, draft_vocab: int, options: dict):
        super().__init__()
        unknown = set(options) - set(EAGLE3_OPTIONS)
        if unknown:
            raise ValueError(f"unknown EAGLE-3 options {sorted(unknown)}; known: {sorted(EAGLE3_OPTIONS)}")
        opts = EAGLE3_OPTIONS | dict(options)
        H = hidden_size
        Ht = int(opts["target_hidden_size"]) or H
        eps = float(spec["args"].get("rms_norm_eps", 1e-6))
        self.target_width, self.fused = Ht, fused
        self.norm_before_residual = bool(opts["norm_before_residual"])
        self.norm_output = bool(opts["norm_output"])
        self.fc = nn.Linear(fused * Ht, H, bias=bool(opts["fc_bias"]))
        if opts["norm_before_fc"]:
            self.input_norm = nn.RMSNorm(fused * Ht, eps=eps)
        if opts["fc_norm"]:
            self.fc_norm = [nn.RMSNorm(Ht, eps=eps) for _ in range(fused)]
        layer = build_layer(spec)
        attn, a = layer.self_attn, spec["args"]
        bias = bool(a.get("attention_bias", False))
        # q/k/v read [input_layernorm(e); hidden_norm(x)]: 2H wide
        attn.q_proj = nn.Linear(2 * H, attn.q_proj.weight.shape[0], bias=bias)
        attn.k_proj = nn.Linear(2 * H, attn.k_proj.weight.shape[0], bias=bias)
        attn.v_proj = nn.Linear(2 * H, attn.v_proj.weight.shape[0], bias=bias)
        self.layer = layer
        self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.norm = nn.RMSNorm(H, eps=eps)
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        if opts["embed"]:
            self.embed_tokens = nn.Embedding(int(a["vocab_size"]), H)

    def features(self, f: mx.array) -> mx.array:
        """The target's features ``(..., (1 + fused) H_t)`` (its final hidden state, then
        the inputs of the fused layers, as the decode loop captures them) projected to
        ``(..., H)``; the layer's own outputs ``(..., H)`` (drafting on) pass unchanged."""
        H = self.norm.weight.shape[0]
        f = f.astype(mx.float32)
        if f.shape[-1] == H:
            return f
        aux = f[..., self.target_width :]  # (the final hidden state is not an EAGLE-3 input)
        if "input_norm" in self:
            aux = self.input_norm(aux)
        if "fc_norm" in self:
            Ht = self.target_width
            aux = mx.concatenate([n(aux[..., j * Ht : (j + 1) * Ht]) for j, n in enumerate(self.fc_norm)], -1)
        return self.fc(aux)

    def embed(self, tokens: mx.array) -> mx.array | None:
        """The checkpoint's own embeddings of ``tokens``, or None where it has none
        (the target's are used)."""
        return self.embed_tokens(tokens) if "embed_tokens" in self else None

    def __call__(self, f: mx.array, e: mx.array, positions: mx.array, mask, cache) -> mx.array:
        """Entries of N tree nodes or sequence positions.

        Args:
            f: ``(N, (1 + fused) H_t)`` the target's features, or ``(N, H)`` the layer's
                own outputs (drafting on).
            e: ``(N, H)`` input embeddings of x_{i+1}.
            positions: int ``(N,)`` rotary positions i.
            mask: ``None`` (a single entry) or bool ``(N, S)`` over the cache's entries
                plus these N.
            cache: an mlx-lm ``KVCache``; the N entries are appended to it.

        Returns:
            ``(N, H)`` float32: the layer's output h (``norm(h)`` with ``norm_output``),
            what the next entry reads and :meth:`logits` scores.
        """
        from mlx_stream.models.llama import _attention

        layer = self.layer
        x = self.features(f)[None]
        hx = self.hidden_norm(x)
        inp = mx.concatenate([layer.input_layernorm(e.astype(mx.float32)[None]), hx], axis=-1)
        h = (hx if self.norm_before_residual else x) + _attention(
            layer.self_attn, inp, positions, mask, cache
        )
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h[0]) if self.norm_output else h[0]

    def sequence(self, f: mx.array, e: mx.array, mask=None) -> mx.array:
        """Teacher-forced entries over whole sequences (training; a causal prefill).

        Args:
            f: ``(B, L, (1 + fused) H_t)`` the target's features; e: ``(B, L, H)``
                embeddings of the next tokens.
            mask: bool or additive ``(L, L)``; ``None``: causal.

        Returns:
            ``(B, L, H)`` outputs, as :meth:`__call__` gives them entry by entry.
        """
        layer = self.layer
        x = self.features(f)
        hx = self.hidden_norm(x)
        inp = mx.concatenate([layer.input_layernorm(e.astype(mx.float32)), hx], axis=-1)
        h = (hx if self.norm_before_residual else x) + layer.self_attn(
            inp, "causal" if mask is None else mask, None
        )
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h) if self.norm_output else h

    def logits(self, h: mx.array) -> mx.array:
        """``(..., draft_vocab)`` logits of the layer's outputs ``(..., H)``."""
        return self.lm_head(h if self.norm_output else self.norm(h))
