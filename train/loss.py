"""The multi-stream loss for stream heads over a frozen backbone."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def head_weights(num_heads: int, decay: float = 0.8) -> mx.array:
    """Per-head loss weights ``decay**(j-1)`` for j = 1..K (Medusa's lambda_k = 0.8^k,
    Cai et al. 2024, eq. 2)."""
    return mx.array([decay**j for j in range(num_heads)], dtype=mx.float32)


def stream_logits(model, heads, hidden: mx.array, rows: mx.array | None = None) -> mx.array:
    """``hidden`` ``(B, H)`` -> ``(K, B, V)`` logits of each head through the frozen
    output projection (only its ``rows``, ``(V', H)``, for a reduced draft vocabulary)."""
    hs = heads(hidden.astype(mx.float32))
    return model.family.project(model.backbone, hs) if rows is None else hs @ rows.T


def draft_vocab_lut(heads, vocab_size: int) -> mx.array | None:
    """``(V,)`` int32: each token's index in the heads' draft vocabulary, -1 outside
    it; ``None`` for full-vocabulary heads."""
    if not heads.config.draft_vocab_size:
        return None
    lut = mx.full((vocab_size,), -1, dtype=mx.int32)
    lut[heads.draft_ids] = mx.arange(heads.config.draft_vocab_size, dtype=mx.int32)
    return lut


def stream_loss(model, heads, hidden: mx.array, targets: mx.array, weights: mx.array,
                rows: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Multi-stream cross-entropy (Speculative Streaming, Bhendawade et al. 2024,
    eq. 5, with the backbone frozen so the main-stream term is constant).

    Args:
        hidden: ``(B, H)`` final hidden states h_t.
        targets: ``(B, K + 1)`` int32 tokens t+1..t+1+K; column j (j >= 1) is head j's
            label, -1 is ignored.
        weights: ``(K,)`` per-head weights.
        rows: for a reduced draft vocabulary, its output-projection rows ``(V', H)``;
            ``targets`` must then hold draft-vocabulary indices (-1 outside it).

    Returns:
        ``(loss, correct)``: the scalar weighted mean loss and ``(K, 2)`` counts of
        top-1-correct and valid positions per head.
    """
    logits = stream_logits(model, heads, hidden, rows)  # (K, B, V)
    labels = targets[:, 1:].T  # (K, B)
    valid = labels >= 0
    ce = nn.losses.cross_entropy(logits, mx.maximum(labels, 0), reduction="none")  # (K, B)
    n = mx.maximum(valid.sum(axis=1), 1)
    per_head = (ce * valid).sum(axis=1) / n
    loss = (weights * per_head).sum() / weights.sum()
    hit = (mx.argmax(logits, axis=-1) == labels) & valid
    correct = mx.stack([hit.sum(axis=1), valid.sum(axis=1)], axis=1)
    return loss, correct
