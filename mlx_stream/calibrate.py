"""How deep a draft model drafts on this device, and which of the target's layers a
self-speculative draft keeps: both chosen by measurement, cached per model and device.

A draft of per-token acceptance alpha that drafts a chain of K tokens emits
``(1 - alpha^(K+1)) / (1 - alpha)`` tokens per step on average (Leviathan et al. 2023,
eq. 1) at a cost, relative to a plain step, of ``c(K + 1) + K r``: the target's forward
over K + 1 nodes (this device's measured c(N), :func:`mlx_stream.cost.device_costs`)
plus K draft forwards, each ``r`` of a target forward (Leviathan et al. 2023, sec. 3.4,
with the measured c(N) in place of a free verification). :func:`calibrate_draft`
measures alpha as the teacher-forced greedy agreement of the draft with the target on
held-out text the target wrote itself, and r by timing; the best K is the one whose
expected speedup is largest, and none where no K pays (plain decoding).

Self-speculative decoding (Zhang et al. 2024, Draft & Verify; Xia et al. 2025, SWIFT)
drafts with the target minus some of its layers, sharing its weights:
:func:`self_draft` scores candidate layer subsets the same way and keeps the best, or
none. Run again with ``mlx-stream calibrate --draft-model DRAFT --refresh``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from .cost import StepCosts, device_costs, device_key
from .drafters.draft_model import DraftModel

MAX_DEPTH = 8  # the longest chain considered
MIN_SPEEDUP = 1.02  # a draft must be expected to beat plain decoding by this much
CALIBRATION_PROMPTS = 4  # held-out prompts whose continuations the agreement is measured on
CALIBRATION_TOKENS = 48  # tokens the target writes for each
NODE_COUNTS = (2, 4)  # frontier nodes a depth might expand at once, timed
CALIBRATION_VERSION = 2  # what a cached calibration holds (2: node_costs); older ones are measured again


def layer_subset(backbone, keep: Sequence[int]):
    """A view of an mlx-lm llama-family model that runs only the layers ``keep``, in
    order, sharing every weight with ``backbone`` (no copy in memory): the embedding,
    the final norm and the output projection are the backbone's own.

    Raises:
        ValueError: an empty, unsorted or out-of-range ``keep``, or a model whose
            layers are not ``backbone.model.layers``.
    """
    layers = getattr(getattr(backbone, "model", None), "layers", None)
    if layers is None:
        raise ValueError("self-speculative drafting needs a llama-family model (model.layers)")
    from .cache import cache_kinds

    if any(type(c).__name__ != "KVCache" for c in cache_kinds(backbone)):
        raise ValueError(
            f"self-speculative drafting skips layers, and {backbone.model_type!r} lays out its caches by "
            "layer (sliding windows, shared or latent caches): use a draft model or heads with it"
        )
    keep = list(keep)
    if not keep or keep != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= len(layers):
        raise ValueError(f"keep must be increasing layer indices in 0..{len(layers) - 1}, got {keep}")
    view, inner = copy.copy(backbone), copy.copy(backbone.model)
    inner.layers = [layers[i] for i in keep]
    view.model = inner
    return view


def subset_candidates(num_layers: int) -> list[tuple[int, ...]]:
    """The layer subsets :func:`self_draft` scores: a contiguous block of a quarter,
    a third or half of the layers skipped at a few places between the first and the
    last two layers (which every subset keeps: the first layers build the token's
    representation, the last ones map it to the vocabulary), and every second layer
    skipped over the middle half (SWIFT's interleaved skipping)."""
    L, out = num_layers, []
    for frac in (4, 3, 2):
        size = max(L // frac, 1)
        for start in sorted({max(L // 4, 1), max(L // 2 - size // 2, 1), L - 2 - size}):
            if start >= 1 and start + size <= L - 2:
                out.append(tuple(i for i in range(L) if not start <= i < start + size))
    out.append(tuple(i for i in range(L) if not (L // 4 <= i < 3 * L // 4 and i % 2)))
    return sorted({k for k in out if len(k) < L}, key=lambda k: (-len(k), k))


def expected_speedup(alpha: float, r: float, k: int, costs: StepCosts) -> float:
    """Expected tokens per unit time of a K-token chain relative to plain decoding:
    ``(1 - alpha^(K+1)) / (1 - alpha) / (c(K + 1) + K r)`` (module docstring)."""
    tau = float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tau / (costs.forward(k + 1) + k * r)


def best_depth(alpha: float, r: float, costs: StepCosts) -> tuple[int, float]:
    """``(K, speedup)``: the chain length in 1..:data:`MAX_DEPTH` with the largest
    :func:`expected_speedup` and that speedup; K is 0 (plain decoding) where it does not
    reach :data:`MIN_SPEEDUP`."""
    k, s = max(
        ((k, expected_speedup(alpha, r, k, costs)) for k in range(1, MAX_DEPTH + 1)), key=lambda t: t[1]
    )
    return (k if s >= MIN_SPEEDUP else 0), s


def tree_budget(depth: int, costs: StepCosts) -> int:
    """Nodes (root included) of a draft model's tree of ``depth``: the largest N up to
    ``2 depth + 1`` whose forward costs at most 5% of a plain step more than the chain's
    (on a GPU, where c(N) is flat, about two candidates a depth; on this CPU, about the chain)."""
    chain = costs.forward(depth + 1)
    return max(n for n in range(depth + 1, 2 * depth + 2) if costs.forward(n) <= chain + 0.05)


def _calibration_text(model, tokenizer) -> list[list[int]]:
    # held-out prompts (the last builtin ones: no benchmark reads them) and what the target
    # writes after each, greedy: the text a draft is accepted or rejected on
    import mlx_lm

    from .prompts import BUILTIN_PROMPTS, load_prompts, prompt_ids

    texts = load_prompts(BUILTIN_PROMPTS)
    seqs = []
    for text in texts[-CALIBRATION_PROMPTS:]:
        ids = prompt_ids(tokenizer, text)
        out = [
            r.token
            for r in mlx_lm.stream_generate(
                model.backbone, tokenizer, mx.array(ids), max_tokens=CALIBRATION_TOKENS
            )
        ]
        seqs.append((ids, out))
    return seqs


def _agreement(backbone, targets: list[mx.array], seqs) -> float:
    hits = total = 0
    for (ids, out), want in zip(seqs, targets):
        logits = backbone(mx.array(ids + out)[None])[0, len(ids) - 1 : -1]
        got = logits.argmax(axis=-1)
        hits += int((got[: want.shape[0]] == want[: got.shape[0]]).sum().item())
        total += int(want.shape[0])
    return hits / max(total, 1)


def _forward_ms(backbone, context: int = 256, repeats: int = 5, nodes: int = 1) -> float:
    from .cache import make_tree_cache, mark, rewind
    from .models import family

    fam = family(backbone)
    cache = make_tree_cache(backbone)
    fam.prefill_hidden(backbone, mx.zeros((context,), dtype=mx.int32), cache)
    marks = mark(cache)
    tokens, positions = mx.zeros((nodes,), dtype=mx.int32), mx.full((nodes,), context, dtype=mx.int32)
    mask = None if nodes == 1 else mx.ones((nodes, context + nodes), dtype=mx.bool_)
    runs = []
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        h, _ = fam.tree_hidden(backbone, tokens, positions, mask, cache)
        mx.eval(fam.project(backbone, h))
        runs.append(time.perf_counter() - tic)
        rewind(cache, context, marks)
    return 1e3 * statistics.median(runs[1:])


def node_costs(backbone, t1_ms: float | None = None) -> dict[str, float]:
    """A draft forward over n frontier nodes, for n in :data:`NODE_COUNTS`, relative to its
    forward over one (the cost of expanding n nodes of a depth at once: about 1 where
    the device is memory-bound, as on Apple silicon; about n on this CPU, whose quantized
    kernels do not batch)."""
    one = t1_ms if t1_ms is not None else _forward_ms(backbone)
    return {str(n): _forward_ms(backbone, nodes=n) / one for n in NODE_COUNTS}


def _done(tic: float) -> dict:
    seconds = time.perf_counter() - tic
    print(f"  calibrated in {seconds:.0f} s", file=sys.stderr)
    return {"seconds": round(seconds, 1)}


def _cached(model, what: dict, cache_dir, refresh: bool, measure) -> dict:
    if cache_dir is None:
        from .files import cache_dir as default_dir

        cache_dir = default_dir() / "drafts"
    key = device_key(model) | {"draft": what}
    path = Path(cache_dir) / (
        hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json"
    )
    if path.is_file() and not refresh:
        try:
            return json.loads(path.read_text()) | {"cached": True}
        except (OSError, ValueError):
            pass  # unreadable: measured again and rewritten
    info = measure() | {"key": key}
    try:
        from .files import write_json

        write_json(info, path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return info | {"cached": False}


def _draft_id(draft: DraftModel) -> dict:
    import numpy as np
    from mlx.utils import tree_flatten

    params = tree_flatten(draft.backbone.parameters())
    digest = hashlib.sha256()  # the weights themselves: two drafts of one shape are told apart
    for _, v in params[:: max(len(params) // 8, 1)]:
        digest.update(np.array(v.reshape(-1)[:4096]).tobytes())
    return {
        "name": draft.name,
        "weights": digest.hexdigest()[:16],
        "layers": len(draft.backbone.layers),
        "parameters": sum(int(v.size) for _, v in params),
        "dtype": str(params[0][1].dtype) if params else None,
    }


def calibrate_draft(model, tokenizer, draft: DraftModel, cache_dir=None, refresh: bool = False) -> dict:
    """Measure a draft model against ``model`` on this device and choose how deep it drafts.

    Returns:
        ``{"alpha", "r", "depth", "budget", "speedup", "cached", ...}``: the greedy
        agreement, the draft forward's time over the target's, the chain length K with
        the best expected speedup (0: no K pays here), the tree's node budget
        (:func:`tree_budget`), and that expected speedup. Cached in
        :func:`mlx_stream.files.cache_dir` / ``drafts`` by device and draft.
    """

    def measure():
        print(
            f"calibrating the draft model {draft.name} on this device once (cached; the target writes "
            f"{CALIBRATION_PROMPTS} x {CALIBRATION_TOKENS} tokens of text to measure on, then both are "
            "timed)",
            file=sys.stderr,
        )
        tic = time.perf_counter()
        costs = device_costs(model)
        seqs = _calibration_text(model, tokenizer)
        targets = [mx.array(out) for _, out in seqs]
        alpha = _agreement(draft.backbone, targets, seqs)
        t_draft = _forward_ms(draft.backbone)
        r = t_draft / _forward_ms(model.backbone)
        k, s = best_depth(alpha, r, costs)
        return {
            "alpha": alpha,
            "r": r,
            "depth": k,
            "budget": tree_budget(k, costs) if k else 0,
            "speedup": s,
            "node_costs": node_costs(draft.backbone, t_draft),
        } | _done(tic)

    return _cached(model, _draft_id(draft) | {"v": CALIBRATION_VERSION}, cache_dir, refresh, measure)


def self_draft(model, tokenizer, cache_dir=None, refresh: bool = False) -> tuple[DraftModel, dict]:
    """The target drafting for itself with a subset of its layers, chosen by measurement.

    Every subset of :func:`subset_candidates` is scored by its greedy agreement with the
    full model on held-out text the model wrote (:func:`calibrate_draft`'s text) and its
    measured forward time; the subset and chain length with the best expected speedup win.

    Returns:
        ``(draft, info)``: a :class:`~mlx_stream.drafters.draft_model.DraftModel` over the best
        subset's layers (sharing the target's weights) with its calibrated ``depth`` and
        ``budget``: depth 0 where no subset is expected to pay on this device (the loop
        then decodes plainly unless ``num_draft_tokens`` forces a chain); ``info`` has
        every candidate's ``keep``, ``alpha``, ``r``, ``depth`` and ``speedup``, and ``best``.

    Raises:
        ValueError: a model that is not of the llama family, or too shallow to skip layers.
    """
    bb = model.backbone
    num = len(bb.model.layers) if hasattr(getattr(bb, "model", None), "layers") else 0
    if not num:
        raise ValueError("self-speculative drafting needs a llama-family model (model.layers)")
    if not subset_candidates(num):
        raise ValueError(
            f"a model of {num} layers has no layer subset to draft with (self-speculative drafting)"
        )

    def measure():
        cands = subset_candidates(num)
        print(
            f"choosing the layers a self-speculative draft keeps, once (cached): the target writes "
            f"{CALIBRATION_PROMPTS} x {CALIBRATION_TOKENS} tokens of text, then {len(cands)} layer subsets "
            "are measured on it",
            file=sys.stderr,
        )
        tic = time.perf_counter()
        costs = device_costs(model)
        seqs = _calibration_text(model, tokenizer)
        targets = [mx.array(out) for _, out in seqs]
        t_full = _forward_ms(bb)
        rows = []
        t_first = time.perf_counter()
        for i, keep in enumerate(cands):
            if i == 1:  # the rest take about as long as the first
                more = (time.perf_counter() - t_first) * (len(cands) - 1)
                print(f"  1/{len(cands)} measured; about {more:.0f} s more", file=sys.stderr)
            view = layer_subset(bb, keep)
            alpha = _agreement(view, targets, seqs)
            r = _forward_ms(view) / t_full
            k, s = best_depth(alpha, r, costs)
            rows.append({"keep": list(keep), "alpha": alpha, "r": r, "depth": k, "speedup": s})
        best = max(range(len(rows)), key=lambda i: rows[i]["speedup"])
        row = rows[best]
        row["budget"] = tree_budget(row["depth"], costs) if row["depth"] else 0
        row["node_costs"] = node_costs(layer_subset(bb, row["keep"]))
        return {"candidates": rows, "best": best} | _done(tic)

    what = {"name": "self", "layers": num, "v": CALIBRATION_VERSION}
    info = _cached(model, what, cache_dir, refresh, measure)
    row = info["candidates"][info["best"]]
    kept = ",".join(map(str, row["keep"]))
    draft = DraftModel(layer_subset(bb, row["keep"]), model.args.vocab_size, name=f"self (layers {kept})")
    draft.depth, draft.budget, draft.calibration = row["depth"], row["budget"], row
    return draft, info
