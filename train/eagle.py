"""Training the EAGLE-style draft layer ("eagle" heads) on whole sequences.

The draft layer (:class:`mlx_stream.heads.eagle.EagleDraft`) attends over the entries
of its context, so it trains on batches of whole sequences (256 padded tokens each):
the frozen backbone's final features f_i of every position (one teacher-forced prefill per sequence,
:func:`sequence_features`) and the tokens.

Losses (EAGLE, Li et al. 2024, sec. 4.2; EAGLE-3, Li et al. 2025, sec. 3.2): at each
entry i the predicted feature f^_{i+1} is scored by cross-entropy of its logits
against the token x_{i+2} (on the reduced draft vocabulary) plus ``reg_weight`` x the
smooth-L1 distance to the backbone's own f_{i+1}. **Training-time test**: drafting
feeds the layer its own predictions, so the loss is also taken on ``steps - 1``
unrolled passes: at unroll step k the entry at i reads ``[f^ from step k-1 at i-1;
e(x_{i+1})]`` and attends to the real entries up to i-k+1 and to its own chain's
entries of steps 2..k (the diagonal mask of EAGLE-3), exactly what the entry of a
depth-k draft node sees at decode time. Step k is weighted ``step_decay**(k-1)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .config import TrainConfig
from .features import sequence_ids, teacher_forced
from .loss import draft_vocab_lut
from .trainer import _draft_rows, _schedule


@dataclass
class EagleSequence:
    """One training sequence: ``ids`` (L,) int32, ``start`` (first completion token),
    ``feats`` ``(L - 1, H)`` float16 final hidden states of positions 0..L-2 (fused
    features: ``(L - 1, (1 + n) H)``, :func:`sequence_features`)."""

    ids: np.ndarray
    start: int
    feats: np.ndarray


def sequence_features(
    model, tokenizer, rows, tokens_per_pass: int = 4096, fuse_layers: Sequence[int] = ()
) -> list[EagleSequence]:
    """The frozen backbone's final features of every position of ``{"prompt",
    "completion"}`` rows (batched teacher-forced prefill); rows without a completion
    token are skipped. With ``fuse_layers`` each position's feature is the final hidden
    state followed by the hidden states entering those layers (EAGLE-3's fused
    features: ``(L - 1, (1 + len(fuse_layers)) H)``). Returns the sequences in row order."""
    pairs = [sequence_ids(tokenizer, row) for row in rows]
    keep = [i for i, (ids, s) in enumerate(pairs) if len(ids) - s >= 1 and len(ids) >= 3]
    out: dict[int, EagleSequence] = {}
    if fuse_layers:
        found = layer_features(model.backbone, [pairs[i][0] for i in keep], fuse_layers, tokens_per_pass)
    else:
        found = (
            (k, h)
            for k, h, _, _ in teacher_forced(
                model, [(pairs[i][0], 1) for i in keep], tokens_per_pass=tokens_per_pass
            )
        )
    for k, h in found:
        ids, start = pairs[keep[k]]
        out[keep[k]] = EagleSequence(np.asarray(ids, np.int32), max(start, 1), h)
    return [out[i] for i in keep if i in out]


def layer_features(
    backbone, seqs: Sequence[Sequence[int]], layers: Sequence[int] = (), tokens_per_pass: int = 4096
):
    """Teacher-forced features of token sequences (causal, right-padded batches of at
    most ``tokens_per_pass`` tokens): per sequence of L tokens, ``(index, feats)`` with
    ``feats`` ``(L - 1, (1 + len(layers)) H)`` float16: positions 0..L-2's final hidden
    states followed by the hidden states entering each of ``layers`` (EAGLE-3's fused
    features). Shortest sequences first."""
    inner, layers = backbone.model, [int(n) for n in layers]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    k = 0
    while k < len(order):
        group = [order[k]]
        while k + len(group) < len(order) and (len(group) + 1) * len(seqs[order[k + len(group)]]) <= max(
            tokens_per_pass, len(seqs[order[k]])
        ):
            group.append(order[k + len(group)])
        k += len(group)
        width = max(len(seqs[i]) for i in group)
        h = inner.embed_tokens(mx.array([list(seqs[i]) + [0] * (width - len(seqs[i])) for i in group]))
        caps = {}
        for n, layer in enumerate(inner.layers):
            if n in layers:
                caps[n] = h
            h = layer(h, "causal", None)
        feats = mx.concatenate([inner.norm(h)] + [caps[n] for n in layers], axis=-1).astype(mx.float16)
        feats = np.array(feats)
        for b, i in enumerate(group):
            yield i, feats[b, : len(seqs[i]) - 1]


def batches(seqs, tokens: int, seed: int | None = None) -> list[list[int]]:
    """Sequence indices grouped by length into batches of at most ``tokens`` padded
    tokens (a longer sequence alone); batch order shuffled with ``seed`` (None: kept)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    out, cur, width = [], [], 0
    for i in order:
        n = len(seqs[i].ids)
        if cur and max(width, n) * (len(cur) + 1) > tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        out.append(cur)
    if seed is not None:
        np.random.default_rng(seed).shuffle(out)
    return out


def batch_arrays(seqs, idx, lut: mx.array | None):
    """Padded arrays of the sequences ``idx``: features ``(B, T, H)`` (T = longest L - 1),
    next tokens ``(B, T)`` (x_{i+1}), CE targets ``(B, T)`` (x_{i+2} in draft-vocabulary
    rows, -1 where absent, before the completion or outside the draft vocabulary),
    the regression mask ``(B, T)`` (f_{i+1} exists) and, as numpy, where a completion
    target exists at all (draft vocabulary or not)."""
    T = max(len(seqs[i].ids) for i in idx) - 1
    H = seqs[idx[0]].feats.shape[1]
    F = np.zeros((len(idx), T, H), np.float16)
    X = np.zeros((len(idx), T), np.int32)
    Y = np.full((len(idx), T), -1, np.int32)
    R = np.zeros((len(idx), T), np.float32)
    for b, i in enumerate(idx):
        s = seqs[i]
        n = len(s.ids) - 1
        F[b, :n] = s.feats
        X[b, :n] = s.ids[1:]
        tgt = s.ids[2:].astype(np.int32)  # x_{i+2} for i = 0..n-2
        pos = np.arange(len(tgt))
        tgt = np.where(pos + 2 >= s.start, tgt, -1)
        Y[b, : len(tgt)] = tgt
        R[b, : n - 1] = 1.0
    has = Y >= 0
    Y = mx.array(Y)
    if lut is not None:
        Y = mx.where(Y >= 0, lut[mx.maximum(Y, 0)], -1)
    return mx.array(F), mx.array(X), Y, mx.array(R), has


def _qkv(attn, h):
    B, T, _ = h.shape
    q = attn.q_proj(h).reshape(B, T, attn.n_heads, -1)
    k = attn.k_proj(h).reshape(B, T, attn.n_kv_heads, -1)
    v = attn.v_proj(h).reshape(B, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if hasattr(attn, "q_norm"):  # qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = attn.rope(q.transpose(0, 2, 1, 3))
    k = attn.rope(k.transpose(0, 2, 1, 3))
    rep = attn.n_heads // attn.n_kv_heads
    if rep > 1:
        k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    return q, k, v  # (B, nH, T, D)


def _shift(a: mx.array, n: int) -> mx.array:
    # a[..., i, :] -> a[..., i - n, :] along the position axis (-2), zeros shifted in
    if n == 0:
        return a
    pad = mx.zeros((*a.shape[:-2], n, a.shape[-1]), dtype=a.dtype)
    return mx.concatenate([pad, a[..., :-n, :]], axis=-2)


def unrolled_features(draft, F: mx.array, E: mx.array, steps: int) -> list[mx.array]:
    """The draft layer's predicted features over a batch for unroll steps 1..``steps``.

    Args:
        draft: an :class:`~mlx_stream.heads.eagle.EagleDraft`.
        F: ``(B, T, H)`` the backbone's features f_i (fused: ``(B, T, (1 + n) H)``).
        E: ``(B, T, H)`` embeddings of x_{i+1}.

    Returns:
        ``steps`` arrays ``(B, T, H)``: entry i of step k predicts f_{i+1} after reading
        its own predictions for the k-1 positions before it (step 1: teacher forced).
        Entries i < k-1 of step k are not meaningful (masked in the loss).
    """
    layer, attn = draft.layer, draft.layer.self_attn
    B, T, _ = F.shape
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    keys, vals, outs = [], [], []
    prev = None
    for k in range(1, steps + 1):
        f_in = draft.features(F) if k == 1 else _shift(prev, 1)
        z = draft.fc(mx.concatenate([f_in, E.astype(mx.float32)], axis=-1))
        q, kk, vv = _qkv(attn, layer.input_layernorm(z))
        keys.append(kk)
        vals.append(vv)
        # real entries j <= i - k + 1; then this chain's entries of steps 2..k (shifted to i)
        s_real = (q * attn.scale) @ keys[0].transpose(0, 1, 3, 2)  # (B, nH, T, T)
        allowed = causal if k == 1 else _shift(causal.astype(mx.float32)[None], k - 1)[0] > 0
        s_real = mx.where(allowed, s_real, -1e9)
        diag_k = [_shift(keys[m - 1], k - m) for m in range(2, k + 1)]
        diag_v = [_shift(vals[m - 1], k - m) for m in range(2, k + 1)]
        s_diag = [(q * attn.scale * dk).sum(-1, keepdims=True) for dk in diag_k]  # (B, nH, T, 1)
        p = mx.softmax(mx.concatenate([s_real, *s_diag], axis=-1).astype(mx.float32), axis=-1)
        o = p[..., :T] @ vals[0]
        for m, dv in enumerate(diag_v):
            o = o + p[..., T + m : T + m + 1] * dv
        o = attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, T, -1))
        z = z + o
        z = z + layer.mlp(layer.post_attention_layernorm(z))
        prev = draft.norm(z)
        outs.append(prev)
    return outs


def unrolled_entries(layer, F: mx.array, E: mx.array, steps: int) -> list[mx.array]:
    """Any EAGLE-style layer's outputs over a batch for unroll steps 1..``steps``, computed
    with the layer's own drafting forward (``layer(f, e, positions, mask, cache)``), so
    training sees exactly what drafting computes: a published EAGLE-3 layer
    (:class:`~mlx_stream.heads.eagle3.Eagle3Draft`), a checkpoint's MTP module
    (:class:`~mlx_stream.heads.mtp.MTPDraft`, the target's own decoder layer: MLA, MoE)
    or ours. EAGLE-3's training-time test (Li et al. 2025, sec. 3.2): the B sequences lie
    side by side as one row of ``B * T`` entries in one KV cache, step k's entries after
    step k-1's; the entry at i of step k reads step k-1's output at i-1 and attends to
    the step-1 entries up to i-k+1 of its own sequence, its chain's entries of steps
    2..k-1 (at i-k+m) and itself: what the entry of a depth-k draft node sees at decode
    time (:class:`~mlx_stream.drafters.eagle.EagleDrafter`). :func:`unrolled_features`
    computes the same for our :class:`~mlx_stream.heads.eagle.EagleDraft` with its
    attention written out.

    Args:
        layer: the draft layer (``heads.eagle``).
        F: ``(B, T, W)`` the target's features f_i (W: as the layer reads them at step 1).
        E: ``(B, T, H)`` the embeddings of x_{i+1} the layer reads.
        steps: unroll steps, >= 1.

    Returns:
        ``steps`` arrays ``(B, T, H_out)``: the layer's outputs (step 1: teacher forced);
        entries i < k-1 of step k are not meaningful (masked in the loss).
    """
    from mlx_lm.models.cache import KVCache

    B, T = F.shape[:2]
    N = B * T
    pos = mx.tile(mx.arange(T, dtype=mx.int32), (B,))
    seq = mx.repeat(mx.arange(B), T)
    same = seq[:, None] == seq[None, :]
    gap = pos[:, None] - pos[None, :]  # i - j, within a sequence
    e = E.reshape(N, -1)
    cache, outs, prev = KVCache(), [], None
    for k in range(1, steps + 1):
        blocks = [same & (gap >= k - 1)] + [same & (gap == k - m) for m in range(2, k + 1)]
        f = F.reshape(N, -1) if k == 1 else _shift(prev.reshape(B, T, -1), 1).reshape(N, -1)
        prev = layer(f, e, pos, mx.concatenate(blocks, axis=1), cache)
        outs.append(prev.reshape(B, T, -1))
    return outs


def published(heads) -> bool:
    """Whether ``heads`` are a published drafter's layer (EAGLE-3, or a checkpoint's MTP
    module) rather than our own EAGLE-style draft layer."""
    return bool(heads.config.eagle3 or heads.config.mtp)


def unroll(model, heads, F: mx.array, X: mx.array, steps: int) -> list[mx.array]:
    """The draft layer's outputs for unroll steps 1..``steps`` of a batch (``F`` the
    target's features ``(B, T, W)``, ``X`` the next tokens ``(B, T)``): our layer through
    :func:`unrolled_features`, a published one through :func:`unrolled_entries` (with its
    own input embedding where its checkpoint has one)."""
    layer = heads.eagle
    if not published(heads):
        return unrolled_features(layer, F, model.embed(X), steps)
    own = layer.embed(X) if hasattr(layer, "embed") else None
    return unrolled_entries(layer, F, own.astype(mx.float32) if own is not None else model.embed(X), steps)


def draft_logits(model, heads, g: mx.array, rows: mx.array | None) -> mx.array:
    """Logits of the layer's outputs ``g`` ``(..., H)``, as drafting scores them: a
    published EAGLE-3 layer's own head over its draft vocabulary, an MTP module's norm
    before the target's head, else the target's head (``rows``: its rows of a reduced
    draft vocabulary)."""
    layer = heads.eagle
    if hasattr(layer, "logits"):
        return layer.logits(g)
    if hasattr(layer, "head_input"):
        g = layer.head_input(g)
    return g @ rows.T if rows is not None else model.project(g)


def eagle_loss(model, heads, F, X, Y, R, rows, steps: int, reg_weight: float, step_decay: float):
    """Weighted mean over unroll steps of CE(x_{i+2}) + ``reg_weight`` x smooth-L1(f_{i+1})
    (``reg_weight`` 0: the cross-entropy alone, as EAGLE-3 and MTP train; their outputs
    are not the target's features); returns ``(loss, per-step top-1 correct counts,
    per-step counted positions)``."""
    outs = unroll(model, heads, F, X, steps)
    Ff = F[..., : outs[0].shape[-1]].astype(mx.float32)  # the final hidden states (fused: the first H)
    total, correct, counted = 0.0, [], []
    wsum = 0.0
    T = F.shape[1]
    for k, g in enumerate(outs, start=1):
        w = step_decay ** (k - 1)
        valid = (Y >= 0) & (mx.arange(T)[None] >= k - 1)
        logits = draft_logits(model, heads, g, rows)
        ce = nn.losses.cross_entropy(logits, mx.maximum(Y, 0), reduction="none")
        n = mx.maximum(valid.sum(), 1)
        ce = (ce * valid).sum() / n
        if reg_weight:
            rmask = R * (mx.arange(T)[None] >= k - 1)
            reg = nn.losses.smooth_l1_loss(g[:, :-1], Ff[:, 1:], reduction="none").mean(-1)
            ce = ce + reg_weight * (reg * rmask[:, :-1]).sum() / mx.maximum(rmask[:, :-1].sum(), 1)
        total = total + w * ce
        wsum += w
        correct.append(((mx.argmax(logits, axis=-1) == Y) & valid).sum())
        counted.append(valid.sum())
    return total / wsum, mx.stack(correct), mx.stack(counted)


def evaluate_eagle(model, heads, seqs, steps: int, tokens: int = 4096, max_rank: int = 10):
    """Held-out accuracy per draft depth and the rank table for tree search.

    Returns:
        ``(top1, top5, ranks)``: per depth k = 1..``steps``, the fraction of positions
        whose token x_{i+2} is the top-1 / in the top-5 of unroll step k (depth k of a
        chain whose earlier drafts were right); ``ranks`` ``(n, steps)`` int: per chain
        anchor, the rank of the true token at each depth (``max_rank`` when beyond it),
        as :func:`mlx_stream.train.trainer.head_ranks` gives for other heads.
    """
    rows = None if published(heads) else _draft_rows(model, heads)
    lut = draft_vocab_lut(heads, model.args.vocab_size)
    hit1, hit5, n = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    all_ranks = []
    for idx in batches(seqs, tokens):
        F, X, Y, R, has = batch_arrays(seqs, idx, lut)
        outs = unroll(model, heads, F, X, steps)
        T = F.shape[1]
        per_step = []
        for k, g in enumerate(outs, start=1):
            logits = draft_logits(model, heads, g, rows)
            tl = mx.take_along_axis(logits, mx.maximum(Y, 0)[..., None], axis=-1)
            rank = (logits > tl).sum(-1)
            valid = (Y >= 0) & (mx.arange(T)[None] >= k - 1)
            mx.eval(rank, valid)
            r, v = np.array(rank), np.array(valid)
            hit1[k - 1] += ((r == 0) & v).sum()
            hit5[k - 1] += ((r < 5) & v).sum()
            n[k - 1] += (
                has & (np.arange(T)[None] >= k - 1)
            ).sum()  # out-of-vocabulary targets count as misses
            per_step.append(np.where(v & (r < max_rank), r, -1))
        # anchor a (the entry whose step-1 output drafts depth 1): depth k is entry a+k-1 of step k
        for b in range(len(idx)):
            for a in range(T):
                if not has[b, a]:
                    continue
                row = [per_step[k][b, a + k] if a + k < T else -1 for k in range(steps)]
                all_ranks.append(row)
    ranks = np.array(all_ranks, np.int32).reshape(-1, steps)
    return (hit1 / np.maximum(n, 1)).tolist(), (hit5 / np.maximum(n, 1)).tolist(), ranks


def train_eagle(
    model,
    heads,
    seqs,
    epochs: float = 1.0,
    lr: float = 5e-4,
    tokens: int = 256,
    steps: int = 3,
    reg_weight: float = 1.0,
    step_decay: float = 0.8,
    warmup: int = 50,
    seed: int = 0,
    log=print,
) -> dict:
    """Train ``heads.eagle`` (the backbone stays frozen) with AdamW and a cosine schedule.

    Args:
        seqs: :class:`EagleSequence` list (from :func:`sequence_features`).
        tokens: padded tokens per batch (256: ~190 optimizer steps per 48k positions; 4096
            gave too few steps to learn in one epoch, docs/benchmarks.md, "Head architectures and
            ablations"). steps: unroll steps (1 = no training-time test).

    Returns:
        ``{"steps", "positions", "wall_s", "positions_per_s", "final_loss", "train_top1"}``.
    """
    rows = None if published(heads) else _draft_rows(model, heads)
    lut = draft_vocab_lut(heads, model.args.vocab_size)
    plan = []
    for e in range(int(np.ceil(epochs))):
        b = batches(seqs, tokens, seed=seed + e)
        plan += b if e + 1 <= epochs else b[: max(1, int(len(b) * (epochs - e)))]
    total = len(plan)
    sched = _schedule(TrainConfig(lr=lr, warmup=warmup), total)  # warm-up, then cosine, as for other heads
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)

    def loss_fn(hd, F, X, Y, R):
        loss, c, n = eagle_loss(model, hd, F, X, Y, R, rows, steps, reg_weight, step_decay)
        return loss, (c, n)

    step_fn = nn.value_and_grad(heads, loss_fn)
    tic, positions, last = time.perf_counter(), 0, 0.0
    loss_v, acc = float("nan"), []
    for s, idx in enumerate(plan, start=1):
        F, X, Y, R, _ = batch_arrays(seqs, idx, lut)
        (loss, (c, n)), grads = step_fn(heads, F, X, Y, R)
        grads = optim.clip_grad_norm(grads, 1.0)[0]
        opt.update(heads, grads)
        mx.eval(heads.parameters(), opt.state, loss, c, n)
        positions += int(np.array(n)[0])
        loss_v = float(loss)
        acc = (np.array(c) / np.maximum(np.array(n), 1)).tolist()
        if time.perf_counter() - tic - last > 30 or s == total:
            last = time.perf_counter() - tic
            log(
                f"step {s}/{total}  loss {loss_v:.3f}  top-1 "
                + " ".join(f"{a:.2f}" for a in acc)
                + f"  {positions / last:.0f} pos/s"
            )
    wall = time.perf_counter() - tic
    return {
        "steps": total,
        "positions": positions,
        "wall_s": wall,
        "positions_per_s": positions / max(wall, 1e-9),
        "final_loss": loss_v,
        "train_top1": acc,
    }
