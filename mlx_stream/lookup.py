"""Prompt lookup: drafts copied from the context, grafted beside the heads' tree.

Generated text often repeats spans of its context: the document being summarised,
the passage a question is about, the code being edited, or its own earlier output.
When the last few tokens occurred before, the tokens that followed them then are a
cheap and often long draft (prompt lookup decoding, Saxena 2023; LLMA, Yang et al.
2023, "Inference with Reference"; vLLM's and transformers' n-gram speculation).
The stream heads are weakest exactly there (exact copies of long spans), so the
lookup chain is grafted beside their draft tree: one forward pass verifies both.

Pure functions; :class:`~mlx_stream.drafters.LookupDrafter` uses them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .tree import Tree, build_tree


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
