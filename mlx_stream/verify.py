"""Verification of a draft tree against the target's logits: pure functions.

Both rules walk the tree from the root and return the accepted path (node indices,
root first) and the next token: the target's own token at the last accepted node.
The tokens emitted by a step are the accepted drafts followed by that next token,
so every step emits at least one token and the output is the target's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .tree import Tree


def verify_greedy(
    tree: Tree, tokens: Sequence[int], targets: Sequence[int]
) -> tuple[list[int], int]:
    """Greedy (temperature 0) tree verification.

    Starting at the root, follow the child whose drafted token equals the target's
    argmax at the current node, while one exists (Medusa, Cai et al. 2024, sec. 2.1.2;
    Speculative Streaming, Bhendawade et al. 2024, sec. 3.2). Because each accepted
    draft equals the token greedy decoding would have produced, the output is
    token-for-token the target's greedy output.

    Args:
        tree: the tree the forward pass ran over (N nodes).
        tokens: ``N`` ints, the token of each node (``tokens[0]`` is the root).
        targets: ``N`` ints, the argmax of the target's logits at each node.

    Returns:
        ``(path, next_token)``: the accepted nodes (``path[0] == 0``) and the argmax
        at the last of them.
    """
    node = 0
    path = [0]
    while True:
        want = targets[node]
        nxt = next((c for c in tree.children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, int(want)
        node = nxt
        path.append(node)


def verify_sample(
    tree: Tree,
    tokens: Sequence[int],
    probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Exact multi-candidate speculative sampling over a tree of deterministic drafts.

    At the current node with target distribution p (the processed, normalised
    distribution at that node), the children c1..cm are tried in rank order. Each
    was drafted deterministically (q = one-hot), so child c is accepted with
    probability min(1, p(c) / q(c)) = p(c). On rejection the residual becomes
    norm(max(0, p - q)) = p with c removed and renormalised, and the next sibling is
    tried against it. If every child is rejected the next token is sampled from the
    final residual. Invariant: the token emitted at each position is distributed
    exactly as p (Chen et al. 2023, Leviathan et al. 2023, Theorem 1; the
    multi-candidate form is SpecInfer's, Miao et al. 2024, Algorithm 2).

    Args:
        tree: the tree the forward pass ran over (N nodes).
        tokens: ``N`` ints, the token of each node.
        probs: ``(N, V)`` float array, the target's processed distribution at each
            node (rows sum to 1).
        rng: the NumPy generator that supplies the uniforms (seeded by the caller).

    Returns:
        ``(path, next_token)`` as for :func:`verify_greedy`.
    """
    node = 0
    path = [0]
    while True:
        p = np.array(probs[node], dtype=np.float64)  # a copy: the residual is edited
        accepted = None
        for c in tree.children[node]:
            t = tokens[c]
            if rng.random() < p[t]:
                accepted = c
                break
            p[t] = 0.0
            total = p.sum()
            if total <= 0.0:  # every token with mass was drafted and rejected
                break
            p = p / total
        if accepted is None:
            return path, int(rng.choice(p.shape[0], p=p / p.sum()))
        node = accepted
        path.append(node)
