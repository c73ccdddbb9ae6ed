"""The EAGLE-style draft layer: one trainable decoder layer over the backbone's features.

EAGLE (Li et al. 2024, sec. 3-4) drafts at the feature level: the entry at position
i reads the backbone's final feature f_i and the embedding of the next token
x_{i+1} ("shifted token"), ``z_i = W [f_i; e(x_{i+1})] + b``; one decoder layer
attends causally over the entries of the context (its own small KV cache) and
predicts the feature at i+1, ``f^_{i+1} = norm(layer(z)_i)``, whose projection through
the backbone's frozen output layer gives logits for x_{i+2}. Drafting is
autoregressive: the next entry reads ``(f^_{i+1}, e(x^_{i+2}))``. The layer starts
as a copy of the backbone's top layer (the backbone keeps its own, frozen) whose
attention and MLP output projections start at zero, with ``W = [I 0]``: a fresh layer
passes f_i through and predicts what the backbone predicted (the zero-initialised
residual branches of ReZero / Fixup, as hydra heads start; ``mlx_stream.heads.new_heads``).
"""

from __future__ import annotations

import importlib
from dataclasses import asdict

import mlx.core as mx
import mlx.nn as nn


def layer_spec(backbone) -> dict:
    """What rebuilds the draft layer: ``{"model_type", "args"}`` (mlx-lm's ``ModelArgs``
    fields), stored in the heads' config. A llama-family backbone's own decoder layer (its
    top layer's weights can start the draft layer); for any other mlx-lm backbone, a llama
    decoder layer of the backbone's width, heads and rope base (the published EAGLE-3 heads
    of Qwen, gpt-oss and DeepSeek targets are llama layers too), started at random.

    Raises:
        ValueError: OPT (not an mlx-lm model; its heads are hydra or residual).
    """
    from mlx_stream.models import family, llama, model_type, text_args

    kind = model_type(backbone)
    if kind in llama.FAMILY:
        args = {k: v for k, v in asdict(backbone.args).items() if not callable(v)}
        return {"model_type": kind, "args": args}
    if kind == "opt":
        raise ValueError(
            f"eagle heads need an mlx-lm backbone (llama-family or any other), not {kind!r}: "
            "use hydra or residual heads"
        )
    a = text_args(backbone)
    width = family(backbone).state_size(backbone)
    heads = int(getattr(a, "num_attention_heads", 0) or max(width // 64, 1))
    args = {
        "model_type": "llama",
        "hidden_size": width,
        "num_hidden_layers": 1,
        "intermediate_size": int(getattr(a, "intermediate_size", 0) or 4 * width),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(a, "num_key_value_heads", 0) or heads),
        "head_dim": width // heads,
        "rms_norm_eps": float(getattr(a, "rms_norm_eps", 0) or 1e-6),
        "vocab_size": int(a.vocab_size),
        "rope_theta": float(getattr(a, "rope_theta", 0) or 1e4),
        "max_position_embeddings": int(getattr(a, "max_position_embeddings", 0) or 4096),
        "tie_word_embeddings": False,
    }
    return {"model_type": "llama", "args": args}


def build_layer(spec: dict) -> nn.Module:
    """A fresh decoder layer (mlx-lm's ``TransformerBlock``) from :func:`layer_spec`'s output."""
    mod = importlib.import_module(f"mlx_lm.models.{spec['model_type']}")
    return mod.TransformerBlock(mod.ModelArgs.from_dict(spec["args"]))


class EagleDraft(nn.Module):
    """The draft layer's weights: ``fc`` (2H -> H), ``layer`` (a decoder layer),
    ``norm`` (RMSNorm of its output, the predicted feature) and, with ``fused > 0``
    (EAGLE-3's fused features, Li et al. 2025, sec. 3.1), ``fuse`` ((1 + fused)H -> H)
    with an RMSNorm per fused layer: the backbone's feature at i is then the final
    hidden state concatenated with the hidden states entering ``fused`` lower layers,
    ``(N, (1 + fused) H)``, fused to H before it enters ``fc``; the layer's own
    predictions (drafting) are H wide and skip the fusion."""

    def __init__(self, hidden_size: int, spec: dict, fused: int = 0):
        super().__init__()
        eps = float(spec["args"].get("rms_norm_eps", 1e-5))
        self.fc = nn.Linear(2 * hidden_size, hidden_size)
        self.layer = build_layer(spec)
        self.spec_type = spec["model_type"]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        if fused:
            self.fuse_norms = [nn.RMSNorm(hidden_size, eps=eps) for _ in range(fused)]
            self.fuse = nn.Linear((1 + fused) * hidden_size, hidden_size, bias=False)

    def features(self, f: mx.array) -> mx.array:
        """The backbone's features ``(..., (1 + fused) H)`` fused to ``(..., H)`` (float32);
        H-wide features (no fusion, or the layer's own predictions) pass unchanged."""
        H = self.norm.weight.shape[0]
        f = f.astype(mx.float32)
        if f.shape[-1] == H:
            return f
        parts = [f[..., :H]] + [n(f[..., (j + 1) * H : (j + 2) * H]) for j, n in enumerate(self.fuse_norms)]
        return self.fuse(mx.concatenate(parts, axis=-1))

    def __call__(self, f: mx.array, e: mx.array, positions: mx.array, mask, cache) -> mx.array:
        """Entries of N tree nodes or sequence positions.

        Args:
            f: ``(N, H)`` features f_i (the backbone's final hidden states, or the
                layer's own predictions f^_i when drafting); ``(N, (1 + fused) H)``
                for the backbone's fused features (:meth:`features`).
            e: ``(N, H)`` input embeddings of x_{i+1}.
            positions: int ``(N,)`` rotary positions i.
            mask: ``None`` (a single entry), or bool ``(N, S)`` over the cache's
                entries plus these N (S = cache offset + N).
            cache: an mlx-lm ``KVCache``; the N entries are appended to it.

        Returns:
            ``(N, H)`` predicted features f^_{i+1} (float32).
        """
        from mlx_stream.models.llama import _attention

        layer = self.layer
        z = self.fc(mx.concatenate([self.features(f), e.astype(mx.float32)], axis=-1))[None]
        z = z + _attention(layer.self_attn, layer.input_layernorm(z), positions, mask, cache)
        z = z + layer.mlp(layer.post_attention_layernorm(z))
        return self.norm(z[0])

    def sequence(self, f: mx.array, e: mx.array, mask: mx.array | None = None) -> mx.array:
        """Teacher-forced entries over whole sequences (training).

        Args:
            f: ``(B, L, H)`` features; e: ``(B, L, H)`` embeddings of the next tokens.
            mask: additive or bool ``(L, L)`` mask; ``None``: causal.

        Returns:
            ``(B, L, H)`` predicted features.
        """
        z = self.fc(mx.concatenate([self.features(f), e.astype(mx.float32)], axis=-1))
        return self.norm(self.layer(z, "causal" if mask is None else mask, None))
