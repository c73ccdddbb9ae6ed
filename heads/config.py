"""Stream-head configuration (saved as the heads folder's ``config.json``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

ARCHITECTURES = ("residual", "hydra", "msa", "eagle", "dflash")


@dataclass
class HeadConfig:
    """Configuration of K stream heads.

    Attributes:
        num_heads: K; head j (1..K) predicts token t+1+j from the hidden state at t.
        hidden_size: the backbone's hidden size H.
        vocab_size: the backbone's vocabulary size V (logits come from the
            backbone's frozen output projection).
        architecture: the head architecture (one of :data:`ARCHITECTURES`).
        num_layers: blocks per head (for "hydra", the first is the path-conditioned
            block and the rest are residual blocks; for "msa", the residual blocks
            after the streams leave the backbone's top layers).
        draft_vocab_size: 0 for the full vocabulary, else the heads score only this
            many tokens (the most frequent in the training data; ids stored with the
            weights): a reduced draft vocabulary, far cheaper to train and to draft.
        fingerprint: the backbone these heads were trained for (see
            :func:`mlx_stream.heads.backbone_fingerprint`).
        stream_layers: "msa" only: N_s, the backbone's top layers the streams run
            through (their inputs are the hidden state entering layer L - N_s).
        adapter_size: "msa" only: the bottleneck width of the stream-only adapter
            applied before each of those layers (unused with ``stream_copies``).
        stream_copies: "msa" only: the streams run through trainable copies of the
            top N_s layers (initialised from the backbone's; ``layer_spec`` rebuilds
            them) instead of the frozen originals with adapters. The main stream still
            runs the frozen originals, so the verified tokens stay the backbone's.
        tree: the draft tree these heads decode with when none is asked for, as rank
            paths (``"0;1;0,0"``, see :func:`mlx_stream.tree.parse_tree`); empty means
            the default sparse tree.
        sampled_tree: the draft tree when sampling (temperature > 0) and none is asked
            for; empty means ``tree``. Sampled drafts are accepted less often than greedy
            ones, and where a drafting step costs little more than a plain one, more
            siblings per depth pay there first.
        tree_taus: candidate trees and the tau each implies on held-out data
            (``{"0;1;0,0": 1.69, ...}``, written by training); ``tree="auto"`` picks the
            one with the best tau / cost on the device at hand
            (:func:`mlx_stream.speculation.auto_tree`).
        layer_spec: "eagle" (and "msa" with ``stream_copies``): what rebuilds the draft
            layer (the stream layers), a decoder layer like the backbone's
            (``{"model_type", "args"}``, :func:`mlx_stream.heads.eagle.layer_spec`);
            ``num_heads`` is then the deepest draft.
        fuse_layers: "eagle" only: the backbone layers whose input hidden states are
            fused with the final hidden state into the draft layer's feature (EAGLE-3's
            low and middle features, Li et al. 2025); empty: the final hidden state alone.
        trained_positions: training positions the heads have seen, summed over every
            run that trained them (an epoch counts each position once more);
            continued training (``mlx-stream train --init-heads``) adds to it.
        eagle3: "eagle" only: empty for our own draft layer; else the heads are a published
            EAGLE-3 layer (:class:`~mlx_stream.heads.eagle3.Eagle3Draft`, read by
            :func:`mlx_stream.drafters.eagle3.load_eagle3`) with these options
            (:data:`~mlx_stream.heads.eagle3.EAGLE3_OPTIONS`); ``draft_vocab_size`` is
            then its output head's rows (0: the full vocabulary) and ``fuse_layers`` the
            target layers whose inputs it reads.
        dflash: "dflash" only (a published DFlash block drafter,
            :class:`~mlx_stream.heads.dflash.DFlashDraft`, read by
            :func:`mlx_stream.drafters.dflash.load_dflash`): its options
            (:data:`~mlx_stream.heads.dflash.DFLASH_OPTIONS`); ``num_heads`` is then
            ``block_size - 1`` and ``fuse_layers`` the target layers whose inputs its context
            entries read.
        mtp: "eagle" only: empty, or the heads are a multi-token-prediction module read
            from the target's own checkpoint (:class:`~mlx_stream.heads.mtp.MTPDraft`, by
            :func:`mlx_stream.drafters.mtp.load_mtp`) with these options
            (:data:`~mlx_stream.heads.mtp.MTP_OPTIONS`); ``layer_spec`` is then the target's
            mlx-lm module and ``ModelArgs``.
    """

    num_heads: int
    hidden_size: int
    vocab_size: int
    architecture: str = "residual"
    num_layers: int = 1
    draft_vocab_size: int = 0
    fingerprint: dict = field(default_factory=dict)
    tree: str = ""
    stream_layers: int = 2
    adapter_size: int = 128
    tree_taus: dict = field(default_factory=dict)
    trained_positions: int = 0
    layer_spec: dict = field(default_factory=dict)
    stream_copies: bool = False
    fuse_layers: list = field(default_factory=list)
    sampled_tree: str = ""
    eagle3: dict = field(default_factory=dict)
    dflash: dict = field(default_factory=dict)
    mtp: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.architecture == "msa" and (self.stream_layers < 1 or self.adapter_size < 1):
            raise ValueError(
                "msa heads need stream_layers >= 1 and adapter_size >= 1, "
                f"got {self.stream_layers}, {self.adapter_size}"
            )
        if self.architecture == "eagle" and not self.layer_spec:
            raise ValueError("eagle heads need layer_spec (the draft layer's model_type and args)")
        if self.eagle3 and (self.architecture != "eagle" or not self.fuse_layers):
            raise ValueError("eagle3 applies to eagle heads that fuse target layers (fuse_layers)")
        if self.mtp and (self.architecture != "eagle" or self.eagle3 or self.fuse_layers):
            raise ValueError("mtp applies to eagle heads that read the final hidden state alone")
        if self.architecture == "dflash" and not (self.dflash and self.fuse_layers and self.layer_spec):
            raise ValueError(
                "dflash heads need dflash options, fuse_layers and layer_spec (a published DFlash)"
            )
        if self.fuse_layers and self.architecture not in ("eagle", "dflash"):
            raise ValueError("fuse_layers applies to eagle (and dflash) heads only")
        if self.stream_copies and (self.architecture != "msa" or not self.layer_spec):
            raise ValueError(
                "stream_copies applies to msa heads and needs layer_spec "
                "(the copied layers' model_type and args)"
            )
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 0..{self.vocab_size}, got {self.draft_vocab_size}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unknown head architecture {self.architecture!r}; known: {', '.join(ARCHITECTURES)}"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_file(cls, path: Path) -> HeadConfig:
        """Read ``config.json``.

        Raises:
            FileNotFoundError: the file is missing.
            ValueError: the file is not valid JSON or lacks a required field.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: heads config not found (expected config.json in the heads folder)"
            )
        try:
            raw = json.loads(path.read_text())
            return cls(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path}: not a valid heads config.json ({e})") from e
