"""The logits-returning forwards of a family whose logits are its output projection."""

from __future__ import annotations

from collections.abc import Callable


def projected(
    tree_hidden: Callable, prefill_hidden: Callable, project: Callable
) -> tuple[Callable, Callable]:
    """``(tree_forward, prefill_forward)`` for a family module whose logits are
    ``project(hidden)``: each returns ``(logits, hidden, mid)`` as
    :meth:`~mlx_stream.models.generic.Generic.tree_forward` does (``prefill_forward``'s
    logits are the last position's, ``(V,)``)."""

    def tree_forward(backbone, tokens, positions, mask, cache, capture=None):
        h, mid = tree_hidden(backbone, tokens, positions, mask, cache, capture)
        return project(backbone, h), h, mid

    def prefill_forward(backbone, tokens, cache, capture=None):
        h, mid = prefill_hidden(backbone, tokens, cache, capture)
        return project(backbone, h[-1]), h, mid

    return tree_forward, prefill_forward
