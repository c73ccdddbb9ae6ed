"""What a step costs on this device: the tree forward's cost curve c(N) and the heads'
drafting time, measured (the cost model of ``tree="auto"`` and of ``mlx-stream bench``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import mlx.core as mx

from .cache import make_tree_cache, trim_cache
from .drafters import HeadsDrafter
from .tree import chain


def forward_cost(
    model, sizes: Sequence[int] = (1, 2, 4, 8, 16), context: int = 256, repeats: int = 10
) -> dict:
    """c(N): the time of an N-token tree forward relative to a 1-token forward, at a
    cached context of ``context`` tokens.

    The sizes are timed round-robin (each repeat runs every size once, so drift on a
    shared machine hits all sizes alike), each c(N) is the median of ``repeats``, and
    the curve is made non-decreasing (a larger forward never costs less; noise can
    make it look so).

    Returns:
        ``{N: c(N)}`` for each size, plus ``"t1_ms"``: the smallest size's median time
        in milliseconds.
    """
    fam, bb = model.family, model.backbone
    cache = make_tree_cache(bb)
    fam.prefill_hidden(bb, mx.zeros((context,), dtype=mx.int32), cache)
    sizes = sorted(sizes)
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            t = chain(n - 1)
            mask = None
            if n > 1:
                mask = mx.concatenate([mx.ones((n, context), dtype=mx.bool_), mx.array(t.mask)], axis=1)
            tic = time.perf_counter()
            h, _ = fam.tree_hidden(
                bb, mx.zeros((n,), dtype=mx.int32), mx.array(context + t.depths), mask, cache
            )
            mx.eval(fam.project(bb, h))
            if r:  # the first round warms up
                runs[n].append(time.perf_counter() - tic)
            trim_cache(cache, context)
    times, worst = {}, 0.0
    for n in sizes:
        worst = max(worst, statistics.median(runs[n]))
        times[n] = worst
    return {n: times[n] / times[sizes[0]] for n in sizes} | {"t1_ms": times[sizes[0]] * 1e3}


def draft_times(model, trees: Sequence, context: int = 256, repeats: int = 10) -> list[float]:
    """Median milliseconds for ``model``'s heads to draft each tree of ``trees`` once
    (a :class:`~mlx_stream.drafters.HeadsDrafter` at a cached context of ``context``
    tokens, prefilled once for all trees), evaluation included."""
    fam, bb = model.family, model.backbone
    if model.heads is not None and model.heads.autoregressive:
        return _eagle_draft_times(model, trees, context, repeats)
    capture = HeadsDrafter(model, trees[0]).capture if trees else None
    ids = mx.arange(1, context + 1, dtype=mx.int32) % bb.args.vocab_size
    cache = model.make_cache()
    hidden, mid = fam.prefill_hidden(bb, ids, cache, capture=capture)
    hidden, mid = hidden[-1], (mid[-1] if mid is not None else None)
    tokens = ids.tolist() + [1]
    result = []
    for tree in trees:
        drafter = HeadsDrafter(model, tree)
        runs = []
        for _ in range(repeats + 1):
            tic = time.perf_counter()
            mx.eval(drafter.draft(hidden, tokens, mid=mid, cache=cache if mid is not None else None))
            runs.append(time.perf_counter() - tic)
        result.append(1e3 * statistics.median(runs[1:]))
    return result


def _eagle_draft_times(model, trees, context: int, repeats: int) -> list[float]:
    # an eagle drafter primed with the context's entries, then timed on steps that each
    # commit two verified positions (a typical accepted path) and draft the tree
    from .drafters import EagleDrafter

    bb = model.backbone
    ids = mx.arange(1, context + 1, dtype=mx.int32) % bb.args.vocab_size
    hidden, _ = model.family.prefill_hidden(bb, ids, model.make_cache())
    hidden = mx.concatenate([hidden] * (1 + len(model.heads.config.fuse_layers)), axis=-1)  # fused width
    result = []
    for tree in trees:
        drafter = EagleDrafter(model, tree)
        tokens = ids.tolist() + [1]
        mx.eval(drafter.draft(hidden, tokens))
        runs = []
        for _ in range(repeats + 1):
            tokens += [1, 1]
            tic = time.perf_counter()
            mx.eval(drafter.draft(hidden[-2:], tokens))
            runs.append(time.perf_counter() - tic)
        result.append(1e3 * statistics.median(runs[1:]))
    return result
