"""A multi-token-prediction (MTP) module shipped inside a checkpoint, as DeepSeek-V3
(DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sec. 2.2, eq. 21-23) and GLM-4.5 define
it and vLLM / SGLang run it for speculative decoding.

The entry at position i reads the target's final hidden state h_i (the input of its output
projection) and the embedding of the next token x_{i+1}:

    z_i = eh_proj([enorm(e(x_{i+1})); hnorm(h_i)])          (eq. 21, embedding first)
    h'_i = block(z_i)                                          (eq. 22: one decoder layer of
                                                                the target's own architecture)
    logits of x_{i+2} = head(shared_head.norm(h'_i))           (eq. 23: the target's head)

``block`` is built from the target's own mlx-lm decoder-layer class at the layer index the
checkpoint stores it under (``num_hidden_layers``: a MoE layer where the target's later
layers are), so multi-head latent attention, mixture-of-experts routing and partial rotary
embeddings are the target's code, not ours. It attends causally over its own KV cache of
entries; drafting deeper feeds h'_i back as the next entry's h (vLLM's and SGLang's chained
MTP), each tree node positioned through :class:`~mlx_stream.models.generic.NodeRoPE` and
masked by the tree's mask, as the target's own tree forward is. The embedding and output
head are the target's (the report: "shared"; the checkpoint's copies are not read).
"""

from __future__ import annotations

import importlib
import inspect

import mlx.core as mx
import mlx.nn as nn

#: the options of an MTP module (HeadConfig.mtp)
MTP_OPTIONS = ("layer_class", "layer_index", "quantization", "args_class")


def build_block(spec: dict, options: dict) -> nn.Module:
    """The MTP module's decoder layer: ``options["layer_class"]`` of mlx-lm's
    ``mlx_lm.models.<spec["model_type"]>`` built from ``spec["args"]`` (the target's
    ``ModelArgs`` fields, or those of ``options["args_class"]``) at layer index
    ``options["layer_index"]``.

    Raises:
        ValueError: the module has no such class, or its constructor does not take
            ``(args, layer_idx)``.
    """
    mod = importlib.import_module(f"mlx_lm.models.{spec['model_type']}")
    cls = getattr(mod, str(options["layer_class"]), None)
    if cls is None or len(inspect.signature(cls.__init__).parameters) != 3:
        raise ValueError(
            f"mlx_lm.models.{spec['model_type']} has no decoder layer {options['layer_class']!r} "
            "built from (args, layer_idx)"
        )
    # (a wrapper's text model has its own arguments class: qwen3_5's TextModelArgs)
    args = getattr(mod, str(options.get("args_class", "ModelArgs"))).from_dict(spec["args"])
    return cls(args, int(options["layer_index"]))


class MTPDraft(nn.Module):
    """The weights and forward of one MTP module (module docstring).

    Args:
        hidden_size: the target's width H.
        spec: ``{"model_type", "args"}``: the target's mlx-lm module and ``ModelArgs`` fields.
        options: ``layer_class`` (the decoder layer's class name in that module),
            ``layer_index`` (where the checkpoint stores the module) and optionally
            ``quantization`` (``{"group_size", "bits", "mode"}``: the block quantized as the
            target is).

    Raises:
        ValueError: unknown options, or as :func:`build_block`.
    """

    def __init__(self, hidden_size: int, spec: dict, options: dict):
        super().__init__()
        unknown = set(options) - set(MTP_OPTIONS)
        if unknown:
            raise ValueError(f"unknown MTP options {sorted(unknown)}; known: {list(MTP_OPTIONS)}")
        H, eps = hidden_size, float(spec["args"].get("rms_norm_eps", 1e-6))
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = build_block(spec, options)
        self.head_norm = nn.RMSNorm(H, eps=eps)  # the checkpoint's shared_head.norm
        if options.get("quantization"):
            self.quantize(options["quantization"])

    def quantize(self, q: dict) -> None:
        """Quantize the decoder layer in place: ``q`` is ``{"group_size", "bits", "mode"}``
        (the target's); layers whose input width the group size does not divide stay float,
        as mlx-lm's own quantization leaves them."""
        g = int(q["group_size"])
        nn.quantize(
            self.layer,
            group_size=g,
            bits=int(q["bits"]),
            mode=str(q["mode"]),
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % g == 0,
        )

    def _entries(self, f: mx.array, e: mx.array) -> mx.array:
        dt = self.eh_proj.weight.dtype
        return self.eh_proj(mx.concatenate([self.enorm(e.astype(dt)), self.hnorm(f.astype(dt))], axis=-1))

    def __call__(self, f: mx.array, e: mx.array, positions: mx.array, mask, cache) -> mx.array:
        """Entries of N tree nodes or sequence positions.

        Args:
            f: ``(N, H)`` the target's final hidden states h_i, or the module's own
                outputs h'_i (drafting on).
            e: ``(N, H)`` the target's input embeddings of x_{i+1}.
            positions: int32 ``(N,)`` rotary positions i.
            mask: ``None`` (one entry at the cache's end) or bool ``(N, S)`` over the
                cache's entries plus these N.
            cache: an mlx-lm ``KVCache`` (MLA's latent entries included); the N entries
                are appended to it.

        Returns:
            ``(N, H)`` h'_i in the block's dtype: what the next entry reads and
            :meth:`head_input` prepares for the target's output head.
        """
        from mlx_stream.models.generic import node_positions

        with node_positions(self.layer, positions):
            return self.layer(self._entries(f, e)[None], mask, cache)[0]

    def sequence(self, f: mx.array, e: mx.array, mask: mx.array | None = None) -> mx.array:
        """Teacher-forced entries over whole sequences (training; a causal prefill).

        Args:
            f: ``(B, L, H)`` the target's final hidden states; e: ``(B, L, H)`` the
                embeddings of the next tokens.
            mask: bool ``(L, L)``; ``None``: causal.

        Returns:
            ``(B, L, H)`` outputs, as :meth:`__call__` gives them entry by entry.
        """
        L = f.shape[1]
        if mask is None:  # (a bool array: MLA attention masks its scores with mx.where)
            mask = mx.tril(mx.ones((L, L), dtype=mx.bool_))
        return self.layer(self._entries(f, e), mask, None)

    def head_input(self, h: mx.array) -> mx.array:
        """``shared_head.norm(h)``: what the target's output head scores, ``(..., H)``."""
        return self.head_norm(h)
