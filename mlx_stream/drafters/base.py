"""What every drafter is: the :class:`Drafter` protocol and its optional parts, the
drafter that drafts nothing, and :func:`propose`, how the loop asks any drafter for a step.

The verifier does not care where drafts come from. A drafter owns a
:class:`~mlx_stream.tree.Tree` and, once per decoding step, fills its non-root nodes
with tokens (a :class:`TreeProposer` picks the tree per step too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import mlx.core as mx

from ..tree import Tree, no_drafts


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


class Backlog:
    """The verified positions a drafter that reads every position (``reads_path``: an
    EAGLE-style layer, DFlash) has not read yet. Steps that adaptive speculation leaves
    plain record their features here instead of running the drafter's own forward, and
    the next drafted step reads them all in one batched call, its cache in step again:
    a plain step then costs the drafter nothing (it cost one draft-layer forward).

    Args:
        limit: the most positions kept; past it only the latest are, and the drafter
            starts its cache over from them (its drafts then attend to those alone: the
            output is unaffected, as after any gap).
    """

    def __init__(self, limit: int = 1024):
        self.limit, self.parts, self.size, self.end = limit, [], 0, None

    def add(self, hidden: mx.array, r: int) -> None:
        """Record ``hidden`` ``(P, W)``, the features of positions ``r - P .. r - 1``."""
        P = hidden.shape[0]
        if self.parts and self.end != r - P:  # a gap: what waited is not before these
            self.parts, self.size = [], 0
        self.parts.append(hidden)
        self.size, self.end = self.size + P, r
        if self.size > self.limit:
            self.parts, self.size = [mx.concatenate(self.parts)[-self.limit :]], self.limit

    def take(self, hidden: mx.array, r: int) -> mx.array:
        """``hidden`` ``(P, W)`` (positions ``r - P .. r - 1``) with the recorded positions
        before it where they lead up to it, ``(P' , W)``; the backlog is then empty."""
        if self.parts and self.end == r - hidden.shape[0]:
            hidden = mx.concatenate([*self.parts, hidden])
        self.parts, self.size, self.end = [], 0, None
        return hidden


def topk(logits: mx.array, k: int) -> mx.array:
    """``(..., V)`` -> ``(..., k)`` indices of the k largest, best first (on the device)."""
    if k == 1:
        return mx.argmax(logits, axis=-1, keepdims=True)
    part = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]  # unordered
    order = mx.argsort(-mx.take_along_axis(logits, part, axis=-1), axis=-1)
    return mx.take_along_axis(part, order, axis=-1)


def accepted_nodes(tree: Tree, tokens: Sequence[int], emitted: Sequence[int]) -> list[int]:
    """The non-root nodes of a verified ``tree`` whose path spells a prefix of ``emitted``
    (the step's accepted drafts, then the target's next token); ``tokens``: the ``N`` node
    tokens, root first."""
    ok = [True] + [False] * (tree.size - 1)
    for i in range(1, tree.size):
        d = int(tree.depths[i])
        ok[i] = ok[int(tree.parents[i])] and d <= len(emitted) and int(tokens[i]) == int(emitted[d - 1])
    return [i for i in range(1, tree.size) if ok[i]]


def proposes(drafter) -> bool:
    """Whether ``drafter`` picks its tree per step (a :class:`TreeProposer`)."""
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
    if proposes(drafter):
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
