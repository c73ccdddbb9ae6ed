"""Prompt lookup: drafts copied from the context, grafted beside the heads' tree.

Generated text often repeats spans of its context: the document being summarised,
the passage a question is about, the code being edited, or its own earlier output.
When the last few tokens occurred before, the tokens that followed them then are a
cheap and often long draft (prompt lookup decoding, Saxena 2023; LLMA, Yang et al.
2023, "Inference with Reference"; vLLM's and transformers' n-gram speculation).
The stream heads are weakest exactly there (exact copies of long spans), so the
lookup chain is grafted beside their draft tree: one forward pass verifies both.

Pure functions for matching and grafting, and :class:`LookupDrafter`, which drafts with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..checks import require_drafter, require_int, require_number
from ..tree import Tree, build_tree
from .base import accepted_nodes, propose


def match_suffix(
    tokens: Sequence[int] | np.ndarray, max_ngram: int = 6, min_ngram: int = 2
) -> tuple[int, int]:
    """The longest suffix of the context that occurred before, and where it occurred last.

    Args:
        tokens: ``(L,)`` ints, the whole context (prompt and output, the last
            emitted token last).
        max_ngram, min_ngram: suffix lengths tried, longest first,
            ``1 <= min_ngram <= max_ngram``.

    Returns:
        ``(n, start)``: the suffix length matched and the index just after its latest
        earlier occurrence (where a copy starts); ``(0, -1)`` when nothing matched.

    Raises:
        ValueError: bad n-gram bounds.
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    a = np.asarray(tokens)
    L = len(a)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        hit = np.ones(L - n, dtype=bool)  # hit[s]: a[s:s+n] == suffix, s + n <= L - 1
        for k in range(n):
            hit &= a[k : L - n + k] == a[L - n + k]
        where = np.flatnonzero(hit)
        if where.size:
            return n, int(where[-1]) + n
    return 0, -1


def copy_from(tokens: Sequence[int] | np.ndarray, start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``tokens[start:]``; a copy that reaches the end continues
    with its own first tokens (an overlapping copy, as in LZ77), so a loop of period
    ``len(tokens) - start`` yields the loop's next ``k`` tokens."""
    a = np.asarray(tokens)
    out = [int(t) for t in a[start : start + k]]
    while len(out) < k:
        out.append(out[len(out) - (len(a) - start)])
    return out


def lookup_length(n: int, num_draft: int) -> int:
    """Tokens to copy after an ``n``-token match: ``2 (n - 1)``, at most ``num_draft``.

    A copy's tokens are accepted far more often after a long match than after a short
    one (held-out self-distilled SmolLM2 outputs: first-token acceptance 0.51 after a
    2-token match, 0.58 after 3, 0.76 after 4, 0.91 after 5 or more;
    docs/benchmarks.md, "Prompt lookup"), while each drafted node costs about a tenth
    of a forward pass on a CPU, so the copy grows with the match.
    """
    return max(0, min(num_draft, 2 * (n - 1)))


def prompt_lookup(
    tokens: Sequence[int] | np.ndarray, num_draft: int, max_ngram: int = 6, min_ngram: int = 2
) -> list[int]:
    """The draft prompt lookup proposes: after the longest suffix that occurred before
    (:func:`match_suffix`), copy :func:`lookup_length` tokens (:func:`copy_from`).

    Args:
        tokens: ``(L,)`` ints, the whole context, the last emitted token last.
        num_draft: most tokens to return (>= 0).
        max_ngram, min_ngram: suffix lengths tried.

    Returns:
        The drafted tokens (empty when nothing matched).

    Raises:
        ValueError: ``num_draft < 0`` or bad n-gram bounds.
    """
    if num_draft < 0:
        raise ValueError(f"num_draft must be >= 0, got {num_draft}")
    n, start = match_suffix(tokens, max_ngram, min_ngram)
    return copy_from(tokens, start, lookup_length(n, num_draft)) if n else []


def append_chain(tree: Tree, length: int) -> tuple[Tree, np.ndarray]:
    """The tree with a chain of ``length`` nodes added under the root as its last child.

    The shape does not depend on any token, so the chain (copied on the host) and the
    base tree's drafts (still on the device) are joined without a host sync. Where the
    chain's first tokens repeat the base tree's drafts, siblings hold the same token;
    verification follows every matching branch and keeps the longest accepted path
    (:func:`~mlx_stream.verify.verify_greedy`, :func:`~mlx_stream.verify.verify_coupled`).

    Args:
        tree: the base tree's shape (N nodes).
        length: the chain's length (>= 1).

    Returns:
        ``(merged, take)``: the merged tree (N + length nodes) and ``(N - 1 + length,)``
        int32 indices such that its drafts, in node order, are
        ``concatenate([base drafts, chain])[take]``.
    """
    r = max((c[0] for c in tree.choices if len(c) == 1), default=-1) + 1  # the root's next rank
    links = [(r,) + (0,) * d for d in range(length)]
    merged = build_tree(list(tree.choices) + links)
    index = {c: i for i, c in enumerate(tree.choices)}
    index.update({c: len(tree.choices) + d for d, c in enumerate(links)})
    return merged, np.array([index[c] for c in merged.choices], dtype=np.int32)


class LookupDrafter:
    """A drafter plus prompt lookup: the context's own continuation grafted beside its tree.

    Each step the base drafter fills its static tree; then the tokens that followed the
    latest earlier occurrence of the context's longest repeated suffix (``max_ngram``
    down to ``min_ngram`` tokens; :func:`~mlx_stream.drafters.lookup.prompt_lookup`) join it as
    a chain under the root, the root's last child (:func:`~mlx_stream.drafters.lookup.append_chain`).
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
