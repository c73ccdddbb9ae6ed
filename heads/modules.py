"""Stream-head modules."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import HeadConfig


class ResidualBlock(nn.Module):
    """``h + SiLU(W h + b)`` with W, b zero-initialised, so a fresh head is the identity
    and its first prediction is the backbone's own next-token prediction (Medusa's
    ResBlock, Cai et al. 2024, eq. 1)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.linear.weight = mx.zeros_like(self.linear.weight)
        self.linear.bias = mx.zeros_like(self.linear.bias)

    def __call__(self, h: mx.array) -> mx.array:
        return h + nn.silu(self.linear(h))


class HydraBlock(nn.Module):
    """One step of a path-conditioned head: ``s + W_2 SiLU(W_1 [s; e] + b_1) + b_2``, with
    ``W_2``, ``b_2`` zero-initialised (a fresh step is the identity on ``s``).

    ``s`` is the head state of the previous depth (the backbone's hidden state h_t at
    depth 0) and ``e`` the input embedding of the token on the draft path that this
    depth conditions on (Hydra's sequentially dependent heads, Ankner et al. 2024,
    sec. 3; the recurrence over the path follows EAGLE's feature + shifted-token input,
    Li et al. 2024).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.inp = nn.Linear(2 * hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        self.out.weight = mx.zeros_like(self.out.weight)
        self.out.bias = mx.zeros_like(self.out.bias)

    def __call__(self, s: mx.array, e: mx.array) -> mx.array:
        return s + self.out(nn.silu(self.inp(mx.concatenate([s, e.astype(s.dtype)], axis=-1))))


class Adapter(nn.Module):
    """A bottleneck adapter ``x + W_2 SiLU(W_1 x)`` (Houlsby et al. 2019), ``W_2``
    zero-initialised so a fresh adapter is the identity. Applied to the speculative
    streams only, so the frozen backbone's main stream is untouched."""

    def __init__(self, hidden_size: int, size: int):
        super().__init__()
        self.down = nn.Linear(hidden_size, size)
        self.up = nn.Linear(size, hidden_size)
        self.up.weight = mx.zeros_like(self.up.weight)
        self.up.bias = mx.zeros_like(self.up.bias)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.up(nn.silu(self.down(x)))


class StreamHeads(nn.Module):
    """K stream heads over the backbone's last hidden state, in one of two architectures.

    Head j (1..K) yields a hidden vector whose projection through the backbone's frozen
    output head gives logits for token t+1+j (Speculative Streaming, Bhendawade et al.
    2024, sec. 3.1: stream j predicts the (j+1)-th next token).

    * ``"residual"`` (Medusa-1, Cai et al. 2024, eq. 1): head j is ``num_layers``
      residual SiLU blocks applied to h_t; heads are independent of each other.
    * ``"hydra"`` (Ankner et al. 2024): head j also sees the tokens on the draft path
      before the token it predicts. State ``s_0 = h_t``; ``s_j = B_j(s_{j-1}, e(x_{t+j}))``
      (a :class:`HydraBlock`, then ``num_layers - 1`` residual blocks), where
      ``x_{t+1}`` is the backbone's own next token (the tree's root) and ``e`` the
      backbone's frozen input embedding. A draft tree is then filled depth by depth,
      each child conditioned on its own ancestors.
    * ``"eagle"`` (EAGLE, Li et al. 2024): one draft layer, a decoder layer started from
      a copy of the backbone's top layer, reading ``[f_t; e(x_{t+1})]`` and attending over
      its own KV cache of the context; drafted autoregressively
      (:class:`~mlx_stream.heads.eagle.EagleDraft`, :class:`mlx_stream.drafters.EagleDrafter`).
    * ``"msa"`` (multi-stream attention, Bhendawade et al. 2024, sec. 3.1, with the
      backbone frozen): stream j starts as ``x_t + P_j + R e(x_{t+1})`` (the hidden
      state entering layer L - N_s, a learned stream embedding, and, as in Hydra, the
      projected embedding of the root token x_{t+1}, which is known when drafting) and runs through the
      backbone's
      own top N_s layers, each preceded by a stream-only :class:`Adapter`; stream j
      attends to the main stream's keys/values at positions <= t and to streams
      1..j at t, at rotary position t + j. The main stream never attends to the
      streams, so decoding stays lossless. Then the final norm, ``num_layers``
      residual blocks per stream, and the frozen output projection. The family
      module's ``stream_hidden`` runs it (the heads hold only their own weights).
      With ``config.stream_copies`` ("trainable stream layers") the streams run
      through the heads' own trainable copies of those N_s layers, started from the
      backbone's weights, without adapters; they still attend to the main stream's
      keys/values, which the frozen originals computed.
    """

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        H, n = config.hidden_size, config.num_layers
        if config.architecture == "msa":
            self.streams = mx.zeros((config.num_heads, H))
            self.root = nn.Linear(H, H, bias=False)  # the root token's embedding into every stream
            self.root.weight = mx.zeros_like(self.root.weight)
            if config.stream_copies:
                from .eagle import build_layer

                self.layers = [build_layer(config.layer_spec) for _ in range(config.stream_layers)]
            else:
                self.adapters = [Adapter(H, config.adapter_size) for _ in range(config.stream_layers)]
        if config.architecture == "dflash":  # a published DFlash block drafter
            from .dflash import DFlashDraft

            self.dflash = DFlashDraft(H, config.layer_spec, len(config.fuse_layers), config.dflash)
            self.heads = []
        elif config.architecture == "eagle" and config.mtp:  # a checkpoint's own MTP module
            from .mtp import MTPDraft

            self.eagle = MTPDraft(H, config.layer_spec, config.mtp)
            self.heads = []
        elif config.architecture == "eagle" and config.eagle3:  # a published EAGLE-3 layer
            from .eagle3 import Eagle3Draft

            rows = config.draft_vocab_size or config.vocab_size
            self.eagle = Eagle3Draft(H, config.layer_spec, len(config.fuse_layers), rows, config.eagle3)
            self.heads = []
        elif config.architecture == "eagle":
            from .eagle import EagleDraft

            self.eagle = EagleDraft(H, config.layer_spec, fused=len(config.fuse_layers))
            self.heads = []
        elif config.architecture == "hydra":
            self.heads = [
                [HydraBlock(H)] + [ResidualBlock(H) for _ in range(n - 1)] for _ in range(config.num_heads)
            ]
        else:
            self.heads = [[ResidualBlock(H) for _ in range(n)] for _ in range(config.num_heads)]
        if config.draft_vocab_size:
            # token ids of the draft vocabulary (row i of the head logits = token draft_ids[i])
            self.draft_ids = mx.arange(config.draft_vocab_size, dtype=mx.int32)
            self.freeze(keys=["draft_ids"], recurse=False)

    def set_draft_vocab(self, ids: mx.array) -> None:
        """Set the draft vocabulary: ``(draft_vocab_size,)`` distinct token ids.

        Raises:
            ValueError: the heads were configured for the full vocabulary, or the
                shape does not match ``config.draft_vocab_size``.
        """
        if not self.config.draft_vocab_size or ids.shape != (self.config.draft_vocab_size,):
            raise ValueError(
                f"expected {self.config.draft_vocab_size} draft token ids, got shape {tuple(ids.shape)}"
            )
        self.draft_ids = ids.astype(mx.int32)
        self.freeze(keys=["draft_ids"], recurse=False)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def attends(self) -> bool:
        """Whether the heads read the top layers' inputs and the KV cache (``"msa"``)
        rather than one final hidden state."""
        return self.config.architecture == "msa"

    @property
    def autoregressive(self) -> bool:
        """Whether the heads are an EAGLE-style draft layer (``"eagle"``): drafted
        autoregressively from its own KV cache, not head by head."""
        return self.config.architecture == "eagle"

    @property
    def conditioned(self) -> bool:
        """Whether head j needs the path tokens ``x_{t+1..t+j}`` (the ``"hydra"`` heads)."""
        return self.config.architecture == "hydra"

    def step(self, j: int, s: mx.array, e: mx.array | None = None) -> mx.array:
        """Head ``j`` (1-based) on one input: for residual heads ``s`` is h_t and ``e`` is
        ignored; for hydra heads ``s`` is ``s_{j-1}`` and ``e`` the ``(..., H)`` embedding
        of ``x_{t+j}``. Returns ``(..., H)``."""
        blocks = self.heads[j - 1]
        if self.conditioned:
            if e is None:
                raise ValueError("hydra heads need the embedding of the previous path token")
            s = blocks[0](s, e)
            blocks = blocks[1:]
        for block in blocks:
            s = block(s)
        return s

    def __call__(self, h: mx.array, path: mx.array | None = None) -> mx.array:
        """All K heads along one path (teacher forcing in training; a chain in drafting).
        For ``"msa"`` heads ``h`` is ``(K, ..., H)``, the streams' final normed hidden
        states from the family's ``stream_hidden``, and head j is applied to stream j.

        Args:
            h: ``(..., H)`` final hidden states h_t.
            path: ``(..., K, H)`` embeddings of ``x_{t+1}, ..., x_{t+K}``; required for
                hydra heads, ignored by residual heads.

        Returns:
            ``(K, ..., H)``, one hidden vector per head.
        """
        outs, s = [], h
        for j in range(1, self.num_heads + 1):
            if self.attends:
                outs.append(self.step(j, h[j - 1]))
            elif self.conditioned:
                if path is None:
                    raise ValueError("hydra heads need the path tokens' embeddings (path=...)")
                s = self.step(j, s, path[..., j - 1, :])
                outs.append(s)
            else:
                outs.append(self.step(j, h))
        return mx.stack(outs)
