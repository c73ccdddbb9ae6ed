"""KV cache for tree decoding, on top of mlx-lm's cache objects.

A tree forward appends the keys/values of all N tree nodes after the emitted
prefix. After verification only the accepted path is kept: its entries are copied
into contiguous slots and the offset is set past them, so the cache again holds
exactly the emitted prefix (minus the newest token, which is the next root).

Three kinds, each with mlx-lm's semantics for the same settings:

- :class:`TreeKVCache`: mlx-lm's ``KVCache`` (every token).
- :class:`TreeQuantizedKVCache`: mlx-lm's ``QuantizedKVCache`` (``kv_bits``): keys and
  values stored quantized (``mx.quantize``, groups along the head dimension); the
  tree's rows are compacted on each of the packed arrays.
- :class:`WindowKVCache`: mlx-lm's ``RotatingKVCache(max_kv_size, keep=4)`` as its
  attention sees it (what ``max_kv_size`` means), but rewindable: entries are kept in
  temporal order, a little past the window, and the window is applied by the
  attention mask, so a rejected draft never needs an entry the cache has lost.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

SINK_TOKENS = 4  # mlx-lm's RotatingKVCache(max_kv_size, keep=4) in make_prompt_cache


class TreeMask:
    """The attention mask of a draft tree, answered to a model's own ``cache.make_mask``.

    Almost every mlx-lm model builds its masks through ``cache.make_mask(N, return_array=,
    window_size=)``; while :attr:`tree` is set (:func:`mlx_stream.models.generic` sets it
    for one forward), that call returns the tree's mask instead of a causal one: the cached
    prefix plus each node's ancestors, narrowed to ``window_size`` where a sliding-window
    layer asks for one. Mixed into every KV cache class here.

    Attributes:
        tree: ``(mask, positions)``: ``mask`` bool ``(N, S)`` over the held entries and the
            N nodes (None: every node sees everything), ``positions`` int32 ``(N,)`` the
            nodes' absolute positions; None outside a tree forward.
    """

    tree: tuple[mx.array | None, mx.array] | None = None

    def held_positions(self) -> np.ndarray:
        """Absolute position of every held entry, in order."""
        return np.arange(self.offset)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if self.tree is None:
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        mask, positions = self.tree
        held = self.held_positions()
        if mask is not None and mask.shape[1] != len(held) + N:
            # caches that hold different entries (sliding-window layers beside full ones): the
            # tree's part of the mask, after every held entry (no step is queued ahead on them)
            mask = mx.concatenate([mx.ones((N, len(held)), dtype=mx.bool_), mask[:, -N:]], axis=1)
        if window_size is None:
            return mask
        keys = mx.concatenate([mx.array(held, dtype=mx.int32), positions])
        near = positions[:, None] - keys[None] < window_size
        return near if mask is None else mask & near


def _check_nodes(offset: int, start: int, nodes: Sequence[int]) -> None:
    # the bounds every keep checks: the kept nodes are entries written so far
    if len(nodes) and start + nodes[-1] >= offset:
        raise ValueError(f"node {nodes[-1]} is past the cache end ({offset - start} tree entries)")


class TreeKVCache(TreeMask, KVCache):
    """mlx-lm's :class:`~mlx_lm.models.cache.KVCache` plus :meth:`keep` and a draft
    tree's mask (:class:`TreeMask`).

    Keys/values: ``(B, n_kv_heads, capacity, head_dim)``, valid up to ``offset``.
    """

    def keep(self, start: int, nodes: Sequence[int], slots: mx.array | None = None) -> None:
        """Keep the tree nodes ``nodes`` (indices relative to ``start``, ascending,
        ``nodes[0] == 0``) in slots ``start .. start + len(nodes) - 1`` and drop the
        rest of the tree. ``slots``: int32 ``start + nodes`` where the caller made it
        already (:func:`keep_path`: one upload for every layer).

        Raises:
            ValueError: ``nodes`` reaches past the entries written so far.
        """
        n = len(nodes)
        _check_nodes(self.offset, start, nodes)
        if list(nodes) != list(range(n)):  # a path that is a prefix needs no copy
            if slots is None:
                slots = mx.array([start + i for i in nodes], dtype=mx.int32)
            # take along the sequence axis: one gather (indexing with `...` adds reshapes;
            # ~0.05 ms of host and device time a tree step on the tiny model)
            self.keys[..., start : start + n, :] = mx.take(self.keys, slots, axis=2)
            self.values[..., start : start + n, :] = mx.take(self.values, slots, axis=2)
        self.offset = start + n

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> TreeQuantizedKVCache:
        """This cache's entries quantized (as mlx-lm's ``KVCache.to_quantized``)."""
        q = TreeQuantizedKVCache(group_size=group_size, bits=bits)
        q.offset = self.offset
        if self.keys is not None:
            n = self.offset
            q.keys = mx.quantize(self.keys[..., :n, :], group_size=group_size, bits=bits)
            q.values = mx.quantize(self.values[..., :n, :], group_size=group_size, bits=bits)
        return q


class TreeQuantizedKVCache(TreeMask, QuantizedKVCache):
    """mlx-lm's :class:`~mlx_lm.models.cache.QuantizedKVCache` plus :meth:`keep`.

    Keys/values: tuples ``(packed uint32, scales, biases)``, each
    ``(B, n_kv_heads, capacity, ·)``, valid up to ``offset``; attention over them is
    mlx-lm's ``quantized_scaled_dot_product_attention`` (chosen by ``bits``).
    """

    def keep(self, start: int, nodes: Sequence[int]) -> None:
        """As :meth:`TreeKVCache.keep`, on each packed array."""
        n = len(nodes)
        _check_nodes(self.offset, start, nodes)
        if list(nodes) != list(range(n)):
            idx = mx.array([start + i for i in nodes], dtype=mx.int32)
            for arrays in (self.keys, self.values):
                for a in arrays:
                    a[..., start : start + n, :] = mx.take(a, idx, axis=2)
        self.offset = start + n


class WindowKVCache(TreeMask):
    """A bounded KV cache with the attention of mlx-lm's ``RotatingKVCache(max_size,
    keep=4)`` (``max_kv_size``), that a tree step can rewind.

    Entries are held in temporal order: the first ``keep`` positions (attention
    sinks), then a window of the most recent positions, trimmed once it runs
    ``slack`` entries past what the next token can see. What each query sees is
    mlx-lm's, reproduced by the mask (:meth:`make_mask` for prefill chunks, which
    mlx-lm runs through ``_update_concat``; :meth:`tree_mask` for decoding, where
    mlx-lm writes one token at a time in place): a single token at position q sees the
    sinks and positions ``q - (max_size - keep) + 1 .. q``.

    Attributes:
        offset: tokens through the cache (absolute positions; the rotary offset).
        dropped: positions dropped between the sinks and the window.
        keys, values: ``(B, n_kv_heads, held, head_dim)``; ``held = offset - dropped``.

    Raises:
        ValueError: ``max_size`` <= ``keep``.
    """

    def __init__(self, max_size: int, keep: int = SINK_TOKENS, slack: int = 64):
        if max_size <= keep or max_size < 1:
            raise ValueError(f"max_kv_size must be > {keep} (the attention sinks kept), got {max_size}")
        self.max_size, self.keep_first, self.slack = max_size, keep, slack
        self.keys = self.values = None
        self.offset = 0
        self.dropped = 0

    @property
    def window(self) -> int:
        return self.max_size - self.keep_first

    def held_positions(self) -> np.ndarray:
        """Absolute position of every held entry, in order."""
        held = self.offset - self.dropped
        first = min(self.keep_first, held)
        return np.concatenate([np.arange(first), np.arange(first + self.dropped, self.offset)])

    @property
    def state(self):
        return self.keys, self.values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n, S = self.offset - self.dropped, keys.shape[2]
        if self.keys is None or n + S > self.keys.shape[2]:  # grow by whole steps of 256
            B, H, _, D = keys.shape
            grow = (S + 255) // 256 * 256
            nk = mx.zeros((B, H, grow, D), keys.dtype)
            nv = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = nk, nv
            else:
                self.keys = mx.concatenate([self.keys[..., :n, :], nk], axis=2)
                self.values = mx.concatenate([self.values[..., :n, :], nv], axis=2)
        self.keys[..., n : n + S, :] = keys
        self.values[..., n : n + S, :] = values
        self.offset += S
        return self.keys[..., : n + S, :], self.values[..., : n + S, :]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the newest ``n`` entries.

        Raises:
            ValueError: the next token would need entries the window has dropped.
        """
        n = min(n, self.offset)
        oldest_needed = max(self.offset - n - self.window + 1, self.keep_first)
        if self.dropped and oldest_needed < self.keep_first + self.dropped:
            raise ValueError("cannot rewind past entries the window has dropped")
        self.offset -= n
        return n

    def rewindable_to(self, length: int) -> bool:
        """Whether trimming back to ``length`` tokens gives what a cold start would. With
        attention sinks (``keep > 0``, ``max_kv_size``), only while the window has never
        been full (else the held entries were computed with a window that a cold prefill
        would apply differently); a plain sliding window (``keep=0``, a model's own
        windowed layers) sees the same positions either way: while the entries the next
        token needs are still held."""
        if length >= self.offset:
            return True
        if self.keep_first == 0:
            return max(length - self.window + 1, 0) >= self.dropped
        return self.dropped == 0 and self.offset < self.max_size

    def keep(self, start: int, nodes: Sequence[int]) -> None:
        """As :meth:`TreeKVCache.keep` (``start``: the root's absolute position), then
        drop what the next token can no longer see, once past ``slack``."""
        n = len(nodes)
        _check_nodes(self.offset, start, nodes)
        p = start - self.dropped  # physical slot of the root
        if list(nodes) != list(range(n)):
            idx = mx.array([p + i for i in nodes], dtype=mx.int32)
            self.keys[..., p : p + n, :] = mx.take(self.keys, idx, axis=2)
            self.values[..., p : p + n, :] = mx.take(self.values, idx, axis=2)
        self.offset = start + n
        self.evict()

    def evict(self) -> None:
        """Drop window entries older than the next token can see, once they exceed
        ``slack`` (the copy is amortised over ``slack`` steps)."""
        oldest = max(self.offset - self.window + 1, self.keep_first)  # the next token's oldest non-sink
        extra = oldest - (self.keep_first + self.dropped)
        if extra > self.slack:
            k, n = self.keep_first, self.offset - self.dropped
            self.keys, self.values = (
                mx.concatenate([a[..., :k, :], a[..., k + extra : n, :]], axis=2)
                for a in (self.keys, self.values)
            )
            self.dropped += extra

    def tree_mask(self, depths: np.ndarray, ancestors: np.ndarray) -> mx.array | None:
        """Mask ``(N, held + N)`` for N tokens written one at a time in mlx-lm (decoding):
        node i at position ``offset + depths[i]`` sees the sinks and the last
        ``max_size - keep`` positions, among the held entries and its tree ancestors
        (``ancestors`` ``(N, N)`` bool). None when every node sees everything."""
        q = self.offset + np.asarray(depths)[:, None]
        pos = np.concatenate([self.held_positions(), self.offset + np.asarray(depths)])[None]
        see = (pos < self.keep_first) | (pos > q - self.window)
        held = self.offset - self.dropped
        see[:, held:] &= np.asarray(ancestors, dtype=bool)
        if see.all():
            return None
        return mx.array(see)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        """mlx-lm's attention for N tokens at once (a prefill chunk: its
        ``RotatingKVCache._update_concat`` and window mask), or one token (in place),
        over the held entries and the N new ones: ``(N, held + N)`` bool, or None; a
        draft tree's while one is set (:class:`TreeMask`)."""
        if self.tree is not None:
            return TreeMask.make_mask(self, N, return_array, window_size)
        if N == 1:
            return self.tree_mask(np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=bool))
        c, M, k = self.offset, self.max_size, self.keep_first
        i = np.arange(N)[:, None]
        pos = np.concatenate([self.held_positions(), c + np.arange(N)])[None]
        see = (pos <= c + i) & (pos > c + i - M)
        if c >= M:  # mlx-lm trimmed its cache to the sinks and the last M - 1 - keep first
            old = (pos >= k) & (pos < c)
            see = np.where(old, pos >= np.maximum(c + i - M + 1, c - (M - 1 - k)), see)
            see = np.where(pos < k, pos >= i, see)
        return mx.array(see)


class OwnCache:
    """A cache of the model's own kind that a rejected draft cannot be taken out of
    (a recurrent layer's state: mlx-lm's ``ArraysCache``/``MambaCache``; ``CacheList``,
    ``ChunkedKVCache``, ...), kept as mlx-lm keeps it, for plain decoding, which never
    rewinds. Mixed into the model's own cache object (its class is swapped for a
    subclass, so the model's code sees the object it made).

    Attributes:
        tokens_read: tokens through the cache (counted by the forward that feeds it:
            :class:`~mlx_stream.models.generic.Generic`).
    """

    tokens_read = 0

    def keep(self, start: int, nodes: Sequence[int]) -> None:
        """Keep ``nodes`` of the entries written at ``start``: only all of them, in order.

        Raises:
            ValueError: anything else (a recurrent state cannot drop a token it has read).
        """
        if list(nodes) != list(range(len(nodes))) or start + len(nodes) != self.tokens_read:
            raise ValueError("a recurrent layer's state cannot drop tokens it has read (plain decoding only)")

    def rewindable_to(self, length: int) -> bool:
        """Only to where it is (its state holds every token it has read)."""
        return length >= self.tokens_read

    def trim(self, n: int) -> int:
        if n:
            raise ValueError("a recurrent layer's state cannot be trimmed")
        return 0


class RecurrentCache(OwnCache):
    """A recurrent layer's state (mlx-lm's ``ArraysCache``: a convolution window, a matrix
    state), kept as mlx-lm keeps it, that also verifies draft trees exactly.

    A step over a tree of N nodes runs the layer on N rows of the batch axis at once, row i
    reading the path from the root to node i (:meth:`rows`): the state is broadcast to N
    rows and ``lengths`` set to each path's length, which mlx-lm's recurrent layers honour
    as they do for a batch of right-padded prompts (the convolution window taken at each
    row's end, the recurrence masked past it). After one forward, row i holds the state
    after node i's path (for a chain, row r the state after its first r + 1 tokens), so when
    verification accepts a path :meth:`keep` selects the row of its last node: no replay, no
    second forward. Each node's output, row i at its own depth, is what flows on to the next
    layer (:class:`~mlx_stream.models.generic.Generic` wraps the layer's mixer).

    Memory: N copies of the layer's state for one step, and the mixer reads N x N tokens
    (N = the tree's nodes).
    """

    chain_rows = 0  # N while a step's rows are held, else 0

    def rows(self, n: int, lengths: mx.array | None = None) -> None:
        """Hold ``n`` rows for a step over ``n`` nodes; ``lengths`` int ``(n,)``: row i's
        path length (its node's depth + 1; None: a chain, ``1..n``).

        Raises:
            ValueError: the cache holds no state yet (a step follows a prefill), or rows
                already (the last step was not kept).
        """
        if self.chain_rows or any(c is None for c in self.cache):
            raise ValueError("a draft step needs a recurrent state of one row (after the prefill, kept)")
        self.cache = [mx.broadcast_to(c, (n,) + c.shape[1:]) for c in self.cache]
        self.lengths = mx.arange(1, n + 1) if lengths is None else lengths
        self.chain_rows = n

    def keep(self, start: int, nodes: Sequence[int]) -> None:
        """Keep the accepted path ``nodes`` (root first) of the step's tree: the state of
        the row of its last node; outside a draft step, as :meth:`OwnCache.keep`.

        Raises:
            ValueError: ``nodes`` is empty, longer than the step, or names no node of it.
        """
        n, a = self.chain_rows, len(nodes)
        if not n:
            return super().keep(start, nodes)
        if not 1 <= a <= n or not 0 <= nodes[-1] < n or start + n != self.tokens_read:
            raise ValueError("a recurrent layer keeps a path of the tree it verified")
        last = int(nodes[-1])
        self.cache = [c[last : last + 1] for c in self.cache]
        self.lengths, self.chain_rows, self.tokens_read = None, 0, start + a

    def snapshot(self) -> tuple[list, int]:
        """The state as it is (arrays are immutable: references, no copy) and the tokens read."""
        return list(self.cache), self.tokens_read

    def restore(self, snap: tuple[list, int]) -> None:
        """Back to a :meth:`snapshot` (a draft model's state before drafts it did not keep);
        a chain step's rows are dropped."""
        self.cache, self.tokens_read = list(snap[0]), snap[1]
        self.lengths, self.chain_rows = None, 0


@functools.cache
def _own_class(kind: type, base: type = OwnCache) -> type:
    return type(kind.__name__, (base, kind), {})


def own_cache(cache) -> OwnCache:
    """``cache`` (a model's own cache object) as an :class:`OwnCache`, in place (a
    :class:`RecurrentCache` for mlx-lm's ``ArraysCache``)."""
    base = RecurrentCache if isinstance(cache, ArraysCache) else OwnCache
    cache.__class__ = _own_class(type(cache), base)
    return cache


def cache_kinds(backbone) -> list:
    """The caches an mlx-lm model asks for, one per cache entry (``make_cache()``; one
    ``KVCache`` per layer where the model has no ``make_cache``)."""
    if hasattr(backbone, "make_cache"):
        return list(backbone.make_cache())
    return [KVCache() for _ in backbone.layers]


def rows_kinds(backbone) -> bool:
    """Whether every cache ``backbone`` asks for either keeps keys and values or is a
    recurrent ``ArraysCache`` (a model that may verify drafts by rows: :class:`RecurrentCache`)."""
    kinds = cache_kinds(backbone)
    return all(
        type(c).__name__ == "KVCache"
        or (type(c).__name__ == "RotatingKVCache" and not c.keep)
        or type(c) is ArraysCache
        for c in kinds
    )


def unrewindable(backbone) -> str | None:
    """Why a rejected draft could not be taken back out of ``backbone``'s caches (the
    kinds named: recurrent ``ArraysCache``/``MambaCache``, ``CacheList``, ...), or None
    where every layer keeps keys and values."""
    kinds = cache_kinds(backbone)
    bad = {type(c).__name__ for c in kinds} - {"KVCache", "RotatingKVCache"}
    if any(type(c).__name__ == "RotatingKVCache" and c.keep for c in kinds):
        bad.add("RotatingKVCache with attention sinks")
    if not bad:
        return None
    return f"this model uses {', '.join(sorted(bad))}, which a rejected draft cannot be taken out of"


def make_tree_cache(backbone, max_kv_size: int | None = None) -> list:
    """One :class:`TreeKVCache` per cache entry of an mlx-lm model, or with
    ``max_kv_size`` one :class:`WindowKVCache` of that size per entry.

    A sliding-window layer (mlx-lm's ``RotatingKVCache(window, keep=0)``) gets a
    :class:`WindowKVCache` of that window without sinks: its entries stay in order a little
    past the window (bounded memory) and the window is applied by the mask, so a rejected
    draft can be rewound (mlx-lm's own rotating cache cannot trim once it wraps). A hybrid
    whose other layers are recurrent (``ArraysCache``, :func:`rows_kinds`) keeps those as
    :class:`RecurrentCache` (drafts verified by rows) beside rewindable attention caches. Where the
    model asks for other caches that cannot be rewound (:func:`unrewindable`), every entry
    is the model's own cache (:class:`OwnCache`): plain decoding only.

    Raises:
        ValueError: ``max_kv_size`` on a model with sliding-window layers or caches of
            its own kind.
    """
    kinds = cache_kinds(backbone)
    names = {type(c).__name__ for c in kinds}
    if unrewindable(backbone) is not None:
        if max_kv_size is not None:
            raise ValueError("max_kv_size: this model builds caches of its own kind; leave out max_kv_size")
        if not rows_kinds(backbone):
            return [own_cache(c) for c in kinds]
    elif max_kv_size is not None:
        if "RotatingKVCache" in names:
            raise ValueError(
                "max_kv_size: this model's sliding-window layers already bound their caches "
                "(mlx-lm ignores max_kv_size for it too); leave out max_kv_size"
            )
        return [WindowKVCache(max_kv_size) for _ in kinds]
    # (a hybrid's recurrent layers: their own caches, drafts verified by rows; the rest rewindable)
    return [
        own_cache(c)
        if type(c) is ArraysCache
        else WindowKVCache(c.max_size, keep=0)
        if type(c).__name__ == "RotatingKVCache"
        else TreeKVCache()
        for c in kinds
    ]


def quantize_cache(cache: list, bits: int | None, group_size: int, start: int) -> None:
    """mlx-lm's ``maybe_quantize_kv_cache``: once ``start`` tokens are cached, each
    :class:`TreeKVCache` layer becomes a :class:`TreeQuantizedKVCache` (in place in
    the list). No-op without ``bits``."""
    if bits is None:
        return
    for i, c in enumerate(cache):
        if isinstance(c, TreeKVCache) and c.offset >= start:
            cache[i] = c.to_quantized(group_size=group_size, bits=bits)


def attention_mask(cache: list, tree) -> mx.array | None:
    """The mask of a step over ``tree`` (a :class:`~mlx_stream.tree.Tree`) after the cached
    prefix: ``(N, S)`` bool (S = held entries + N), or None for a single node that sees
    everything. Over a full layer where the model mixes them with sliding-window ones
    (whose masks are narrowed from it by :class:`TreeMask`)."""
    c = next((x for x in cache if not isinstance(x, (WindowKVCache, OwnCache))), cache[0])
    if isinstance(c, WindowKVCache):
        return c.tree_mask(tree.depths, tree.mask)
    n = tree.size
    if n == 1:
        return None
    # the tree's part is on the device already (Tree.arrays): nothing uploaded per step
    return mx.concatenate([mx.ones((n, tokens_in(c)), dtype=mx.bool_), tree.arrays[1]], axis=1)


def can_rewind(cache: Sequence, length: int) -> bool:
    """Whether trimming every layer back to ``length`` tokens gives what a fresh prefill
    would (:meth:`WindowKVCache.rewindable_to` on bounded layers, :meth:`OwnCache.rewindable_to`
    on recurrent ones; always for the others)."""
    return all(c.rewindable_to(length) for c in cache if isinstance(c, (WindowKVCache, OwnCache)))


def evict(cache: Sequence) -> None:
    """:meth:`WindowKVCache.evict` on every bounded layer."""
    for c in cache:
        if isinstance(c, WindowKVCache):
            c.evict()


def tokens_in(c) -> int:
    """Tokens through one layer's cache."""
    return c.tokens_read if isinstance(c, OwnCache) else c.offset


def cache_offset(cache: Sequence[TreeKVCache]) -> int:
    """Number of tokens held by the cache (all layers hold the same)."""
    return tokens_in(cache[0])


def trim_cache(cache: Sequence[TreeKVCache], length: int) -> None:
    """Drop entries past ``length`` in every layer (used to reuse a prompt prefix)."""
    for c in cache:
        if tokens_in(c) > length:
            c.trim(tokens_in(c) - length)


def mark(cache: Sequence) -> list:
    """What :func:`rewind` needs to bring ``cache`` back to where it is now: each recurrent
    layer's :meth:`RecurrentCache.snapshot` (None for the layers that trim)."""
    return [c.snapshot() if isinstance(c, RecurrentCache) else None for c in cache]


def rewind(cache: Sequence, length: int, marks: list) -> None:
    """Back to ``length`` tokens, where :func:`mark` was taken: recurrent layers restored,
    the others trimmed (timing loops that run forwards and drop them)."""
    for c, m in zip(cache, marks):
        if m is not None:
            c.restore(m)
    trim_cache(cache, length)


def keep_path(cache: Sequence[TreeKVCache], start: int, nodes: Sequence[int]) -> None:
    """:meth:`TreeKVCache.keep` on every layer.

    Raises:
        ValueError: ``nodes`` reaches past the entries written so far."""
    nodes = list(nodes)
    end = start + len(nodes)
    if nodes == list(range(len(nodes))):  # a prefix of what was written: no copy
        _check_nodes(cache_offset(cache), start, nodes)
        for c in cache:  # (the plain step: nothing moves; asked every step, per layer)
            if type(c) is TreeKVCache:
                c.offset = end
            else:
                c.keep(start, nodes)
        return
    slots = mx.array([start + i for i in nodes], dtype=mx.int32)  # (the same in every full layer)
    for c in cache:
        if type(c) is TreeKVCache:
            c.keep(start, nodes, slots)
        else:
            c.keep(start, nodes)
