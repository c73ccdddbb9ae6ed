"""Drafters: what proposes the tokens of the next draft tree.

The verifier does not care where drafts come from. A drafter owns a static
:class:`~mlx_stream.tree.Tree` and, once per decoding step, fills its non-root
nodes with tokens. The stream-head drafter reads the backbone's hidden state at
the last accepted position; other drafters (the test oracle here; n-gram or a
separate draft model later) use the emitted tokens instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from .checks import require_drafter, require_int, require_number, require_token_ids
from .model import require_model
from .tree import Tree, build_tree, chain, check_depth, no_drafts


class Drafter(Protocol):
    """The drafting interface.

    Attributes:
        tree: the tree shape this drafter fills (root included).
        capture: ``None``, or the layer l whose input hidden state (and the KV cache)
            the drafter reads as well (multi-stream attention heads).

    A drafter with the attribute ``coupled = True`` also takes ``noise=``, a
    :class:`~mlx_stream.sampling.DraftNoise` (None when greedy): when sampling, its drafts
    at depth d are the top-k of ``noise.perturb(its logits, d)``, so they follow the
    target's Gumbel-max draws (see :class:`~mlx_stream.sampling.GumbelNoise`).
    """

    tree: Tree
    capture: int | None

    def draft(
        self, hidden: mx.array, tokens: Sequence[int], mid: mx.array | None = None, cache=None
    ) -> mx.array:
        """Tokens for the tree's non-root nodes.

        Args:
            hidden: ``(H,)`` the backbone's final hidden state at the last accepted
                position (the one whose canonical prediction is the root).
            tokens: every token so far, prompt and output, the root last.
            mid: ``(H,)`` the hidden state entering layer ``capture`` at that
                position (only when ``capture`` is set).
            cache: the KV cache (per layer), holding exactly the positions up to the
                last accepted one (only when ``capture`` is set).

        Returns:
            ``(tree.size - 1,)`` int32 draft tokens in node order (may stay lazy).
        """
        ...


@runtime_checkable
class TreeProposer(Protocol):
    """A drafter whose tree changes from step to step (optional, beside :class:`Drafter`).

    The loop calls :meth:`propose` instead of filling ``drafter.tree``
    (:func:`propose`); :class:`LookupDrafter` is one.
    """

    def propose(
        self,
        hidden: mx.array,
        tokens: Sequence[int],
        max_depth: int,
        mid=None,
        cache=None,
        base: bool = True,
        noise=None,
    ) -> tuple[Tree, mx.array]:
        """This step's tree (at most ``max_depth`` deep; ``base=False``: without the
        static tree) and its ``(N - 1,)`` int32 drafts in node order, lazy (no host sync);
        ``noise`` as for a coupled :class:`Drafter`."""
        ...


@runtime_checkable
class AcceptanceObserver(Protocol):
    """A drafter that learns from verification (optional): after every step the loop
    reports the verified tree, its ``N`` node tokens (root first) and the tokens the step
    emitted (the accepted drafts, then the target's next token)."""

    def observe(self, tree: Tree, tokens: Sequence[int], emitted: Sequence[int]) -> None: ...


@runtime_checkable
class StepTimer(Protocol):
    """A drafter that learns what steps cost (optional): before :meth:`AcceptanceObserver.observe`
    the loop reports each timed step's tree size (1: a plain step) and its wall time in
    seconds, from the end of the step before, the caller's time left out."""

    def observe_time(self, size: int, seconds: float) -> None: ...


class NoDrafter:
    """Drafts nothing: one token per forward pass (plain decoding, same loop)."""

    capture = None

    def __init__(self):
        self.tree = no_drafts()

    def draft(self, hidden, tokens, mid=None, cache=None):
        return mx.zeros((0,), dtype=mx.int32)


def _topk(logits: mx.array, k: int) -> mx.array:
    """``(..., V)`` -> ``(..., k)`` indices of the k largest, best first (on the device)."""
    if k == 1:
        return mx.argmax(logits, axis=-1, keepdims=True)
    part = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]  # unordered
    order = mx.argsort(-mx.take_along_axis(logits, part, axis=-1), axis=-1)
    return mx.take_along_axis(part, order, axis=-1)


class HeadsDrafter:
    """Fill the tree from the stream heads' top-k at one hidden state.

    Independent ("residual") heads: a node at depth d with rank r gets head d's r-th
    most likely token (Speculative Streaming, Bhendawade et al. 2024, sec. 3.3;
    Medusa tree candidates, Cai et al. 2024, sec. 2.1.2); the heads run once, on a
    single hidden vector.

    Path-conditioned ("hydra") heads: the tree is filled depth by depth; the children
    of a node are the top-k of head d run on that node's own path (its head state and
    its token), so siblings' subtrees differ (Hydra, Ankner et al. 2024, sec. 3). One
    small batched head call per depth.

    Multi-stream attention ("msa") heads: the K streams run through the backbone's
    top layers from the hidden state entering them at the last accepted position,
    attending to the KV cache (read only), then fill the tree as independent heads
    do (Bhendawade et al. 2024, sec. 3.1).

    When sampling (``noise``), each node's candidates are the top-k of the head's logits
    over the temperature plus the Gumbel noise of the position they draft, so the heads'
    distribution q is the proposal: a draft is accepted about as often as q agrees with
    the target's distribution, not only when the target happens to draw q's argmax
    (:class:`~mlx_stream.sampling.GumbelNoise`).

    Everything stays lazy on the device: no host sync while drafting.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
    """

    coupled = True

    def __init__(self, model, tree: Tree):
        require_model(model)
        check_depth(tree, 1 << 10)
        if model.heads is None:
            raise ValueError("HeadsDrafter needs a model with stream heads")
        check_depth(tree, model.heads.num_heads)
        self.model = model
        self.tree = tree
        self._k = max(tree.topk(), default=0)
        # a reduced draft vocabulary scores only its own rows of the output projection
        self._ids = model.heads.draft_ids if model.heads.config.draft_vocab_size else None
        self._rows = None
        if self._ids is not None:
            from .heads import output_weight

            self._rows = output_weight(model.backbone)[self._ids]
        self._head_idx = mx.array(tree.depths[1:] - 1, dtype=mx.int32)
        self._rank_idx = mx.array(tree.ranks[1:], dtype=mx.int32)
        self._levels = self._plan_levels(tree) if model.heads.conditioned else None
        cfg = model.heads.config
        self.capture = len(model.backbone.layers) - cfg.stream_layers if model.heads.attends else None

    @staticmethod
    def _plan_levels(tree: Tree):
        # per depth d: (k_d, row of each parent in level d-1, row of each child's parent
        # among those parents, each child's rank); nodes are breadth-first, so level d is
        # a contiguous run of node indices and concatenating the levels gives node order
        levels, prev = [], [0]
        for d, k in enumerate(tree.topk(), start=1):
            nodes = [i for i in range(tree.size) if tree.depths[i] == d]
            parents = sorted({int(tree.parents[i]) for i in nodes})
            levels.append(
                (
                    k,
                    mx.array([prev.index(p) for p in parents], dtype=mx.int32),
                    mx.array([parents.index(int(tree.parents[i])) for i in nodes], dtype=mx.int32),
                    mx.array([int(tree.ranks[i]) for i in nodes], dtype=mx.int32),
                )
            )
            prev = nodes
        return levels

    def draft(self, hidden, tokens, mid=None, cache=None, noise=None):
        if self.tree.size == 1:
            return mx.zeros((0,), dtype=mx.int32)
        if self._levels is not None:
            return self._draft_conditioned(hidden, tokens[-1], noise)
        if self.capture is not None:
            if mid is None or cache is None:
                raise ValueError("msa heads draft from the top layers' input and the KV cache (mid=, cache=)")
            logits = self.model.stream_logits(mid, tokens[-1], cache, self._rows)
        else:
            logits = self.model.head_logits(hidden, self._rows)
        logits = logits[: self.tree.depth]  # (D, V or V')
        if noise is not None:
            logits = mx.stack(
                [noise.perturb(logits[d - 1], d, self._ids) for d in range(1, logits.shape[0] + 1)]
            )
        top = _topk(logits, self._k)[self._head_idx, self._rank_idx]
        return (top if self._ids is None else self._ids[top]).astype(mx.int32)

    def draft_queued(self, hidden: mx.array, root: mx.array, noise=None, length=None) -> mx.array:
        """:meth:`draft` for a step queued before the host reads its root token: ``hidden``
        ``(H,)`` and ``root`` ``(1,)`` int32 may both still be computed by the step before
        (no host sync). ``length``: the tokens up to and including the root, a lazy ``()``
        int32 (unused here: the heads draft from the hidden state alone).

        Raises:
            ValueError: multi-stream attention heads (they read the KV cache of the
                accepted path, which the host has not compacted yet).
        """
        if self.capture is not None:
            raise ValueError("msa heads read the compacted KV cache: they cannot draft a queued step")
        return self.draft(hidden, [root], noise=noise)

    def _draft_conditioned(self, hidden, root, noise=None) -> mx.array:
        heads, out = self.model.heads, []
        state = hidden.astype(mx.float32)[None]  # (1, H): level 0 is the root
        if isinstance(root, mx.array):  # (1,): a step queued before its root reached the host
            toks = root.reshape(1).astype(mx.int32)
        else:
            toks = mx.array([root], dtype=mx.int32)
        for d, (k, prow, crow, rank) in enumerate(self._levels, start=1):
            s = heads.step(d, state[prow], self.model.embed(toks[prow]))  # (n_parents, H)
            logits = self.model.project(s, self._rows)
            if noise is not None:
                logits = noise.perturb(logits, d, self._ids)
            top = _topk(logits, k)  # (n_parents, k)
            toks = top[crow, rank]
            if self._ids is not None:
                toks = self._ids[toks]
            toks = toks.astype(mx.int32)
            state = s[crow]
            out.append(toks)
        return mx.concatenate(out)


class EagleDrafter:
    """Draft with an EAGLE-style draft layer (``"eagle"`` heads), autoregressively.

    The layer keeps its own KV cache of entries ``[f_i; e(x_{i+1})]`` (Li et al. 2024,
    sec. 4), in step with the accepted tokens: each call first drops the previous
    call's speculative entries, then appends the entries of the positions verified
    since (the backbone's features of the accepted path, ``hidden``), whose last
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
        if self._ids is not None:
            from .heads import output_weight

            self._rows = output_weight(model.backbone)[self._ids]
        self._levels = HeadsDrafter._plan_levels(self.tree)
        self._masks = self._plan_masks(self.tree)
        self.cache = KVCache()
        self._committed = 0  # entries of verified positions in the cache
        self._next = None  # the position the next verified entry is for

    def _commit(self, hidden, tokens):
        # drop the last call's speculative entries, append those of the positions verified
        # since; returns their outputs (P, H) and the root's position r
        hidden = hidden.reshape(-1, hidden.shape[-1])
        width = (1 + len(self.fuse_layers)) * self.model.heads.config.hidden_size
        if hidden.shape[-1] != width:
            raise ValueError(
                f"these eagle heads read {width}-wide features (the final hidden state and the inputs "
                f"of layers {list(self.fuse_layers)}), got {hidden.shape[-1]}"
            )
        P, r = hidden.shape[0], len(tokens) - 1
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
        out = self.model.heads.eagle(hidden, self.model.embed(new), pos, mask, self.cache)
        self._committed += P
        return out, r

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
        without the layer); a call whose positions do not follow the last one's starts
        a fresh cache. ``noise``: as for :class:`HeadsDrafter` (sampling).

        Raises:
            ValueError: ``hidden`` is not as wide as the heads' features."""
        draft = self.model.heads.eagle
        out, r = self._commit(hidden, tokens)
        depth = self.tree.depth if max_depth is None else min(max_depth, self.tree.depth)
        if depth < 1:
            return mx.zeros((0,), dtype=mx.int32)
        feats = out[-1:]  # (1, H): the feature that scores the root's children
        toks = mx.array([tokens[-1]], dtype=mx.int32)
        outs = []
        for d, (k, prow, crow, rank) in enumerate(self._levels[:depth], start=1):
            scored = feats
            if d > 1:  # one entry per parent: [the feature that drafted it; its token]
                spec = self._masks[d - 1]
                m = mx.concatenate([mx.ones((spec.shape[0], self._committed), dtype=mx.bool_), spec], axis=1)
                p = mx.full((spec.shape[0],), r + d - 2, dtype=mx.int32)
                scored = draft(feats[prow], self.model.embed(toks[prow]), p, m, self.cache)
            logits = self.model.project(scored, self._rows)
            if noise is not None:
                logits = noise.perturb(logits, d, self._ids)
            top = _topk(logits, k)  # (n_parents, k)
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
        out, r = self._commit(hidden, tokens)
        depth = min(self.depth, max_depth) if base else 0
        if depth < 1:
            return no_drafts(), mx.zeros((0,), dtype=mx.int32)
        draft, k = self.model.heads.eagle, self.width
        toks, vals, pars, rks = [], [], [], []
        # depth 1: the root's children, scored by the last committed entry's output
        lp = self._log_probs(out[-1:], 1, noise)[0]
        top = _topk(lp, k)
        toks.append(top)
        vals.append(lp[top])
        pars.append(mx.full((k,), -1, dtype=mx.int32))
        rks.append(mx.arange(k, dtype=mx.int32))
        level_feat = mx.broadcast_to(out[-1:], (k, out.shape[-1]))  # what drafted each candidate
        level_entry = mx.full((k,), -1, dtype=mx.int32)  # the speculative entry that scored it
        level0, anc = 0, mx.zeros((0, 0), dtype=mx.bool_)  # first candidate index of the level
        for d in range(2, depth + 1):
            sel = _topk(vals[-1], min(k, vals[-1].shape[0]))  # the level's best, expanded
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
            g = draft(level_feat[sel], self.model.embed(toks[-1][sel]), pos, m, self.cache)  # (n, H)
            lp = self._log_probs(g, d, noise)  # (n, V')
            top = _topk(lp, k)  # (n, k)
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
        logits = self.model.project(feats, self._rows)
        if noise is not None:
            logits = noise.perturb(logits, d, self._ids)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class OracleDrafter:
    """Proposes a known continuation (for tests and for measuring the loop's ceiling).

    Given the target's own greedy output for the prompt, the rank-0 path of the
    tree drafts exactly the next tokens of that output, so every draft on it is
    accepted; other ranks draft ``(true token + rank) mod V``, which is wrong.
    With ``wrong=True`` every node drafts a wrong token, so nothing is accepted.

    Args:
        prompt_len: number of prompt tokens.
        continuation: the target's output after the prompt.
        tree: the tree to fill.
        vocab_size: V.
        wrong: draft a wrong token at every depth.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
    """

    def __init__(
        self, prompt_len: int, continuation: Sequence[int], tree: Tree, vocab_size: int, wrong: bool = False
    ):
        require_int(prompt_len, "prompt_len", 0)
        require_token_ids(continuation, "continuation")
        require_int(vocab_size, "vocab_size", 1)
        check_depth(tree, 1 << 10)
        self.prompt_len = prompt_len
        self.continuation = list(continuation)
        self.tree = tree
        self.vocab_size = vocab_size
        self.wrong = wrong
        self._device = None  # (continuation, depths, rank shifts) on the device, made once

    capture = None

    def draft_queued(self, hidden, root, noise=None, length=None) -> mx.array:
        """:meth:`draft` on the device for a step queued before the host knows how many
        tokens precede it: ``length`` is the lazy ``()`` int32 count of tokens up to and
        including the root (the loop passes it); ``hidden``, ``root`` and ``noise`` are
        unused. No host sync, so the loop queues oracle steps as it queues the heads'."""
        if self._device is None:  # the continuation, then 0 (as the host's past its end)
            cont = mx.array(self.continuation + [0], dtype=mx.int32)
            depths = mx.array(self.tree.depths[1:] - 1, dtype=mx.int32)
            shifts = mx.array(self.tree.ranks[1:] + (1 if self.wrong else 0), dtype=mx.int32)
            self._device = (cont, depths, shifts)
        cont, depths, shifts = self._device
        j = mx.clip(length - self.prompt_len + depths, 0, cont.size - 1)
        return (cont[j] + shifts) % self.vocab_size

    def draft(self, hidden, tokens, mid=None, cache=None):
        pos = len(tokens) - self.prompt_len  # index in the continuation of the first draft
        out = []
        for i in range(1, self.tree.size):
            d, r = int(self.tree.depths[i]), int(self.tree.ranks[i])
            j = pos + d - 1
            true = self.continuation[j] if j < len(self.continuation) else 0
            shift = r + (1 if self.wrong else 0)
            out.append((true + shift) % self.vocab_size)
        return mx.array(out, dtype=mx.int32)


class LookupDrafter:
    """A drafter plus prompt lookup: the context's own continuation grafted beside its tree.

    Each step the base drafter fills its static tree; then the tokens that followed the
    latest earlier occurrence of the context's longest repeated suffix (``max_ngram``
    down to ``min_ngram`` tokens; :func:`~mlx_stream.lookup.prompt_lookup`) join it as
    a chain under the root, the root's last child (:func:`~mlx_stream.lookup.append_chain`).
    The merged shape depends only on the chain's length, so the base drafts never
    leave the device: the step keeps its single host sync. Where the chain repeats
    the heads' drafts, siblings hold the same token and verification keeps the longest
    accepted branch (:func:`~mlx_stream.verify.verify_greedy`), so output stays
    lossless, greedy and sampled. The chain grows with the match (2 (n - 1) tokens
    after an n-token match, at most ``num_draft``); a step without a match drafts the
    base tree alone.

    Chains pay only while they add accepted tokens: the loop reports each verified
    tree (:meth:`observe`), the drafter keeps a moving average (weight ``decay``) of the
    tokens the chain accepted beyond what the base tree accepted on its own, per chain
    node drafted, and while it is below
    ``min_accept`` (a drafted node costs about a tenth of a forward pass on a CPU) only
    every ``explore_every``-th match is drafted (from the ``prior`` of 0.25, four misses
    in a row stop it). Text that does not repeat (sampling at high temperature) thus
    stops paying for copies, and drafting resumes when it does.

    Args:
        base: the drafter whose tree the chain joins (:class:`HeadsDrafter`, or
            :class:`NoDrafter` for prompt lookup alone).
        num_draft: the longest chain, in tokens (>= 1).
        max_ngram, min_ngram: suffix lengths matched.
        min_accept, explore_every, decay, prior: the acceptance gate (above).
        store: a :class:`~mlx_stream.datastore.Datastore` of past outputs: where the
            context has no match, its most frequent continuation is the chain (REST,
            He et al. 2023), gated apart from the context's copies.

    Attributes:
        accept_rate: the moving average of tokens gained / chain nodes, starting from
            ``prior`` (so a few misses in a row are needed to stop drafting copies).

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: bad lengths.
    """

    def __init__(
        self,
        base,
        num_draft: int = 10,
        max_ngram: int = 6,
        min_ngram: int = 2,
        min_accept: float = 0.1,
        explore_every: int = 16,
        decay: float = 0.25,
        prior: float = 0.25,
        store=None,
    ):
        require_drafter(base, "base")
        for name, v in (("num_draft", num_draft), ("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            require_int(v, name)
        require_int(explore_every, "explore_every", 1)
        for name, v in (("min_accept", min_accept), ("decay", decay), ("prior", prior)):
            require_number(v, name)
        if store is not None and not hasattr(store, "lookup"):
            raise TypeError(f"store must be a Datastore, DraftStore or None, got {type(store).__name__}")
        if num_draft < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(
                f"prompt lookup needs num_draft >= 1 and 1 <= min_ngram <= max_ngram, "
                f"got {num_draft}, {min_ngram}, {max_ngram}"
            )
        self.base = base
        self.num_draft, self.max_ngram, self.min_ngram = num_draft, max_ngram, min_ngram
        self.min_accept, self.explore_every, self.decay = min_accept, max(explore_every, 1), decay
        self.capture = getattr(base, "capture", None)
        self.reads_path = getattr(base, "reads_path", False)
        self.fuse_layers = getattr(base, "fuse_layers", ())
        self.store = store
        self.rates = {"context": prior, "store": prior}  # the gate's moving average per source
        self._skipped = {"context": 0, "store": 0}
        self._pending: tuple | None = None  # (tree, chain node indices, source) of the last proposal
        self._trees: dict = {}  # merged shapes seen so far (a handful per base tree)

    @property
    def accept_rate(self) -> float:
        """The prompt-lookup chain's moving average of tokens gained per chain node."""
        return self.rates["context"]

    def _wanted(self, source: str) -> bool:
        if self.rates[source] >= self.min_accept:
            return True
        self._skipped[source] += 1
        if self._skipped[source] >= self.explore_every:
            self._skipped[source] = 0
            return True
        return False

    def observe(self, tree: Tree, tokens: Sequence[int], emitted: Sequence[int]) -> None:
        """Record a verified tree: its ``N`` node tokens (root first) and the tokens the
        step emitted (accepted drafts, then the target's next token)."""
        if self._pending is None or self._pending[0] is not tree:
            return
        chain_nodes = self._pending[1]
        # a node is accepted when its path spells a prefix of the emitted tokens
        best = {True: 0, False: 0}  # deepest accepted chain node / base node
        for i in accepted_nodes(tree, tokens, emitted):
            key = i in chain_nodes
            best[key] = max(best[key], int(tree.depths[i]))
        gain = max(best[True] - best[False], 0) / len(chain_nodes)
        source = self._pending[2]
        self.rates[source] += self.decay * (gain - self.rates[source])
        self._pending = None

    @property
    def tree(self) -> Tree:
        """The base drafter's static tree (the part drafted every step)."""
        return self.base.tree

    def may_chain_after(self, tokens: Sequence[int]) -> bool:
        """Whether a step rooted at the token after ``tokens`` (not known yet) may draft a
        chain: the context's suffix (or, without one, the store's) matches already and the
        acceptance gate would let the chain through. (A match ending at the next token
        extends one ending here, except a fresh ``min_ngram``-token one.) Where the gate
        would skip it, the skip is counted as :meth:`propose` counts it. The loop queues a
        plain step on a token still being computed only when this is False."""
        from .lookup import match_suffix

        if match_suffix(tokens, self.max_ngram, self.min_ngram)[0]:
            source = "context"
        elif self.store is not None and self.store.lookup(tokens, 1, self.min_ngram):
            source = "store"
        else:
            return False
        if self.rates[source] >= self.min_accept or self._skipped[source] + 1 >= self.explore_every:
            return True  # propose decides (and counts) on the real context
        self._skipped[source] += 1
        return False

    def propose(
        self, hidden, tokens, max_depth: int, mid=None, cache=None, base: bool = True, noise=None
    ) -> tuple[Tree, mx.array]:
        """The step's tree and its ``(N - 1,)`` drafts, at most ``max_depth`` deep;
        ``base=False`` leaves the base drafter's tree out (the lookup chain alone);
        ``noise`` goes to the base drafter (the chain is the context's own tokens)."""
        from .lookup import append_chain, prompt_lookup

        tree, drafts = propose(self.base, hidden, tokens, max_depth, mid, cache, base=base, noise=noise)
        self._pending = None
        n = min(self.num_draft, max_depth)
        source, chain_ = "context", prompt_lookup(tokens, n, self.max_ngram, self.min_ngram)
        if not chain_ and self.store is not None:
            source, chain_ = "store", self.store.lookup(tokens, n, self.min_ngram)
        if not chain_ or not self._wanted(source):
            return tree, drafts
        key = (tree, len(chain_))
        if key not in self._trees:
            if len(self._trees) >= 4096:  # a dynamic base tree changes shape step by step
                self._trees.clear()
            merged, take = append_chain(tree, len(chain_))
            grafted = {i for i, j in enumerate(take.tolist(), start=1) if j >= tree.size - 1}
            self._trees[key] = merged, mx.array(take), grafted
        merged, take, grafted = self._trees[key]
        self._pending = (merged, grafted, source)
        return merged, mx.concatenate([drafts, mx.array(chain_, dtype=mx.int32)])[take]


def accepted_nodes(tree: Tree, tokens: Sequence[int], emitted: Sequence[int]) -> list[int]:
    """The non-root nodes of a verified ``tree`` whose path spells a prefix of ``emitted``
    (the step's accepted drafts, then the target's next token); ``tokens``: the ``N`` node
    tokens, root first."""
    ok = [True] + [False] * (tree.size - 1)
    for i in range(1, tree.size):
        d = int(tree.depths[i])
        ok[i] = ok[int(tree.parents[i])] and d <= len(emitted) and int(tokens[i]) == int(emitted[d - 1])
    return [i for i in range(1, tree.size) if ok[i]]


def _proposes(drafter) -> bool:
    # isinstance(drafter, TreeProposer) without typing's runtime-protocol walk (~20 us a
    # call: it is asked every step)
    return callable(getattr(drafter, "propose", None))


def propose(
    drafter, hidden, tokens, max_depth: int, mid=None, cache=None, base: bool = True, noise=None
) -> tuple[Tree, mx.array]:
    """One step's draft tree and tokens from any drafter, at most ``max_depth`` deep.

    A :class:`TreeProposer` (a tree that changes per step, like :class:`LookupDrafter`)
    answers itself; static drafters fill ``drafter.tree``
    truncated to ``max_depth``. ``base=False`` drops the static tree (a plain step,
    plus whatever a dynamic drafter adds on its own). ``noise`` (a
    :class:`~mlx_stream.sampling.DraftNoise`, when sampling) reaches drafters that are
    ``coupled``; others draft as when greedy.

    Returns:
        ``(tree, drafts)``: ``drafts`` is ``(tree.size - 1,)`` int32 in node order.
    """
    if _proposes(drafter):
        return drafter.propose(hidden, tokens, max_depth, mid=mid, cache=cache, base=base, noise=noise)
    tree = drafter.tree.truncate(max_depth if base else 0)
    kw = {"noise": noise} if noise is not None and getattr(drafter, "coupled", False) else {}
    if getattr(drafter, "reads_path", False):  # keeps its own cache in step, drafting or not
        drafts = drafter.draft(hidden, tokens, max_depth=tree.depth, **kw)
        return tree, drafts[: tree.size - 1].astype(mx.int32)
    if tree.size == 1:
        return tree, mx.zeros((0,), dtype=mx.int32)
    if getattr(drafter, "capture", None) is None:
        drafts = drafter.draft(hidden, tokens, **kw)
    else:
        drafts = drafter.draft(hidden, tokens, mid=mid, cache=cache, **kw)
    return tree, drafts[: tree.size - 1].astype(mx.int32)


def draft_cache_of(drafter):
    """The :class:`~mlx_stream.draft_model.DraftCache` of a draft-model drafter (a
    :class:`LookupDrafter` may wrap it), or None."""
    return getattr(getattr(drafter, "base", drafter), "draft_cache", None)


def queues_steps(drafter) -> bool:
    """Whether the decode loop may queue ``drafter``'s steps before the step before is
    read back: plain steps, and steps whose tree is its static one (not for heads that
    read the KV cache or every verified position, nor for trees that change per step,
    except a :class:`LookupDrafter`'s when no chain joins). Beside a draft model, whose
    own steps wait for the host, the plain steps adaptive speculation takes instead are
    queued like any others: they do not touch its cache, which catches up with the tokens
    when it next drafts."""
    if draft_cache_of(drafter) is not None:
        return True
    return (
        getattr(drafter, "capture", None) is None
        and not getattr(drafter, "reads_path", False)
        and (not _proposes(drafter) or isinstance(drafter, LookupDrafter))
    )


def queued_drafter(drafter):
    """The static drafter that drafts a step the decode loop queues before its root token
    reaches the host (:meth:`HeadsDrafter.draft_queued`): ``drafter`` itself, or the base
    of a :class:`LookupDrafter`; None when it has none (dynamic trees, heads that read the
    KV cache or every verified position)."""
    base = drafter.base if isinstance(drafter, LookupDrafter) else drafter
    ok = hasattr(base, "draft_queued") and getattr(base, "capture", None) is None
    return base if ok and not getattr(base, "reads_path", False) else None


def drafts_own_tree(drafter) -> bool:
    """Whether the step just proposed by ``drafter`` is its base's own tree, of a drafter
    whose tree changes step by step (a dynamic tree, a draft model's), with no
    prompt-lookup chain joined: a step adaptive speculation may time as drafting's."""
    if isinstance(drafter, LookupDrafter):
        if drafter._pending is not None:
            return False
        drafter = drafter.base
    return getattr(drafter, "dynamic_tree", False)


def is_static_step(tree: Tree, queued, depth: int) -> bool:
    """Whether a step proposed at most ``depth`` deep drafts nothing or exactly
    ``queued``'s static tree (no prompt-lookup chain joined): a step the loop may queue
    the next one behind (:func:`queued_tree`)."""
    return tree.size == 1 or (queued is not None and tree == queued.tree.truncate(depth))


def queued_tree(drafter, queued, tokens: Sequence[int], spare: int, drafts_on: bool) -> Tree | None:
    """The tree of the step after the one in flight, when the loop may queue it before
    reading the one in flight back; None when it must wait for the host.

    The step in flight is rooted at ``tokens[-1]`` and leaves the next step at least
    ``spare`` tokens of depth (< 0: no room for a next step that it knows of). The next
    step drafts ``queued``'s static tree truncated to ``spare`` (plain when
    ``drafts_on`` is False, ``spare < 1`` or the drafter drafts nothing); it waits when a
    prompt-lookup chain may join it (:meth:`LookupDrafter.may_chain_after`, which counts
    the gate's skips) or when it should draft and ``queued`` is None
    (:func:`queued_drafter`). Shared by :func:`mlx_stream.stream_generate` and the greedy
    replay (``train/replay.py``), so that the two take the same steps."""
    if spare < 0:
        return None
    if isinstance(drafter, LookupDrafter) and drafter.may_chain_after(tokens):
        return None
    if not (drafts_on and spare >= 1 and drafter.tree.size > 1):
        return no_drafts()
    return None if queued is None else queued.tree.truncate(spare)
