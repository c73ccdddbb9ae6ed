"""A tree forward through an mlx-lm model's own ``__call__``: the family of every
key/value-cache model that has no module of its own here (issue 49).

Almost every mlx-lm model reads token positions only through its attentions'
``rope(x, offset=cache.offset)`` and builds its attention masks only through
``cache.make_mask(N, return_array=..., window_size=...)``. So a draft tree of N nodes
runs through the model's own code, unchanged, with two substitutions for the length
of one call:

- each rotary embedding module is wrapped (:class:`NodeRoPE`) so that the N nodes move
  onto the batch axis, node i rotated by its own position (``mx.fast.rope`` takes one
  offset per batch row: bitwise the rotation a sequential forward gives it), and
- every layer's cache (:class:`~mlx_stream.cache.TreeMask`) answers ``make_mask`` with
  the tree's mask: causal over the cache, ancestors-only inside the tree, narrowed to
  the window where a sliding-window layer asks for one.

The states that drafters read are taken where the model's own code passes them
(:class:`Tap`): the input of its output projection (stream heads, a draft's features)
and the inputs of chosen layers (EAGLE-3's fused features). Nothing is re-implemented
per architecture (the tree attention of Miao et al. 2024 / Cai et al. 2024 is only the
mask and the positions). :meth:`Generic.self_check` runs a small tree against
sequential forwards once per model, so a model whose positions or masks do not pass
through these two places decodes plainly instead of wrongly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache import (
    OwnCache,
    RecurrentCache,
    cache_kinds,
    keep_path,
    make_tree_cache,
    rows_kinds,
    unrewindable,
)
from .args import text_args

FAMILY: tuple[str, ...] = ()  # chosen by models.family for every type without a module of its own


class NodeRoPE(nn.Module):
    """A rotary embedding that rotates each of N tree nodes at its own position.

    Args:
        rope: the model's rotary embedding module (``nn.RoPE``, ``Llama3RoPE``,
            ``YarnRoPE``, ``SuScaledRoPE``, ``ProportionalRoPE``, ...).
        positions: int32 ``(N,)``, the absolute position of each node.

    Called as the wrapped module (``rope(x, offset)``) on ``x`` of shape ``(1, H, N, D)``:
    the nodes go onto the batch axis, ``(N, H, 1, D)``, with one offset per row, and back.
    The ``offset`` the model passes (the cache's length) is replaced by ``positions``.

    Raises:
        ValueError: ``x`` is not one sequence of the N nodes (a model that rotates another
            layout; :meth:`Generic.self_check` turns trees off for it).
    """

    def __init__(self, rope: nn.Module, positions: mx.array):
        super().__init__()
        self.inner = rope
        object.__setattr__(self, "_positions", positions)  # not a parameter

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
def _swapped(slots: Sequence[tuple], make) -> Iterator[None]:
    # the module at each slot replaced by make(i, original) for the block, then put back
    originals = [m[k] for m, k in slots]
    try:
        for i, ((m, k), orig) in enumerate(zip(slots, originals)):
            m[k] = make(i, orig)
        yield
    finally:
        for (m, k), orig in zip(slots, originals):
            m[k] = orig


@contextmanager
def node_positions(backbone: nn.Module, positions: mx.array, slots=None) -> Iterator[None]:
    """Within the block, every rotary embedding of ``backbone`` (at ``slots``, from
    :func:`rope_slots`, found again where not given) rotates tree nodes at ``positions``
    (:class:`NodeRoPE`); the model's own modules are back after it."""
    slots = rope_slots(backbone) if slots is None else slots
    with _swapped(slots, lambda i, rope: NodeRoPE(rope, positions)):
        yield


class Tap(nn.Module):
    """A module that records the input it is called with and calls the one it wraps.

    For an embedding used as the output projection (tied weights), only ``as_linear``
    records; its ``__call__`` (the input embedding) passes through.
    """

    def __init__(self, inner: nn.Module, box: list, on_linear: bool = False):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_box", box)  # not a parameter
        self._on_linear = on_linear

    def __call__(self, *args, **kwargs):
        if not self._on_linear:  # the input: the first argument, positional or not
            self._box.append(args[0] if args else next(iter(kwargs.values())))
        return self.inner(*args, **kwargs)

    def as_linear(self, x):
        self._box.append(x)
        return self.inner.as_linear(x)

    def __getattr__(self, name):
        if name in self or "inner" not in self:
            return super().__getattr__(name)
        return getattr(self["inner"], name)  # the model may read the wrapped module's attributes


def _slot(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    # (parent, key) of the submodule at a dotted path such as "model.embed_tokens" or "layers.3"
    *parents, key = path.split(".")
    m = root
    for p in parents:
        m = m[int(p)] if isinstance(m, list) else m[p]
    return m, (int(key) if isinstance(m, list) else key)


def _layer_slots(backbone: nn.Module, i: int) -> list[tuple[list, int]]:
    # every place that holds decoder layer i: the model may iterate another list than
    # ``backbone.layers`` (a pipeline's slice of them, qwen3_moe's ``pipeline_layers``)
    layer, seen, out = backbone.layers[i], set(), []
    for _, m in backbone.named_modules():
        for v in m.values():
            if isinstance(v, list) and id(v) not in seen:
                seen.add(id(v))
                out += [(v, j) for j, x in enumerate(v) if x is layer]
    return out


def _output_candidates(backbone: nn.Module, vocab: int) -> list[tuple[str, bool]]:
    # (path, tied) of every module that may be the output projection: an lm_head, a linear
    # layer onto the vocabulary, an embedding (tied weights)
    out = []
    for name, m in backbone.named_modules():
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            out.append((name, True))
        elif name.split(".")[-1] == "lm_head" or (
            isinstance(m, (nn.Linear, nn.QuantizedLinear)) and m.weight.shape[0] == vocab
        ):
            out.append((name, False))
    return out


class _OrderedTap(Tap):
    # a Tap that also notes, in a list shared by all taps, that it was called
    def __init__(self, inner, box, on_linear, index, order):
        super().__init__(inner, box, on_linear)
        object.__setattr__(self, "_note", lambda: order.append(index))

    def __call__(self, *args, **kwargs):
        if not self._on_linear:
            self._note()
        return super().__call__(*args, **kwargs)

    def as_linear(self, x):
        self._note()
        return super().as_linear(x)


class Generic:
    """The tree forward of every mlx-lm model whose caches are key/value caches
    (``KVCache``, ``RotatingKVCache`` sliding windows, MLA's latent caches), through the
    model's own modules and ``__call__``.

    Provides the family interface of :mod:`mlx_stream.models` (``tree_forward``,
    ``prefill_forward``, ``tree_hidden``, ``prefill_hidden``, ``project``, ``embed``,
    ``output_layer``, ``state_size``) as methods taking the backbone first.

    Args:
        backbone: an mlx-lm ``Model`` (a vision-language wrapper's text model included).

    Attributes:
        vocab: the vocabulary size (the logits' width).
        output: dotted path of the output projection (``lm_head``, or the embedding when
            tied), found by running one token through the model; None where the model
            multiplies by a raw matrix that cannot be tapped (then heads and drafters that
            read hidden states are refused; trees and draft models still work).
        embedding: dotted path of the input embedding.
        windowed: whether some layers attend over a sliding window.
        trees: why draft trees cannot run through this model (a one-line reason: caches a
            rejected draft cannot be taken out of, such as recurrent layers', which then
            are the model's own and decode plainly; or a failed :meth:`self_check`), or
            None when :meth:`self_check` found them exact.

    Raises:
        ValueError: the model has no token embedding.
    """

    def __init__(self, backbone: nn.Module):
        kinds = cache_kinds(backbone)
        own = unrewindable(backbone)  # recurrent layers: the model's own caches
        hybrid = own is not None and rows_kinds(backbone)  # recurrent layers beside attention: rows
        self.windowed = (own is None or hybrid) and any(type(c).__name__ == "RotatingKVCache" for c in kinds)
        self.vocab = int(text_args(backbone).vocab_size)
        self._ropes = rope_slots(backbone)  # (found once per model: a tree step swaps them)
        self._layer_slots: dict[tuple[int, ...], list] = {}
        self.output, self.embedding, self._width = self._probe(backbone, check_windows=own is None)
        self.trees: str | None = None
        self.recurrent = False  # recurrent layers verified by rows (RecurrentCache)
        self._mixers: list = []
        if not own:
            self.trees = self.self_check(backbone)
        elif not hybrid:
            self.trees = f"{own}: plain decoding only"
        else:
            self._mixers = self._find_mixers(backbone)
            self.recurrent = True
            why = (
                self.self_check(backbone)
                if self._mixers
                else "no recurrent mixer found to verify drafts through"
            )
            if why is not None:
                self.recurrent, self.trees = False, f"{own}: plain decoding only ({why})"

    # -- finding the model's own modules

    def _probe(self, backbone, check_windows: bool) -> tuple[str | None, str, int | None]:
        # the output projection is the last candidate module the model's forward calls
        cands = _output_candidates(backbone, self.vocab)
        boxes, order = [[] for _ in cands], []
        slots = [_slot(backbone, name) for name, _ in cands]
        embeds = [name for name, tied in cands if tied]
        if not embeds:
            raise ValueError(f"{type(backbone).__module__}: no token embedding found")
        cache, asked = make_tree_cache(backbone), set()
        for c in cache if check_windows else ():  # note the windows the model asks its masks for
            c.make_mask = lambda *a, _c=c, **k: (
                asked.add(k.get("window_size")) or type(_c).make_mask(_c, *a, **k)
            )
        with _swapped(slots, lambda i, m: _OrderedTap(m, boxes[i], cands[i][1], i, order)):
            backbone(mx.array([[0]]), cache=cache)
        sizes = {c.max_size for c in cache_kinds(backbone) if type(c).__name__ == "RotatingKVCache"}
        if check_windows and not sizes <= asked:
            # a layer whose rotating cache, not its mask, bounds what it sees: mlx-lm's own
            # output depends on that cache's wrap-around, which a rewindable cache cannot follow
            raise ValueError(
                f"{type(backbone).__module__}: its sliding-window caches hold {sorted(sizes)} tokens but its "
                f"masks ask for windows of {sorted(w for w in asked if w)}: not supported"
            )
        embedding = next((n for n in embeds if n.endswith("embed_tokens")), embeds[0])
        if not order:  # a raw matrix product (hidden @ W.T): nothing to tap
            return None, embedding, None
        last = order[-1]
        return cands[last][0], embedding, int(boxes[last][-1].shape[-1])

    def _find_mixers(self, backbone) -> list[tuple[nn.Module, str]]:
        # (parent, key) of each decoder layer's child module that is handed a recurrent cache
        # (its mixer: Gated DeltaNet, Mamba, a short convolution), found by one token's forward
        children = [
            (layer, k) for layer in backbone.layers for k, v in layer.items() if isinstance(v, nn.Module)
        ]
        got: list = []

        def make(i, inner):
            def note(*args, **kwargs):
                if any(isinstance(a, RecurrentCache) for a in (*args, *kwargs.values())):
                    got.append(children[i])
                return inner(*args, **kwargs)

            return _Called(inner, note)

        with _swapped(children, make):
            backbone(mx.array([[0]]), cache=make_tree_cache(backbone))
        return got

    def _module(self, backbone, path: str):
        m, k = _slot(backbone, path)
        return m[k]

    # -- the forwards

    @contextmanager
    def _taps(self, backbone, capture: tuple[int, ...]) -> Iterator[tuple[list, list]]:
        out, mids = [], [[] for _ in capture]
        outs = [] if self.output is None else [_slot(backbone, self.output)]
        if capture not in self._layer_slots:  # found once: the model's structure does not change
            self._layer_slots[capture] = [_layer_slots(backbone, i) for i in capture]
        layer_slots = self._layer_slots[capture]
        slots = outs + [s for ls in layer_slots for s in ls]
        boxes = [out][: len(outs)] + [box for box, ls in zip(mids, layer_slots) for _ in ls]
        tied = [self.output == self.embedding][: len(outs)] + [False] * (len(slots) - len(outs))
        with _swapped(slots, lambda i, m: Tap(m, boxes[i], on_linear=tied[i])):
            yield out, mids

    def _run(self, backbone, tokens, cache, capture) -> tuple[mx.array, mx.array, mx.array | None]:
        layers = _captured(capture)
        with self._taps(backbone, layers) as (out, mids):
            logits = backbone(tokens[None], cache=cache)[0]
        for c in cache:
            if isinstance(c, OwnCache):  # (mlx-lm's recurrent caches count no tokens)
                c.tokens_read += tokens.shape[0]
        if any(not m for m in mids):
            raise ValueError(
                f"{type(backbone).__module__} does not call its decoder layers from a list this forward "
                f"can see, so the inputs of layers {list(layers)} cannot be captured: use heads that read "
                "only the final hidden state (residual, hydra, eagle without fused layers)"
            )
        mid = mx.concatenate([m[0][0] for m in mids], axis=-1) if layers else None
        # (no tapped projection: the logits stand in for the states, which nothing reads then)
        return logits, (out[-1][0] if out else logits), mid

    def tree_forward(self, backbone, tokens: mx.array, positions: mx.array, mask, cache, capture=None):
        """Logits and states of a draft tree through the model's own ``__call__``.

        Args:
            tokens: int ``(N,)``, node 0 the root (the last emitted token), parents first.
            positions: int32 ``(N,)`` each node's absolute position (may be lazy).
            mask: bool ``(N, S)`` over the held cache entries and the tree (what each node
                sees), or None where every node sees everything (a single node).
            cache: the model's caches (:func:`~mlx_stream.cache.make_tree_cache`); the N
                entries are appended (``keep`` the accepted path after verifying).
            capture: a layer index, or a tuple of them: also return the hidden states
                entering those layers, concatenated in that order.

        Returns:
            ``(logits (N, V), hidden (N, H), mid)``: the model's own logits (softcapping
            and logit scales included), the input of its output projection, and ``(N, n*H)``
            captured layer inputs or None.

        Raises:
            ValueError: a tree of more than one node on a model whose trees are off
                (:attr:`trees` says why).
        """
        if tokens.shape[0] > 1 and self.trees is not None:
            raise ValueError(f"draft trees are off for this model: {self.trees}")
        if self.trees is not None or tokens.shape[0] == 1 and self.recurrent:
            return self._run(backbone, tokens, cache, capture)  # one node at the cache's end: the model's own
        for c in cache:
            c.tree = (mask, positions)
        try:
            rows = self._recurrent_rows(tokens.shape[0], mask, cache) if self.recurrent else nullcontext()
            with node_positions(backbone, positions, self._ropes), rows:
                return self._run(backbone, tokens, cache, capture)
        finally:
            for c in cache:
                c.tree = None

    @contextmanager
    def _recurrent_rows(self, n: int, mask, cache) -> Iterator[None]:
        # a recurrent hybrid's tree of n nodes: each recurrent layer's mixer runs n rows, row i
        # the path from the root to node i (gathered from the tree's ancestor mask: the mask's
        # last n columns), padded to n and cut by its cache's lengths; node i's output is row i
        # at its own depth (RecurrentCache.rows; keep_path later selects the accepted row)
        anc = mx.tril(mx.ones((n, n), dtype=mx.bool_)) if mask is None else mask[:, -n:]
        depth = anc.sum(axis=-1).astype(mx.int32) - 1
        at = anc[:, None, :] & (depth[None, None, :] == mx.arange(n)[None, :, None])  # (node, t, j)
        paths = mx.argmax(at, axis=-1)  # (n, n): node i's ancestor at depth t (0 past its depth)
        for c in cache:
            if isinstance(c, RecurrentCache):
                c.rows(n, depth + 1)
        rows = mx.arange(n)

        def wrap(i, mixer):
            return _Called(mixer, lambda x, *a, **k: mixer(x[0][paths], *a, **k)[rows, depth][None])

        with _swapped(self._mixers, wrap):
            yield

    def tree_hidden(self, backbone, tokens, positions, mask, cache, capture=None):
        """``(hidden, mid)`` of :meth:`tree_forward`."""
        return self.tree_forward(backbone, tokens, positions, mask, cache, capture)[1:]

    def prefill_forward(self, backbone, tokens: mx.array, cache, capture=None):
        """A causal prefill of L tokens (the model's own forward): ``(logits (V,) at the last
        position, hidden (L, H), mid (L, n*H) or None)``, as :meth:`tree_forward`."""
        logits, hidden, mid = self._run(backbone, tokens, cache, capture)
        return logits[-1], hidden, mid

    def prefill_hidden(self, backbone, tokens, cache, capture=None):
        """``(hidden, mid)`` of :meth:`prefill_forward`."""
        return self.prefill_forward(backbone, tokens, cache, capture)[1:]

    def project(self, backbone, hidden: mx.array) -> mx.array:
        """The output projection alone: hidden ``(..., H)`` -> ``(..., V)`` (what drafters
        score with; without the model's softcapping or logit scale, which keep the order).

        Raises:
            ValueError: the model's output projection could not be tapped (:attr:`output`).
        """
        out = self.output_layer(backbone)
        return out.as_linear(hidden) if self.output == self.embedding else out(hidden)

    def embed(self, backbone, tokens: mx.array) -> mx.array:
        """The input embeddings of ``tokens``, ``(..., H)`` (before any scaling the model applies)."""
        return self._module(backbone, self.embedding)(tokens)

    def output_layer(self, backbone):
        """The module of the output projection (holding its ``(V, H)`` weight).

        Raises:
            ValueError: the model multiplies by a raw matrix that cannot be tapped.
        """
        if self.output is None:
            raise ValueError(
                f"{type(backbone).__module__} computes its logits as a raw matrix product: stream heads "
                "and drafters that read hidden states need an output projection module; use a draft model"
            )
        return self._module(backbone, self.output)

    def state_size(self, backbone) -> int:
        """Width of the states the heads read (the output projection's input).

        Raises:
            ValueError: as :meth:`output_layer`.
        """
        self.output_layer(backbone)
        return self._width

    # -- the self-check

    def self_check(self, backbone, atol: float | None = None) -> str | None:
        """Run a small draft tree against sequential forwards of each node's path (a few
        tokens, once per model): None when every node's logits agree, else a one-line
        reason why trees are off for this model.

        ``atol``: the largest difference allowed, relative to the largest logit; by
        default 1e-3 in float32, 5e-2 in lower precision (rounding differs between a
        batched and a one-token forward; a wrong position or mask moves logits by their
        whole scale). A model with no rotary embedding module reads positions some other
        way (learned position embeddings, its own rotation): trees are off for it even
        where a random model hides the difference.
        """
        if not self._ropes and not self.recurrent:  # (a recurrent layer reads no positions)
            return (
                f"{type(backbone).__module__} has no rotary embedding module to position tree nodes through "
                "(learned or hand-computed positions)"
            )
        vocab = self.vocab
        rng = np.random.default_rng(0)
        prefix = rng.integers(0, vocab, 6).tolist()
        tokens = rng.integers(0, vocab, 4).tolist()  # root; two children; a grandchild under the first
        parents = [-1, 0, 0, 1]
        depths = np.array([0, 1, 1, 2])
        anc = np.eye(4, dtype=bool)
        for i in range(1, 4):
            anc[i] |= anc[parents[i]]
        try:
            cache = make_tree_cache(backbone)
            self._run(backbone, mx.array(prefix), cache, None)
            n = len(prefix)
            mask = mx.concatenate([mx.ones((4, n), dtype=mx.bool_), mx.array(anc)], axis=1)
            saved, self.trees = self.trees, None
            try:
                got = self.tree_forward(
                    backbone, mx.array(tokens), mx.array(n + depths, dtype=mx.int32), mask, cache
                )[0]
                paths = [prefix + [t for t, a in zip(tokens, anc[i]) if a] for i in range(4)]
                if self.recurrent:  # the state kept for the path root -> second child, read on by one more
                    keep_path(cache, n, [0, 2])
                    more = self.tree_forward(backbone, mx.array(tokens[3:]), mx.array([n + 2]), None, cache)[
                        0
                    ]
                    got = mx.concatenate([got, more])
                    paths.append(prefix + [tokens[0], tokens[2], tokens[3]])
            finally:
                self.trees = saved
            want = mx.stack([backbone(mx.array(p)[None])[0, -1] for p in paths])
            got, want = got.astype(mx.float32), want.astype(mx.float32)
            mx.eval(got, want)
        except Exception as e:  # noqa: BLE001  any failure of the substituted forward means no trees
            return f"a draft tree does not run through {type(backbone).__module__} ({type(e).__name__}: {e})"
        if atol is None:
            atol = 1e-3 if got.dtype == mx.float32 and want.dtype == mx.float32 else 5e-2
        scale = float(mx.abs(want).max()) or 1.0
        err = float(mx.abs(got - want).max()) / scale
        if err > atol or (got.argmax(-1) != want.argmax(-1)).any().item():
            how = (
                "a recurrent layer that does not honour its cache's lengths, or positions or masks "
                "that bypass rope/make_mask"
                if self.recurrent
                else "positions or masks that bypass rope/make_mask"
            )
            return (
                f"a draft tree's logits differ from sequential decoding by {err:.2g} of their scale in "
                f"{type(backbone).__module__} ({how})"
            )
        return None


class _Called(nn.Module):
    # a module called through ``fn`` (the wrapped module's attributes still read through)
    def __init__(self, inner: nn.Module, fn):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def __getattr__(self, name):
        if name in self or "inner" not in self:
            return super().__getattr__(name)
        return getattr(self["inner"], name)


def _captured(capture) -> tuple[int, ...]:
    return () if capture is None else (capture,) if isinstance(capture, int) else tuple(capture)


__all__ = ["Generic", "NodeRoPE", "Tap", "node_positions", "rope_slots"]
