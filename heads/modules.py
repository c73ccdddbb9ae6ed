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
