"""What a step costs on this device: the tree forward's cost curve c(N) and the heads'
drafting time, measured once per model, heads and device and cached
(:func:`device_costs`: the one owner of measured costs, read by ``tree="auto"``,
``dynamic:auto`` and ``tree="budget"``); :func:`forward_cost` is also ``mlx-stream
bench``'s fresh measurement."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .cache import make_tree_cache, mark, rewind
from .drafters.stream_heads import HeadsDrafter
from .models import text_args
from .tree import Tree, chain

# forward sizes measured for the cost curve (root included); c(N) between them is linear
CURVE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass
class StepCosts:
    """What a step costs on this device, relative to a 1-token forward.

    Attributes:
        curve: ``{N: c(N)}`` measured forward costs of N-token trees (root included).
        t1_ms: a 1-token forward in milliseconds.
        draft_ms: ``{h: ms}`` the heads' drafting time for their h-node candidate tree.
        cached: whether :func:`device_costs` read these from its cache (not measured now).
    """

    curve: dict[int, float]
    t1_ms: float
    draft_ms: dict[int, float] = field(default_factory=dict)
    cached: bool = field(default=False, compare=False)

    def forward(self, n: int) -> float:
        """c(n), linear between the measured sizes and beyond the largest."""
        sizes = sorted(self.curve)
        if n <= sizes[0]:
            return self.curve[sizes[0]]
        if n >= sizes[-1]:
            a, b = sizes[-2], sizes[-1]
        else:
            i = int(np.searchsorted(sizes, n))
            a, b = sizes[i - 1], sizes[i]
        ca, cb = self.curve[a], self.curve[b]
        return ca + (cb - ca) * (n - a) / (b - a)

    def step(self, counts: Sequence[int]) -> float:
        """A step drafting ``counts`` (heads first): c(1 + nodes) + heads' drafting."""
        h = counts[0] if counts else 0
        return self.forward(1 + sum(counts)) + (self.draft_ms.get(h, 0.0) / self.t1_ms if h else 0.0)


def device_key(model) -> dict:
    """What the costs depend on: the heads, the backbone, its dtype, and the machine."""
    from mlx.utils import tree_flatten

    from .env import openblas_active

    cfg = model.heads.config if model.heads is not None else None
    dtype = str(next(iter(v.dtype for _, v in tree_flatten(model.backbone.parameters()))))
    return {
        "heads": hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16] if cfg else None,
        "backbone": (cfg.fingerprint if cfg else None) or model.args.model_type,
        "dtype": dtype,
        "device": str(mx.default_device()),
        "machine": f"{platform.system()} {platform.machine()} {platform.processor()} {os.cpu_count()} CPUs",
        "openblas": openblas_active(),
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", ""),
    }


def measure_costs(model, heads_trees: Sequence[Tree] = (), repeats: int = 5) -> StepCosts:
    """Measure :class:`StepCosts` now, uncached: c(N) at :data:`CURVE_SIZES`
    (:func:`forward_cost`) and the heads' drafting time of each tree of ``heads_trees``
    (:func:`draft_times`), medians of ``repeats``. :func:`device_costs` caches this."""
    curve = forward_cost(model, sizes=CURVE_SIZES, repeats=repeats)
    t1 = curve.pop("t1_ms")
    trees = [t for t in heads_trees if t.size > 1]
    ms = draft_times(model, trees, repeats=repeats) if trees else []
    return StepCosts(curve, t1, {t.size - 1: m for t, m in zip(trees, ms)})


def device_costs(model, heads_trees: Sequence[Tree] = (), cache_dir=None, refresh: bool = False) -> StepCosts:
    """This device's :class:`StepCosts` for ``model`` and its heads' ``heads_trees``
    (their drafting times, by drafted-node count), measured once (about half a minute
    for the default model here) and cached in :func:`mlx_stream.files.cache_dir` /
    ``costs`` by :func:`device_key` and the trees' sizes; ``refresh`` measures again
    (``mlx-stream bench --tree auto`` after a change of machine load, for example).
    An unreadable cache entry is measured again and rewritten."""
    from .files import write_json

    if cache_dir is None:
        from .files import cache_dir as default_dir

        cache_dir = default_dir() / "costs"
    key = device_key(model) | {"trees": [t.size for t in heads_trees]}
    path = Path(cache_dir) / (
        hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json"
    )
    if path.is_file() and not refresh:
        try:
            d = json.loads(path.read_text())
            return StepCosts(
                {int(k): float(v) for k, v in d["curve"].items()},
                float(d["t1_ms"]),
                {int(k): float(v) for k, v in d["draft_ms"].items()},
                cached=True,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # unreadable: measured again and rewritten
    print(
        f"measuring this device's forward and drafting costs once (cached in {cache_dir}) ...",
        file=sys.stderr,
    )
    tic = time.perf_counter()
    costs = measure_costs(model, heads_trees)
    print(f"  measured in {time.perf_counter() - tic:.0f} s", file=sys.stderr)
    try:
        write_json({"key": key, "curve": costs.curve, "t1_ms": costs.t1_ms, "draft_ms": costs.draft_ms}, path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return costs


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
    marks = mark(cache)
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
            rewind(cache, context, marks)
    times, worst = {}, 0.0
    for n in sizes:
        worst = max(worst, statistics.median(runs[n]))
        times[n] = worst
    return {n: times[n] / times[sizes[0]] for n in sizes} | {"t1_ms": times[sizes[0]] * 1e3}


def draft_times(model, trees: Sequence, context: int = 256, repeats: int = 10) -> list[float]:
    """Median milliseconds for ``model``'s heads to draft each tree of ``trees`` once
    (a :class:`~mlx_stream.drafters.stream_heads.HeadsDrafter` at a cached context of ``context``
    tokens, prefilled once for all trees), evaluation included."""
    fam, bb = model.family, model.backbone
    if model.heads is not None and model.heads.autoregressive:
        return _eagle_draft_times(model, trees, context, repeats)
    capture = HeadsDrafter(model, trees[0]).capture if trees else None
    ids = mx.arange(1, context + 1, dtype=mx.int32) % text_args(bb).vocab_size
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
    from .drafters.eagle import EagleDrafter

    bb = model.backbone
    ids = mx.arange(1, context + 1, dtype=mx.int32) % text_args(bb).vocab_size
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
