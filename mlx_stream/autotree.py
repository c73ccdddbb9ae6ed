"""``tree="auto"``: the draft tree that maximises expected tokens per second on this device.

A tree of N drafted nodes is worth its expected tokens per forward pass, tau (from the
heads' held-out acceptance, measured at training: ``HeadConfig.tree_taus``), divided by
what a step with it costs relative to a plain step on this device: the (N+1)-token
forward's cost c(N+1) plus the time to draft the tree. tau / cost is the speedup the
tree would give if the loop had no other overhead (Medusa's tree choice, Cai et al.
2024, sec. 2.1.2, with the device's measured cost model in place of a fixed budget;
cf. Sequoia, Chen et al. 2024). The costs depend on the device, the dtype and the
BLAS, so the choice is measured once per model + heads + device and cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path

from .cost import draft_times, forward_cost
from .files import write_json
from .tree import Tree, format_tree, parse_tree


def score_trees(model, candidates: Sequence[tuple[Tree, float]], repeats: int = 5) -> dict:
    """Score candidate trees on this device.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel` with heads.
        candidates: ``(tree, tau)`` pairs (tau: expected tokens per forward pass).
        repeats: timing repeats per forward size (medians).

    Returns:
        ``{"best": i, "t1_ms": ..., "sizes": [{"tree", "nodes", "tau", "cost", "draft_ms",
        "speedup_bound"}, ...]}`` in the order of ``candidates``; ``cost`` is c(N+1) plus
        the drafting time in units of a 1-token forward, ``speedup_bound = tau / cost``.
    """
    nodes = [t.size for t, _ in candidates]
    costs = forward_cost(model, sizes=tuple(sorted(set(nodes) | {1})), repeats=repeats)
    drafted = [t for t, _ in candidates if t.size > 1]
    ms = iter(draft_times(model, drafted, repeats=repeats) if drafted else [])
    sizes = []
    for tree, tau in candidates:
        d = next(ms) if tree.size > 1 else 0.0
        cost = costs[tree.size] + d / costs["t1_ms"]
        sizes.append(
            {
                "tree": format_tree(tree) or "none",
                "nodes": tree.size - 1,
                "tau": tau,
                "cost": cost,
                "draft_ms": d,
                "speedup_bound": tau / cost,
            }
        )
    best = max(range(len(sizes)), key=lambda i: sizes[i]["speedup_bound"])
    return {"best": best, "t1_ms": costs["t1_ms"], "sizes": sizes}


def device_key(model) -> dict:
    """What the costs depend on: the heads, the backbone, its dtype, and the machine."""
    import mlx.core as mx

    from .env import openblas_active

    cfg = model.heads.config if model.heads is not None else None
    dtype = str(next(iter(v.dtype for _, v in _params(model.backbone))))
    return {
        "heads": hashlib.sha256(cfg.to_json().encode()).hexdigest()[:16] if cfg else None,
        "backbone": (cfg.fingerprint if cfg else None) or model.args.model_type,
        "dtype": dtype,
        "device": str(mx.default_device()),
        "machine": f"{platform.system()} {platform.machine()} {platform.processor()} {os.cpu_count()} CPUs",
        "openblas": openblas_active(),
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", ""),
    }


def _params(module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def auto_tree(model, cache_dir: str | Path | None = None, refresh: bool = False) -> tuple[Tree, dict]:
    """The tree among the heads' candidates with the best tau / cost on this device.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel` whose heads carry
            ``config.tree_taus`` (written by ``mlx-stream train``).
        cache_dir: where choices are kept (default: :func:`mlx_stream.loader.cache_dir`
            / ``trees``); one JSON file per :func:`device_key`.
        refresh: measure again even when a choice is cached.

    Returns:
        ``(tree, info)``: ``info`` is :func:`score_trees`'s result plus ``key`` and
        ``cached`` (whether it came from the cache).

    Raises:
        ValueError: no heads, or heads without candidate trees (retrain them, or pass a tree).
    """
    if model.heads is None:
        raise ValueError("tree='auto' chooses among the heads' trees: load heads first")
    cands = model.heads.config.tree_taus
    if not cands:
        raise ValueError(
            "these heads carry no candidate trees (config.json 'tree_taus', written by "
            "`mlx-stream train`); pass a tree such as '0;1;0,0' instead of 'auto'"
        )
    if cache_dir is None:
        from .loader import cache_dir as default_dir

        cache_dir = default_dir() / "trees"
    key = device_key(model)
    path = Path(cache_dir) / (
        hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json"
    )
    if path.is_file() and not refresh:
        try:
            info = json.loads(path.read_text())
            return parse_tree(info["sizes"][info["best"]]["tree"], model.heads.num_heads), info | {
                "cached": True
            }
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            pass  # an unreadable cache entry is measured again and rewritten
    # plain decoding (tau 1, cost 1) is always a candidate: no tree may be worth its cost here
    candidates = [(parse_tree("none", 1), 1.0)] + [
        (parse_tree(t, model.heads.num_heads), float(tau)) for t, tau in sorted(cands.items()) if t != "none"
    ]
    info = score_trees(model, candidates) | {"key": key}
    try:
        write_json(info, path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return candidates[info["best"]][0], info | {"cached": False}
