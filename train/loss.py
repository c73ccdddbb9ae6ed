"""The multi-stream loss for stream heads over a frozen backbone."""

from __future__ import annotations

import contextlib

import mlx.core as mx


def head_weights(num_heads: int, decay: float = 0.8) -> mx.array:
    """Per-head loss weights ``decay**(j-1)`` for j = 1..K (Medusa's lambda_k = 0.8^k,
    Cai et al. 2024, eq. 2)."""
    return mx.array([decay**j for j in range(num_heads)], dtype=mx.float32)


def stream_logits(
    model, heads, hidden: mx.array, rows: mx.array | None = None, path: mx.array | None = None
) -> mx.array:
    """``hidden`` ``(B, H)`` -> ``(K, B, V)`` logits of each head through the frozen
    output projection (only its ``rows``, ``(V', H)``, for a reduced draft vocabulary).
    ``path``: int ``(B, K)`` tokens ``x_{t+1..t+K}`` (teacher forcing for hydra heads;
    -1 past the end is embedded as token 0, its label is ignored anyway)."""
    emb = model.embed(mx.maximum(path, 0)) if heads.conditioned and path is not None else None
    if heads.conditioned and emb is None:
        raise ValueError("hydra heads need the path tokens (targets) to compute their logits")
    return model.project(heads(hidden.astype(mx.float32), emb), rows)


def draft_vocab_lut(heads, vocab_size: int) -> mx.array | None:
    """``(V,)`` int32: each token's index in the heads' draft vocabulary, -1 outside
    it; ``None`` for full-vocabulary heads."""
    if not heads.config.draft_vocab_size:
        return None
    lut = mx.full((vocab_size,), -1, dtype=mx.int32)
    lut[heads.draft_ids] = mx.arange(heads.config.draft_vocab_size, dtype=mx.int32)
    return lut


def stream_loss(
    model,
    heads,
    hidden: mx.array,
    targets: mx.array,
    weights: mx.array,
    rows: mx.array | None = None,
    path: mx.array | None = None,
    teacher: mx.array | None = None,
    kl_weight: float = 0.0,
    soft: tuple[mx.array, mx.array] | None = None,
    streams: list | None = None,
    counts: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Multi-stream cross-entropy (Speculative Streaming, Bhendawade et al. 2024,
    eq. 5, with the backbone frozen so the main-stream term is constant), optionally
    plus ``kl_weight`` times KL(p || q_j) from the backbone's own next-token
    distribution p at position t+j (the soft target for x_{t+1+j}; Medusa-2's
    self-distillation loss, Cai et al. 2024, sec. 2.3.2) to head j's distribution q_j.

    Args:
        hidden: ``(B, H)`` final hidden states h_t.
        targets: ``(B, K + 1)`` int32 tokens t+1..t+1+K; column j (j >= 1) is head j's
            label, -1 is ignored.
        path: int ``(B, K)`` true tokens ``x_{t+1..t+K}`` for hydra heads (teacher
            forcing); ``targets[:, :K]`` with full-vocabulary ids.
        weights: ``(K,)`` per-head weights.
        rows: for a reduced draft vocabulary, its output-projection rows ``(V', H)``;
            ``targets`` must then hold draft-vocabulary indices (-1 outside it).
        teacher: ``(B, K, H)`` the backbone's final hidden states at t+1..t+K (free
            from the feature cache: a sequence's positions are contiguous), needed
            when ``kl_weight > 0``; over a reduced vocabulary both distributions are
            renormalised on it.
        kl_weight: weight of the KL term (0: hard labels only).
        soft: the stored soft targets instead of ``teacher``: ``(logprobs, ids)``, both
            ``(B, K, k)``, the backbone's top-k log-probabilities at t+1..t+K and their
            token ids (draft-vocabulary indices for a reduced vocabulary, -1 outside
            it); p is renormalised over the ids present, so the KL is over the top-k
            support (EAGLE's and Medusa-2's distillation of the target distribution,
            truncated to its head as in top-k knowledge distillation).
        streams: MLX streams to spread the heads over (contiguous groups of heads,
            one per stream; None: the default stream). On a CPU each stream runs on
            its own thread, and the projection's softmax, which MLX computes on one
            thread, dominates a step, so two streams on two cores train ~1.5x
            faster (``benchmarks/train_step.py``).
        counts: ``(K,)`` the number of valid labels per head in the whole batch that
            this slice belongs to (data-parallel ranks each hold a slice; the slices'
            losses and gradients then sum to the whole batch's); None: this batch's.

    Returns:
        ``(loss, correct)``: the scalar weighted mean loss and ``(K, 2)`` counts of
        top-1-correct and valid positions per head.
    """
    K = heads.num_heads
    emb = model.embed(mx.maximum(path, 0)) if heads.conditioned else None
    if heads.conditioned and path is None:
        raise ValueError("hydra heads need the path tokens (targets) to compute their logits")
    hs = heads(hidden.astype(mx.float32), emb)  # (K, B, H)
    labels = targets[:, 1 : K + 1].T  # (K, B)
    valid = labels >= 0
    n = mx.maximum(valid.sum(axis=1) if counts is None else counts, 1)
    streams = list(streams or [None])
    per_head, hits = [], []
    for g, s in enumerate(streams):  # contiguous groups of heads, one per stream
        sl = slice(g * K // len(streams), (g + 1) * K // len(streams))
        if sl.start == sl.stop:
            continue
        with mx.stream(s) if s is not None else contextlib.nullcontext():
            logits = model.project(hs[sl], rows)  # (k, B, V)
            logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            lab, ok = labels[sl], valid[sl]
            ce = -mx.take_along_axis(logq, mx.maximum(lab, 0)[..., None], axis=-1)[..., 0]  # (k, B)
            if kl_weight > 0 and soft is not None:
                lp, ids = (a[:, sl].transpose(1, 0, 2) for a in soft)  # (k, B, top-k)
                present = ids >= 0
                logp = mx.where(present, lp.astype(mx.float32), -mx.inf)
                logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
                lq = mx.take_along_axis(logq, mx.maximum(ids, 0), axis=-1)
                kl = mx.where(present, mx.exp(logp) * (logp - lq), 0.0).sum(axis=-1)
                ce = ce + kl_weight * mx.where(present.any(axis=-1), kl, 0.0)
            elif kl_weight > 0:
                p_logits = model.project(teacher[:, sl].astype(mx.float32).transpose(1, 0, 2), rows)
                logp = p_logits - mx.logsumexp(p_logits, axis=-1, keepdims=True)
                ce = ce + kl_weight * (mx.exp(logp) * (logp - logq)).sum(axis=-1)
            per_head.append((ce * ok).sum(axis=1) / n[sl])
            hits.append(((mx.argmax(logits, axis=-1) == lab) & ok).sum(axis=1))
    loss = (weights * mx.concatenate(per_head)).sum() / weights.sum()
    correct = mx.stack([mx.concatenate(hits), valid.sum(axis=1)], axis=1)
    return loss, correct
