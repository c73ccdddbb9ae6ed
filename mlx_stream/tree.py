"""Draft trees: static shapes built once from *choices* (paths of top-k ranks).

A draft tree has N nodes. Node 0 is the root: the last emitted token, not yet in
the KV cache. Every other node is a drafted token whose context is its chain of
ancestors. A node at depth d is drafted by stream head d (d = 1..K) and takes that
head's top-``rank`` token, so a tree is fully described by the paths of ranks that
lead to its nodes, as in Medusa (Cai et al. 2024, "medusa_choices"):
``(0,)`` is head 1's top-1 token, ``(0, 1)`` is head 2's top-2 token placed under
it, and so on.

Nodes are stored breadth-first (sorted by depth, then by path), so

* every ancestor precedes its descendants (``parents[i] < i``), and
* the nodes of depth <= d form a prefix: clamping a tree near the context or
  token limit is a slice (:meth:`Tree.truncate`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

Choice = tuple[int, ...]


@dataclass(frozen=True)
class Tree:
    """A static draft tree.

    Attributes:
        choices: the non-root nodes as paths of top-k ranks, breadth-first.
        parents: ``(N,)`` int, parent node index of each node (-1 for the root).
        depths: ``(N,)`` int, depth of each node (0 for the root). The node's
            absolute position is ``cache offset + depth``.
        ranks: ``(N,)`` int, the node's rank among its head's top-k (0 for root).
        mask: ``(N, N)`` bool, ``mask[i, j]`` is True when node j is node i or one
            of its ancestors: the tree part of the attention mask (Medusa /
            SpecInfer tree attention).
        children: for each node, its children's indices in rank order.
    """

    choices: tuple[Choice, ...]
    parents: np.ndarray = field(repr=False, compare=False)
    depths: np.ndarray = field(repr=False, compare=False)
    ranks: np.ndarray = field(repr=False, compare=False)
    mask: np.ndarray = field(repr=False, compare=False)
    children: tuple[tuple[int, ...], ...] = field(repr=False, compare=False)

    @property
    def size(self) -> int:
        """Number of nodes N, root included."""
        return len(self.choices) + 1

    @functools.cached_property
    def depth(self) -> int:
        """Depth of the deepest node (the number of stream heads it needs)."""
        return int(self.depths.max())

    @functools.cached_property
    def is_chain(self) -> bool:
        """Whether the tree is one path (node i at depth i), root only included."""
        return self.depth == self.size - 1

    def topk(self) -> tuple[int, ...]:
        """How many top-k tokens each head must provide: ``(k_1, ..., k_depth)``."""
        ks = [0] * self.depth
        for c in self.choices:
            ks[len(c) - 1] = max(ks[len(c) - 1], c[-1] + 1)
        return tuple(ks)

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the non-root nodes from the root down to it (itself
        included; empty for the root): the drafted tokens its prediction is
        conditioned on."""
        out: list[tuple[int, ...]] = []
        for i in range(self.size):
            p = int(self.parents[i])
            out.append(() if p < 0 else out[p] + (i,))
        return tuple(out)

    @functools.cached_property
    def arrays(self) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``(depths, mask, parents, order)`` on the device, made once per tree so a step
        uploads none: int32 ``(N,)``, bool ``(N, N)``, int32 ``(N - 1,)`` (the non-root
        nodes' parents) and int32 ``(N,)`` ``depth * N + index`` (deepest, then latest
        node first: the order :func:`~mlx_stream.verify.accepted_node` ranks nodes in)."""
        n = self.size
        return (
            mx.array(self.depths, dtype=mx.int32),
            mx.array(self.mask),
            mx.array(self.parents[1:], dtype=mx.int32),
            mx.array(self.depths * n + np.arange(n), dtype=mx.int32),
        )

    def truncate(self, max_depth: int) -> Tree:
        """The subtree of nodes with depth <= ``max_depth`` (a prefix of the nodes)."""
        if max_depth >= self.depth:
            return self
        return _truncated(self, max(max_depth, 0))

    def __hash__(self) -> int:
        return hash(self.choices)


@functools.lru_cache(maxsize=256)
def _truncated(tree: Tree, max_depth: int) -> Tree:
    # near the end of a generation every step truncates the same trees
    return build_tree([c for c in tree.choices if len(c) <= max_depth])


def build_tree(choices: Sequence[Sequence[int]]) -> Tree:
    """Build a :class:`Tree` from paths of top-k ranks.

    Args:
        choices: paths such as ``[(0,), (1,), (0, 0)]``. Every prefix of a path
            must itself be a path (a node's parent must exist); duplicates are
            removed. An empty list is the root-only tree (no drafts).

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: a path with a negative rank, an empty path, or a missing parent.
    """
    if isinstance(choices, (str, bytes)) or not isinstance(choices, (Sequence, np.ndarray)):
        raise TypeError(
            f"choices must be a list of rank paths such as [(0,), (1,), (0, 0)], got {type(choices).__name__}"
        )
    for c in choices:
        if isinstance(c, (str, bytes)) or not isinstance(c, (Sequence, np.ndarray)):
            raise TypeError(f"each tree path is a sequence of ranks such as (0, 1), got {c!r}")
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in c):
            raise TypeError(f"tree path {c!r}: ranks are integers >= 0")
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    index = {(): 0}
    for i, c in enumerate(paths, start=1):
        if len(c) == 0 or min(c) < 0:
            raise ValueError(f"invalid tree path {c}: paths are non-empty tuples of ranks >= 0")
        if c[:-1] not in index:
            raise ValueError(f"tree path {c} has no parent {c[:-1]}: add the parent path")
        index[c] = i
    n = len(paths) + 1
    parents = np.full(n, -1, dtype=np.int32)
    depths = np.zeros(n, dtype=np.int32)
    ranks = np.zeros(n, dtype=np.int32)
    mask = np.eye(n, dtype=bool)
    kids: list[list[int]] = [[] for _ in range(n)]
    for c, i in index.items():
        if i == 0:
            continue
        p = index[c[:-1]]
        parents[i], depths[i], ranks[i] = p, len(c), c[-1]
        mask[i] = mask[p]
        mask[i, i] = True
        kids[p].append(i)
    children = tuple(tuple(sorted(k, key=lambda j: ranks[j])) for k in kids)
    return Tree(tuple(paths), parents, depths, ranks, mask, children)


def chain(k: int) -> Tree:
    """The chain tree: head j's top-1 token at depth j, j = 1..k.

    Raises:
        ValueError: ``k`` is not an integer >= 0.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"a chain's length k must be an integer >= 0, got {k!r}")
    return build_tree([(0,) * d for d in range(1, k + 1)])


@functools.cache
def no_drafts() -> Tree:
    """The root-only tree: plain decoding, one token per forward pass (one shared,
    immutable instance: asked for at every plain step)."""
    return build_tree([])


def sparse(k: int, widths: Sequence[int] = (2, 1, 1, 1, 1, 1)) -> Tree:
    """A sparse tree in the spirit of Medusa's: ``widths[d]`` alternatives at depth
    d+1 under the top-1 path, and the top-1 continuation under each depth-1
    alternative. Depth ``k``."""
    choices: set[Choice] = set()
    for d in range(1, k + 1):
        w = widths[d - 1] if d - 1 < len(widths) else 1
        for r in range(w):
            choices.add((0,) * (d - 1) + (r,))
    for r in range(1, widths[0] if widths else 1):
        for d in range(2, k + 1):
            choices.add((r,) + (0,) * (d - 1))
    return build_tree(sorted(choices))


def tree_from_ranks(ranks: np.ndarray, size: int) -> tuple[Tree, float]:
    """The draft tree of at most ``size`` drafted nodes that accepts the most tokens on
    held-out data, and the tau it implies.

    Greedy tree verification accepts the longest prefix of the true tokens' head
    ranks ``(r_1, ..., r_d)`` that is a path of the tree, so the accepted length is
    the number of tree nodes whose path is a prefix of the true rank sequence, and
    ``tau = 1 + sum over nodes of P(rank prefix = node's path)``: additive over
    nodes. A child is never more frequent than its parent, so the ``size`` most
    frequent rank prefixes (parents first on ties) form the optimal tree, using the
    empirical joint rank statistics rather than independent per-head accuracies
    (Medusa's tree construction, Cai et al. 2024, sec. 2.1.2, assumes independence).
    For path-conditioned heads the ranks must be teacher-forced along the true path,
    which is exactly what drafting sees on every accepted prefix.

    Args:
        ranks: ``(P, K)`` int, the rank of the true token t+1+j in head j's logits at
            each held-out position (-1: beyond the ranks measured, or no target).
        size: the number of non-root nodes allowed (>= 0).

    Returns:
        ``(tree, tau)``.
    """
    counts: dict[Choice, int] = {}
    for row in np.asarray(ranks):
        for d in range(len(row)):
            if row[d] < 0:
                break
            key = tuple(int(r) for r in row[: d + 1])
            counts[key] = counts.get(key, 0) + 1
    best = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[: max(size, 0)]
    return build_tree([c for c, _ in best]), 1.0 + sum(n for _, n in best) / max(len(ranks), 1)


def format_tree(tree: Tree) -> str:
    """The rank-path string of a tree (``"0;1;0,0"``), as :func:`parse_tree` reads it."""
    return ";".join(",".join(str(r) for r in c) for c in tree.choices)


PRESETS = ("none", "chain", "sparse")


def parse_tree(spec: str | Sequence[Sequence[int]] | Tree | None, num_heads: int) -> Tree:
    """Resolve a tree specification.

    Args:
        spec: a :class:`Tree`; a list of rank paths; ``None`` or ``"sparse"`` (the
            default sparse tree over all heads); ``"chain"`` / ``"chain:K"``;
            ``"none"`` (no drafts); or a string of paths such as
            ``"0;1;0,0;0,0,0"`` (``;`` between paths, ``,`` between ranks).
        num_heads: how many stream heads are available; deeper trees are refused.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: an unknown preset, a malformed path string, or a tree deeper
            than ``num_heads``.
    """
    if isinstance(spec, Tree):
        tree = spec
    elif spec is None or spec == "sparse":
        tree = sparse(num_heads)
    elif isinstance(spec, str):
        s = spec.strip()
        if s == "none":
            tree = no_drafts()
        elif s == "chain":
            tree = chain(num_heads)
        elif re.fullmatch(r"chain:\d+", s):
            tree = chain(int(s.split(":")[1]))
        elif re.fullmatch(r"\d+(,\d+)*(;\d+(,\d+)*)*", s):
            tree = build_tree([tuple(int(r) for r in p.split(",")) for p in s.split(";")])
        else:
            raise ValueError(
                f"unknown tree {spec!r}: use one of {', '.join(PRESETS)}, 'chain:K', "
                "or rank paths like '0;1;0,0;0,0,0'"
            )
    elif isinstance(spec, (Sequence, np.ndarray)) and not isinstance(spec, bytes):
        tree = build_tree(spec)
    else:
        raise TypeError(
            f"a tree is a Tree, a list of rank paths such as [(0,), (0, 0)], None, or a string "
            f"({', '.join(PRESETS)}, 'chain:K', or paths such as '0;1;0,0'); got {type(spec).__name__}"
        )
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)):
        raise TypeError(f"num_heads must be an integer, got {type(num_heads).__name__}")
    check_depth(tree, num_heads)
    return tree


def check_tree_syntax(spec: str | Sequence[Sequence[int]] | Tree | None) -> None:
    """Refuse a malformed tree spec before any heads are known, building no preset (their
    size follows the heads: ``"sparse"`` over 1,024 of them is a 2,047-node tree).

    Raises:
        TypeError, ValueError: as :func:`parse_tree`, but never for a tree's depth.
    """
    if spec is None or (isinstance(spec, str) and spec.strip() in PRESETS):
        return
    parse_tree(spec, 1 << 30)  # paths and chain:K are built as given, however deep


def check_depth(tree: Tree, num_heads: int) -> None:
    """Refuse a tree that ``num_heads`` stream heads cannot fill (one head per depth).

    Raises:
        TypeError: ``tree`` is not a :class:`Tree` (parse a spec with :func:`parse_tree`).
        ValueError: the tree is deeper than ``num_heads``.
    """
    if not isinstance(tree, Tree):
        raise TypeError(f"expected a Tree (parse a spec with parse_tree), got {type(tree).__name__}")
    if tree.size > 1 and tree.depth > num_heads:
        raise ValueError(
            f"tree depth {tree.depth} needs {tree.depth} stream heads but only {num_heads} "
            "are loaded: use a shallower tree (e.g. 'chain')"
        )


def check_ranks(tree: Tree, vocab_size: int) -> None:
    """Refuse a tree whose ranks reach past the vocabulary (a node of rank r is its
    head's (r + 1)-th most likely token, so ranks run from 0 to ``vocab_size - 1``).

    Raises:
        ValueError: a rank >= ``vocab_size``; the message names the largest allowed.
    """
    top = int(tree.ranks.max()) if tree.size > 1 else 0
    if top >= vocab_size:
        raise ValueError(
            f"tree rank {top} is beyond the vocabulary: a rank is a token's place among the head's "
            f"{vocab_size} predictions, so the largest allowed is {vocab_size - 1}"
        )
