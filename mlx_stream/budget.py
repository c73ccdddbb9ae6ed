"""A draft tree budgeted across sources: the heads, prompt lookup and the datastore.

Each step, every source offers candidate nodes with an estimated acceptance
probability: the heads their candidate trees grown node by node (each node worth
the tau it added on held-out data, ``HeadConfig.tree_taus``, times a calibration
measured while decoding), prompt lookup's copy and the datastore's chain their
tokens (node k worth p^k, p the source's measured per-token acceptance after a
match of that length). The step drafts the nodes that maximise expected tokens per
unit of time, ``(1 + sum of the chosen values) / cost``, where the cost is this
device's measured forward cost c(N) for N nodes plus the heads' drafting time
(:func:`mlx_stream.cost.device_costs`), scaled by what drafting steps are measured to cost while
decoding (:meth:`BudgetDrafter.observe_time`): the budget N follows from the device's
c(N) instead of a fixed tree (EAGLE-2, Li et al. 2024, expands a draft tree by estimated acceptance;
Sequoia, Chen et al. 2024, sizes a tree to the hardware; here the candidates come
from three sources at once).

The tree's shape depends only on host-side numbers (the values, the chains copied
on the host and their lengths), so the heads' drafts stay on the device and each
step keeps its single host sync.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from .checks import require_int
from .cost import StepCosts
from .drafters.base import NoDrafter, accepted_nodes, propose
from .drafters.lookup import LookupDrafter, append_chain, lookup_length, match_suffix
from .drafters.stream_heads import HeadsDrafter
from .model import require_model
from .tree import Tree

SOURCES = ("heads", "context", "store")
# per-token acceptance of a chain after a match of 2, 3, 4, 5+ tokens, before any is
# measured (prompt lookup on held-out SmolLM2 outputs: docs/benchmarks.md, "Prompt lookup";
# the datastore's are guesses a little below)
PRIORS = {"context": (0.51, 0.58, 0.76, 0.91), "store": (0.4, 0.5, 0.6, 0.7)}


def plan_budget(values: Sequence[Sequence[float]], cost: Callable[[Sequence[int]], float]) -> list[int]:
    """How many candidate nodes to take from each source.

    Candidates are taken best value first (each source's values must not increase:
    node k's ancestors come before it), and of the resulting nested plans the one
    with the largest ``(1 + sum of values) / cost(counts)`` is returned: the expected
    tokens per forward pass over the step's relative cost (the speedup bound of
    Medusa's and Sequoia's tree choice, Cai et al. 2024 sec. 2.1.2, Chen et al. 2024).

    Args:
        values: per source, the candidate nodes' acceptance probabilities in order.
        cost: the relative cost of a step drafting ``counts[s]`` nodes of source s.

    Returns:
        ``counts``, one per source (all zero when no draft pays).
    """
    counts = [0] * len(values)
    best, best_counts, total = 1.0 / cost(counts), list(counts), 1.0
    heap = [(-v[0], s) for s, v in enumerate(values) if len(v)]
    heapq.heapify(heap)
    while heap:
        neg, s = heapq.heappop(heap)
        counts[s] += 1
        total -= neg
        if counts[s] < len(values[s]):
            heapq.heappush(heap, (-values[s][counts[s]], s))
        r = total / cost(counts)
        if r > best:
            best, best_counts = r, list(counts)
    return best_counts


def head_values(candidates: Sequence[tuple[Tree, float]], max_nodes: int = 15) -> list[tuple[Tree, float]]:
    """The heads' candidate trees by size (1 to ``max_nodes`` drafted nodes) and each
    one's last node's value: the held-out tau it added, made non-increasing.

    Args:
        candidates: ``(tree, tau)`` pairs, the heads' parsed ``HeadConfig.tree_taus``
            (:func:`mlx_stream.speculation.candidate_trees`; the drafting plan's
            ``candidates``). Empty gives an empty list.
    """
    taus = {}
    for t, tau in candidates:
        if 1 < t.size <= max_nodes + 1 and (t.size not in taus or tau > taus[t.size][1]):
            taus[t.size] = (t, float(tau))
    out, prev, last = [], 1.0, 1.0
    for size in range(2, max_nodes + 2):
        if size not in taus:
            break
        tree, tau = taus[size]
        last = min(last, max(tau - prev, 0.0))
        out.append((tree, last))
        prev = tau
    return out


class BudgetDrafter(LookupDrafter):
    """Prompt lookup, the datastore and the heads in one budgeted tree per step.

    Each step the candidates are the heads' candidate trees (:func:`head_values`,
    their held-out values times :attr:`calibration`), prompt lookup's copy after the
    context's longest repeated suffix, and the datastore's most frequent continuation
    (both up to ``num_draft`` tokens; the store's chain is dropped where it starts
    like the copy); :func:`plan_budget` picks how many nodes of each to draft under
    this device's :class:`StepCosts`. The chains join under the root as
    :class:`~mlx_stream.drafters.lookup.LookupDrafter`'s chain does, so verification (greedy
    or exact sampling) is unchanged and output stays lossless.

    Estimates are learned from every verified step (:meth:`observe`): a chain's
    per-token acceptance p by source and match length (node k is worth p^k), and the
    ratio of the tokens the heads' nodes gave to what their values predicted. A source
    that the budget leaves out is still drafted (two nodes) every ``explore_every``-th
    time it has a chain, so its estimate can recover. Costs are learned too
    (:meth:`observe_time`): the step costs are scaled by :attr:`cost_scale`, the
    measured time of drafting steps over what :class:`StepCosts` predicted for them
    (host work per node, verification and cache compaction are not in c(N), and plain
    steps are queued ahead while drafting steps are not), relative to the measured time
    of plain steps; old drafting times are forgotten while only plain steps run, so
    drafting is tried again.

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel` (heads optional).
        costs: the device's :class:`StepCosts` (:func:`mlx_stream.cost.device_costs`).
        base: the heads' drafter for their configured tree (used where the heads carry
            no candidate trees, and as :attr:`tree`), or :class:`NoDrafter`.
        num_draft: the longest chain (>= 1).
        store: a datastore (:class:`~mlx_stream.datastore.DraftStore`), or None.
        candidates: the heads' parsed candidate trees and their held-out taus
            (``(tree, tau)`` pairs: the drafting plan's ``candidates``,
            :func:`mlx_stream.speculation.plan_drafting`); empty: the heads draft
            ``base``'s tree alone.
        max_heads: the largest heads tree considered, in drafted nodes.
        decay: the weight of each new observation in the estimates.
        explore_every: see above.
        max_ngram, min_ngram: suffix lengths matched (prompt lookup, datastore).
        chains: False drafts the heads alone (prompt lookup off).

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: ``num_draft < 1``.
    """

    def __init__(
        self,
        model,
        costs: StepCosts,
        base=None,
        num_draft: int = 10,
        store=None,
        candidates: Sequence[tuple[Tree, float]] = (),
        max_heads: int = 15,
        decay: float = 0.05,
        explore_every: int = 16,
        max_ngram: int = 6,
        min_ngram: int = 2,
        chains: bool = True,
    ):
        require_model(model)
        if not isinstance(costs, StepCosts):
            raise TypeError(
                f"costs must be StepCosts (mlx_stream.cost.device_costs(model)), got {type(costs).__name__}"
            )
        require_int(max_heads, "max_heads", 1)
        base = base if base is not None else NoDrafter()
        super().__init__(
            base, num_draft, max_ngram, min_ngram, explore_every=explore_every, decay=decay, store=store
        )
        self.model, self.costs, self.chains = model, costs, chains
        cands = head_values(candidates, max_heads) if model.heads is not None else []
        self._heads = [HeadsDrafter(model, t) for t, _ in cands]
        self.head_values = [v for _, v in cands]
        # estimates: (accepted, reached) pseudo-counts per (source, match bucket); heads: (got, predicted)
        self._acc = {(s, b): [2.0 * p, 2.0] for s, ps in PRIORS.items() for b, p in enumerate(ps)}
        self._cal = [1.0, 1.0]
        self._skips = {"context": 0, "store": 0}
        self._plan: dict | None = None
        self._shapes: dict = {}  # (tree, chain lengths) -> merged shape (_merged)
        self._plain_s: list[float] = []  # the latest plain steps' wall times (s)
        self._draft_s: list[tuple[float, float]] = []  # the latest drafting steps': (s, predicted cost)
        self._plain_run = 0  # plain steps since the last drafting step

    @property
    def cost_scale(self) -> float:
        """Measured drafting steps' time over their predicted relative cost times the
        plain step's time (medians of the latest 16; 1.0 until 4 drafting steps were
        timed; clipped to [0.5, 3])."""
        if len(self._draft_s) < 4:
            return 1.0
        t1 = statistics.median(self._plain_s) if len(self._plain_s) >= 3 else self.costs.t1_ms / 1e3
        return min(max(statistics.median(s / c for s, c in self._draft_s) / t1, 0.5), 3.0)

    def observe_time(self, size: int, seconds: float) -> None:
        """Learn from a timed step: ``size`` its tree's nodes (1: plain), ``seconds`` its
        wall time."""
        if size == 1:
            self._plain_s = (self._plain_s + [seconds])[-16:]
            self._plain_run += 1
            if self._plain_run % 32 == 0 and self._draft_s:  # drafting left off: forget its oldest time
                self._draft_s.pop(0)
        elif self._plan is not None and self._plan["tree"].size == size:
            self._draft_s = (self._draft_s + [(seconds, self._plan["cost"])])[-16:]
            self._plain_run = 0

    @property
    def calibration(self) -> float:
        """Tokens the heads' nodes gave per token their held-out values predicted."""
        return self._cal[0] / self._cal[1]

    def acceptance(self, source: str, n: int) -> float:
        """The estimated per-token acceptance of ``source``'s chain after an n-token match."""
        a, r = self._acc[(source, min(max(n, 2), 5) - 2)]
        return a / r

    def _chains(self, tokens, max_depth: int) -> dict:
        k = min(self.num_draft, max_depth) if self.chains else 0
        out = {}
        n, start = match_suffix(tokens, self.max_ngram, self.min_ngram)
        if n and k:
            from .drafters.lookup import copy_from

            out["context"] = (n, copy_from(tokens, start, lookup_length(n, k)))
        if self.store is not None and k:
            m, toks = self.store.lookup_ngram(tokens, k, self.min_ngram)
            if toks and not ("context" in out and out["context"][1][:1] == toks[:1]):
                out["store"] = (m, toks)
        return {s: c for s, c in out.items() if c[1]}

    def _counts(self, chains: dict, heads: bool, count_skips: bool) -> list[int]:
        values = [[v * self.calibration for v in self.head_values] if heads else []]
        for s in SOURCES[1:]:
            if s in chains:
                p = self.acceptance(s, chains[s][0])
                values.append(list(p ** np.arange(1, len(chains[s][1]) + 1)))
            else:
                values.append([])
        scale = self.cost_scale
        counts = plan_budget(values, lambda c: self.costs.step(c) * (scale if any(c) else 1.0))
        for i, s in enumerate(SOURCES[1:], start=1):
            if s in chains and counts[i] == 0:
                if self._skips[s] + 1 >= self.explore_every:
                    if count_skips:
                        self._skips[s] = 0
                    counts[i] = min(2, len(chains[s][1]))
                elif count_skips:
                    self._skips[s] += 1
        return counts

    def may_chain_after(self, tokens) -> bool:
        """Whether a step rooted at the token after ``tokens`` may draft a chain (then the
        loop does not queue a plain step ahead): the budget, without the heads, would
        draft one from the chains that already match."""
        chains = self._chains(tokens, self.num_draft)
        return bool(chains) and any(self._counts(chains, heads=False, count_skips=False)[1:])

    def propose(self, hidden, tokens, max_depth: int, mid=None, cache=None, base: bool = True, noise=None):
        """The step's budgeted tree and its ``(N - 1,)`` drafts, at most ``max_depth``
        deep; ``base=False`` leaves the heads out (chains only)."""
        self._plan = None
        chains = self._chains(tokens, max_depth)
        use_heads = base and max_depth >= 1 and self.model.heads is not None
        if use_heads and not self._heads:  # heads without candidate trees: their configured tree
            tree, drafts = propose(self.base, hidden, tokens, max_depth, mid, cache, base=True, noise=noise)
            counts = [0] + self._counts(chains, heads=False, count_skips=True)[1:]
            cost = self.costs.forward(tree.size + sum(counts))
        else:
            counts = self._counts(chains, heads=use_heads, count_skips=True)
            h = counts[0]
            drafter = self._heads[h - 1] if h else self.base
            tree, drafts = propose(drafter, hidden, tokens, max_depth, mid, cache, base=h > 0, noise=noise)
            cost = self.costs.step(counts)
        lengths = tuple(counts[1:])
        if any(lengths):
            tree, take, groups = self._merged(tree, lengths)
            toks = [t for src, n in zip(SOURCES[1:], lengths) if n for t in chains[src][1][:n]]
            drafts = mx.concatenate([drafts, mx.array(toks, dtype=mx.int32)])[take]
        else:
            groups = {"heads": set(range(1, tree.size))}
        self._plan = {
            "tree": tree,
            "groups": groups,
            "chains": {s: chains[s][0] for s in SOURCES[1:] if counts[SOURCES.index(s)]},
            "heads_value": sum(self.head_values[: counts[0]]) * self.calibration if counts[0] else 0.0,
            "cost": cost,
        }
        return tree, drafts

    def _merged(self, tree: Tree, lengths: tuple) -> tuple:
        # the tree with each source's chain (lengths, in SOURCES order after the heads) under
        # the root; the indices that put concatenate([tree's drafts, chains...]) in node
        # order; each source's node indices. Built once per shape (a handful per tree).
        key = (tree, lengths)
        if key not in self._shapes:
            if len(self._shapes) >= 4096:
                self._shapes.clear()
            index = list(range(tree.size - 1))  # node i + 1 -> its draft in the concatenation
            groups, offset = {"heads": set(range(1, tree.size))}, tree.size - 1
            for src, n in zip(SOURCES[1:], lengths):
                if not n:
                    continue
                tree, take = append_chain(tree, n)
                take = take.tolist()
                where = {j: node for node, j in enumerate(take, start=1)}  # old draft j -> new node
                groups = {g: {where[i - 1] for i in nodes} for g, nodes in groups.items()}
                groups[src] = {node for node, j in enumerate(take, start=1) if j >= len(index)}
                index = [index[j] if j < len(index) else offset + j - len(index) for j in take]
                offset += n
            self._shapes[key] = tree, mx.array(index, dtype=mx.int32), groups
        return self._shapes[key]

    def observe(self, tree: Tree, tokens, emitted) -> None:
        """Learn from a verified step: each chain's accepted tokens, and the heads'."""
        plan, self._plan = self._plan, None
        if plan is None or plan["tree"] is not tree:
            return
        deepest = dict.fromkeys(plan["groups"], 0)
        for i in accepted_nodes(tree, tokens, emitted):
            for g, nodes in plan["groups"].items():
                if i in nodes:
                    deepest[g] = max(deepest[g], int(tree.depths[i]))
        w = 1.0 - self.decay
        for s, n in plan["chains"].items():
            length = len(plan["groups"][s])
            est = self._acc[(s, min(max(n, 2), 5) - 2)]
            est[0] = w * est[0] + deepest[s]
            est[1] = w * est[1] + min(deepest[s] + 1, length)
        if plan["heads_value"] > 0:
            self._cal[0] = w * self._cal[0] + deepest["heads"]
            self._cal[1] = w * self._cal[1] + plan["heads_value"] / self.calibration
