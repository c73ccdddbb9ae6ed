"""Published DFlash block drafters: a checkpoint folder read as ``"dflash"`` heads, and
the drafter that fills a static tree from one block forward.

Two layouts are read, told apart by ``config.json``:

* z-lab (``architectures: ["DFlashDraftModel"]``): the config is the draft layers' own
  (a Qwen3 config: ``num_hidden_layers`` draft layers, ``block_size``) with
  ``dflash_config: {target_layer_ids, mask_token_id}``; weights ``layers.{i}.*``, ``fc``,
  ``hidden_norm``, ``norm``; the target's embedding and output head. Its
  ``target_layer_ids`` name layer *outputs* (the hidden state entering layer id + 1).
* vLLM ``speculators`` (``["DFlashSpeculator"]``): the layers' config under
  ``transformer_layer_config``; ``block_size``, ``mask_token_id``,
  ``aux_hidden_state_layer_ids`` (layer *inputs*), ``target_hidden_size``; an own
  ``lm_head`` over ``draft_vocab_size`` tokens with ``d2t`` where it has one.

The drafter (:class:`DFlashDrafter`) keeps each draft layer's context entries in step with
the verified positions (as :class:`~mlx_stream.drafters.eagle.EagleDrafter` keeps its
cache), runs one block forward per step and fills any static tree of depth up to
``block_size - 1`` from the block's per-position distributions: a chain (DFlash's own
drafting), or a tree of each position's top-k (the idea of DDTree's trees, over
independent per-depth distributions as stream heads fill theirs); drafts follow the
sampler's noise when sampling (coupled), so the verifier stays exact.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from ..tree import Tree, check_depth
from .base import Backlog, topk

LAYER_TYPES = ("qwen3",)


def _config(path: Path) -> dict | None:
    f = path / "config.json"
    if not path.is_dir() or not f.is_file():
        return None
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _layout(cfg: dict) -> str | None:
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") == "dflash" or "DFlashSpeculator" in archs:
        return "speculators"
    if "DFlashDraftModel" in archs or "dflash_config" in cfg:
        return "z-lab"
    return None


def is_dflash(path) -> bool:
    """Whether ``path`` is a published DFlash checkpoint folder."""
    cfg = _config(Path(path))
    return cfg is not None and _layout(cfg) is not None


def load_dflash(path, backbone, fingerprint: dict):
    """Read a published DFlash checkpoint folder as ``"dflash"`` heads for ``backbone``.

    Args:
        path: the folder (``config.json`` plus ``*.safetensors`` or ``pytorch_model*.bin``).
        backbone: the target (an mlx-lm model), checked against the checkpoint.
        fingerprint: the target's :func:`~mlx_stream.heads.backbone_fingerprint`.

    Returns:
        :class:`~mlx_stream.heads.StreamHeads` of architecture ``"dflash"`` (float32):
        ``num_heads`` ``block_size - 1`` (the deepest draft), ``fuse_layers`` the target
        layers whose inputs the context entries read, ``tree`` a chain of
        ``block_size - 1``.

    Raises:
        FileNotFoundError: no config or weights.
        ValueError: not a DFlash checkpoint; layers of another type than ``qwen3``; a
            checkpoint for another target (width, vocabulary, layers it reads; the message
            names both); a mask token outside the vocabulary; weights that do not match.
    """
    from ..convert.hf import read_weights, weight_files
    from ..heads import HeadConfig, StreamHeads
    from ..models import family, text_args

    path = Path(path)
    cfg = _config(path)
    if cfg is None:
        raise FileNotFoundError(f"{path}: no readable config.json (a DFlash checkpoint folder has one)")
    layout = _layout(cfg)
    if layout is None:
        raise ValueError(f"{path}: config.json names no DFlash architecture ({cfg.get('architectures')})")
    if layout == "speculators":
        layer_cfg = dict(cfg.get("transformer_layer_config") or {})
        ids = cfg.get("aux_hidden_state_layer_ids")
        mask_id, block = cfg.get("mask_token_id"), int(cfg.get("block_size", 8))
    else:
        layer_cfg, d = dict(cfg), cfg.get("dflash_config") or {}
        ids = d.get("target_layer_ids")
        ids = None if ids is None else [int(i) + 1 for i in ids]  # outputs of layer i: inputs of i + 1
        mask_id, block = d.get("mask_token_id", cfg.get("mask_token_id")), int(cfg.get("block_size", 16))
    kind = layer_cfg.get("model_type", "qwen3")
    if kind not in LAYER_TYPES:
        raise ValueError(f"{path}: {kind!r} draft layers; DFlash layers read here: {', '.join(LAYER_TYPES)}")
    a = text_args(backbone)
    V, Ht, L = int(a.vocab_size), family(backbone).state_size(backbone), len(backbone.layers)
    H = int(layer_cfg["hidden_size"])
    target_h = int(cfg.get("target_hidden_size") or H)
    if target_h != Ht:
        raise ValueError(f"{path}: drafts for a target {target_h} wide; this target is {Ht} wide")
    if int(layer_cfg.get("vocab_size", V)) != V:
        raise ValueError(
            f"{path}: drafts for a {layer_cfg['vocab_size']}-token vocabulary; this target has {V} tokens"
        )
    if not isinstance(ids, list) or not ids:
        raise ValueError(
            f"{path}: names no target layers to read (target_layer_ids / aux_hidden_state_layer_ids)"
        )
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= L:
        raise ValueError(
            f"{path}: reads the inputs of target layers {ids}; this target has {L} layers (0..{L - 1})"
            + ("; the last layer's output (the final hidden state) is not read here" if max(ids) == L else "")
        )
    if not isinstance(mask_id, int) or not 0 <= mask_id < V or block < 2:
        raise ValueError(
            f"{path}: needs a mask_token_id in 0..{V - 1} and block_size >= 2, got {mask_id}, {block}"
        )
    weights = read_weights(weight_files(path))
    d2t = next((weights[k] for k in ("d2t", "model.d2t") if k in weights), None)
    mapped = {}
    for k, v in weights.items():
        k = k.removeprefix("model.")
        if k in ("d2t", "t2d") or k.startswith(("verifier_", "embed_tokens")):
            continue  # (the target's own embedding and head; the vocabulary map is read apart)
        mapped["dflash." + k] = v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
    rows = int(mapped["dflash.lm_head.weight"].shape[0]) if "dflash.lm_head.weight" in mapped else 0
    n_layers = int(layer_cfg.get("num_hidden_layers", 1))
    heads_n = int(layer_cfg["num_attention_heads"])
    args = {
        k: layer_cfg[k]
        for k in (
            "num_key_value_heads",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "max_position_embeddings",
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
    for k, v in (("rms_norm_eps", 1e-6), ("rope_theta", 1e6), ("max_position_embeddings", 4096)):
        args.setdefault(k, v)
    args.setdefault("num_key_value_heads", heads_n)
    draft_ids = mx.arange(rows, dtype=mx.int32) + (d2t.astype(mx.int32) if d2t is not None else 0)
    if rows and (rows > V or mx.min(draft_ids).item() < 0 or mx.max(draft_ids).item() >= V):
        raise ValueError(f"{path}: the draft vocabulary maps outside this target's {V} tokens")
    config = HeadConfig(
        num_heads=block - 1,
        hidden_size=H,
        vocab_size=V,
        architecture="dflash",
        draft_vocab_size=rows if rows and rows < V else 0,
        fingerprint=dict(fingerprint),
        tree=f"chain:{block - 1}",
        layer_spec={"model_type": kind, "args": args},
        fuse_layers=list(ids),
        dflash={
            "block_size": block,
            "mask_token_id": int(mask_id),
            "target_hidden_size": Ht,
            "layers": n_layers,
            "head": rows,
        },
    )
    heads = StreamHeads(config)
    if config.draft_vocab_size:
        heads.set_draft_vocab(draft_ids)
        mapped["draft_ids"] = heads.draft_ids
    try:
        heads.load_weights(list(mapped.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{path}: weights do not match a DFlash drafter of this config ({e})") from e
    mx.eval(heads.parameters())
    return heads


class DFlashDrafter:
    """Fill a static tree from one DFlash block forward per step.

    The block's position j (1..B-1) gives the distribution of the token j after the root;
    a node at depth d with rank r drafts position d's r-th most likely token (the top-k of
    ``noise.perturb`` of it when sampling, so drafts follow the target's Gumbel-max draws;
    :class:`~mlx_stream.sampling.GumbelNoise`). The context entries of every verified
    position are appended once (the loop hands over the accepted path's features: fused,
    ``(P, (1 + n) H_t)``); a call whose positions do not follow the last one's starts over.

    Args:
        model: a model whose heads are ``"dflash"``.
        tree: any static tree no deeper than ``block_size - 1``.

    Raises:
        ValueError: heads that are not DFlash, or a tree too deep.
    """

    capture = None
    reads_path = True
    coupled = True

    def __init__(self, model, tree: Tree):
        from mlx_lm.models.cache import KVCache

        if model.heads is None or model.heads.config.architecture != "dflash":
            raise ValueError("DFlashDrafter needs DFlash heads (a published DFlash checkpoint)")
        check_depth(tree, model.heads.num_heads)
        self.model, self.tree = model, tree
        self.fuse_layers = tuple(model.heads.config.fuse_layers)
        opts = model.heads.config.dflash
        self._block = [int(opts["mask_token_id"])] * (int(opts["block_size"]) - 1)
        self._ids = model.heads.draft_ids if model.heads.config.draft_vocab_size else None
        self._k = max(tree.topk(), default=0)
        self._head_idx = mx.array(tree.depths[1:] - 1, dtype=mx.int32)
        self._rank_idx = mx.array(tree.ranks[1:], dtype=mx.int32)
        self._new_cache = lambda: [KVCache() for _ in model.heads.dflash.layers]
        self.caches = self._new_cache()
        self._next = None  # the position the next verified entry is for
        self._backlog = Backlog()  # positions of steps drafted without the block

    def draft(
        self, hidden, tokens: Sequence[int], mid=None, cache=None, max_depth: int | None = None, noise=None
    ):
        """``hidden``: ``(P, (1 + n) H_t)`` the target's features of the P positions verified
        since the last call (the prompt's at the first), the root's parent last; ``tokens``
        every token so far, the root last. ``max_depth=0`` only records them (they enter
        the context with the next drafted step's, in one call:
        :class:`~mlx_stream.drafters.base.Backlog`).

        Returns:
            ``(N - 1,)`` int32 drafts in node order of :attr:`tree` truncated to ``max_depth``.

        Raises:
            ValueError: ``hidden`` is not as wide as the target's fused features."""
        d = self.model.heads.dflash
        hidden = hidden.reshape(-1, hidden.shape[-1])
        width = (1 + len(self.fuse_layers)) * d.target_width
        if hidden.shape[-1] != width:
            raise ValueError(
                f"this DFlash drafter reads {width}-wide features (the final hidden state and the inputs "
                f"of layers {list(self.fuse_layers)}), got {hidden.shape[-1]}"
            )
        r = len(tokens) - 1
        depth = self.tree.depth if max_depth is None else min(max_depth, self.tree.depth)
        if depth < 1:  # a step drafted without the block: its positions wait for the next drafted one
            self._backlog.add(hidden, r)
            return mx.zeros((0,), dtype=mx.int32)
        hidden = self._backlog.take(hidden, r)
        P = hidden.shape[0]
        if self._next != r - P:  # first call, or a gap: start over from these positions
            self.caches = self._new_cache()
        d.commit(d.context(hidden), r - P, self.caches)
        self._next = r
        root = tokens[-1]
        toks = root.reshape(1).astype(mx.int32) if isinstance(root, mx.array) else mx.array([root], mx.int32)
        e = self.model.embed(mx.concatenate([toks, mx.array(self._block, dtype=mx.int32)]))
        out = d.block(e, r, self.caches)[1 : depth + 1]  # (depth, H): positions r + 1 .. r + depth
        logits = self._logits(out)
        if noise is not None:
            logits = mx.stack([noise.perturb(logits[j - 1], j, self._ids) for j in range(1, depth + 1)])
        n = sum(1 for x in self.tree.depths[1:] if x <= depth)
        top = topk(logits, self._k)[self._head_idx[:n], self._rank_idx[:n]]
        return (top if self._ids is None else self._ids[top]).astype(mx.int32)

    def _logits(self, out: mx.array) -> mx.array:
        # (depth, V) over the target's vocabulary, or (depth, V') over the checkpoint's own
        d = self.model.heads.dflash
        return d.lm_head(out) if "lm_head" in d else self.model.project(out)
