"""Verification of a draft tree against the target's logits: pure functions.

Every rule walks the tree from the root and returns the accepted path (node indices,
root first) and the next token: the target's own token at the last accepted node.
The tokens emitted by a step are the accepted drafts followed by that next token,
so every step emits at least one token and the output is the target's.

* :func:`verify_greedy`: the walk over the target's token at every node. The decode
  loop uses it greedy (the argmax) and sampled: there the token at every node is the
  Gumbel-max draw with noise keyed by (seed, position) that the drafts are perturbed by
  too (:class:`~mlx_stream.sampling.GumbelNoise`), so the draw, hence the output, does
  not depend on what was drafted.
* :func:`verify_sample`: the general multi-candidate rule (any draft distribution q).
* :func:`verify_coupled`: the same rule for deterministic drafts, realised with one
  uniform per position (``stream_generate(verifier=verify_coupled)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from .tree import Tree


def verify_greedy(tree: Tree, tokens: Sequence[int], targets: Sequence[int]) -> tuple[list[int], int]:
    """Greedy (temperature 0) tree verification.

    Starting at the root, follow the child whose drafted token equals the target's
    argmax at the current node, while one exists (Medusa, Cai et al. 2024, sec. 2.1.2;
    Speculative Streaming, Bhendawade et al. 2024, sec. 3.2). Because each accepted
    draft equals the token greedy decoding would have produced, the output is
    token-for-token the target's greedy output. Siblings may draft the same token
    (a prompt-lookup chain grafted beside the heads' tree): every matching branch is
    followed and the longest accepted path is kept, the later sibling's on ties; all
    of them emit the same tokens, so the choice only sets how many are accepted.

    Args:
        tree: the tree the forward pass ran over (N nodes).
        tokens: ``N`` ints, the token of each node (``tokens[0]`` is the root).
        targets: ``N`` ints, the argmax of the target's logits at each node.

    Returns:
        ``(path, next_token)``: the accepted nodes (``path[0] == 0``) and the argmax
        at the last of them.
    """
    return _longest_path(tree, tokens, lambda node: int(targets[node]))


def accepted_node(tree: Tree, tokens: mx.array, targets: mx.array) -> mx.array:
    """:func:`verify_greedy` on the device, for a step queued before the host reads it.

    The accepted nodes are those whose every draft on the path from the root equals
    the target's token at its parent; the result is the deepest of them, the later one
    in depth-first order (the later sibling) on ties, as :func:`verify_greedy` keeps.
    Needs a tree whose node order is depth-first order within each depth, as
    :func:`~mlx_stream.tree.build_tree` makes (breadth-first by path).

    Args:
        tree: the tree the forward pass ran over (N nodes).
        tokens: ``(N,)`` int32 node tokens (``tokens[0]`` is the root), may be lazy.
        targets: ``(N,)`` int the target's token at each node, may be lazy.

    Returns:
        ``()`` int32 (lazy): the last node of the accepted path; its depth + 1 is the
        number of tokens the step emits and ``targets[node]`` the next token.
    """
    if tree.size == 1:
        return mx.array(0, dtype=mx.int32)
    if tree.is_chain:  # the leading drafts that equal their parents' targets (6 ops, not 18)
        match = (tokens[1:] == targets[:-1]).astype(mx.int32)
        return mx.cumprod(match).sum().astype(mx.int32)
    _, ancestors, parents, order = tree.arrays
    match = tokens[1:] == targets[parents]  # (N - 1,) each draft equals its parent's target
    own = mx.concatenate([mx.array([True]), match])  # (N,)
    # a node is accepted when every node on its path matched: a fixed number of ops
    # whatever the depth (each op is host work on a fast device)
    ok = mx.all(mx.where(ancestors, own[None], True), axis=1)
    return mx.argmax(mx.where(ok, order, -1)).astype(mx.int32)


def verify_sample(
    tree: Tree,
    tokens: Sequence[int],
    probs: np.ndarray,
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,
) -> tuple[list[int], int]:
    """Exact multi-candidate speculative sampling over a draft tree.

    At the current node, with p the target's processed distribution there (after
    logits processors, top-p/top-k/min-p and temperature: what plain sampling would
    draw from), the children c1..cm are tried in rank order. Child c, drafted from a
    distribution q, is accepted with probability min(1, p(c) / q(c)); on rejection p
    becomes the residual norm(max(0, p - q)) and the next sibling is tried against it.
    If every child is rejected, the next token is drawn from the final residual.
    Deterministic drafts (the stream heads' top-k) have q = one-hot(c), so c is
    accepted with probability p(c) and the residual is p with c removed.

    Invariant: whatever the drafts, the token emitted at each position is distributed
    exactly as p given the tokens before it, so the output has the target's
    distribution (Leviathan et al. 2023, Chen et al. 2023, Theorem 1; the
    multi-candidate form with residual updates is SpecInfer's, Miao et al. 2024,
    Algorithm 2 / Theorem 4.2). For stochastic drafts, siblings must be drawn
    independently from their q.

    Args:
        tree: the tree the forward pass ran over (N nodes).
        tokens: ``N`` ints, the token of each node.
        probs: ``(N, V)`` float array, the target's processed distribution at each
            node (rows sum to 1).
        rng: the NumPy generator that supplies the uniforms (seeded by the caller).
        draft_probs: ``(N, V)`` float array or None: row i is the distribution node
            i's token was drafted from; None means every draft is deterministic.

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
            q = None if draft_probs is None else np.asarray(draft_probs[c], dtype=np.float64)
            qt = 1.0 if q is None else q[t]
            if qt > 0 and rng.random() * qt < p[t]:  # u < p(t) / q(t), without dividing
                accepted = c
                break
            if q is None:
                p[t] = 0.0
            else:
                p = np.maximum(p - q, 0.0)
            total = p.sum()
            if total <= 0.0:  # no mass left: p was contained in the rejected drafts' q
                break
            p = p / total
        if accepted is None:
            if p.sum() <= 0.0:  # cannot happen for an exact p; keep the original row
                p = np.array(probs[node], dtype=np.float64)
            return path, int(rng.choice(p.shape[0], p=p / p.sum()))
        node = accepted
        path.append(node)


def sample_index(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the index i with ``cdf[i-1] <= u * total < cdf[i]`` for a
    ``(V,)`` non-negative weight vector ``p`` and ``u`` in [0, 1). Entries with zero
    weight are never drawn."""
    cdf = np.cumsum(np.asarray(p, dtype=np.float64))
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(i, int(np.flatnonzero(np.asarray(p) > 0)[-1]))


def verify_coupled(
    tree: Tree,
    tokens: Sequence[int],
    probs: np.ndarray,
    uniforms: Sequence[float],
) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling for deterministic drafts, one uniform per
    position.

    At the current node (depth d) the target's token is drawn by inverse CDF from its
    processed distribution p with the uniform ``uniforms[d]``; the child drafting that
    token is accepted and the walk continues there, otherwise the drawn token is the
    next token. This is :func:`verify_sample`'s law for one-hot draft distributions:
    child c1 is accepted with probability p(c1); given its rejection the draw is
    distributed as the residual p with c1 removed, so c2 is accepted with the
    residual's probability of c2, and so on, and the next token follows the final
    residual (SpecInfer, Miao et al. 2024, Algorithm 2, with q one-hot). Every emitted
    token is a deterministic function of its position's uniform and the target's
    distribution there, so with uniforms keyed by (seed, position) the output does not
    depend on what was drafted: speculative and plain decoding give the same tokens.
    Siblings drafting the same token are all followed and the longest accepted path is
    kept (the later sibling's on ties): the tokens emitted along any of them are the
    same draws, so this is still the rule above, accepting more.

    Args:
        tree: the tree the forward pass ran over (N nodes).
        tokens: ``N`` ints, the token of each node.
        probs: ``(N, V)`` float array, the target's processed distribution at each node.
        uniforms: ``tree.depth + 1`` floats in [0, 1): ``uniforms[d]`` draws the token
            that follows a node of depth d.

    Returns:
        ``(path, next_token)`` as for :func:`verify_greedy`.
    """
    return _longest_path(
        tree, tokens, lambda node: sample_index(probs[node], uniforms[int(tree.depths[node])])
    )


def _longest_path(tree: Tree, tokens: Sequence[int], target) -> tuple[list[int], int]:
    # follow every child that drafts the target's token (``target(node)``, a deterministic
    # function of the node); siblings may draft the same token (a grafted prompt-lookup
    # chain), so keep the longest accepted path, the later one (depth-first) on ties
    best = ([0], target(0))
    stack = [([0], best[1])]
    while stack:
        path, x = stack.pop()
        if len(path) >= len(best[0]):
            best = (path, x)
        for c in reversed(tree.children[path[-1]]):  # earlier siblings are visited first
            if tokens[c] == x:
                stack.append((path + [c], target(c)))
    return best
