"""An EAGLE-style draft layer's drafts (EAGLE, Li et al. 2024; EAGLE-2's context-aware
and dynamic trees, Li et al. 2024b): a static tree filled depth by depth, or the
budgeted dynamic tree reranked by cumulative draft log-probability.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..tree import Tree, build_tree, chain, check_depth, no_drafts
from .base import Backlog, topk
from .stream_heads import HeadsDrafter


class EagleDrafter:
    """Draft with an EAGLE-style draft layer (``"eagle"`` heads), autoregressively.

    The layer keeps its own KV cache of entries ``[f_i; e(x_{i+1})]`` (Li et al. 2024,
    sec. 4), in step with the accepted tokens: each call first drops the previous
    call's speculative entries, then appends the entries of the positions verified
    since (the backbone's features of the accepted path, ``hidden``; after steps drafted
    without the layer, theirs too, in the same call), whose last
    output f^_r (r: the root's position) scores the depth-1 drafts. The tree is then
    filled depth by depth as for hydra heads: the children of a node at depth
    d >= 1 are the top-k of the entry ``[f^ that drafted it; e(its token)]`` at
    position r + d - 1, which attends to every committed entry, its ancestors'
    entries and itself (a tree mask), so siblings' subtrees differ (EAGLE-2's
    context-aware tree, Li et al. 2024b). One batched layer call per depth, all lazy.

    A prompt-cache prefix reused from an earlier call (chat) has no entries: the
    drafts then attend to the new tokens only (output is unaffected).

    With fused features (``heads.config.fuse_layers``, EAGLE-3) the loop hands it each
    position's final hidden state followed by the inputs of those layers
    (``fuse_layers``: the decode loop captures them in the same forward pass).

    Args:
        model: a model whose heads are ``"eagle"``.
        tree: the tree to fill (no deeper than ``num_heads``).

    Raises:
        ValueError: the model's heads are not ``"eagle"``, or the tree is too deep.
    """

    capture = None
    reads_path = True
    coupled = True

    def __init__(self, model, tree: Tree):
        from mlx_lm.models.cache import KVCache

        if model.heads is None or not model.heads.autoregressive:
            raise ValueError("EagleDrafter needs eagle heads")
        check_depth(tree, model.heads.num_heads)
        self.model = model
        self.tree = tree
        self.fuse_layers = tuple(model.heads.config.fuse_layers)
        self._ids = model.heads.draft_ids if model.heads.config.draft_vocab_size else None
        self._rows = None
        layer = model.heads.eagle
        # a published EAGLE-3 layer scores with its own output head (its draft vocabulary's
        # rows); ours with the backbone's (its rows of a reduced draft vocabulary)
        self._own_head = hasattr(layer, "logits")
        if self._ids is not None and not self._own_head:
            from ..heads import output_weight

            self._rows = output_weight(model.backbone)[self._ids]
        self._own_embed = "embed_tokens" in layer
        self._head_input = hasattr(layer, "head_input")
        self._levels = HeadsDrafter._plan_levels(self.tree)
        self._masks = self._plan_masks(self.tree)
        self.cache = KVCache()
        self._committed = 0  # entries of verified positions in the cache
        self._next = None  # the position the next verified entry is for
        self._backlog = Backlog()  # positions of steps drafted without the layer

    def _features(self, hidden):
        hidden = hidden.reshape(-1, hidden.shape[-1])
        width = (1 + len(self.fuse_layers)) * self.model.state_size
        if hidden.shape[-1] != width:
            raise ValueError(
                f"these eagle heads read {width}-wide features (the final hidden state and the inputs "
                f"of layers {list(self.fuse_layers)}), got {hidden.shape[-1]}"
            )
        return hidden

    def _record(self, hidden, tokens) -> None:
        # a step drafted without the layer: its positions wait for the next drafted step
        self._backlog.add(self._features(hidden), len(tokens) - 1)

    def _commit(self, hidden, tokens):
        # drop the last call's speculative entries, append those of the positions verified
        # since (with the backlog's, in one call); returns their outputs (P, H) and the root's
        # position r
        r = len(tokens) - 1
        hidden = self._backlog.take(self._features(hidden), r)
        P = hidden.shape[0]
        if self._next != r - P:  # first call, or a gap: start over from these positions
            self._committed = 0
        if self.cache.offset > self._committed:
            self.cache.trim(self.cache.offset - self._committed)
        self._next = r
        new = mx.array(tokens[r - P + 1 : r + 1], dtype=mx.int32)  # x_{i+1} of each new entry
        pos = mx.arange(r - P, r, dtype=mx.int32)
        mask = None
        if P > 1:
            mask = mx.concatenate(
                [mx.ones((P, self._committed), dtype=mx.bool_), mx.tril(mx.ones((P, P), dtype=mx.bool_))],
                axis=1,
            )
        out = self.model.heads.eagle(hidden, self._embed(new), pos, mask, self.cache)
        self._committed += P
        return out, r

    def _embed(self, tokens: mx.array) -> mx.array:
        # the draft layer's own input embedding where a published checkpoint carries one
        if self._own_embed:
            return self.model.heads.eagle.embed(tokens).astype(mx.float32)
        return self.model.embed(tokens)

    def _logits(self, feats: mx.array) -> mx.array:
        # (..., V) or (..., V') over the draft vocabulary (self._ids maps rows to tokens)
        layer = self.model.heads.eagle
        if self._own_head:
            return layer.logits(feats)
        if self._head_input:  # an MTP module's own norm before the target's head
            feats = layer.head_input(feats)
        return self.model.project(feats, self._rows)

    @staticmethod
    def _plan_masks(tree: Tree) -> list:
        # per depth d >= 2: the bool mask of its parents' new entries over the speculative
        # entries made so far plus themselves (ancestors at depth >= 1, and self)
        masks, entry = [None], {}
        for d in range(2, tree.depth + 1):
            parents = sorted({int(tree.parents[i]) for i in range(tree.size) if tree.depths[i] == d})
            n0, rows = len(entry), []
            for a, node in enumerate(parents):
                row = [False] * (n0 + len(parents))
                p = int(tree.parents[node])
                while p > 0:
                    row[entry[p]] = True
                    p = int(tree.parents[p])
                row[n0 + a] = True
                rows.append(row)
            for a, node in enumerate(parents):
                entry[node] = n0 + a
            masks.append(mx.array(rows, dtype=mx.bool_))
        return masks

    def draft(self, hidden, tokens, mid=None, cache=None, max_depth: int | None = None, noise=None):
        """``hidden``: ``(P, H)`` (fused: ``(P, (1 + n) H)``) the backbone's features of
        the P positions verified since the last call (the prompt's at the first call),
        the root's parent last. ``max_depth=0`` only records them (a step drafted
        without the layer: they wait in a :class:`~mlx_stream.drafters.base.Backlog` and
        enter the layer's cache with the next drafted step's, in one call); a call whose
        positions do not follow the last one's starts a fresh cache. ``noise``: as for
        :class:`HeadsDrafter` (sampling).

        Raises:
            ValueError: ``hidden`` is not as wide as the heads' features."""
        draft = self.model.heads.eagle
        depth = self.tree.depth if max_depth is None else min(max_depth, self.tree.depth)
        if depth < 1:
            self._record(hidden, tokens)
            return mx.zeros((0,), dtype=mx.int32)
        out, r = self._commit(hidden, tokens)
        feats = out[-1:]  # (1, H): the feature that scores the root's children
        toks = mx.array([tokens[-1]], dtype=mx.int32)
        outs = []
        for d, (k, prow, crow, rank) in enumerate(self._levels[:depth], start=1):
            scored = feats
            if d > 1:  # one entry per parent: [the feature that drafted it; its token]
                spec = self._masks[d - 1]
                m = mx.concatenate([mx.ones((spec.shape[0], self._committed), dtype=mx.bool_), spec], axis=1)
                p = mx.full((spec.shape[0],), r + d - 2, dtype=mx.int32)
                scored = draft(feats[prow], self._embed(toks[prow]), p, m, self.cache)
            logits = self._logits(scored)
            if noise is not None:
                logits = noise.perturb(logits, d, self._ids)
            top = topk(logits, k)  # (n_parents, k)
            toks = top[crow, rank]
            if self._ids is not None:
                toks = self._ids[toks]
            toks = toks.astype(mx.int32)
            feats = scored[crow]
            outs.append(toks)
        return mx.concatenate(outs)


def select_dynamic_tree(
    values: np.ndarray, parents: np.ndarray, ranks: np.ndarray, budget: int
) -> tuple[list[tuple[int, ...]], list[int]]:
    """EAGLE-2's reranking (Li et al. 2024b, sec. 4.2): the ``budget - 1`` drafted
    candidates with the highest cumulative draft log-probability, as a tree.

    Args:
        values: ``(C,)`` float, each candidate's cumulative log-probability (its own
            draft log-probability plus its parent's value).
        parents: ``(C,)`` int, the parent candidate's index (-1: the root); a parent
            precedes its children.
        ranks: ``(C,)`` int, the candidate's rank among its parent's children.
        budget: the most nodes of the tree, root included (>= 1).

    Returns:
        ``(paths, picked)``: the chosen candidates' rank paths (for
        :func:`~mlx_stream.tree.build_tree`) and their candidate indices, in the same
        order. A candidate is chosen only with its parent (a child's value never
        exceeds its parent's; ties go to the shallower node), so the result is a tree.
    """
    depth = np.zeros(len(values), np.int32)
    for c, p in enumerate(parents):
        depth[c] = 1 if p < 0 else depth[p] + 1
    order = np.lexsort((depth, -np.asarray(values, np.float64)))  # value desc, then shallower
    path: dict[int, tuple[int, ...]] = {}
    picked = []
    for c in order:
        if len(picked) >= budget - 1:
            break
        p = int(parents[c])
        if p >= 0 and p not in path:
            continue  # its parent did not make the cut
        path[int(c)] = (path[p] if p >= 0 else ()) + (int(ranks[c]),)
        picked.append(int(c))
    return [path[c] for c in picked], picked


def reranked_tree(
    trees: dict, vals: mx.array, pars: mx.array, rks: mx.array, budget: int
) -> tuple[Tree, mx.array]:
    """The tree of the ``budget - 1`` best evaluated candidates (:func:`select_dynamic_tree`)
    and ``(N - 1,)`` int32 candidate indices in its node order; ``trees`` caches the
    shapes seen (a handful recur), cleared past 4096."""
    paths, picked = select_dynamic_tree(np.array(vals), np.array(pars), np.array(rks), budget)
    key = tuple(paths)
    tree = trees.get(key)
    if tree is None:
        if len(trees) >= 4096:
            trees.clear()
        tree = trees[key] = build_tree(paths)
    where = dict(zip(paths, picked))
    return tree, mx.array([where[c] for c in tree.choices], dtype=mx.int32)


class DynamicTreeDrafter(EagleDrafter):
    """EAGLE-2's budgeted dynamic draft tree (Li et al. 2024b, sec. 4) for eagle heads.

    The tree's shape follows the draft layer's own confidence, step by step.
    **Expansion**: depth 1 holds the root's ``width`` most likely children; at each
    deeper level the ``width`` candidates of the level above with the highest
    cumulative draft log-probability (their value) are run through the draft layer
    (one batched call, each entry attending to the committed context, its ancestors'
    entries and itself) and each proposes its ``width`` most likely children.
    **Reranking**: the ``budget - 1`` candidates of highest value become the tree
    (:func:`select_dynamic_tree`). Expansion stays on the device; the reranking reads
    the candidates back (one host sync per drafted step, which static trees avoid).
    Verification is unchanged, so output stays lossless.

    Args:
        model: a model whose heads are ``"eagle"``.
        budget: the most nodes per tree, root included (>= 2); ``tree="dynamic:auto"``
            picks it from this device's measured cost of an N-node forward
            (:func:`mlx_stream.speculation.make_drafter`).
        width: children per expanded node and nodes expanded per level (>= 1).
        depth: the deepest level (default: the heads' ``num_heads``, at most ``budget - 1``:
            no deeper level can enter the tree).

    Raises:
        ValueError: heads that are not ``"eagle"``, or a budget, width or depth out of range.
    """

    dynamic_tree = True  # the tree's shape changes step by step (adaptive speculation times each)

    def __init__(self, model, budget: int, width: int = 4, depth: int | None = None):
        if model.heads is None or not model.heads.autoregressive:
            raise ValueError("a dynamic draft tree needs eagle heads (an EAGLE-style draft layer)")
        depth = min(model.heads.num_heads, budget - 1) if depth is None else depth
        if budget < 2 or width < 1 or not 1 <= depth <= model.heads.num_heads:
            raise ValueError(
                f"dynamic tree: budget must be >= 2, width >= 1 and depth in 1..{model.heads.num_heads}, "
                f"got {budget}, {width}, {depth}"
            )
        super().__init__(model, chain(depth))
        self.budget, self.width, self.depth = budget, width, depth
        self._trees: dict[tuple, Tree] = {}
        self.values = mx.zeros((0,))  # the last tree's (N - 1,) cumulative draft log-probabilities

    def propose(
        self, hidden, tokens, max_depth: int, mid=None, cache=None, base: bool = True, noise=None
    ) -> tuple[Tree, mx.array]:
        """This step's tree (at most ``max_depth`` deep; ``base=False``: root only, the
        verified positions still recorded) and its ``(N - 1,)`` int32 drafts, node order."""
        depth = min(self.depth, max_depth) if base else 0
        if depth < 1:
            self._record(hidden, tokens)
            return no_drafts(), mx.zeros((0,), dtype=mx.int32)
        out, r = self._commit(hidden, tokens)
        draft, k = self.model.heads.eagle, self.width
        toks, vals, pars, rks = [], [], [], []
        # depth 1: the root's children, scored by the last committed entry's output
        lp = self._log_probs(out[-1:], 1, noise)[0]
        top = topk(lp, k)
        toks.append(top)
        vals.append(lp[top])
        pars.append(mx.full((k,), -1, dtype=mx.int32))
        rks.append(mx.arange(k, dtype=mx.int32))
        level_feat = mx.broadcast_to(out[-1:], (k, out.shape[-1]))  # what drafted each candidate
        level_entry = mx.full((k,), -1, dtype=mx.int32)  # the speculative entry that scored it
        level0, anc = 0, mx.zeros((0, 0), dtype=mx.bool_)  # first candidate index of the level
        for d in range(2, depth + 1):
            sel = topk(vals[-1], min(k, vals[-1].shape[0]))  # the level's best, expanded
            n, E = sel.shape[0], anc.shape[0]
            # each new entry sees its parent's entry, that entry's ancestors, and itself
            with_self = mx.concatenate([mx.zeros((1, E), dtype=mx.bool_), anc | mx.eye(E, dtype=mx.bool_)])
            rows = with_self[level_entry[sel] + 1]  # (n, E)
            spec = mx.concatenate([rows, mx.eye(n, dtype=mx.bool_)], axis=1)
            anc = mx.concatenate(
                [mx.pad(anc, [(0, 0), (0, n)]), mx.concatenate([rows, mx.zeros((n, n), mx.bool_)], 1)]
            )
            m = mx.concatenate([mx.ones((n, self._committed), dtype=mx.bool_), spec], axis=1)
            pos = mx.full((n,), r + d - 2, dtype=mx.int32)
            g = draft(level_feat[sel], self._embed(toks[-1][sel]), pos, m, self.cache)  # (n, H)
            lp = self._log_probs(g, d, noise)  # (n, V')
            top = topk(lp, k)  # (n, k)
            toks.append(top.reshape(-1))
            vals.append((vals[-1][sel][:, None] + mx.take_along_axis(lp, top, axis=-1)).reshape(-1))
            pars.append(mx.repeat(level0 + sel.astype(mx.int32), k))
            rks.append(mx.tile(mx.arange(k, dtype=mx.int32), n))
            level0 += vals[-2].shape[0]
            level_feat = mx.repeat(g, k, axis=0)
            level_entry = mx.repeat(E + mx.arange(n, dtype=mx.int32), k)
        toks, vals, pars, rks = (mx.concatenate(a) for a in (toks, vals, pars, rks))
        if self._ids is not None:
            toks = self._ids[toks]
        mx.eval(toks, vals, pars, rks)
        tree, order = reranked_tree(self._trees, vals, pars, rks, self.budget)
        self.values = vals[order]  # the nodes' cumulative draft log-probabilities, node order
        return tree, toks[order].astype(mx.int32)

    def _log_probs(self, feats, d, noise):
        logits = self._logits(feats)
        if noise is not None:
            logits = noise.perturb(logits, d, self._ids)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
