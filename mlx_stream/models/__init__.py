"""Tree-capable forwards: a module of its own for llama (measured to pay: its pipelined
forward, see :mod:`.llama`) and OPT (not an mlx-lm model), and :class:`.generic.Generic`,
the model's own ``__call__``, for every other key/value-cache mlx-lm model.

Each family provides ``tree_forward`` and ``prefill_forward`` (both return ``(logits,
hidden, mid)``: the model's logits, the input of its output projection, and the input of
captured layers or None), ``tree_hidden`` and ``prefill_hidden`` (``(hidden, mid)``),
``project``, ``embed``, ``output_layer`` and ``state_size`` over an mlx-lm-style model
object (llama also ``stream_hidden`` and ``main_stream_kv`` for multi-stream attention
heads); :func:`family` picks it for a backbone.
"""

from __future__ import annotations

from . import llama, opt
from .args import head_dim, model_type, text_args
from .generic import Generic

__all__ = ["family", "head_dim", "model_type", "text_args"]

_FAMILIES = {name: mod for mod in (llama, opt) for name in mod.FAMILY}


def family(backbone):
    """The tree-forward family of ``backbone`` (an mlx-lm ``Model``): the llama or OPT
    module, or a :class:`~.generic.Generic` over the model's own code.

    Raises:
        ValueError: the model's caches cannot be rewound after a rejected draft
            (recurrent layers, ...); the message names them.
    """
    kind = model_type(backbone)
    if kind in _FAMILIES and not _needs_generic(backbone):
        return _FAMILIES[kind]
    # the probe and self-check run once per model object: kept on it
    fam = backbone.__dict__.get("_tree_family")
    if fam is None:
        fam = Generic(backbone)
        backbone._tree_family = fam
    return fam


def _needs_generic(backbone) -> bool:
    # llama-family checkpoints that llama.py's re-assembled attention does not cover
    if any(getattr(layer, "use_sliding", False) for layer in backbone.layers):
        return True
    scaling = getattr(text_args(backbone), "rope_scaling", None) or {}
    return (scaling.get("type") or scaling.get("rope_type")) not in (
        None,
        "default",
        "linear",
        "llama3",
        "yarn",
    )
