"""Stream heads' drafts: the heads' top-k at the last accepted position (Speculative
Streaming, Bhendawade et al. 2024), path-conditioned or reading the top layers.
"""

from __future__ import annotations

import mlx.core as mx

from ..model import require_model
from ..tree import Tree, check_depth
from .base import topk


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
        if model.heads.config.architecture == "dflash":
            raise ValueError("DFlash heads draft a block at a time: use DFlashDrafter")
        check_depth(tree, model.heads.num_heads)
        self.model = model
        self.tree = tree
        self._k = max(tree.topk(), default=0)
        # a reduced draft vocabulary scores only its own rows of the output projection
        self._ids = model.heads.draft_ids if model.heads.config.draft_vocab_size else None
        self._rows = None
        if self._ids is not None:
            from ..heads import output_weight

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
        top = topk(logits, self._k)[self._head_idx, self._rank_idx]
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
            top = topk(logits, k)  # (n_parents, k)
            toks = top[crow, rank]
            if self._ids is not None:
                toks = self._ids[toks]
            toks = toks.astype(mx.int32)
            state = s[crow]
            out.append(toks)
        return mx.concatenate(out)
