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


class StreamHeads(nn.Module):
    """K independent residual stream heads over the backbone's last hidden state.

    Head j maps the final (normed) hidden state h_t, shape ``(..., H)``, to a hidden
    vector whose projection through the backbone's frozen output head gives logits for
    token t+1+j (Speculative Streaming, Bhendawade et al. 2024, sec. 3.1: stream j
    predicts the (j+1)-th next token; Medusa heads, Cai et al. 2024, eq. 1).
    """

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.heads = [
            [ResidualBlock(config.hidden_size) for _ in range(config.num_layers)]
            for _ in range(config.num_heads)
        ]
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

    def __call__(self, h: mx.array) -> mx.array:
        """``h``: ``(..., H)`` -> ``(K, ..., H)``, one hidden vector per head."""
        outs = []
        for blocks in self.heads:
            x = h
            for block in blocks:
                x = block(x)
            outs.append(x)
        return mx.stack(outs)
