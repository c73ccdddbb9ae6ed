"""A separate draft model (Leviathan et al. 2023; Chen et al. 2023): checks that it may
draft for a target.

A draft model proposes token ids that the target verifies, so the two must mean the same
thing by every id: the same token text at every id the target knows and the same special
tokens (llama.cpp's ``common_speculative_are_compatible`` compares the vocabulary entry
by entry; mlx-lm's ``--draft-model`` compares only the vocabulary size, which two
different tokenizers of the same size pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..tree import Tree, chain, no_drafts
from .base import topk
from .eagle import reranked_tree

# where drafting stops (llama.cpp's --draft-p-min, here on the draft's cumulative path
# probability, as EAGLE-2 ranks nodes): a depth is drafted only while its best candidate is
# at least this likely under the draft. Measured on this CPU (2026-12-03, docs/drafting.md,
# "Stopping early"): a chain of 3 from the 3-bit copy of the default model, 6 Spec-Bench
# prompts, went from 0.23x to 0.34x of plain greedy (tau 1.40 -> 1.36) and from 0.23x to
# 0.31x at T = 0.7 (tau 1.48 -> 1.42) as p_min went from 0 to 0.6.
P_MIN = 0.6
# a draft model's default tree: (nodes incl. the root, children per expanded node, depth).
# Four siblings a node: they cost the draft nothing, and with one node expanded a depth
# (this CPU) the 3-bit copy of the default model drafting 4 deep, greedy, p_min 0, made
# tau 1.53 / 1.59 / 2.08 on 3 Spec-Bench prompts where (8, 2) made 1.41 / 1.40 / 1.90
# (2026-12-04, docs/drafting.md, "Drafting with a draft model").
DRAFT_TREE = (16, 4, 4)
# a depth expands several frontier nodes at once only where feeding them costs at most this
# many single-node draft forwards (calibrated ``node_costs``): siblings themselves are free
# (the top-k of logits already computed), expanding them is not where the draft's kernels
# do not batch (this CPU, 3-bit: 2 nodes cost 1.56x one, 4 nodes 3.75x)
EXPAND_COST = 1.25


def _vocab(tokenizer) -> dict[str, int]:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper
    return inner.get_vocab()


def _special(tokenizer) -> dict[str, object]:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return {
        "bos_token_id": getattr(inner, "bos_token_id", None),
        "eos_token_ids": sorted(getattr(tokenizer, "eos_token_ids", None) or [inner.eos_token_id]),
        "pad_token_id": getattr(inner, "pad_token_id", None),
        "special tokens": sorted(getattr(inner, "all_special_tokens", []) or []),
    }


def check_draft_tokenizer(
    target_tokenizer, draft_tokenizer, target_vocab_size: int, draft_vocab_size: int
) -> int:
    """Check that a draft model's token ids mean what the target's do.

    Args:
        target_tokenizer, draft_tokenizer: mlx-lm ``TokenizerWrapper`` (or Hugging Face
            tokenizers).
        target_vocab_size, draft_vocab_size: the rows of each model's embedding (a model
            may pad its embedding past its tokenizer's vocabulary).

    Returns:
        The number of leading logits of the draft that can be drafted from:
        ``min(target_vocab_size, draft_vocab_size)`` (a draft padded beyond the target's
        vocabulary is cut to it).

    Raises:
        ValueError: naming the first difference: a token whose id differs (or that one
            tokenizer lacks), a special token that differs, or a tokenizer vocabulary
            larger than the other model's embedding.
    """
    tv, dv = _vocab(target_tokenizer), _vocab(draft_tokenizer)
    if len(tv) != len(dv) or tv != dv:
        by_id_t = {i: t for t, i in tv.items()}
        by_id_d = {i: t for t, i in dv.items()}
        for i in sorted(set(by_id_t) | set(by_id_d)):
            a, b = by_id_t.get(i), by_id_d.get(i)
            if a != b:
                raise ValueError(
                    f"the draft model's tokenizer differs from the target's at token id {i}: "
                    f"target {a!r}, draft {b!r} (vocabularies of {len(tv)} and {len(dv)} tokens); "
                    "a draft model must share the target's tokenizer (a smaller model of the same family)"
                )
    ts, ds = _special(target_tokenizer), _special(draft_tokenizer)
    for key in ts:
        if ts[key] != ds[key]:
            raise ValueError(
                f"the draft model's {key} differ from the target's: target {ts[key]!r}, draft {ds[key]!r}; "
                "a draft model must share the target's tokenizer and special tokens"
            )
    for name, size in (("target", target_vocab_size), ("draft", draft_vocab_size)):
        if max(tv.values(), default=-1) >= size:
            raise ValueError(
                f"the tokenizer has token ids up to {max(tv.values())} but the {name} model's embedding "
                f"has {size} rows: the model and its tokenizer do not belong together"
            )
    return min(target_vocab_size, draft_vocab_size)


class DraftModel:
    """A draft model for a target: its weights, how many of its logits are drafted from,
    and the name messages give it. It holds no decoding state: each generation's
    :class:`DraftCache` does (in the :class:`~mlx_stream.generate.PromptCache`, so a
    chat's turns reuse the draft's cache as they reuse the target's).

    Args:
        backbone: an mlx-lm model (llama family or OPT, as the target), any dtype or
            quantization.
        vocab: the leading logits drafted from (:func:`check_draft_tokenizer`).
        name: how messages name it (its spec).

    Attributes:
        depth, budget: how deep it drafts and its tree's nodes on this device, where
            measured (:func:`mlx_stream.calibrate.calibrate_draft`; depth 0: drafting
            does not pay here), else None (:data:`DRAFT_TREE`).
        calibration: what the calibration measured, or None.
        p_min: drafting stops once the best candidate's cumulative draft probability
            falls below this (llama.cpp's ``--draft-p-min``; 0: always the full depth);
            set it to change how much a step drafts. None (default): :data:`P_MIN` for
            its trees, 0 for an explicit chain (``num_draft_tokens=K`` drafts K, as mlx-lm).
    """

    def __init__(self, backbone, vocab: int, name: str = "draft"):
        from ..models import family

        self.backbone, self.family, self.vocab, self.name = backbone, family(backbone), vocab, name
        # a recurrent hybrid drafts chains, one token a forward (DraftCache keeps its states)
        self.recurrent = getattr(self.family, "recurrent", False)
        if getattr(self.family, "trees", None) is not None:
            raise ValueError(f"{name} cannot draft: {self.family.trees}")
        self.depth: int | None = None
        self.budget: int | None = None
        self.calibration: dict | None = None
        self.p_min: float | None = None

    def expand_for(self, width: int) -> int:
        """Frontier nodes a tree of ``width`` children per node expands per depth: the
        most, up to ``width``, whose batched draft forward was measured to cost at most
        :data:`EXPAND_COST` single-node ones (``calibration["node_costs"]``), else 1;
        ``width`` (EAGLE-2's top-k expansion) where not measured."""
        costs = (self.calibration or {}).get("node_costs")
        return expand_count(costs, width) if costs else width


def expand_count(node_costs: dict[str, float], width: int) -> int:
    """The most frontier nodes, up to ``width``, whose batched draft forward costs at most
    :data:`EXPAND_COST` single-node ones (``node_costs``: nodes -> cost over one), else 1."""
    cheap = [int(n) for n, c in node_costs.items() if int(n) <= width and c <= EXPAND_COST]
    return max([1, *cheap])


class DraftCache:
    """A draft model's own KV cache, kept equal to the tokens it last saw.

    The cache is keyed by tokens, not by steps: :meth:`sync` trims it to its longest
    common prefix with the sequence it is given and prefills the rest, so after any
    step (drafts accepted, rejected or all accepted), a new turn of a chat, or another
    prompt, it holds exactly the tokens given, as a fresh prefill of them would.
    The speculative entries a tree step writes (:meth:`forward`) stay until the next
    :meth:`sync`, which keeps those on the path the target accepted (their keys and
    values are what a prefill of the accepted tokens would write: each entry saw the
    context, its ancestors and itself) and drops the rest, as mlx-lm trims its draft
    cache: a step then feeds the draft only the tokens it has not seen (the target's
    own token, and an accepted leaf), not every accepted draft again.

    Args:
        draft: the :class:`DraftModel`.

    Attributes:
        layers: one :class:`~mlx_stream.cache.TreeKVCache` per layer of the draft.
        tokens: the tokens whose keys/values ``layers`` hold, in order, before any
            speculative entries.
        fed: tokens the last :meth:`sync` fed the draft model.
        catch_up: seconds per token of the draft's prefill, measured on the prompt
            (:func:`~mlx_stream.steps.prefill`; 0 until measured): what a drafting step
            spends catching up with tokens decoded plainly.
    """

    def __init__(self, draft: DraftModel):
        from ..cache import make_tree_cache

        self.draft = draft
        self.layers = make_tree_cache(draft.backbone)
        self.tokens: list[int] = []
        # (parent entries, tokens) per forward: parents as host ints where the host knows them
        self._pending: list[tuple[list[int] | mx.array, mx.array]] = []
        self.fed = 0  # tokens the last sync fed the draft
        self.catch_up = 0.0  # seconds per token of a prefill (measured on the prompt), 0: not yet
        # a recurrent draft: its recurrent layers' states before and after each speculative entry
        self._states: list[list] = []

    def sync(self, tokens: Sequence[int], step_size: int = 2048) -> mx.array:
        """Make the cache hold exactly ``tokens`` (reusing its common prefix with them and
        the speculative entries on their path, at least one token fed) and return the
        ``(vocab,)`` logits after the last, lazy."""
        from ..cache import can_rewind, keep_path, make_tree_cache, trim_cache

        d = self.draft
        n, limit = 0, min(len(self.tokens), len(tokens) - 1)
        if self.tokens[:limit] == list(tokens[:limit]):  # (every step: one comparison in C)
            n = limit
        while n < limit and self.tokens[n] == tokens[n]:
            n += 1
        if n < len(self.tokens) and not can_rewind(self.layers, n):  # a sliding window moved past n
            self.layers, self.tokens, self._pending, n = make_tree_cache(d.backbone), [], [], 0
            self._states = []
        if n == len(self.tokens) and self._pending:
            path = self._accepted_path(tokens[n : len(tokens) - 1])
            if self._states:  # a recurrent draft's chain: the state after the accepted entries
                self._restore(len(path))
            keep_path(self.layers, n, path)  # the accepted entries into slots n.., the rest dropped
            n += len(path)
        else:
            if self._states:
                self._restore(0)
            trim_cache(self.layers, n)
        self._pending = []
        rest = list(tokens[n:])
        self.fed = len(rest)
        for i in range(0, len(rest), step_size):
            logits, _, _ = d.family.prefill_forward(
                d.backbone, mx.array(rest[i : i + step_size]), self.layers
            )
            if i + step_size < len(rest):
                mx.eval([c.state for c in self.layers])
        self.tokens = list(tokens)
        return logits[: d.vocab]

    def _accepted_path(self, tokens: Sequence[int]) -> list[int]:
        # each part read as it is (computed with the step): no new op to evaluate here
        parents = [e for p, _ in self._pending for e in (p if isinstance(p, list) else p.tolist())]
        toks = [t for _, ts in self._pending for t in ts.tolist()]
        children: dict[tuple[int, int], int] = {}
        for e, key in enumerate(zip(parents, toks)):
            children.setdefault(key, e)
        path, cur = [], -1
        for t in tokens:
            cur = children.get((cur, int(t)), -2)
            if cur == -2:
                break
            path.append(cur)
        return path

    def forward(
        self,
        tokens: mx.array,
        positions: mx.array,
        mask: mx.array,
        parents: mx.array | list[int] | None = None,
    ) -> mx.array:
        """``(n, vocab)`` logits of ``n`` speculative entries (``(n,)`` tokens at
        ``(n,)`` positions) written after what the cache holds (:attr:`tokens` and the
        ``E`` entries written since); ``mask`` ``(n, len(tokens) + E + n)``; ``parents``
        ``(n,)`` int32 (or ``n`` ints): each entry's parent entry (0..E-1, or -1: the last
        of :attr:`tokens`), so that :meth:`sync` can keep the accepted ones (None: never
        kept)."""
        d = self.draft
        if d.recurrent:
            if tokens.shape[0] != 1:
                raise ValueError("a recurrent draft model drafts chains: one entry a forward")
            if not self._states:
                self._states.append(self._recurrent_states())
        logits, _, _ = d.family.tree_forward(d.backbone, tokens, positions, mask, self.layers)
        n = tokens.shape[0]
        self._pending.append(([-3] * n if parents is None else parents, tokens))
        if d.recurrent:
            self._states.append(self._recurrent_states())
        return logits[:, : d.vocab]

    def _recurrent_states(self) -> list:
        from ..cache import RecurrentCache

        return [c.snapshot() for c in self.layers if isinstance(c, RecurrentCache)]

    def _restore(self, kept: int) -> None:
        # a recurrent draft's layers back to the state after ``kept`` speculative entries (a chain)
        from ..cache import RecurrentCache

        for c, snap in zip((c for c in self.layers if isinstance(c, RecurrentCache)), self._states[kept]):
            c.restore(snap)
        self._states = []

    def rewind(self) -> None:
        """Drop the speculative entries (the cache holds :attr:`tokens` again)."""
        from ..cache import trim_cache

        if self._states:
            self._restore(0)
        trim_cache(self.layers, len(self.tokens))
        self._pending = []


class DraftModelDrafter:
    """Draft trees from a separate draft model (SpecInfer, Miao et al. 2024; Sequoia; the
    expansion and reranking of EAGLE-2, Li et al. 2024b, sec. 4, with a draft model).

    Each step the draft model's cache is brought to the context (:meth:`DraftCache.sync`,
    keeping the entries the last step wrote on the accepted path, one forward over the
    accepted tokens it has not seen and the root), then the tree
    grows one depth per batched draft forward: depth 1 holds the root's ``width`` most
    likely children; at each deeper depth the ``expand`` candidates of highest cumulative
    draft log-probability are fed together (each attends to the context, its ancestors
    and itself) and each proposes its ``width`` most likely children. Siblings cost the
    draft nothing (the top-k of logits it computed anyway); each expanded node costs a
    node of a draft forward, so ``expand`` follows the device
    (:meth:`DraftModel.expand_for`): ``width`` where a batched forward is about as
    cheap as one, 1 (a chain's draft cost, its siblings verified too) where it is not. Expansion stops
    early once the best candidate of a depth is less likely than ``p_min`` (llama.cpp's
    ``--draft-p-min``), so a draft that is unsure costs few forwards. The ``budget - 1``
    candidates of highest value become the tree (:func:`~mlx_stream.drafters.select_dynamic_tree`).
    ``width=1`` is a chain of ``depth`` tokens (mlx-lm's ``num_draft_tokens``).

    When sampling, the draft's log-probabilities are perturbed by the Gumbel noise of the
    target's draw at each position (``coupled``; :class:`~mlx_stream.sampling.DraftNoise`):
    a draft is accepted whenever both distributions' perturbed argmax agree, about
    as often as the two distributions agree, rather than ``sum p q`` for independent
    draws. Verification is the target's own, so the output is lossless either way.

    Args:
        draft: the draft model's :class:`DraftCache` (its weights and its cache).
        budget: the most nodes per tree, root included (>= 2; default
            :data:`DRAFT_TREE`'s, as width and depth).
        width: children per expanded node, the most nodes expanded per depth (>= 1).
        depth: the deepest draft (>= 1).
        p_min: stop expanding once the best candidate's cumulative draft probability
            is below this (0: never; default :data:`P_MIN`).
        expand: frontier nodes fed per depth, 1..``width`` (default ``width``).

    Raises:
        ValueError: a budget, width, depth, p_min or expand out of range.
    """

    capture = None
    reads_path = False
    coupled = True
    dynamic_tree = True  # the tree's shape changes step by step (adaptive speculation times each)

    def __init__(
        self,
        draft: DraftCache,
        budget: int = DRAFT_TREE[0],
        width: int = DRAFT_TREE[1],
        depth: int = DRAFT_TREE[2],
        p_min: float = P_MIN,
        expand: int | None = None,
    ):
        expand = width if expand is None else expand
        if budget < 2 or width < 1 or depth < 1 or not 0.0 <= p_min < 1.0 or not 1 <= expand <= width:
            raise ValueError(
                f"draft model tree: budget must be >= 2, width >= 1, depth >= 1, 0 <= p_min < 1 and "
                f"1 <= expand <= width, got {budget}, {width}, {depth}, {p_min}, {expand}"
            )
        self.draft, self.budget, self.width, self.p_min = draft, budget, width, p_min
        self.expand = expand
        self.draft_cache = draft  # what the loop checks (a draft model's cache is not bounded)
        self.depth = min(depth, budget - 1)
        self.tree = chain(self.depth)  # the deepest shape a step drafts (adaptive speculation's)
        self._trees: dict[tuple, Tree] = {}

    def _log_probs(self, logits: mx.array, d: int, noise) -> mx.array:
        if noise is not None:
            v = logits.shape[-1]
            ids = None if v == noise.noise.vocab_size else mx.arange(v)
            logits = noise.perturb(logits, d, ids)
        logits = logits.astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _chain(self, tokens, depth: int, noise) -> tuple[Tree, mx.array]:
        # a chain drafted to its full depth (mlx-lm's num_draft_tokens): nothing decides on
        # the host, so the drafts stay lazy and the step keeps the loop's one host sync (the
        # tree's p_min stop and reranking read values back once per depth)
        held, out = len(tokens), []
        logits = self.draft.sync(tokens)
        for d in range(1, depth + 1):
            scores = (
                logits[None] if noise is None else self._log_probs(logits[None], d, noise)
            )  # (same argmax)
            out.append(mx.argmax(scores, axis=-1).astype(mx.int32))
            mx.async_eval(out[-1])  # computed while the host records the next depth (as mlx-lm)
            if d < depth:  # the draft at depth d, after its parent's entry (d - 2; -1: the root)
                logits = self.draft.forward(out[-1], mx.array([held + d - 1], dtype=mx.int32), None, [d - 2])[
                    0
                ]
        key = ("chain", depth)
        if key not in self._trees:
            self._trees[key] = chain(depth)
        return self._trees[key], mx.concatenate(out)

    def propose(
        self, hidden, tokens, max_depth: int, mid=None, cache=None, base: bool = True, noise=None
    ) -> tuple[Tree, mx.array]:
        """This step's tree (at most ``max_depth`` deep; ``base=False``: root only, and the
        draft model not run) and its ``(N - 1,)`` int32 drafts in node order."""
        depth = min(self.depth, max_depth) if base else 0
        if depth < 1:
            return no_drafts(), mx.zeros((0,), dtype=mx.int32)
        if self.width == 1 and self.p_min == 0:
            return self._chain(tokens, depth, noise)
        k, held = self.width, len(tokens)
        lp = self._log_probs(self.draft.sync(tokens)[None], 1, noise)[0]
        top = topk(lp, k)
        toks, vals = [top], [lp[top]]
        pars, rks = [mx.full((k,), -1, dtype=mx.int32)], [mx.arange(k, dtype=mx.int32)]
        level_entry = mx.full((k,), -1, dtype=mx.int32)  # the speculative entry that scored each candidate
        level0, anc = 0, mx.zeros((0, 0), dtype=mx.bool_)
        floor = np.log(self.p_min) if self.p_min > 0 else None
        for d in range(2, depth + 1):
            sel = topk(vals[-1], min(self.expand, vals[-1].shape[0]))  # the depth's best, expanded
            if floor is not None and vals[-1][sel[0]].item() < floor:
                break  # the draft is unsure: further depths would rarely be accepted
            n, E = sel.shape[0], anc.shape[0]
            # each new entry sees its parent's entry, that entry's ancestors, and itself
            with_self = mx.concatenate([mx.zeros((1, E), dtype=mx.bool_), anc | mx.eye(E, dtype=mx.bool_)])
            rows = with_self[level_entry[sel] + 1]  # (n, E)
            anc = mx.concatenate(
                [mx.pad(anc, [(0, 0), (0, n)]), mx.concatenate([rows, mx.zeros((n, n), mx.bool_)], 1)]
            )
            mask = mx.concatenate(
                [mx.ones((n, held), dtype=mx.bool_), rows, mx.eye(n, dtype=mx.bool_)], axis=1
            )
            pos = mx.full((n,), held + d - 2, dtype=mx.int32)
            fed = self.draft.forward(toks[-1][sel], pos, mask, level_entry[sel])
            lp = self._log_probs(fed, d, noise)  # (n, V)
            top = topk(lp, k)  # (n, k)
            toks.append(top.reshape(-1))
            vals.append((vals[-1][sel][:, None] + mx.take_along_axis(lp, top, axis=-1)).reshape(-1))
            pars.append(mx.repeat(level0 + sel.astype(mx.int32), k))
            rks.append(mx.tile(mx.arange(k, dtype=mx.int32), n))
            level0 += vals[-2].shape[0]
            level_entry = mx.repeat(E + mx.arange(n, dtype=mx.int32), k)
        toks, vals, pars, rks = (mx.concatenate(a) for a in (toks, vals, pars, rks))
        mx.eval(toks, vals, pars, rks)  # the speculative entries stay: the next sync keeps the accepted
        tree, order = reranked_tree(self._trees, vals, pars, rks, self.budget)
        return tree, toks[order].astype(mx.int32)
