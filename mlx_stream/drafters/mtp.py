"""The multi-token-prediction (MTP) modules a checkpoint ships beside its layers, drafting
for their own model: ``--heads mtp`` / ``load(model, heads="mtp")``.

DeepSeek-V3 / V3.2 and GLM-4.5 / 4.7 store ``num_nextn_predict_layers`` modules after their
``num_hidden_layers`` decoder layers, under ``model.layers.{L + k}.*``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` (and copies of the embedding and output head), plus one full
decoder layer of the target's architecture (:mod:`mlx_stream.heads.mtp`). mlx-lm's ``sanitize``
drops them when it loads the model, so they are read here from the checkpoint's own files and
run through the same ``sanitize`` (FP8 dequantisation, expert stacking, MLA's ``kv_b_proj``
split) under the index of the target's last layer. The first module drafts at every depth,
feeding its own output back (vLLM's and SGLang's chained MTP), as :class:`EagleDrafter` does
for any EAGLE-style layer, verified by the same exact loop (greedy and sampled).

Qwen3-Next stores its module as ``mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}``
(the same definition, zero-centred norms that scale by 1 + w) with a full-attention decoder
layer under ``mtp.layers.0.``, built here as the target's last full-attention layer and drafting
over the recurrent hybrid through its rows (:class:`~mlx_stream.cache.RecurrentCache`); so does
Qwen3.5's (``qwen3_5``, the vision-language wrapper of the same text model, whose sanitize leaves
the module's norms unshifted: they are shifted here). MiMo's ``model.mtp_layers`` are not read.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

#: the ``heads`` value that names a checkpoint's own MTP modules
MTP_HEADS = "mtp"
#: how deep the module drafts at most
DEPTH = 3
#: the tree it drafts when none is asked for: a chain of 3 (SGLang's recommended DeepSeek-V3
#: MTP settings: 3 steps, top-1, 4 draft tokens; not measured on Metal here)
TREE = "0;0,0;0,0,0"
#: the MTP weights that are not the decoder layer's, and their names in MTPDraft
_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "head_norm.weight",
}
#: Qwen3-Next's names for the same weights (under ``mtp.``; the decoder layer under ``mtp.layers.0.``)
_QWEN_OWN = {
    "pre_fc_norm_embedding.weight": "enorm.weight",
    "pre_fc_norm_hidden.weight": "hnorm.weight",
    "fc.weight": "eh_proj.weight",
    "norm.weight": "head_norm.weight",
}
#: the decoder layer's zero-centred norms in Qwen3-Next's layout
_QWEN_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
#: the config fields that count a checkpoint's MTP modules (DeepSeek / GLM, Qwen3-Next)
_COUNTS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
#: the checkpoint's copies of the target's embedding and head (the target's are used)
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def _mtp_weights(path: Path, prefix: str) -> dict[str, mx.array]:
    # the checkpoint's tensors under ``prefix``, opening only the files that hold them
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wmap = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for k, f in wmap.items() if k.startswith(prefix)})
    else:
        files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        out |= {k: v for k, v in mx.load(str(f)).items() if k.startswith(prefix)}
    return out


def _quantization(backbone) -> dict | None:
    # how the target's decoder layers are quantized, if they are
    for _, m in backbone.layers[-1].named_modules():
        if isinstance(m, nn.QuantizedLinear):
            return {"group_size": int(m.group_size), "bits": int(m.bits), "mode": str(m.mode)}
    return None


def _float_dtype(backbone):
    for _, v in nn.utils.tree_flatten(backbone.layers[-1].parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32


def load_mtp(path, backbone, fingerprint: dict, depth: int = DEPTH):
    """Read the first MTP module of the checkpoint at ``path`` as eagle heads for ``backbone``.

    Args:
        path: the target's own checkpoint folder (``config.json`` with
            ``num_nextn_predict_layers`` >= 1 and its ``*.safetensors``, as published:
            a folder written by ``mlx_lm.convert`` no longer holds the modules).
        backbone: the target loaded from that folder (an mlx-lm model).
        fingerprint: the target's :func:`~mlx_stream.heads.backbone_fingerprint`.
        depth: the deepest draft (``HeadConfig.num_heads``), >= 1.

    Returns:
        :class:`~mlx_stream.heads.StreamHeads` of architecture ``"eagle"`` whose
        ``config.mtp`` names the decoder-layer class and index, ``layer_spec`` the target's
        mlx-lm module and arguments, ``tree`` :data:`TREE`; weights in the target's float
        dtype, the decoder layer quantized as the target's are.

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        ValueError: a config without MTP modules or for another model (layer count or
            width), a target whose decoder-layer class is not built from
            ``(args, layer_idx)``, no weights under ``model.layers.{L}.`` (the message
            says where to find them), or weights that do not fit the module.
    """
    from ..heads import HeadConfig, StreamHeads
    from ..models import family, text_args

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{path}: no config.json: --heads mtp reads the target's own checkpoint folder"
        )
    cfg = json.loads(cfg_file.read_text())
    if not any(k in cfg for k in _COUNTS):
        cfg = cfg.get("text_config", cfg)
    count = next((k for k in _COUNTS if cfg.get(k)), None)
    n_mtp, L = int(cfg.get(count) or 0) if count else 0, len(backbone.layers)
    if n_mtp < 1:
        raise ValueError(
            f"{path}: this checkpoint has no multi-token-prediction modules (num_nextn_predict_layers / "
            "mtp_num_hidden_layers is 0 or missing); --heads mtp needs a DeepSeek-V3, GLM-4.5 or Qwen3-Next "
            "style one"
        )
    if int(cfg.get("num_hidden_layers", L)) != L:
        raise ValueError(f"{path}: a config of {cfg['num_hidden_layers']} layers; the loaded target has {L}")
    # DeepSeek / GLM: the module after the L layers, built as layer L; Qwen3-Next: ``mtp.*``, a
    # full-attention layer (built at the index of the target's last full-attention layer)
    qwen = count == "mtp_num_hidden_layers"
    at = L
    if qwen:
        at = next((i for i in reversed(range(L)) if hasattr(backbone.layers[i], "self_attn")), None)
        if at is None:
            raise ValueError(f"{path}: no full-attention layer in this target to build its MTP layer as")
    block = backbone.layers[-1 if not qwen else at]
    module = type(block).__module__
    if (
        not module.startswith("mlx_lm.models.")
        or len(inspect.signature(type(block).__init__).parameters) != 3
    ):
        raise ValueError(
            f"{module}.{type(block).__name__}: the decoder layer is not built from (args, layer_idx); MTP "
            "modules are read for DeepSeek-V3 / GLM-4.5 style models"
        )
    H = family(backbone).state_size(backbone)
    if int(cfg.get("hidden_size", H)) != H:
        raise ValueError(f"{path}: MTP modules {cfg['hidden_size']} wide; this target is {H} wide")
    prefix, names, inner = ("mtp.", _QWEN_OWN, "layers.0.") if qwen else (f"model.layers.{L}.", _OWN, "")
    raw = _mtp_weights(path, prefix)
    if not raw:
        raise ValueError(
            f"{path}: no MTP weights ({prefix}*) in this folder: mlx-lm's convert drops them, so use the "
            "model's original Hugging Face checkpoint folder"
        )
    own, rest = {}, {}
    slot = at if qwen else L - 1  # the target layer whose name the block takes for its sanitize
    for k, v in raw.items():
        name = k[len(prefix) :]
        if name in names:
            # (Qwen3-Next's norms scale by 1 + w, as its sanitize makes of the target's)
            own["eagle." + names[name]] = v + 1.0 if qwen and name != "fc.weight" else v
        elif name.startswith(inner) and name not in _SHARED:
            rest[f"model.layers.{slot}.{name[len(inner) :]}"] = v
    if set(own) != {"eagle." + n for n in names.values()}:
        missing = sorted(k for k, n in names.items() if "eagle." + n not in own)
        raise ValueError(f"{path}: the MTP module lacks {', '.join(prefix + m for m in missing)}")
    raw_block = dict(rest)
    if hasattr(backbone, "sanitize"):
        rest = backbone.sanitize(rest)
    at_key = f"layers.{slot}."  # (a wrapper's sanitize may prefix it: qwen3_5's language_model.model.)
    block_w = {k[k.index(at_key) + len(at_key) :]: v for k, v in rest.items() if at_key in k}
    if qwen:  # zero-centred norms that the target's sanitize left as stored (qwen3_5 shifts them only
        # beside its convolution weights, which the module has none of): 1 + w, as the model applies them
        for k, v in block_w.items():
            stored = raw_block.get(f"model.layers.{slot}.{k}")
            if (
                k.endswith(_QWEN_NORMS)
                and stored is not None
                and v.ndim == 1
                and mx.array_equal(v, stored).item()
            ):
                block_w[k] = v + 1.0
    own |= {"eagle.layer." + k: v for k, v in block_w.items()}
    dt = _float_dtype(backbone)
    own = {k: v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in own.items()}
    args = {k: v for k, v in asdict(text_args(backbone)).items() if not callable(v)}
    spec = {"model_type": module.removeprefix("mlx_lm.models."), "args": args}
    try:
        json.dumps(spec)
    except TypeError as e:
        raise ValueError(f"{module}: its ModelArgs do not serialise to JSON ({e})") from e
    config = HeadConfig(
        num_heads=depth,
        hidden_size=H,
        vocab_size=int(text_args(backbone).vocab_size),
        architecture="eagle",
        fingerprint=dict(fingerprint),
        tree=TREE,
        layer_spec=spec,
        mtp={"layer_class": type(block).__name__, "layer_index": at}
        | (
            {}
            if type(text_args(backbone)).__name__ == "ModelArgs"
            else {"args_class": type(text_args(backbone)).__name__}
        ),
    )
    heads = StreamHeads(config)
    try:
        heads.load_weights(list(own.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{path}: the MTP weights do not fit a {type(block).__name__} ({e})") from e
    q = _quantization(backbone)
    if q:  # as the target's layers (a saved copy rebuilds it quantized: HeadConfig.mtp)
        heads.eagle.quantize(q)
        heads.config.mtp["quantization"] = q
    mx.eval(heads.parameters())
    return heads
