"""A tree forward through an mlx-lm model's own ``__call__`` (issue 49, first step).

Almost every mlx-lm model reads token positions only through its attentions'
``rope(x, offset=cache.offset)`` and builds its attention masks only through
``cache.make_mask(N, return_array=..., window_size=...)``. So a tree of N nodes runs
through the model's own code, unchanged, with two substitutions for the length of one
call (:func:`tree_logits`):

- each rotary embedding module is wrapped so that the N nodes move onto the batch axis,
  node i rotated by its own position ``positions[i]`` (``mx.fast.rope`` takes one offset
  per batch row: bitwise the rotation a sequential forward gives it), and
- every layer's :class:`NodeMaskKVCache` answers ``make_mask`` with the tree's mask:
  causal over the cache, ancestors-only inside the tree, narrowed to the window where the
  model asks for one (sliding-window layers).

Nothing is re-implemented per architecture (Bhendawade et al. 2024 and Cai et al. 2024's
tree attention are only the mask and the positions). Not wired into the decode loop yet;
``tests/test_any_model.py`` checks it exact, node by node, on tiny models from mlx-lm's
own classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache import TreeKVCache


class NodeRoPE(nn.Module):
    """A rotary embedding that rotates each of N tree nodes at its own position.

    Args:
        rope: the model's rotary embedding module (``nn.RoPE``, ``Llama3RoPE``,
            ``YarnRoPE``, ``SuScaledRoPE``, ``ProportionalRoPE``, ...).
        positions: int ``(N,)``, the absolute position of each node.

    Called as the wrapped module (``rope(x, offset)``) on ``x`` of shape ``(1, H, N, D)``:
    the nodes go onto the batch axis, ``(N, H, 1, D)``, with one offset per row, and back.
    The ``offset`` the model passes (the cache's length) is replaced by ``positions``.
    """

    def __init__(self, rope: nn.Module, positions: mx.array):
        super().__init__()
        self.inner = rope
        self._positions = positions

    def __call__(self, x: mx.array, offset=0, *args, **kwargs) -> mx.array:
        B, H, N, D = x.shape
        if B != 1 or N != self._positions.shape[0]:
            raise ValueError(
                f"a tree forward rotates one sequence of {self._positions.shape[0]} nodes, got {x.shape}"
            )
        y = self.inner(x.transpose(2, 1, 0, 3), self._positions, *args, **kwargs)
        return y.transpose(2, 1, 0, 3)


def _is_rope(module) -> bool:
    return isinstance(module, nn.RoPE) or type(module).__name__.endswith("RoPE")


def rope_slots(backbone: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(parent, key)`` of every rotary embedding module in ``backbone``."""
    return [(m, k) for _, m in backbone.named_modules() for k, v in m.items() if _is_rope(v)]


@contextmanager
def node_positions(backbone: nn.Module, positions: mx.array) -> Iterator[None]:
    """Within the block, every rotary embedding of ``backbone`` rotates tree nodes at
    ``positions`` (:class:`NodeRoPE`); the model's own modules are back after it."""
    slots = rope_slots(backbone)
    originals = [m[k] for m, k in slots]
    try:
        for (m, k), rope in zip(slots, originals):
            m[k] = NodeRoPE(rope, positions)
        yield
    finally:
        for (m, k), rope in zip(slots, originals):
            m[k] = rope


class NodeMaskKVCache(TreeKVCache):
    """A :class:`~mlx_stream.cache.TreeKVCache` (mlx-lm's ``KVCache`` plus ``keep``) whose
    ``make_mask`` gives a draft tree's attention while one is set (:meth:`set_tree`), and
    mlx-lm's causal masks otherwise.

    Keys/values: ``(B, n_kv_heads, capacity, head_dim)`` valid up to ``offset``; every
    position is held (a sliding window is applied by the mask, so a rejected draft can
    always be rewound).
    """

    def __init__(self):
        super().__init__()
        self._tree: tuple[np.ndarray, np.ndarray] | None = None

    def set_tree(self, depths: np.ndarray | None, ancestors: np.ndarray | None = None) -> None:
        """The next forward is a tree: node i at ``offset + depths[i]`` sees the cache and
        its ancestors (``ancestors`` bool ``(N, N)``, itself included). None: causal again."""
        self._tree = None if depths is None else (np.asarray(depths), np.asarray(ancestors, dtype=bool))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if self._tree is None:
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        depths, ancestors = self._tree
        q = self.offset + depths[:, None]  # (N, 1) node positions
        k = np.concatenate([np.arange(self.offset), self.offset + depths])[None]  # (1, S)
        see = np.concatenate([np.ones((N, self.offset), dtype=bool), ancestors], axis=1)
        if window_size is not None:
            see &= q - k < window_size
        return mx.array(see)


def tree_logits(
    backbone: nn.Module, tokens: mx.array, depths: np.ndarray, ancestors: np.ndarray, cache: list
):
    """Logits of a draft tree through ``backbone``'s own ``__call__``.

    Args:
        backbone: an mlx-lm ``Model`` whose attentions rotate through ``self.rope`` and
            mask through ``cache.make_mask``.
        tokens: int ``(N,)``, node 0 the root (the last emitted token), parents first.
        depths: int ``(N,)``, each node's depth (the root's is 0).
        ancestors: bool ``(N, N)``, ``ancestors[i, j]``: node j is i or an ancestor of i.
        cache: one :class:`NodeMaskKVCache` per layer, holding the emitted prefix; the
            tree's N entries are appended (``keep`` the accepted path after verifying).

    Returns:
        ``(N, V)`` logits: row i is what a sequential forward over the prefix and node i's
        path gives at node i.
    """
    positions = mx.array(cache[0].offset + np.asarray(depths), dtype=mx.int32)
    for c in cache:
        c.set_tree(depths, ancestors)
    try:
        with node_positions(backbone, positions):
            return backbone(tokens[None], cache=cache)[0]
    finally:
        for c in cache:
            c.set_tree(None)
