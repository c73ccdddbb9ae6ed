"""Prompt lookup: drafts copied from the context, grafted into the heads' tree.

Generated text often repeats spans of its context: the document being summarised,
the passage a question is about, the code being edited, or its own earlier output.
When the last few tokens occurred before, the tokens that followed them then are a
cheap and often long draft (prompt lookup decoding, Saxena 2023; LLMA, Yang et al.
2023, "Inference with Reference"; vLLM's and transformers' n-gram speculation).
The stream heads are weakest exactly there (exact copies of long spans), so the
lookup chain is grafted into their draft tree: one forward pass verifies both.

Pure functions; :class:`~mlx_stream.drafters.LookupDrafter` uses them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .tree import Choice, Tree


def match_suffix(tokens: Sequence[int] | np.ndarray, max_ngram: int = 6, min_ngram: int = 2) -> tuple[int, int]:
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
    2-token match, 0.58 after 3, 0.76 after 4, 0.91 after 5 or more; README, "Prompt
    lookup"), while each drafted node costs about a tenth of a forward pass on a CPU,
    so the copy grows with the match.
    """
    return max(0, min(num_draft, 2 * (n - 1)))


def prompt_lookup(tokens: Sequence[int] | np.ndarray, num_draft: int, max_ngram: int = 6,
                  min_ngram: int = 2) -> list[int]:
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


def graft_chain(tree: Tree, node_tokens: Sequence[int], chain: Sequence[int]) -> tuple[list[Choice], dict]:
    """Merge a chain of drafted tokens into a filled draft tree, sharing prefixes.

    From the root, the chain follows the existing child that holds its next token
    while there is one; the rest of the chain hangs below the last shared node as new
    nodes (each the last child of its parent). Sibling tokens stay distinct, so the
    merged tree verifies exactly as each part would alone and accepts the longer of
    the two accepted paths.

    Args:
        tree: the filled tree's shape (N nodes).
        node_tokens: ``N`` ints, its tokens (root first).
        chain: tokens to draft after the root, in order.

    Returns:
        ``(choices, tokens)``: the merged tree's paths (sibling ordinals: a node's
        ``rank`` is its index among its parent's children, :func:`~mlx_stream.tree.build_tree`
        builds it) and ``{path: token}`` for every non-root node.
    """
    tokens = {c: int(node_tokens[i]) for i, c in enumerate(tree.choices, start=1)}
    kids: dict[Choice, list[Choice]] = {(): []}
    for c in tree.choices:
        kids.setdefault(c[:-1], []).append(c)
        kids.setdefault(c, [])
    at: Choice = ()
    for t in chain:
        nxt = next((c for c in kids[at] if tokens[c] == int(t)), None)
        if nxt is None:
            nxt = at + (max((c[-1] for c in kids[at]), default=-1) + 1,)
            kids[at].append(nxt)
            kids[nxt] = []
            tokens[nxt] = int(t)
        at = nxt
    return sorted(tokens, key=lambda c: (len(c), c)), tokens
