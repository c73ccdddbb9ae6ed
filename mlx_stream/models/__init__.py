"""Tree-capable forwards, one module per architecture family.

Each family module provides ``tree_hidden`` and ``prefill_hidden`` (both return
``(hidden, mid)``: ``mid`` is the input of a captured layer, or None), ``project``,
``embed``, ``output_layer`` and ``state_size`` over an mlx-lm-style model object
(llama also ``stream_hidden`` and ``main_stream_kv`` for multi-stream attention
heads); :func:`family` picks the module for a backbone.
"""

from __future__ import annotations

from types import ModuleType

from . import llama, opt

_FAMILIES = {name: mod for mod in (llama, opt) for name in mod.FAMILY}


def family(backbone) -> ModuleType:
    """The tree-forward module for ``backbone`` (an mlx-lm ``Model``).

    Raises:
        ValueError: the architecture has no tree forward here; the message lists
            the supported ``model_type`` values.
    """
    kind = getattr(backbone, "model_type", None) or getattr(backbone.args, "model_type", None)
    if kind not in _FAMILIES:
        raise ValueError(
            f"model_type {kind!r} is not supported for tree decoding; supported: "
            f"{', '.join(sorted(_FAMILIES))}"
        )
    layers = backbone.layers
    if any(getattr(layer, "use_sliding", False) for layer in layers):
        raise ValueError("sliding-window attention layers are not supported for tree decoding")
    return _FAMILIES[kind]
