"""Training multi-stream attention ("msa") heads, which read whole sequences.

Residual and hydra heads read one final hidden state per position, so the trainer
batches positions. Multi-stream attention heads (Bhendawade et al. 2024, sec. 3.1;
see :class:`mlx_stream.heads.StreamHeads`) attend to the main stream's keys/values
of every earlier position, so they train on batches of whole sequences: the hidden
states entering layer L - N_s (kept once per sequence, like the final hidden states
of the position cache), the frozen top layers recomputing the main stream's
keys/values on the fly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .features import targets_for
from .loss import draft_vocab_lut, head_weights


@dataclass
class StreamSequence:
    """One training sequence: ``ids`` (L,) int32, ``start`` (index of the first
    completion token), ``mid`` ``(L, H)`` hidden states entering layer L - N_s."""

    ids: np.ndarray
    start: int
    mid: np.ndarray


def sequence_features(model, tokenizer, rows, layer: int):
    """Run the frozen backbone once over ``{"prompt", "completion"}`` rows and keep, per
    sequence, the hidden states entering ``layer`` and the final hidden states.

    Returns:
        ``(sequences, finals)``: a list of :class:`StreamSequence` and a list of ``(L, H)``
        float16 final hidden states (for position-level heads on the same data).
    """
    from .features import sequence_ids

    seqs, finals = [], []
    for row in rows:
        ids, start = sequence_ids(tokenizer, row)
        if len(ids) - start < 1:
            continue
        h, mid = model.family.prefill_hidden(model.backbone, mx.array(ids), model.make_cache(), capture=layer)
        seqs.append(StreamSequence(np.asarray(ids, np.int32), start, np.array(mid.astype(mx.float16))))
        finals.append(np.array(h.astype(mx.float16)))
    return seqs, finals


def sequence_batches(seqs, tokens: int) -> list[list[int]]:
    """Group sequence indices, sorted by length, into batches of at most ``tokens``
    padded tokens (a longer sequence gets a batch of its own)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i].ids) > tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + ([cur] if cur else [])


def batch_tensors(seqs, idx, num_heads: int, lut: mx.array | None):
    """Right-padded tensors for sequences ``idx``: ``x`` (B, T, H) float32, positions
    (B, T), the causal visibility (B, T, T), labels (K, B, T) (-1 = none: padding,
    prompt positions, past the end; draft-vocabulary indices when ``lut`` is given)
    and the root tokens x_{t+1} (B, T)."""
    K = num_heads
    T = max(len(seqs[i].ids) for i in idx)
    B, H = len(idx), seqs[idx[0]].mid.shape[1]
    x = np.zeros((B, T, H), np.float32)
    lab = np.full((K, B, T), -1, np.int32)
    root = np.zeros((B, T), np.int32)
    for b, i in enumerate(idx):
        s = seqs[i]
        L = len(s.ids)
        x[b, :L] = s.mid
        root[b, : L - 1] = s.ids[1:]
        t0 = max(s.start - 1, 0)
        lab[:, b, t0 : L - 1] = targets_for(s.ids, s.start, K)[:, 1:].T  # rows t = start-1 .. L-2
    lab = mx.array(lab)
    if lut is not None:
        lab = mx.where(lab >= 0, lut[mx.maximum(lab, 0)], -1)
    ar = mx.arange(T)
    vis = mx.broadcast_to((ar[None, :] <= ar[:, None])[None], (B, T, T))
    return mx.array(x), mx.broadcast_to(ar[None], (B, T)), vis, lab, mx.array(root)


def msa_logits(model, heads, x, positions, visible, root, rows=None) -> mx.array:
    """``(K, B, T, V or V')`` stream logits over a sequence batch (main stream frozen)."""
    fam = model.family
    kv = [
        (mx.stop_gradient(k), mx.stop_gradient(v))
        for k, v in fam.main_stream_kv(model.backbone, x, heads.config.stream_layers)
    ]
    return model.project(
        heads(fam.stream_hidden(model.backbone, heads, x, positions, kv, visible, root)), rows
    )


def _rows(model, heads):
    from mlx_stream.heads import output_weight

    return output_weight(model.backbone)[heads.draft_ids] if heads.config.draft_vocab_size else None


def train_stream_heads(
    model,
    heads,
    seqs,
    epochs: float = 1.0,
    tokens: int = 512,
    lr: float = 1e-3,
    warmup: int = 30,
    head_decay: float = 0.8,
    seed: int = 0,
    log=print,
) -> dict:
    """Train "msa" heads on whole sequences (AdamW, warm-up + cosine; the multi-stream
    cross-entropy of :func:`train.loss.stream_loss`, hard labels). Returns
    ``{"steps", "wall_s", "positions_per_s", "final_loss"}``."""
    K = heads.num_heads
    model.backbone.freeze()
    rows, lut = _rows(model, heads), draft_vocab_lut(heads, model.args.vocab_size)
    w = head_weights(K, head_decay)

    def loss_fn(x, pos, vis, lab, root):
        lg = msa_logits(model, heads, x, pos, vis, root, rows)
        valid = lab >= 0
        ce = nn.losses.cross_entropy(lg, mx.maximum(lab, 0), reduction="none")
        per = (ce * valid).sum(axis=(1, 2)) / mx.maximum(valid.sum(axis=(1, 2)), 1)
        return (w * per).sum() / w.sum()

    step_fn = nn.value_and_grad(heads, loss_fn)
    batches = sequence_batches(seqs, tokens)
    total = max(int(epochs * len(batches)), 1)
    warm = max(1, min(warmup, total // 5))
    sched = optim.join_schedules(
        [optim.linear_schedule(lr / warm, lr, warm), optim.cosine_decay(lr, max(total - warm, 1))], [warm]
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    step, losses, positions, tic = 0, [], 0, time.perf_counter()
    while step < total:
        for bi in rng.permutation(len(batches)):
            if step >= total:
                break
            batch = batch_tensors(seqs, batches[bi], K, lut)
            loss, grads = step_fn(*batch)
            opt.update(heads, grads)
            mx.eval(heads.parameters(), opt.state, loss)
            step += 1
            losses.append(float(loss))
            positions += sum(len(seqs[i].ids) - seqs[i].start for i in batches[bi])
            if log and step % 25 == 0:
                log(
                    f"[msa] step {step}/{total} loss {np.mean(losses[-25:]):.3f} "
                    f"{positions / (time.perf_counter() - tic):.0f} positions/s"
                )
    wall = time.perf_counter() - tic
    return {
        "steps": total,
        "wall_s": wall,
        "positions_per_s": positions / wall,
        "final_loss": float(np.mean(losses[-20:])),
    }


def stream_ranks(model, heads, seqs, max_rank: int = 10) -> np.ndarray:
    """``(P, K)`` ranks of the true tokens (as :func:`train.trainer.head_ranks`) at the
    completion positions of ``seqs``, in sequence order."""
    K = heads.num_heads
    rows, lut = _rows(model, heads), draft_vocab_lut(heads, model.args.vocab_size)
    out = []
    for i in range(len(seqs)):
        x, pos, vis, lab, root = batch_tensors(seqs, [i], K, lut)
        lg = msa_logits(model, heads, x, pos, vis, root, rows)[:, 0]  # (K, T, V')
        lab = lab[:, 0]
        true = mx.take_along_axis(lg, mx.maximum(lab, 0)[..., None], axis=-1)
        r = (lg > true).sum(axis=-1)
        r = mx.where((lab >= 0) & (r < max_rank), r, -1)
        s = seqs[i]
        out.append(np.array(r).T[max(s.start - 1, 0) : len(s.ids) - 1])
    return np.concatenate(out) if out else np.zeros((0, K), np.int32)
