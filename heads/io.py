"""Saving and loading stream heads: a folder with ``config.json`` + ``heads.safetensors``."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_stream.files import staged_folder

from .config import HeadConfig
from .modules import StreamHeads


def output_weight(backbone) -> mx.array:
    """The backbone's output projection as a float ``(V, H)`` matrix (dequantised)."""
    from mlx_stream.models import family

    head = family(backbone).output_layer(backbone)
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return mx.dequantize(
            head.weight,
            head.scales.astype(mx.float32),
            head.biases.astype(mx.float32),
            head.group_size,
            head.bits,
        )
    return head.weight


def backbone_fingerprint(backbone, tokenizer) -> dict:
    """Identify a backbone so heads trained for it are not used on another.

    Returns a dict: ``architecture`` (mlx-lm ``model_type``), ``hidden_size``,
    ``vocab_size``, ``tokenizer`` (sha256 of the sorted vocabulary, first 16 hex
    digits) and ``weights`` (sha256 of the output projection rounded to float16, so
    the same weights quantised or not give the same value, first 16 hex digits).
    """
    from mlx_stream.models import family, text_args

    args = text_args(backbone)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    tok_hash = hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]
    w = np.array(output_weight(backbone).astype(mx.float16))
    return {
        "architecture": backbone.model_type,
        "hidden_size": family(backbone).state_size(backbone),
        "vocab_size": int(args.vocab_size),
        "tokenizer": tok_hash,
        "weights": hashlib.sha256(w.tobytes()).hexdigest()[:16],
    }


def new_heads(
    backbone,
    tokenizer,
    num_heads: int = 3,
    num_layers: int = 1,
    seed: int | None = None,
    scale: float = 0.0,
    draft_ids: mx.array | None = None,
    architecture: str = "residual",
    stream_layers: int = 2,
    adapter_size: int = 128,
    copy_top_layer: bool = True,
    stream_copies: bool = False,
    fuse_layers: Sequence[int] = (),
) -> StreamHeads:
    """Fresh heads for ``backbone``: their output blocks zero-initialised (``scale=0``,
    so a fresh head repeats the backbone's own prediction), or every weight drawn from
    N(0, scale^2) (for tests). Carries the backbone fingerprint. ``stream_layers`` and
    ``adapter_size`` apply to ``"msa"`` heads only (see :class:`HeadConfig`).
    ``"eagle"`` heads start their draft layer as a copy of the backbone's top layer
    (``copy_top_layer``; else random), with the output projections of its attention and
    MLP at zero and the input projection ``[I 0]``, so a fresh draft layer first predicts
    the backbone's own next token (unless ``scale > 0``: all random). ``"msa"`` heads
    with ``stream_copies`` start their stream layers as copies of the backbone's top
    ``stream_layers`` layers (unless ``scale > 0``). ``fuse_layers`` (``"eagle"``):
    backbone layers whose input hidden states the draft layer fuses with the final
    one (EAGLE-3); the fusion starts as ``[I 0 ... 0]`` (the final hidden state alone).

    Raises:
        ValueError: an unknown ``architecture``, ``num_heads``/``num_layers`` < 1,
            more ``stream_layers`` than the backbone has, or a fuse layer outside it.
    """
    from mlx_stream.models import family, text_args

    fam = family(backbone)
    if architecture == "msa" and not hasattr(fam, "stream_hidden"):
        raise ValueError(
            f"msa stream heads need a llama-family backbone, not {backbone.model_type!r}: "
            "use residual or hydra heads"
        )
    if architecture == "msa" and stream_layers > len(backbone.layers):
        raise ValueError(f"stream_layers={stream_layers} but the backbone has {len(backbone.layers)} layers")
    if any(not 0 <= int(n) < len(backbone.layers) for n in fuse_layers):
        raise ValueError(
            f"fuse_layers {list(fuse_layers)}: the backbone has layers 0..{len(backbone.layers) - 1}"
        )
    spec = {}
    if architecture == "eagle" or (architecture == "msa" and stream_copies):
        from .eagle import layer_spec

        spec = layer_spec(backbone)
    cfg = HeadConfig(
        layer_spec=spec,
        num_heads=num_heads,
        hidden_size=fam.state_size(backbone),
        vocab_size=int(text_args(backbone).vocab_size),
        architecture=architecture,
        num_layers=num_layers,
        stream_layers=stream_layers,
        adapter_size=adapter_size,
        stream_copies=stream_copies,
        fuse_layers=[int(n) for n in fuse_layers],
        draft_vocab_size=0 if draft_ids is None else int(draft_ids.shape[0]),
        fingerprint=backbone_fingerprint(backbone, tokenizer),
    )
    heads = StreamHeads(cfg)
    if draft_ids is not None:
        heads.set_draft_vocab(draft_ids)
    flat = tree_flatten(heads.trainable_parameters())
    keys = mx.random.split(mx.random.key(0 if seed is None else seed), len(flat))
    if scale > 0:
        params = [(name, scale * mx.random.normal(p.shape, key=k)) for (name, p), k in zip(flat, keys)]
    else:  # nn.Linear's default init for what is not zero-initialised, but from ``seed``, not the global RNG
        params = [
            (
                name,
                p
                if not p.any() or "norm" in name
                else mx.random.uniform(-1, 1, p.shape, key=k) / math.sqrt(p.shape[-1]),
            )
            for (name, p), k in zip(flat, keys)
        ]
    heads.load_weights(params, strict=False)
    if architecture == "eagle" and scale == 0:
        _init_draft_layer(heads.eagle, backbone, copy_top_layer)
    if architecture == "msa" and stream_copies and scale == 0:
        for copy, layer in zip(
            heads.layers, backbone.model.layers[len(backbone.model.layers) - stream_layers :]
        ):
            copy.load_weights(tree_flatten(layer.parameters()), strict=True)
    mx.eval(heads.parameters())
    return heads


def _init_draft_layer(draft, backbone, copy_top_layer: bool) -> None:
    # the layer's weights from the backbone's top layer (or random); its residual branches'
    # output projections at zero and the input projection [I 0], so a fresh draft layer
    # passes f_t through (up to its norm) and first predicts the backbone's own next token,
    # as a fresh hydra head does (held-out top-1 0.19 -> 0.29 on the same data,
    # docs/benchmarks.md, "Head architectures and ablations")
    if copy_top_layer and draft.spec_type == getattr(backbone, "model_type", None):  # a layer like its own
        draft.layer.load_weights(tree_flatten(backbone.model.layers[-1].parameters()), strict=True)
    layer, H = draft.layer, draft.fc.weight.shape[0]
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    draft.fc.weight = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
    draft.fc.bias = mx.zeros((H,))
    draft.norm.weight = mx.ones((H,))
    if hasattr(draft, "fuse"):  # the final hidden state alone, to start
        n = draft.fuse.weight.shape[1] // H
        draft.fuse.weight = mx.concatenate([mx.eye(H)] + [mx.zeros((H, H))] * (n - 1), axis=1)
        for norm in draft.fuse_norms:
            norm.weight = mx.ones((H,))


def save_heads(heads: StreamHeads, path: str | Path, dtype: mx.Dtype | None = None) -> Path:
    """Write ``config.json`` and ``heads.safetensors`` into the folder ``path``, with the
    floating-point weights stored as ``dtype`` (e.g. ``mx.float16`` to halve the file;
    :func:`load_heads` casts them back to float32) or as they are.

    The folder is written next to its destination and renamed into place, so an
    interrupted save leaves either the old folder or the new one, never half of one.
    """
    path = Path(path)
    with staged_folder(path, replace=True) as tmp:
        (tmp / "config.json").write_text(heads.config.to_json())
        weights = {
            k: v.astype(dtype) if dtype is not None and mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in tree_flatten(heads.parameters())
        }
        mx.save_safetensors(str(tmp / "heads.safetensors"), weights, metadata={"format": "mlx"})
    return path


def load_heads(path: str | Path, fingerprint: dict | None = None) -> StreamHeads:
    """Load heads from a folder written by :func:`save_heads`.

    Args:
        path: the heads folder.
        fingerprint: the backbone's :func:`backbone_fingerprint`; when given, heads
            trained for another backbone are refused.

    The weights are returned as float32 whatever their stored precision.

    Raises:
        FileNotFoundError: the folder or one of its files is missing.
        ValueError: a corrupt file, weights that do not match the config, or a
            fingerprint mismatch (the message names both backbones).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: heads folder not found (expected config.json + heads.safetensors)")
    cfg = HeadConfig.from_file(path / "config.json")
    if fingerprint is not None and cfg.fingerprint != fingerprint:
        raise ValueError(
            f"{path}: these heads were trained for backbone {cfg.fingerprint} but the loaded "
            f"backbone is {fingerprint}; train heads for this model with `mlx-stream train`"
        )
    wfile = path / "heads.safetensors"
    if not wfile.is_file():
        raise FileNotFoundError(f"{wfile}: heads weights not found")
    try:
        weights = mx.load(str(wfile))
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(f"{wfile}: not a readable safetensors file ({e})") from e
    heads = StreamHeads(cfg)
    weights = {
        k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }
    try:
        heads.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{wfile}: weights do not match {path / 'config.json'} ({e})") from e
    mx.eval(heads.parameters())
    return heads
