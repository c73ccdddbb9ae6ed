"""OPT (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models") in MLX,
with the tree forward.

mlx-lm has no OPT, so the model is written here following mlx-lm's model contract
(``ModelArgs`` mirroring ``config.json``, ``Model`` with ``layers``, ``sanitize``;
the KV cache is mlx-lm's) and Hugging Face's ``modeling_opt.py`` names, so
``mlx_lm.utils.load_model(path, get_model_classes=get_classes)`` loads a converted
checkpoint and ``mlx_lm.stream_generate`` decodes with it.

What differs from llama: learned absolute position embeddings read at
``position + 2`` (OPT's offset), multi-head attention with biases and the query
scaled before the product, ReLU MLP (``fc1``/``fc2``), LayerNorm either before each
block (``do_layer_norm_before``, most sizes) or after it (350m), and for 350m an
embedding width ``word_embed_proj_dim`` smaller than the model's, bridged by
``project_in``/``project_out``. The output projection is tied to the embeddings.

The states the stream heads read (``tree_hidden``) are the inputs of the output
projection: after ``project_out`` when there is one (width ``word_embed_proj_dim``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, create_attention_mask, scaled_dot_product_attention

from .projected import projected

FAMILY = ("opt",)
POSITION_OFFSET = 2  # OPT's learned position table has two extra leading rows


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    ffn_dim: int
    max_position_embeddings: int = 2048
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    activation_function: str = "relu"
    tie_word_embeddings: bool = True
    _remove_final_layer_norm: bool = False

    def __post_init__(self):
        if self.word_embed_proj_dim is None:
            self.word_embed_proj_dim = self.hidden_size
        if self.activation_function != "relu":
            raise ValueError(f"OPT activation {self.activation_function!r} is not supported (only relu)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, b = args.hidden_size, args.enable_bias
        self.n_heads = args.num_attention_heads
        self.scale = (d // self.n_heads) ** -0.5
        self.q_proj = nn.Linear(d, d, bias=b)
        self.k_proj = nn.Linear(d, d, bias=b)
        self.v_proj = nn.Linear(d, d, bias=b)
        self.out_proj = nn.Linear(d, d, bias=b)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = (
            p(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )  # (B, H, L, D)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, aff = args.hidden_size, args.layer_norm_elementwise_affine
        self.pre_norm = args.do_layer_norm_before
        self.self_attn = Attention(args)
        self.self_attn_layer_norm = nn.LayerNorm(d, affine=aff)
        self.fc1 = nn.Linear(d, args.ffn_dim, bias=args.enable_bias)
        self.fc2 = nn.Linear(args.ffn_dim, d, bias=args.enable_bias)
        self.final_layer_norm = nn.LayerNorm(d, affine=aff)

    def __call__(self, x, mask=None, cache=None):
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, mask, cache)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(nn.relu(self.fc1(h)))
        return x if self.pre_norm else self.final_layer_norm(x)


class Decoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, e = args.hidden_size, args.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(args.vocab_size, e)
        self.embed_positions = nn.Embedding(args.max_position_embeddings + POSITION_OFFSET, d)
        if e != d:
            self.project_in = nn.Linear(e, d, bias=False)
            self.project_out = nn.Linear(d, e, bias=False)
        if args.do_layer_norm_before and not args._remove_final_layer_norm:
            self.final_layer_norm = nn.LayerNorm(d, affine=args.layer_norm_elementwise_affine)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]

    def embed(self, tokens: mx.array, positions: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        if "project_in" in self:
            h = self.project_in(h)
        return h + self.embed_positions(positions + POSITION_OFFSET)

    def finish(self, h: mx.array) -> mx.array:
        if "final_layer_norm" in self:
            h = self.final_layer_norm(h)
        return self.project_out(h) if "project_out" in self else h

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        offset = cache[0].offset if cache is not None else 0
        L = tokens.shape[1]
        if isinstance(offset, mx.array):  # mlx-lm's BatchKVCache: per row, negative over left padding
            positions = mx.maximum(offset[:, None] + mx.arange(L)[None], 0)
        else:
            positions = mx.arange(offset, offset + L)
        h = self.embed(tokens, positions)
        mask = create_attention_mask(h, cache[0] if cache is not None else None)
        for layer, c in zip(self.layers, cache if cache is not None else [None] * len(self.layers)):
            h = layer(h, mask, c)
        return self.finish(h)


class OPTModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.decoder = Decoder(args)

    def __call__(self, tokens, cache=None):
        return self.decoder(tokens, cache)


class Model(nn.Module):
    """OPTForCausalLM: ``model(tokens (B, L), cache=None) -> logits (B, L, V)``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = OPTModel(args)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        return self.model.decoder.embed_tokens.as_linear(self.model(inputs, cache))

    @property
    def layers(self):
        return self.model.decoder.layers

    def sanitize(self, weights: dict) -> dict:
        # the output projection is tied; old checkpoints lack the "model." prefix
        out = {}
        for k, v in weights.items():
            if k == "lm_head.weight":
                continue
            if k.startswith("decoder."):
                k = "model." + k
            out[k] = v
        return out


def get_classes(config: dict):
    """``get_model_classes`` for ``mlx_lm.utils.load_model``."""
    return Model, ModelArgs


# the tree forward (the family interface, see mlx_stream.models)


def _attention(attn, x, mask, cache):
    B, N, _ = x.shape
    q, k, v = (
        p(x).reshape(B, N, attn.n_heads, -1).transpose(0, 2, 1, 3)
        for p in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    k, v = cache.update_and_fetch(k, v)  # (B, H, S, D)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return attn.out_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))


def tree_hidden(backbone, tokens: mx.array, positions: mx.array, mask, cache, capture: int | None = None):
    """``(hidden, None)``: the output projection's inputs at the tree nodes, ``hidden``
    ``(N, word_embed_proj_dim)`` (the same return shape as the llama family's).

    Each node is embedded at its own position (``positions``, absolute); ``mask`` is
    ``None`` for one node, else bool ``(N, S)`` over the cached prefix plus the tree.

    Raises:
        ValueError: ``capture`` (multi-stream attention heads need a llama-family backbone).
    """
    if capture is not None:
        raise ValueError(
            "msa stream heads need a llama-family backbone; use residual or hydra heads with OPT"
        )
    dec = backbone.model.decoder
    h = dec.embed(tokens[None], positions[None])  # (1, N, d)
    for layer, c in zip(dec.layers, cache):
        a = layer.self_attn_layer_norm(h) if layer.pre_norm else h
        h = h + _attention(layer.self_attn, a, mask, c)
        if not layer.pre_norm:
            h = layer.self_attn_layer_norm(h)
        a = layer.final_layer_norm(h) if layer.pre_norm else h
        h = h + layer.fc2(nn.relu(layer.fc1(a)))
        if not layer.pre_norm:
            h = layer.final_layer_norm(h)
    return dec.finish(h)[0], None


def prefill_hidden(backbone, tokens: mx.array, cache, capture: int | None = None):
    """``(hidden, None)`` after a causal prefill: ``hidden`` ``(L, word_embed_proj_dim)``."""
    if capture is not None:
        raise ValueError(
            "msa stream heads need a llama-family backbone; use residual or hydra heads with OPT"
        )
    return backbone.model(tokens[None], cache)[0], None


def project(backbone, hidden: mx.array) -> mx.array:
    """hidden ``(..., word_embed_proj_dim)`` -> logits ``(..., V)`` (tied embeddings)."""
    return backbone.model.decoder.embed_tokens.as_linear(hidden)


def embed(backbone, tokens: mx.array) -> mx.array:
    """The input embeddings of ``tokens``, ``(..., word_embed_proj_dim)``."""
    return backbone.model.decoder.embed_tokens(tokens)


def output_layer(backbone):
    """The module holding the output projection's ``(V, word_embed_proj_dim)`` weight."""
    return backbone.model.decoder.embed_tokens


def state_size(backbone) -> int:
    """Width of the states the heads read (the output projection's input)."""
    return int(backbone.args.word_embed_proj_dim)


tree_forward, prefill_forward = projected(tree_hidden, prefill_hidden, project)
