"""The Speculative Streaming decode loop.

Prefill the prompt; then each step is exactly one backbone forward over the draft
tree (root = the last emitted token, then the drafts): it yields the canonical
logits at every node, which verify the drafts, and the hidden state at the last
accepted node, from which the stream heads draft the next tree (Bhendawade et al.
2024, sec. 3.2-3.3). The KV cache keeps only the accepted path.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from .adaptive import SpeculationPolicy
from .cache import (
    TreeQuantizedKVCache,
    WindowKVCache,
    attention_mask,
    cache_offset,
    keep_path,
    make_tree_cache,
    quantize_cache,
    trim_cache,
)
from .drafters import (
    AcceptanceObserver,
    Drafter,
    NoDrafter,
    StepTimer,
    is_static_step,
    propose,
    queued_drafter,
    queued_tree,
    queues_steps,
)
from .sampling import DraftNoise, GumbelNoise, LogitsProcessor, SamplingParams, log_softmax, process_logits
from .speculation import check_prompt_lookup, check_tree_spec, make_drafter
from .tree import Tree, no_drafts
from .verify import accepted_node, verify_greedy


@dataclass
class GenerationResponse:
    """One decoding step's output (one step may emit several tokens).

    Attributes:
        text: the text delta released this step (text that could still become a
            stop string is held back until it cannot).
        tokens: token ids emitted this step.
        logprobs: the log-probability of each of ``tokens`` as mlx-lm reports it:
            ``log_softmax`` of the target's logits after the logits processors,
            before temperature and top-p/top-k/min-p (natural log, float).
        accepted: drafts accepted this step.
        drafted: drafts verified by the forward pass that produced this step's tokens
            (0 for a plain step, and for the first token, which comes from the prefill).
        prompt_tokens: prompt length in tokens (including reused cache entries).
        cached_tokens: how many of ``prompt_tokens`` came from a reused
            :class:`PromptCache` rather than being prefilled (as OpenAI's
            ``usage.prompt_tokens_details.cached_tokens``).
        prompt_tps: prefill speed, tokens/s (over the tokens actually prefilled).
        generation_tokens: tokens emitted so far.
        generation_tps: tokens/s since the first token.
        forward_passes: decoding forward passes so far (the prefill excluded; the
            first token comes from the prefill).
        peak_memory: peak memory so far, GB.
        finish_reason: ``None`` while running, then ``"stop"`` (EOS or a stop string)
            or ``"length"`` (max_tokens or the context window).
        top_logprobs: with ``stream_generate(top_logprobs=k)``, per token of ``tokens``
            the k most likely ``(token id, log-probability)`` at its position, most
            likely first; else None.
        tau: mean tokens per decoding forward pass so far: the tokens the target
            produced after the first (an ending EOS included) over ``forward_passes``.
            Plain decoding gives 1.0.
    """

    text: str
    tokens: list[int]
    accepted: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    forward_passes: int
    peak_memory: float
    finish_reason: str | None = None
    tau: float = 0.0
    logprobs: list[float] | None = None
    drafted: int = 0
    cached_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None


class PromptCache:
    """A KV cache that persists across calls (multi-turn chat).

    Args:
        model: the :class:`~mlx_stream.model.SpeculativeModel` it serves.
        max_kv_size: ``None`` keeps every token; else a bounded cache of that many
            tokens with the attention of mlx-lm's rotating cache
            (:class:`~mlx_stream.cache.WindowKVCache`); generations with this cache must
            ask for the same ``max_kv_size``.

    Attributes:
        layers: one cache per backbone layer (:class:`~mlx_stream.cache.TreeKVCache`,
            its quantized form once ``kv_bits`` applies, or
            :class:`~mlx_stream.cache.WindowKVCache`).
        tokens: the tokens whose keys/values the cache holds, in order.
    """

    def __init__(self, model, max_kv_size: int | None = None):
        self.backbone, self.max_kv_size = model.backbone, max_kv_size
        self.layers = make_tree_cache(model.backbone, max_kv_size)
        self.tokens: list[int] = []

    def reset(self) -> None:
        """Forget everything."""
        self.layers[:] = make_tree_cache(self.backbone, self.max_kv_size)
        self.tokens = []

    @property
    def quantization(self) -> tuple[int, int] | None:
        """``(bits, group_size)`` once the entries are stored quantized, else None."""
        c = self.layers[0]
        return (c.bits, c.group_size) if isinstance(c, TreeQuantizedKVCache) else None

    def shared_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the cache holds (its common prefix with them)."""
        n, limit = 0, min(len(self.tokens), len(ids))
        while n < limit and self.tokens[n] == ids[n]:
            n += 1
        return n

    def reuse(self, ids: Sequence[int], quantized_kv_start: int | None = None) -> int:
        """Trim the cache to its longest common prefix with ``ids``, leaving at least
        one token of ``ids`` to prefill. Returns the number of tokens reused.

        Where trimming cannot give what a fresh cache would (a bounded cache whose
        window was full, or quantized entries the prompt would have kept in full
        precision below ``quantized_kv_start``), the cache is reset instead."""
        n = min(self.shared_prefix(ids), len(ids) - 1)
        c = self.layers[0]
        if n < len(self.tokens) and (
            (isinstance(c, WindowKVCache) and not c.rewindable_to(n))
            or (
                isinstance(c, TreeQuantizedKVCache) and (quantized_kv_start is None or n < quantized_kv_start)
            )
        ):
            self.reset()
            return 0
        trim_cache(self.layers, n)
        self.tokens = self.tokens[:n]
        return n


_PROMPT_FORMS = "a string, or a 1-D sequence of token ids (a list of ints, a 1-D mx.array or numpy array)"


def encode_prompt(tokenizer, prompt, vocab_size: int | None = None) -> list[int]:
    """The token ids :func:`stream_generate` decodes for ``prompt``: text is encoded as
    ``mlx_lm.stream_generate`` does (no second BOS when the text starts with one); a
    1-D sequence of token ids (list, tuple, ``mx.array``, numpy array) is taken as it is.

    Raises:
        ValueError: any other form (a batch of prompts, nested lists, floats, strings
            among the ids), or ids outside ``[0, vocab_size)`` when ``vocab_size`` is given.
    """
    if isinstance(prompt, str):
        # as mlx_lm.stream_generate: no second BOS when the text already has one
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    shape = getattr(prompt, "shape", None)
    if shape is not None:  # mx.array, numpy array
        kind = str(getattr(prompt, "dtype", ""))
        if len(shape) != 1 or not any(k in kind for k in ("int", "uint")):
            raise ValueError(
                f"a prompt array must be 1-D integer token ids, got shape {tuple(shape)} of {kind}; "
                f"prompts are {_PROMPT_FORMS} (one prompt per call)"
            )
        ids = [int(t) for t in prompt.tolist()]
    elif isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            bad = next(t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool))
            raise ValueError(
                f"a prompt list must hold token ids (ints), got {type(bad).__name__} {bad!r}; "
                f"prompts are {_PROMPT_FORMS} (one prompt per call)"
            )
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"prompts are {_PROMPT_FORMS}, got {type(prompt).__name__}")
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in ids):
        bad = next(t for t in ids if t < 0 or t >= vocab_size)
        raise ValueError(f"token id {bad} in the prompt is outside the vocabulary [0, {vocab_size})")
    return ids


def check_generation(
    max_tokens: int,
    sampling: SamplingParams | float,
    vocab_size: int | None = None,
    *,
    tree=None,
    prompt_lookup: int | None = None,
) -> None:
    """Check generation settings before any model is loaded or run.

    Args:
        max_tokens: must be a positive integer.
        sampling: :meth:`~mlx_stream.sampling.SamplingParams.check` (a float is a temperature).
        vocab_size: ``top_k`` must stay below it, when given.
        tree: a tree spec, syntax only (:func:`~mlx_stream.speculation.check_tree_spec`).
        prompt_lookup: ``None`` or an integer >= 0.

    Raises:
        ValueError: naming the first setting out of range.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(sampling, SamplingParams):
        sampling = SamplingParams(temp=sampling)
    sampling.check(vocab_size)
    check_tree_spec(tree)
    check_prompt_lookup(prompt_lookup)


class _Emitter:
    """Applies the stop conditions token by token and releases text safely."""

    def __init__(self, tokenizer, max_tokens: int, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos = set(tokenizer.eos_token_ids)
        self.max_tokens = max_tokens
        self.stop = [s for s in stop if s]
        self.maxlen = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.eos_hit = False
        self.sent = 0

    def _stop_at(self, text: str, start: int) -> int | None:
        hits = [i for i in (text.find(s, max(0, start)) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        for n in range(min(self.maxlen - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _text_of(self, tokens: Sequence[int]) -> str:
        d = self.tokenizer.detokenizer  # a fresh copy
        for t in tokens:
            d.add_token(t)
        d.finalize()
        return d.text

    def _completes_stop(self) -> bool:
        # whether the newest token completes a stop string in the decoded text. The
        # streaming detokenizer may show a token's text (trailing spaces) only tokens
        # later, so the tail is decoded whole: enough tokens for the longest stop
        # string even at 4 bytes (4 byte tokens) per character
        tail = self._text_of(self.tokens[-(4 * self.maxlen + 4) :])
        return any(s in tail for s in self.stop)

    def push(self, chunk: Sequence[int], out_of_room: bool = False) -> tuple[str, list[int], str | None]:
        """Feed one step's tokens. Returns ``(text delta, tokens kept, finish_reason)``.

        When a stop string ends the output, the tokens kept end with the one that
        completes it in the decoded text (the text ends before it)."""
        kept: list[int] = []
        reason = None
        for t in chunk:
            if t in self.eos:
                reason = "stop"
                self.eos_hit = True
                break
            kept.append(t)
            self.tokens.append(t)
            self.detok.add_token(t)
            if self.stop and self._completes_stop():
                reason = "stop"
                break
            if len(self.tokens) >= self.max_tokens:
                reason = "length"
                break
        if reason is None and out_of_room:
            reason = "length"
        if reason is not None:
            self.detok.finalize()
        text = self.detok.text
        end = len(text)
        if self.stop:
            cut = self._stop_at(text, self.sent - self.maxlen)
            if cut is not None:
                end, reason = cut, "stop"
            elif reason is None:
                end -= self._holdback(text)
        if reason is None and text.endswith("\ufffd"):
            end = min(end, len(text) - 1)  # an incomplete UTF-8 sequence
        delta = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return delta, kept, reason


class _TreeVerifier:
    """The target's distribution at every tree node, and the accepted path through it.

    Runs the logits processors at every node on that node's own history, then takes the
    target's token at every node: the argmax when greedy, otherwise the Gumbel-max draw
    ``argmax(mask(logprobs) / temp + g)`` with the noise of the token's position
    (:class:`~mlx_stream.sampling.GumbelNoise`), both on the device; the accepted path is
    the longest one whose drafts equal those tokens
    (:func:`~mlx_stream.verify.verify_greedy`). A custom ``verifier`` ``f(tree, tokens,
    probs, uniforms)`` gets the processed distributions on the host and one uniform per
    position keyed by (seed, position) instead. One host sync per call.
    """

    def __init__(
        self,
        sampling: SamplingParams,
        processors: Sequence[LogitsProcessor],
        verifier: Callable | None,
        entropy: int,
        vocab_size: int,
        top_logprobs: int = 0,
        skip: int = 0,
    ):
        self.sampling, self.processors, self.verifier, self.entropy = sampling, processors, verifier, entropy
        self.top_logprobs = top_logprobs
        self.skip = skip  # leading history tokens the processors do not see (unknown ids)
        self.noise = None if sampling.greedy or verifier is not None else GumbelNoise(entropy, vocab_size)

    def draft_noise(self, start: int, shift: mx.array | None = None, spread: int = 0) -> DraftNoise | None:
        """The noise drafts at position ``start`` (``start + shift``, ``shift`` lazy and at
        most ``spread``) onwards are coupled with (None when greedy or with a custom verifier)."""
        return (
            None if self.noise is None else DraftNoise(self.sampling.temp, self.noise, start, shift, spread)
        )

    def _top(self, logprobs: mx.array) -> tuple[mx.array, mx.array] | None:
        # the k most likely tokens at every node, unsorted: (N, k) ids and log-probabilities
        if self.top_logprobs <= 0:
            return None
        k = min(self.top_logprobs, logprobs.shape[-1])
        ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
        return ids, mx.take_along_axis(logprobs, ids, axis=-1)

    @staticmethod
    def _top_rows(top, path: list[int]) -> list[list[tuple[int, float]]] | None:
        if top is None:
            return None
        ids, vals = np.array(top[0]), np.array(top[1])
        rows = []
        for i in path:
            order = np.argsort(-vals[i], kind="stable")
            rows.append([(int(ids[i, j]), float(vals[i, j])) for j in order])
        return rows

    def _processed(self, tree: Tree, node_tokens: mx.array, logits: mx.array, history) -> mx.array:
        # (N, V) logits after the logits processors (each node on its own history)
        if not self.processors:
            return logits
        paths = [mx.array(p, dtype=mx.int32) for p in tree.paths]
        return process_logits(self.processors, history[self.skip :], node_tokens, paths, logits)

    def targets(
        self,
        tree: Tree,
        node_tokens: mx.array,
        logits: mx.array,
        length: int,
        history=None,
        shift: mx.array | None = None,
        spread: int = 0,
    ):
        """Lazy ``(targets (N,), chosen (N,), top, logprobs (N, V))``: the target's token at
        every node (greedy or the Gumbel-max draw), its log-probability, the top
        log-probabilities (or None) and the processed log-probabilities, for the ``(N,)``
        node tokens and their ``(N, V)`` logits after ``length`` tokens (up to and including
        the root; ``length + shift`` for a step queued before the host knows it, ``shift``
        a lazy ``()`` int32 of at most ``spread``). ``history``: those tokens, ``(length,)``
        int32 (it may be lazy), needed only with logits processors. No host sync."""
        logits = self._processed(tree, node_tokens, logits, history)
        logprobs = log_softmax(logits)  # (N, V)
        if self.sampling.greedy:
            scores = logits
        else:  # the token after a node of depth d lands at position length + shift + d
            rows = mx.array(tree.depths, dtype=mx.int32)
            if shift is not None:
                rows = rows + shift
            g = self.noise.rows(length, tree.depth + 1 + spread)[rows]
            scores = self.sampling.mask(logprobs) * (1.0 / self.sampling.temp) + g
        targets = mx.argmax(scores, axis=-1)
        chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        return targets, chosen, self._top(logprobs), logprobs

    def __call__(self, tree: Tree, node_tokens: mx.array, logits: mx.array, history: list[int]):
        """``(accepted path, next token, node tokens, log-probability of each emitted token,
        top log-probabilities)`` for the ``(N,)`` node tokens and their ``(N, V)`` logits
        after ``history``. The last is ``None`` unless ``top_logprobs`` > 0: then, per
        emitted token, the ``top_logprobs`` most likely ``(token id, log-probability)``
        pairs at its position, most likely first."""
        if self.verifier is None or self.sampling.greedy:
            hist = mx.array(history, dtype=mx.int32) if self.processors else None
            targets, chosen, top, _ = self.targets(tree, node_tokens, logits, len(history), hist)
            mx.eval(node_tokens, targets, chosen, top)
            toks = node_tokens.tolist()
            path, nxt = verify_greedy(tree, toks, targets.tolist())
            chosen = chosen.tolist()
            return path, nxt, toks, [chosen[i] for i in path], self._top_rows(top, path)
        logits = self._processed(tree, node_tokens, logits, mx.array(history, dtype=mx.int32))
        logprobs = log_softmax(logits)  # (N, V)
        top = self._top(logprobs)
        probs = self.sampling.distribution(logprobs)
        mx.eval(node_tokens, probs, logprobs, top)
        toks = node_tokens.tolist()
        uniforms = [
            np.random.default_rng([self.entropy, len(history) + d]).random() for d in range(tree.depth + 1)
        ]
        path, nxt = self.verifier(tree, toks, np.array(probs), uniforms)
        lp = np.array(logprobs)
        emitted = [toks[i] for i in path[1:]] + [nxt]
        return path, nxt, toks, [float(lp[i, t]) for i, t in zip(path, emitted)], self._top_rows(top, path)


@dataclass
class _Step:
    """What one forward pass over a draft tree decided."""

    tree: Tree
    node_tokens: list[int]
    path: list[int]  # accepted nodes, root first
    next_token: int  # the target's token after the accepted path
    logprobs: list[float]  # of each emitted token
    top_logprobs: list | None  # per emitted token: [(id, log-probability)] most likely first, or None
    hidden: mx.array  # (H,) final hidden state at the last accepted node
    mid: mx.array | None  # (H,) the captured layer's input there (msa heads)
    path_hidden: mx.array | None = None  # (P, H) final hidden states of the accepted path (eagle heads)

    @cached_property
    def emitted(self) -> list[int]:
        """The tokens this step emits: the accepted drafts, then ``next_token``."""
        return [self.node_tokens[i] for i in self.path[1:]] + [self.next_token]


@dataclass(frozen=True)
class KVSettings:
    """How the KV cache stores tokens (mlx-lm's ``generate_step`` arguments).

    Attributes:
        max_kv_size: bounded cache size in tokens, or None.
        bits, group_size, start: with ``bits``, entries are quantized once ``start``
            tokens are cached (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``).
    """

    max_kv_size: int | None = None
    bits: int | None = None
    group_size: int = 64
    start: int = 5000
    split: bool = False  # split every prefill as mlx-lm does (see mlx_lm_prefill)

    @property
    def mlx_lm_prefill(self) -> bool:
        # where the cache's own semantics depend on how the prompt is split, split it as
        # mlx-lm does: prompt[:-1] in chunks, then the last token alone
        return self.split or self.max_kv_size is not None or self.bits is not None

    def depth_limit(self, offset: int) -> int:
        """The deepest tree a step at this cache offset may verify: nodes stay inside
        the window (quantized caches decode plainly: see :func:`stream_generate`)."""
        return self.max_kv_size - 4 - 1 if self.max_kv_size is not None else 1 << 30


KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize supports
KV_GROUP_SIZES = (32, 64, 128)


def check_kv(kv: KVSettings, head_dim: int | None = None) -> None:
    """Check the KV cache settings before anything runs.

    Raises:
        ValueError: naming the setting out of range, a group size that does not divide
            ``head_dim``, or ``max_kv_size`` with ``kv_bits`` (mlx-lm cannot quantize its
            rotating cache either).
    """

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if kv.max_kv_size is not None and (not is_int(kv.max_kv_size) or kv.max_kv_size <= 4):
        raise ValueError(
            f"max_kv_size must be an integer > 4 (the first 4 tokens are kept), got {kv.max_kv_size!r}"
        )
    if kv.bits is not None and kv.bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, got {kv.bits!r}")
    if kv.group_size not in KV_GROUP_SIZES:
        raise ValueError(
            f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {kv.group_size!r}"
        )
    if not is_int(kv.start) or kv.start < 0:
        raise ValueError(f"quantized_kv_start must be an integer >= 0, got {kv.start!r}")
    if kv.bits is not None and head_dim is not None and head_dim % kv.group_size:
        raise ValueError(
            f"kv_group_size {kv.group_size} does not divide this model's head dimension {head_dim}; "
            f"use one of {', '.join(str(g) for g in KV_GROUP_SIZES if head_dim % g == 0) or 'none'}"
        )
    if kv.bits is not None and kv.max_kv_size is not None:
        raise ValueError(
            "kv_bits and max_kv_size cannot be combined (mlx-lm's rotating cache is not quantized either)"
        )


def _captures(drafter):
    # (layers whose inputs the forward captures, whether they fuse into the drafter's
    # features): the msa heads' layer, or the fused layers of eagle heads (EAGLE-3),
    # whose features are the final hidden states followed by these
    capture = getattr(drafter, "capture", None)
    if capture is not None:
        return capture, False
    fuse = tuple(getattr(drafter, "fuse_layers", ()))
    return (fuse, True) if fuse else (None, False)


def _prefill(model, cache: PromptCache, ids: list[int], drafter, step_size: int, kv: KVSettings):
    # the prompt's keys/values into the cache (reusing its common prefix); returns the last
    # position's (hidden, mid), the number of tokens reused and every position's features
    reused = cache.reuse(ids, kv.start if kv.bits is not None else None)
    rest = ids[reused:]
    if kv.mlx_lm_prefill:
        body = rest[:-1]
        pieces = [body[i : i + step_size] for i in range(0, len(body), step_size)] + [rest[-1:]]
    else:
        pieces = [rest[i : i + step_size] for i in range(0, len(rest), step_size)]
    chunks, (capture, fused) = [], _captures(drafter)
    for piece in pieces:
        h, mids = model.family.prefill_hidden(model.backbone, mx.array(piece), cache.layers, capture=capture)
        hidden, mid = h[-1], (mids[-1] if mids is not None else None)
        h = mx.concatenate([h, mids], axis=-1) if fused else h
        mx.eval(h, [c.state for c in cache.layers])
        quantize_cache(cache.layers, kv.bits, kv.group_size, kv.start)
        if isinstance(cache.layers[0], WindowKVCache):
            for c in cache.layers:
                c.evict()
        chunks.append(h)
    cache.tokens = list(ids)
    return hidden, mid, reused, mx.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def _decode_step(
    model,
    cache: PromptCache,
    drafter: Drafter,
    verify: _TreeVerifier,
    tokens: list[int],
    last: _Step,
    tree: Tree,
    drafts: mx.array,
    kv: KVSettings,
) -> _Step:
    # one backbone forward over the tree rooted at the last emitted token: verify the
    # drafts, keep the accepted path in the cache, and keep the states the next drafts read
    fam, backbone = model.family, model.backbone
    capture, fused = _captures(drafter)
    start = cache_offset(cache.layers)  # == len(tokens) - 1: the root is not cached yet
    node_tokens = mx.concatenate([mx.array([last.next_token], dtype=mx.int32), drafts.astype(mx.int32)])
    positions = mx.array(start + tree.depths, dtype=mx.int32)
    # causal over the cache (inside the window, for a bounded one), ancestors-only inside the tree
    mask = attention_mask(cache.layers, tree.depths, tree.mask)
    h, mids = fam.tree_hidden(backbone, node_tokens, positions, mask, cache.layers, capture=capture)  # (N, H)
    path, nxt, node_list, lps, tops = verify(tree, node_tokens, fam.project(backbone, h), tokens)
    keep_path(cache.layers, start, path)
    quantize_cache(cache.layers, kv.bits, kv.group_size, kv.start)
    cache.tokens.extend(node_list[i] for i in path)
    path_hidden = None
    if getattr(drafter, "reads_path", False):  # eagle heads: their features of the accepted path
        path_hidden = (mx.concatenate([h, mids], axis=-1) if fused else h)[mx.array(path)]
    return _Step(
        tree,
        node_list,
        path,
        nxt,
        lps,
        tops,
        h[path[-1]],
        mids[path[-1]] if mids is not None else None,
        path_hidden,
    )


@dataclass
class _InFlight:
    """A step queued on the device (``mx.async_eval``) and not yet read back."""

    tree: Tree
    node_tokens: mx.array  # (N,) int32; the root may still be computed by the step before
    start: int  # cache slot of the root; its tree's entries follow, then a step queued after it
    history: mx.array | None  # (length,) int32 the tokens up to the root, only for logits processors
    targets: mx.array  # (N,) int32: the target's token after each node
    chosen: mx.array  # (N,) their log-probabilities
    top: tuple[mx.array, mx.array] | None
    hidden: mx.array  # (N, H)
    last: mx.array  # () int32: the last accepted node, decided on the device (accepted_node)
    allowed: bool = False  # drafts were allowed at this step (adaptive speculation chose or not)


def _propose_step(model, cache, drafter, verify, tokens, last: _Step, depth: int, drafts_on: bool):
    # the next step's tree and drafts (lazy), at most depth deep
    if depth < 1:
        return no_drafts(), mx.zeros((0,), dtype=mx.int32)
    capture = getattr(drafter, "capture", None)
    return propose(
        drafter,
        last.path_hidden if getattr(drafter, "reads_path", False) else last.hidden,
        tokens,
        depth,
        last.mid,
        cache.layers if capture is not None else None,
        base=drafts_on,
        noise=verify.draft_noise(len(tokens)),
    )


def _launch(
    model,
    cache: PromptCache,
    verify: _TreeVerifier,
    length: int,
    root: mx.array,
    tree: Tree,
    drafts: mx.array,
    kv: KVSettings,
    allowed: bool,
    history: mx.array | None = None,
    prev: _InFlight | None = None,
) -> _InFlight:
    # one forward over a static tree (a plain step: no drafts) rooted at `root` (1,),
    # queued and not read back, as mlx-lm's generate_step queues plain steps. `length`:
    # the tokens up to and including the root. With `prev`, the step in flight before
    # it, the root is prev's next token (still lazy) and `length` is the tokens up to
    # prev's root + 1: what depends on how many of prev's drafts are accepted stays on
    # the device (the root's position, the mask hiding prev's rejected entries, the
    # noise rows); the host compacts prev's entries once it reads prev (_finish)
    fam, backbone = model.family, model.backbone
    node_tokens = mx.concatenate([root.astype(mx.int32), drafts.astype(mx.int32)])
    shift, spread, mask = None, 0, attention_mask(cache.layers, tree.depths, tree.mask)
    if prev is not None and prev.tree.size > 1:
        shift, spread = mx.array(prev.tree.depths, dtype=mx.int32)[prev.last], prev.tree.depth
        seen = mx.array(prev.tree.mask)[prev.last]  # (N_prev,) prev's accepted path
        n, head = tree.size, prev.start
        mask = mx.concatenate(
            [
                mx.ones((n, head), dtype=mx.bool_),
                mx.broadcast_to(seen, (n, prev.tree.size)),
                mx.array(tree.mask),
            ],
            axis=1,
        )
    root_position = length - 1 if shift is None else shift + (length - 1)
    positions = root_position + mx.array(tree.depths, dtype=mx.int32)
    h, _ = fam.tree_hidden(backbone, node_tokens, positions, mask, cache.layers)
    targets, chosen, top, _ = verify.targets(
        tree, node_tokens, fam.project(backbone, h), length, history, shift, spread
    )
    last = accepted_node(tree, node_tokens, targets)
    quantize_cache(cache.layers, kv.bits, kv.group_size, kv.start)
    mx.async_eval(node_tokens, targets, chosen, top, h, last, [c.state for c in cache.layers])
    start = cache_offset(cache.layers) - tree.size
    return _InFlight(tree, node_tokens, start, history, targets, chosen, top, h, last, allowed)


def _finish(step: _InFlight, cache: PromptCache, verify: _TreeVerifier) -> _Step:
    # the one host sync of a queued step: its accepted path, kept in the cache, with the
    # entries of a step queued after it moved down behind that path
    mx.eval(step.node_tokens, step.targets, step.chosen, step.top, step.last)
    toks = step.node_tokens.tolist()
    path, nxt = verify_greedy(step.tree, toks, step.targets.tolist())
    if path[-1] != step.last.item():  # a step queued after this one was built on `last`
        raise RuntimeError(f"device acceptance {step.last.item()} differs from the host's path {path}")
    n = step.tree.size
    after = cache_offset(cache.layers) - step.start - n
    keep_path(cache.layers, step.start, path + list(range(n, n + after)))
    cache.tokens.extend(toks[i] for i in path)
    chosen = step.chosen.tolist()
    return _Step(
        step.tree,
        toks,
        path,
        nxt,
        [chosen[i] for i in path],
        verify._top_rows(step.top, path),
        step.hidden[path[-1]],
        None,
    )


def _queue_after(model, cache, verify, tokens, prev: _InFlight, queued, tree: Tree, allowed: bool, kv):
    # the step after `prev` (in flight), queued before prev is read back: rooted at prev's
    # next token, `tree` (queued_tree) drafted by `queued` (a static drafter that drafts
    # from lazy inputs) from the hidden state at prev's last accepted node
    root = prev.targets[prev.last].reshape(1).astype(mx.int32)
    if tree.size > 1:
        shift = mx.array(prev.tree.depths, dtype=mx.int32)[prev.last] if prev.tree.size > 1 else None
        noise = verify.draft_noise(len(tokens) + 1, shift, prev.tree.depth)
        drafts = queued.draft_queued(prev.hidden[prev.last], root, noise=noise)[: tree.size - 1]
    else:
        drafts = mx.zeros((0,), dtype=mx.int32)
    hist = None if prev.history is None else mx.concatenate([prev.history, root])
    return _launch(model, cache, verify, len(tokens) + 1, root, tree, drafts, kv, allowed, hist, prev)


def stream_generate(
    model,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    max_tokens: int = 256,
    *,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    tree: str | Sequence[Sequence[int]] | Tree | None = None,
    drafter: Drafter | None = None,
    stop: Sequence[str] | str | None = None,
    seed: int | None = None,
    prompt_cache: PromptCache | None = None,
    prefill_step_size: int = 2048,
    verifier: Callable | None = None,
    adaptive: bool | None = None,
    prompt_lookup: int | None = None,
    top_logprobs: int = 0,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
) -> Iterator[GenerationResponse]:
    """Generate with Speculative Streaming, yielding one response per decoding step.

    Greedy output (``temp=0``) is token-for-token the backbone's greedy output;
    sampled output has exactly the backbone's distribution under the same sampling
    settings: each token is the Gumbel-max draw from the target's processed distribution
    with noise keyed by (seed, position), and drafts are perturbed by the same noise, so
    they are accepted about as often as their distribution agrees with the target's
    (:class:`~mlx_stream.sampling.GumbelNoise`; :mod:`mlx_stream.sampling`).

    Args:
        model: a :class:`~mlx_stream.model.SpeculativeModel` from :func:`mlx_stream.load`.
        tokenizer: its tokenizer.
        prompt: text (encoded as mlx-lm does), or token ids.
        max_tokens: the most tokens to emit (> 0).
        temp: sampling temperature; 0 is greedy.
        top_p, top_k, min_p, min_tokens_to_keep: mlx-lm's ``make_sampler`` filters
            (see :class:`~mlx_stream.sampling.SamplingParams`); ignored when greedy.
        logits_processors: mlx-lm logits processors ``f(tokens, logits) -> logits``
            (``mlx_lm.sample_utils.make_logits_processors``: repetition penalty, logit
            bias, ...), applied at every tree node with that node's own history.
        tree: the draft tree when drafting with the model's heads
            (:func:`mlx_stream.speculation.resolve_tree`: ``None`` is the tree stored
            with the heads (their ``sampled_tree`` when sampling), ``"auto"`` the fastest
            on this device, or a preset or rank paths); ignored without heads.
            ``"budget"``: each step's tree budgeted across the heads, prompt lookup and
            the datastore (:class:`~mlx_stream.budget.BudgetDrafter`).
        drafter: a custom :class:`~mlx_stream.drafters.Drafter` (overrides ``tree`` and
            ``prompt_lookup``).
        stop: stop string(s); output ends before the first occurrence.
        seed: an int >= 0 (``temp > 0``): the token at each position is drawn with
            Gumbel noise keyed by (seed, position), so the same seed and settings give
            the same output whatever else runs in the process, and whatever is drafted
            (heads, tree, adaptive choices or plain decoding). None: fresh entropy.
        prompt_cache: a :class:`PromptCache` to reuse across calls; its common
            prefix with the prompt is not recomputed.
        prefill_step_size: prompt tokens per prefill chunk.
        verifier: a custom sampled verification rule, ``f(tree, tokens, probs, uniforms)
            -> (path, next_token)`` with the ``(N, V)`` processed distributions on the host
            and one uniform per position keyed by (seed, position) (for example
            :func:`~mlx_stream.verify.verify_coupled`; drafts are then not coupled);
            None (default): the Gumbel-max draw on the device.
        adaptive: decode plainly while drafts do not pay (measured online, see
            :class:`~mlx_stream.adaptive.SpeculationPolicy`); the output is the same
            either way. None: on when drafting with the model's heads, off for a
            custom ``drafter``.
        prompt_lookup: the most tokens drafted per step by prompt lookup
            (:class:`~mlx_stream.drafters.LookupDrafter`, joined to the heads' tree
            whatever adaptive speculation decides for the heads); 0 turns it off;
            None: :data:`~mlx_stream.speculation.PROMPT_LOOKUP` with heads, 0 without.
            Where the context has no match, ``model.datastore`` (past answers: the
            heads' store and, if loaded with ``learn``, this machine's) drafts the
            chain; a finished generation's answer is added to it when it learns
            (:meth:`~mlx_stream.datastore.DraftStore.remember`).
        top_logprobs: with k > 0 each response's ``top_logprobs`` lists, per emitted
            token, the k most likely tokens at its position with their log-probabilities
            (as ``logprobs``: after the logits processors, before temperature and the
            filters); 0 (default) computes none.
        max_kv_size: bound the KV cache to this many tokens, with the attention of
            mlx-lm's ``max_kv_size`` (its rotating cache keeping the first 4 tokens): the
            token at position p sees those and the last ``max_kv_size - 4`` positions.
            Tree verification keeps that exactly (:class:`~mlx_stream.cache.WindowKVCache`),
            so greedy output equals ``mlx_lm.generate(..., max_kv_size=...)``. A given
            ``prompt_cache`` must have been made with the same ``max_kv_size``.
        kv_bits, kv_group_size, quantized_kv_start: as mlx-lm: once
            ``quantized_kv_start`` tokens are cached, keys and values are stored quantized
            to ``kv_bits`` (2-8) in groups of ``kv_group_size``; verification runs on the
            quantized cache. Only with plain decoding (a tree's batched keys can round to
            other quantization levels than sequential decoding's: ValueError with a
            drafter), and not with ``max_kv_size`` (mlx-lm neither).

    Yields:
        :class:`GenerationResponse`; the last one has ``finish_reason`` set.

    Raises:
        ValueError: bad parameters, an empty prompt, or a prompt that does not fit
            in the context window (checked before any forward pass).
    """
    sampling = SamplingParams(temp, top_p, top_k, min_p, min_tokens_to_keep)
    check_generation(max_tokens, sampling, model.args.vocab_size)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs must be an integer >= 0, got {top_logprobs!r}")
    ids = encode_prompt(tokenizer, prompt, model.args.vocab_size)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    # a cache loaded from an mlx-lm prompt cache file holds tokens whose ids it does not
    # know (-1): the prompt continues them, as in mlx_lm.generate --prompt-cache-file
    unknown = 0
    if prompt_cache is not None:
        while unknown < len(prompt_cache.tokens) and prompt_cache.tokens[unknown] == -1:
            unknown += 1
        q = prompt_cache.quantization
        if unknown and q is not None and q != (kv_bits, kv_group_size):
            raise ValueError(
                f"this prompt cache holds tokens quantized with kv_bits={q[0]}, kv_group_size={q[1]} "
                "that cannot be recomputed (their ids are unknown): pass the same kv_bits and kv_group_size"
            )
        ids = [-1] * unknown + ids
    # a bounded cache has no context window: positions run on, as in mlx-lm
    ctx = model.context_length if max_kv_size is None else None
    if ctx is not None and len(ids) >= ctx:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the model's context window is {ctx}: shorten the prompt"
        )
    kv = KVSettings(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    args = model.backbone.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    check_kv(kv, head_dim)
    if prompt_cache is not None and prompt_cache.max_kv_size != max_kv_size:
        raise ValueError(
            f"the prompt cache was made with max_kv_size={prompt_cache.max_kv_size}, this call asks for "
            f"{max_kv_size}: make the PromptCache with the same max_kv_size"
        )
    if adaptive is None:
        adaptive = drafter is None
    drafter = (
        drafter
        if drafter is not None
        else make_drafter(model, tree, prompt_lookup, sampled=not sampling.greedy)
    )
    if kv_bits is not None and not isinstance(drafter, NoDrafter):
        raise ValueError(
            "kv_bits cannot be combined with drafting: a draft tree's keys come from one batched "
            "pass and differ from one-token-at-a-time decoding by float rounding (~1e-6), which "
            "quantization can turn into a whole quantization step, so the output could drift from "
            "plain decoding's; decode plainly with it (heads=None and prompt_lookup=0; --no-heads "
            "on the command line), or bound memory with max_kv_size instead"
        )
    if getattr(drafter, "capture", None) is not None and (max_kv_size is not None or kv_bits is not None):
        raise ValueError(
            "these heads read the backbone's cached keys/values (multi-stream attention), which "
            "max_kv_size and kv_bits change; decode them without those options"
        )
    verify = _TreeVerifier(
        sampling,
        list(logits_processors or []),
        verifier,
        np.random.SeedSequence(seed).entropy,
        model.args.vocab_size,
        top_logprobs,
        skip=unknown,
    )
    cache = prompt_cache if prompt_cache is not None else PromptCache(model, max_kv_size)
    if cache.quantization is not None and cache.quantization != (kv_bits, kv_group_size):
        cache.reset()  # quantized for other settings: recompute
    emitter = _Emitter(tokenizer, max_tokens, [stop] if isinstance(stop, str) else list(stop or []))
    policy = SpeculationPolicy() if adaptive and drafter.tree.size > 1 else None

    # prefill; the last hidden state gives the first token and feeds the heads
    tic = time.perf_counter()
    hidden, mid, reused, prompt_hidden = _prefill(model, cache, ids, drafter, prefill_step_size, kv)
    root = no_drafts()
    path, y, _, lps, tops = verify(
        root, mx.array([ids[-1]], dtype=mx.int32), model.family.project(model.backbone, hidden)[None], ids
    )
    step = _Step(root, [ids[-1]], path, y, lps, tops, hidden, mid, prompt_hidden)
    prompt_tps = (len(ids) - reused) / (time.perf_counter() - tic)

    # A step is queued on the device before the step before it is read back (mx.async_eval,
    # as mlx-lm's generate_step queues plain steps), so the host builds the next graph while
    # the device computes. The queued step is rooted at the lazy next token of the one in
    # flight; everything that depends on how many of its drafts are accepted stays on the
    # device (_launch). Only where the queued step's shape does not depend on that: plain,
    # or the static tree of heads that draft from lazy inputs (queued_drafter), and no
    # prompt-lookup match pending (LookupDrafter.may_chain_after).
    can_pipeline = verifier is None and max_kv_size is None and queues_steps(drafter)
    queued = queued_drafter(drafter) if can_pipeline else None
    in_flight: _InFlight | None = None  # a step queued, rooted at step.next_token
    decided: bool | None = None  # the policy's choice for the next step, when asked early
    tic = last_end = time.perf_counter()
    n_fwd = 0
    tokens = list(ids)  # prompt + output; the root (the last emitted token) is last
    while True:
        tokens.extend(step.emitted)
        room = (ctx - len(tokens)) if ctx is not None else None  # tokens that may still follow
        delta, kept, reason = emitter.push(step.emitted, out_of_room=room is not None and room <= 0)
        elapsed = max(time.perf_counter() - tic, 1e-9)
        response = GenerationResponse(
            text=delta,
            tokens=kept,
            accepted=len(step.path) - 1,
            prompt_tokens=len(ids),
            prompt_tps=prompt_tps,
            generation_tokens=len(emitter.tokens),
            generation_tps=len(emitter.tokens) / elapsed,
            forward_passes=n_fwd,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=reason,
            tau=(len(emitter.tokens) + emitter.eos_hit - 1) / n_fwd if n_fwd else 0.0,
            logprobs=step.logprobs[: len(kept)],
            top_logprobs=step.top_logprobs[: len(kept)] if step.top_logprobs is not None else None,
            drafted=step.tree.size - 1,
            cached_tokens=reused,
        )
        if reason is not None:
            if in_flight is not None:  # its forward wrote the root's keys/values (and its drafts')
                trim_cache(cache.layers, len(cache.tokens) + 1)
                cache.tokens.append(step.next_token)
            if model.datastore is not None:  # the answer joins the store of past answers
                model.datastore.remember(emitter.tokens)
            yield response
            return
        # the tree may not reach past max_tokens, the context window or the KV settings' limit
        depth = min(
            max_tokens - len(emitter.tokens) - 1,
            room - 1 if room is not None else 1 << 30,
            kv.depth_limit(cache_offset(cache.layers)),
        )
        if in_flight is None:
            if decided is None:  # the policy decides on the heads' tree; lookup chains join when they match
                drafts_on = depth >= 1 and (policy is None or policy.use_drafts())
            else:  # asked already, while the step before was queued
                drafts_on, decided = depth >= 1 and decided, None
            tree, drafts = _propose_step(model, cache, drafter, verify, tokens, step, depth, drafts_on)
            static = can_pipeline and is_static_step(tree, queued, depth)
            if not static:
                paused = time.perf_counter()
                yield response
                paused = time.perf_counter() - paused
                step = _decode_step(model, cache, drafter, verify, tokens, step, tree, drafts, kv)
                end = time.perf_counter()
                static = drafter.tree.truncate(depth).size if drafts_on else 1
                took = end - last_end - paused  # from the step before's end, the caller's time left out
                if policy is not None and depth >= 1 and step.tree.size == static:  # steps without a chain
                    policy.observe(static > 1, took, len(step.path))
                if isinstance(drafter, StepTimer):
                    drafter.observe_time(step.tree.size, took)
                last_end = end
                if isinstance(drafter, AcceptanceObserver):  # learns from what was accepted (prompt lookup)
                    drafter.observe(step.tree, step.node_tokens, step.emitted)
                n_fwd += 1
                continue
            root = mx.array([step.next_token], dtype=mx.int32)
            hist = mx.array(tokens, dtype=mx.int32) if verify.processors else None
            in_flight = _launch(model, cache, verify, len(tokens), root, tree, drafts, kv, depth >= 1, hist)
        # queue the step after the one in flight where its shape is known already: it may
        # draft `spare` deep whatever the one in flight emits
        ahead, spare = None, depth - in_flight.tree.depth - 1
        if spare >= 0:
            ahead_on = spare >= 1 and (policy is None or policy.use_drafts())
            ahead_tree = queued_tree(drafter, queued, tokens, spare, ahead_on)
            history_ok = not verify.processors or in_flight.tree.size == 1  # else its length is not known
            if ahead_tree is not None and history_ok:
                allowed = spare >= 1
                ahead = _queue_after(model, cache, verify, tokens, in_flight, queued, ahead_tree, allowed, kv)
            else:
                decided = ahead_on
        paused = time.perf_counter()
        try:
            yield response
        except GeneratorExit:  # closed by the caller: drop the queued steps' keys/values
            trim_cache(cache.layers, len(cache.tokens))
            raise
        paused = time.perf_counter() - paused
        step = _finish(in_flight, cache, verify)
        if ahead is not None:  # its entries now follow the accepted path
            ahead.start = in_flight.start + len(step.path)
        end = time.perf_counter()
        took = end - last_end - paused
        if policy is not None and in_flight.allowed:
            policy.observe(in_flight.tree.size > 1, took, len(step.path))
        if isinstance(drafter, StepTimer):
            drafter.observe_time(in_flight.tree.size, took)
        last_end = end
        if in_flight.tree.size > 1 and isinstance(drafter, AcceptanceObserver):
            drafter.observe(step.tree, step.node_tokens, step.emitted)
        in_flight = ahead
        n_fwd += 1


def generate(model, tokenizer, prompt, max_tokens: int = 256, verbose: bool = False, **kwargs) -> str:
    """Generate and return the whole text; arguments as :func:`stream_generate`.

    With ``verbose=True`` the text is printed as it streams, then a stats line.
    """
    text = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print(
            f"\n==========\nPrompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s\n"
            f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s, "
            f"tau {last.tau:.2f}\nPeak memory: {last.peak_memory:.3f} GB"
        )
    return "".join(text)
