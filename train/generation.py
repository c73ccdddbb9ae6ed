"""Batched generation by the frozen backbone that also keeps its hidden states.

Self-distillation needs three things from every generated token: the token (the
dataset), the backbone's final hidden state before it (the heads' input) and,
for soft targets, the backbone's top-k log-probabilities there. All come out of
the same forward pass, so the feature cache costs no second pass over every
sequence.

Where a step's time goes (SmolLM2-135M, float32, OpenBLAS, one core; measured
with ``benchmarks/data_engine.py``): the matmuls of a batch of 64 rows run at
~75 GFLOP/s, but reading the KV cache grows with its length and the batch, and
mlx-lm's ``BatchKVCache.filter`` copies the whole cache (64 rows, 300 cached
tokens: ~1 s, two decode steps' worth). The engine therefore

* prefills prompts in groups of similar length (the pending prompts are sorted
  by length, and a group is split where left padding would waste more than
  about an eighth of its prefill), then merges the groups' caches;
* leaves a finished row in the batch (computing tokens nobody keeps) until a
  quarter of the batch has finished, then drops the finished rows and prefills
  new prompts in their place in one ``filter`` + ``extend``, instead of copying
  the cache every time a row ends;
* prefills long prompts in chunks of ``prefill_chunk`` columns, so memory stays
  bounded;
* syncs with the host once per step (tokens, hidden states and top-k together).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass
class Generated:
    """One finished sequence.

    Attributes:
        tokens: the generated token ids (EOS included when the model emitted it).
        hidden: ``(len(tokens), H)`` float16 final hidden states; row i is the state
            whose logits produced ``tokens[i]`` (row 0 is the last prompt position),
            or None when hidden states were not requested.
        finish_reason: "stop" (EOS) or "length".
        top_logprobs: ``(len(tokens), k)`` float16 log-probabilities of the k most
            likely tokens at each of those states (descending), or None.
        top_ids: ``(len(tokens), k)`` int32 ids of those tokens, or None.
    """

    tokens: list[int]
    hidden: np.ndarray | None
    finish_reason: str
    top_logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None


def top_k_logprobs(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` largest log-probabilities of each row, in descending order.

    Args:
        logprobs: ``(..., V)`` normalised log-probabilities.
        k: how many, ``1 <= k <= V``.

    Returns:
        ``(values, ids)``: ``(..., k)`` float32 and ``(..., k)`` int32.
    """
    ids = mx.argpartition(-logprobs, k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)


class _Rows:
    """Host-side record of the sequences in the running batch (row -> prompt index,
    ``None`` for a finished row still occupying its slot)."""

    def __init__(self, top_k: int):
        self.rows: list[int | None] = []
        self.tokens: dict[int, list[int]] = {}
        self.parts: dict[int, list[tuple]] = {}
        self.top_k = top_k

    def add(self, idx: list[int]) -> None:
        self.rows += idx
        for i in idx:
            self.tokens[i], self.parts[i] = [], []

    def live(self) -> list[int]:
        return [b for b, i in enumerate(self.rows) if i is not None]

    def finish(self, b: int, reason: str, keep_hidden: bool) -> tuple[int, Generated]:
        i, self.rows[b] = self.rows[b], None
        parts = self.parts.pop(i)
        cols = [np.stack(c) for c in zip(*parts)] if parts else []
        hidden = cols.pop(0) if keep_hidden else None
        lp, ids = (cols[0], cols[1]) if self.top_k else (None, None)
        return i, Generated(self.tokens.pop(i), hidden, reason, lp, ids)


def _batch_caches(backbone, left_padding: list[int]) -> list:
    # mlx-lm's batch caches for left-padded rows: a recurrent layer's ArraysCache (its mask
    # keeps the padding out of the state), a BatchKVCache for every other layer
    from mlx_lm.models.cache import ArraysCache, BatchKVCache

    from mlx_stream.cache import cache_kinds

    return [
        ArraysCache(len(c.cache), left_padding=left_padding)
        if type(c) is ArraysCache
        else BatchKVCache(left_padding)
        for c in cache_kinds(backbone)
    ]


def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array] | None = None,
    eos_ids: Sequence[int] = (),
    keep_hidden: bool = False,
    batch_size: int = 64,
    top_k: int = 0,
    prefill_chunk: int = 512,
) -> Iterator[tuple[int, Generated]]:
    """Generate from every prompt with continuous batching: up to ``batch_size``
    sequences decode together, one backbone forward per step for all of them; when
    a quarter of the rows have finished (or all, at the end), those rows are dropped
    and the next prompts, shortest first, are prefilled and merged into the running
    batch (mlx-lm's ``BatchKVCache.filter`` / ``extend``).

    Args:
        model: a :class:`mlx_stream.model.SpeculativeModel` (only the backbone is used).
        prompts: token ids per prompt (each non-empty).
        max_tokens: generated tokens per prompt at most.
        sampler: maps ``(B, V)`` log-probabilities to ``(B,)`` tokens (mlx-lm's
            ``make_sampler``); None is greedy (argmax).
        eos_ids: tokens that end a sequence (kept as its last token).
        keep_hidden: also return the hidden states (float16).
        batch_size: sequences decoded together at most.
        top_k: also return the top-``top_k`` log-probabilities per generated token
            (the backbone's soft targets; 0: none).
        prefill_chunk: prompt columns per prefill forward at most (bounds memory).

    Yields:
        ``(prompt index, Generated)`` as each sequence finishes (not in prompt order;
        the order is a function of the prompts and settings). Greedy tokens equal
        unbatched greedy decoding up to fp32 round-off in near-ties (the batch
        changes the summation order).

    Raises:
        ValueError: an empty prompt, ``max_tokens``, ``batch_size`` or
            ``prefill_chunk`` below 1, or ``top_k`` outside ``[0, V]``.
    """
    if min(max_tokens, batch_size, prefill_chunk) < 1:
        raise ValueError(
            f"max_tokens, batch_size and prefill_chunk must be >= 1, got {max_tokens}, {batch_size} "
            f"and {prefill_chunk}"
        )
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    bb, family = model.backbone, model.family
    if not 0 <= top_k <= model.args.vocab_size:
        raise ValueError(f"top_k must be in [0, {model.args.vocab_size}], got {top_k}")
    eos = set(int(e) for e in eos_ids)

    def head(h):  # (B, H) last hidden states -> what one step hands to the host
        logits = family.project(bb, h).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tok = mx.argmax(logits, axis=-1) if sampler is None else sampler(logprobs)
        out = [tok, h.astype(mx.float16)]
        if top_k:
            out += top_k_logprobs(logprobs, top_k)
        return out

    def prefill_group(idx):
        lengths = [len(prompts[i]) for i in idx]
        width = max(lengths)
        x = mx.array([[0] * (width - n) + list(prompts[i]) for n, i in zip(lengths, idx)])
        cache = _batch_caches(bb, [width - n for n in lengths])
        for s in range(0, width, prefill_chunk):
            h = bb.model(x[:, s : s + prefill_chunk], cache=cache)[:, -1]
            mx.eval(h, [c.state for c in cache])
        return cache, head(h)

    def prefill(idx):  # idx sorted by length: split where padding would waste over ~1/8
        groups, start = [], 0
        for k in range(1, len(idx) + 1):
            if k == len(idx) or len(prompts[idx[k]]) > len(prompts[idx[start]]) * 9 // 8 + 2:
                groups.append(idx[start:k])
                start = k
        cache, out = prefill_group(groups[0])
        for g in groups[1:]:
            c2, o2 = prefill_group(g)
            for c, n in zip(cache, c2):
                c.extend(n)
            out = [mx.concatenate([a, b]) for a, b in zip(out, o2)]
        return cache, out

    # shortest first: a prefill group of similar lengths wastes little on padding
    pending = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)  # pop() = next
    state = _Rows(top_k)
    cache, out = None, None
    while state.live() or pending:
        live = state.live()
        if not live or len(state.rows) - len(live) >= max(batch_size // 4, 1):
            if len(live) < len(state.rows):  # drop the finished rows (one copy of the cache)
                state.rows = [state.rows[b] for b in live]
                if live:
                    keep = mx.array(live)
                    for c in cache:
                        c.filter(keep)
                    out = [a[keep] for a in out]
                else:
                    cache = out = None
            new = [pending.pop() for _ in range(min(batch_size - len(state.rows), len(pending)))]
            if new:
                c2, o2 = prefill(new)
                if cache is None:
                    cache, out = c2, o2
                else:
                    for c, n in zip(cache, c2):
                        c.extend(n)
                    out = [mx.concatenate([a, b]) for a, b in zip(out, o2)]
                state.add(new)
        mx.eval(out)
        host = [np.array(a) for a in out]
        toks = host[0].tolist()
        for b, i in enumerate(state.rows):
            if i is None:
                continue
            t = toks[b]
            state.tokens[i].append(t)
            if keep_hidden or top_k:
                state.parts[i].append(tuple(a[b] for a in host[1 if keep_hidden else 2 :]))
            if t in eos or len(state.tokens[i]) >= max_tokens:
                yield state.finish(b, "stop" if t in eos else "length", keep_hidden)
        if not state.live():
            continue
        h = bb.model(out[0][:, None], cache=cache)[:, -1]
        out = head(h)
