"""KV cache for tree decoding, on top of mlx-lm's cache objects.

A tree forward appends the keys/values of all N tree nodes after the emitted
prefix. After verification only the accepted path is kept: its entries are copied
into contiguous slots and the offset is set past them, so the cache again holds
exactly the emitted prefix (minus the newest token, which is the next root).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class TreeKVCache(KVCache):
    """mlx-lm's :class:`~mlx_lm.models.cache.KVCache` plus :meth:`keep`.

    Keys/values: ``(B, n_kv_heads, capacity, head_dim)``, valid up to ``offset``.
    """

    def keep(self, start: int, nodes: Sequence[int]) -> None:
        """Keep the tree nodes ``nodes`` (indices relative to ``start``, ascending,
        ``nodes[0] == 0``) in slots ``start .. start + len(nodes) - 1`` and drop the
        rest of the tree.

        Raises:
            ValueError: ``nodes`` reaches past the entries written so far.
        """
        n = len(nodes)
        if n and start + nodes[-1] >= self.offset:
            raise ValueError(f"node {nodes[-1]} is past the cache end ({self.offset - start} tree entries)")
        if list(nodes) != list(range(n)):  # a path that is a prefix needs no copy
            idx = mx.array([start + i for i in nodes], dtype=mx.int32)
            self.keys[..., start : start + n, :] = self.keys[..., idx, :]
            self.values[..., start : start + n, :] = self.values[..., idx, :]
        self.offset = start + n


def make_tree_cache(backbone) -> list[TreeKVCache]:
    """One :class:`TreeKVCache` per layer of an mlx-lm model.

    Raises:
        ValueError: the model asks for caches that cannot be rewound (sliding-window
            ``RotatingKVCache``, state-space ``MambaCache``, ...), named in the message.
    """
    if hasattr(backbone, "make_cache"):
        kinds = {type(c).__name__ for c in backbone.make_cache()}
        bad = kinds - {"KVCache"}
        if bad:
            raise ValueError(
                f"this model uses {', '.join(sorted(bad))}, which cannot be rewound after a "
                "rejected draft; tree decoding needs plain KVCache layers"
            )
    return [TreeKVCache() for _ in backbone.layers]


def cache_offset(cache: Sequence[TreeKVCache]) -> int:
    """Number of tokens held by the cache (all layers hold the same)."""
    return cache[0].offset


def trim_cache(cache: Sequence[TreeKVCache], length: int) -> None:
    """Drop entries past ``length`` in every layer (used to reuse a prompt prefix)."""
    for c in cache:
        c.trim(c.offset - length)


def keep_path(cache: Sequence[TreeKVCache], start: int, nodes: Sequence[int]) -> None:
    """:meth:`TreeKVCache.keep` on every layer."""
    for c in cache:
        c.keep(start, nodes)
