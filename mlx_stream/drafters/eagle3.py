"""Published EAGLE-3 drafters (Li et al. 2025): a checkpoint folder read as eagle heads.

Two layouts are read, told apart by ``config.json``:

* SafeAILab / SpecForge (``architectures: ["LlamaForCausalLMEagle3"]``): the config is
  the draft layer's own (a Llama config with ``draft_vocab_size``); weights
  ``midlayer.*`` (the decoder layer, with ``midlayer.hidden_norm``), ``fc``, ``norm``,
  ``lm_head``, ``d2t``, ``t2d``, sometimes ``embed_tokens``. Explicit aux layer ids
  (``eagle_config.eagle_aux_hidden_state_layer_ids``) name layer *outputs*, as SGLang
  captures them (its ``set_eagle3_layers_to_capture`` adds one).
* vLLM ``speculators`` (``architectures: ["Eagle3Speculator"]``): the layer's config
  under ``transformer_layer_config``, options ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output``, ``target_hidden_size``; weights
  ``layers.0.*``. Explicit ids (``eagle_aux_hidden_state_layer_ids``) index the target's
  hidden-state tuple: id k is the input of layer k, as vLLM captures them.

Either may prefix every key with ``model.``; weights are ``*.safetensors`` or
``pytorch_model*.bin``. Without explicit ids the layer reads the inputs of layers
``[2, L // 2, L - 3]`` of an L-layer target (both projects' default). The layer becomes
:class:`~mlx_stream.heads.StreamHeads` of architecture ``"eagle"`` with
``HeadConfig.eagle3`` set (:class:`~mlx_stream.heads.eagle3.Eagle3Draft`), so
:class:`~mlx_stream.drafters.eagle.EagleDrafter` and EAGLE-2's dynamic tree
(:class:`~mlx_stream.drafters.eagle.DynamicTreeDrafter`) draft with it, verified by the
same exact loop (greedy and sampled), beside prompt lookup and adaptive speculation.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

#: how deep a published EAGLE-3 layer drafts at most (EAGLE-2's depth for Llama-3 targets)
DEPTH = 6
#: the tree it drafts when none is asked for: EAGLE-2's dynamic tree, 16 nodes, 4 children a
#: node (EAGLE-2's own default, 60 nodes of 10, is sized for a GPU; not measured on Metal here)
TREE = "dynamic:16,4"
#: draft-layer types whose decoder layer mlx-lm builds here (the published ones are these)
LAYER_TYPES = ("llama", "qwen3")


def _config(path: Path) -> dict | None:
    f = path / "config.json"
    if not f.is_file():
        return None
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _layout(cfg: dict) -> str | None:
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in archs:
        return "speculators"
    if any(isinstance(a, str) and a.endswith("Eagle3") for a in archs):
        return "eagle"
    return None


def is_eagle3(path) -> bool:
    """Whether ``path`` is a published EAGLE-3 checkpoint folder (its ``config.json``
    names an EAGLE-3 architecture)."""
    path = Path(path)
    cfg = _config(path) if path.is_dir() else None
    return cfg is not None and _layout(cfg) is not None


def _key(k: str) -> str | None:
    # one naming for both layouts: the decoder layer under "layer.", its hidden_norm beside it
    k = k.removeprefix("model.")
    for old in ("midlayer.", "layers.0."):
        if k.startswith(old):
            k = "layer." + k[len(old) :]
    if k == "layer.hidden_norm.weight":
        return "hidden_norm.weight"
    if k.startswith("verifier_") or k in ("d2t", "t2d"):
        return None  # the target's own head (speculators keeps a copy), or read apart
    return k


def _aux_layers(cfg: dict, layout: str, n_layers: int, where: Path) -> list[int]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [2, n_layers // 2, n_layers - 3]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(
            f"{where}: eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {ids!r}"
        )
    return [i + 1 for i in ids] if layout == "eagle" else list(ids)


def load_eagle3(path, backbone, fingerprint: dict, depth: int = DEPTH):
    """Read a published EAGLE-3 checkpoint folder as eagle heads for ``backbone``.

    Args:
        path: the folder (``config.json`` plus ``*.safetensors`` or
            ``pytorch_model*.bin``), in either layout (module docstring).
        backbone: the target (an mlx-lm model): its width, vocabulary and layer count are
            checked against the checkpoint's.
        fingerprint: the target's :func:`~mlx_stream.heads.backbone_fingerprint` (the
            heads are recorded as this target's).
        depth: the deepest draft (``HeadConfig.num_heads``), >= 1.

    Returns:
        :class:`~mlx_stream.heads.StreamHeads` (float32 weights) whose
        ``config.eagle3`` holds the layer's options, ``fuse_layers`` the target layers
        whose inputs it reads, ``draft_ids`` the target token of each draft-vocabulary
        row (``j + d2t[j]``; the full vocabulary when the head is as wide as the
        target's and ``d2t`` is zero), ``tree`` :data:`TREE`.

    Raises:
        FileNotFoundError: no config or weights.
        ValueError: not an EAGLE-3 checkpoint; a draft layer of another type than
            :data:`LAYER_TYPES`; a checkpoint for another target (hidden size,
            vocabulary, or aux layers past its layer count; the message names both);
            missing, extra or misshapen weights; a ``d2t`` mapping outside the vocabulary.
    """
    from ..convert.hf import read_weights, weight_files
    from ..heads import HeadConfig, StreamHeads
    from ..models import family, text_args

    path = Path(path)
    cfg = _config(path)
    if cfg is None:
        raise FileNotFoundError(f"{path}: no readable config.json (an EAGLE-3 checkpoint folder has one)")
    layout = _layout(cfg)
    if layout is None:
        raise ValueError(f"{path}: config.json names no EAGLE-3 architecture ({cfg.get('architectures')})")
    layer_cfg = dict(cfg.get("transformer_layer_config") or {}) if layout == "speculators" else dict(cfg)
    kind = layer_cfg.get("model_type", "llama")
    if kind not in LAYER_TYPES:
        raise ValueError(
            f"{path}: a {kind!r} draft layer; EAGLE-3 layers read here: {', '.join(LAYER_TYPES)}"
        )
    a = text_args(backbone)
    V, Ht, L = int(a.vocab_size), family(backbone).state_size(backbone), len(backbone.layers)
    H = int(layer_cfg["hidden_size"])
    target_h = int(cfg.get("target_hidden_size") or layer_cfg.get("target_hidden_size") or H)
    if target_h != Ht:
        raise ValueError(f"{path}: drafts for a target {target_h} wide; this target is {Ht} wide")
    if int(layer_cfg.get("vocab_size", V)) != V:
        raise ValueError(
            f"{path}: drafts for a {layer_cfg['vocab_size']}-token vocabulary; this target has {V} tokens"
        )
    aux = _aux_layers(cfg, layout, L, path)
    if len(set(aux)) != len(aux) or min(aux) < 0 or max(aux) >= L:
        raise ValueError(
            f"{path}: reads the inputs of target layers {aux}; this target has {L} layers (0..{L - 1})"
            + ("; a layer past the last (the final hidden state) is not read here" if max(aux) == L else "")
        )
    weights = read_weights(weight_files(path))
    d2t = next((weights[k] for k in ("d2t", "model.d2t") if k in weights), None)
    mapped = {}
    for k, v in weights.items():
        name = _key(k)
        if name is not None:  # (StreamHeads holds the layer as .eagle)
            mapped["eagle." + name] = v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
    if "eagle.lm_head.weight" not in mapped or "eagle.fc.weight" not in mapped:
        raise ValueError(f"{path}: no fc.weight / lm_head.weight: not an EAGLE-3 draft layer's weights")
    Vd = int(mapped["eagle.lm_head.weight"].shape[0])
    if mapped["eagle.fc.weight"].shape != (H, len(aux) * Ht):
        raise ValueError(
            f"{path}: fc is {tuple(mapped['eagle.fc.weight'].shape)}, expected ({H}, {len(aux) * Ht}): "
            f"{len(aux)} target layers {Ht} wide"
        )
    ids = mx.arange(Vd, dtype=mx.int32)
    if d2t is not None:
        if d2t.shape != (Vd,):
            raise ValueError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({Vd},)")
        ids = ids + d2t.astype(mx.int32)
    if Vd > V or (Vd and (mx.min(ids).item() < 0 or mx.max(ids).item() >= V)):
        raise ValueError(f"{path}: the draft vocabulary maps outside this target's {V} tokens")
    full = Vd == V and bool(mx.all(ids == mx.arange(V)).item())
    heads_n = int(layer_cfg["num_attention_heads"])
    args = {
        k: layer_cfg[k]
        for k in (
            "num_key_value_heads",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "max_position_embeddings",
            "attention_bias",
            "mlp_bias",
            "rope_traditional",
        )
        if layer_cfg.get(k) is not None
    }
    args |= {
        "model_type": kind,
        "hidden_size": H,
        "num_hidden_layers": 1,
        "intermediate_size": int(layer_cfg["intermediate_size"]),
        "num_attention_heads": heads_n,
        "head_dim": int(layer_cfg.get("head_dim") or H // heads_n),
        "vocab_size": V,
        "tie_word_embeddings": False,
    }
    for k, v in (("rms_norm_eps", 1e-6), ("rope_theta", 10000.0), ("max_position_embeddings", 4096)):
        args.setdefault(k, v)
    args.setdefault("num_key_value_heads", heads_n)
    options = {
        "target_hidden_size": Ht,
        "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        "norm_before_fc": bool(cfg.get("norm_before_fc", False)),
        "fc_norm": bool(cfg.get("fc_norm", False)),
        "norm_output": bool(cfg.get("norm_output", False)),
        "fc_bias": "eagle.fc.bias" in mapped,
        "embed": "eagle.embed_tokens.weight" in mapped,
    }
    config = HeadConfig(
        num_heads=depth,
        hidden_size=H,
        vocab_size=V,
        architecture="eagle",
        draft_vocab_size=0 if full else Vd,
        fingerprint=dict(fingerprint),
        tree=TREE,
        layer_spec={"model_type": kind, "args": args},
        fuse_layers=aux,
        eagle3=options,
    )
    heads = StreamHeads(config)
    if not full:
        heads.set_draft_vocab(ids)
        mapped["draft_ids"] = heads.draft_ids
    try:
        heads.load_weights(list(mapped.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{path}: weights do not match an EAGLE-3 layer of this config ({e})") from e
    mx.eval(heads.parameters())
    return heads
