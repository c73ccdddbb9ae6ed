"""What an mlx-lm model says about itself: its type, its text model's arguments."""

from __future__ import annotations


def model_type(backbone) -> str | None:
    """The backbone's ``model_type`` (mlx-lm's ``args.model_type``)."""
    return getattr(backbone, "model_type", None) or getattr(
        getattr(backbone, "args", None), "model_type", None
    )


def text_args(backbone):
    """The model arguments of ``backbone``'s text model: a vision-language wrapper's
    ``language_model.args`` (``qwen3_vl``, ``mistral3``, ...: they carry ``vocab_size``,
    ``hidden_size``, ...), else ``backbone.args`` (``backbone.config`` in the few mlx-lm
    models that name it so)."""
    args = getattr(backbone, "args", None) or getattr(backbone, "config", None)
    inner = getattr(backbone, "language_model", None)
    if inner is not None and not hasattr(args, "vocab_size"):
        return text_args(inner)
    return args


def head_dim(backbone) -> int | None:
    """The attention heads' width from the text model's arguments (``head_dim``, else
    ``hidden_size / num_attention_heads``), or None where they do not say."""
    args = text_args(backbone)
    d = getattr(args, "head_dim", None)
    if d:
        return int(d)
    h, n = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    return int(h) // int(n) if h and n else None
