"""One decoding step on the device, and the pipeline that queues steps ahead.

A step is one backbone forward over a draft tree rooted at the last emitted token
(Bhendawade et al. 2024, sec. 3.2-3.3): the target's token at every node (the argmax,
or the Gumbel-max draw when sampling), the longest accepted path, the KV cache kept on
that path, and the hidden state the next drafts read. Every step has two halves:

- :meth:`StepPipeline.launch` builds the forward and the target's tokens and queues
  them (``mx.async_eval``) without reading anything back;
- :meth:`StepPipeline.finish` is the step's one host sync: it reads the tokens, walks
  the accepted path (:func:`~mlx_stream.verify.verify_greedy`) and compacts the cache.

Between the two the host is free: the caller handles the step before, and where the
next step's shape does not depend on how many of this step's drafts are accepted (a
plain step, or a drafter's static tree with no prompt-lookup chain pending), that step
is queued too (:meth:`StepPipeline.queue_after`), as mlx-lm's ``generate_step`` queues
plain steps: what depends on the acceptance (the next root, its position, the mask over
this step's rejected entries, the noise rows) stays on the device
(:func:`~mlx_stream.verify.accepted_node`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from .cache import TreeKVCache, attention_mask, cache_offset, evict, keep_path, quantize_cache
from .drafters.base import AcceptanceObserver, StepTimer, propose, proposes
from .drafters.lookup import LookupDrafter
from .sampling import DraftNoise, GumbelNoise, LogitsProcessor, SamplingParams, log_softmax, process_logits
from .tree import Tree, no_drafts
from .verify import accepted_node, verify_greedy


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
        the window (quantized caches decode plainly: see
        :func:`~mlx_stream.generate.stream_generate`)."""
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
        fits = [str(g) for g in KV_GROUP_SIZES if head_dim % g == 0]
        raise ValueError(
            f"kv_group_size {kv.group_size} does not divide this model's head dimension {head_dim}; "
            + (
                f"use one of {', '.join(fits)}"
                if fits
                else "no quantization group fits it, so its KV cache cannot be quantized: leave out kv_bits"
            )
        )
    if kv.bits is not None and kv.max_kv_size is not None:
        raise ValueError(
            "kv_bits and max_kv_size cannot be combined (mlx-lm's rotating cache is not quantized either)"
        )


@dataclass
class Verdict:
    """The target's lazy verdict over one tree (no host sync yet): its token at every
    node, or, for a verification rule run on the host, the processed distributions."""

    targets: mx.array | None = None  # (N,) int32: the target's token after each node
    chosen: mx.array | None = None  # (N,) its log-probability
    top: tuple[mx.array, mx.array] | None = None  # (N, k) ids and log-probabilities, or None
    probs: mx.array | None = None  # (N, V) for a host rule
    logprobs: mx.array | None = None  # (N, V) for a host rule

    def arrays(self) -> list:
        return [a for a in (self.targets, self.chosen, self.top, self.probs, self.logprobs) if a is not None]


class TreeVerifier:
    """The target's distribution at every tree node, and the accepted path through it.

    Runs the logits processors at every node on that node's own history, then takes the
    target's token at every node: the argmax when greedy, otherwise the Gumbel-max draw
    ``argmax(mask(logprobs) / temp + g)`` with the noise of the token's position
    (:class:`~mlx_stream.sampling.GumbelNoise`), both on the device; the accepted path is
    the longest one whose drafts equal those tokens
    (:func:`~mlx_stream.verify.verify_greedy`). A custom ``verifier`` ``f(tree, tokens,
    probs, uniforms)`` (sampling only) gets the processed distributions on the host and
    one uniform per position keyed by (seed, position) instead.

    Args:
        sampling: the sampler's settings.
        processors: mlx-lm logits processors.
        verifier: a custom host rule, or None.
        entropy: the seed's entropy (keys the noise and the uniforms).
        vocab_size: V.
        top_logprobs: k most likely tokens to report per emitted token (0: none).
        skip: leading history tokens the processors do not see (unknown ids).
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
        self.host_rule = None if sampling.greedy else verifier  # greedy: the argmax whatever the rule
        self.top_logprobs, self.skip = top_logprobs, skip
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

    def judge(
        self,
        tree: Tree,
        node_tokens: mx.array,
        logits: mx.array,
        length: int,
        history: mx.array | None = None,
        shift: mx.array | None = None,
        spread: int = 0,
    ) -> Verdict:
        """The lazy :class:`Verdict` for the ``(N,)`` node tokens and their ``(N, V)``
        logits after ``length`` tokens (up to and including the root; ``length + shift``
        for a step queued before the host knows it, ``shift`` a lazy ``()`` int32 of at
        most ``spread``). ``history``: those tokens, ``(length,)`` int32 (it may be lazy),
        needed only with logits processors. No host sync."""
        logits = self._processed(tree, node_tokens, logits, history)
        if self.sampling.greedy and self.top_logprobs <= 0:
            # the argmax's log-probability is max - logsumexp, bitwise log_softmax's max (the
            # same subtraction, which keeps the order): no (N, V) array a step
            f = logits.astype(mx.float32)
            return Verdict(mx.argmax(logits, axis=-1), mx.max(f, axis=-1) - mx.logsumexp(f, axis=-1))
        logprobs = log_softmax(logits)  # (N, V)
        top = self._top(logprobs)
        if self.host_rule is not None:
            return Verdict(top=top, probs=self.sampling.distribution(logprobs), logprobs=logprobs)
        if self.sampling.greedy:
            scores = logits
        else:
            if tree.size == 1 and shift is None:  # a plain step: its one position's noise
                g = self.noise.rows(length, 1)
            else:  # the token after a node of depth d lands at position length + shift + d
                rows = tree.arrays[0]
                if shift is not None:
                    rows = rows + shift
                g = self.noise.rows(length, tree.depth + 1 + spread)[rows]
            scores = self.sampling.mask(logprobs) * (1.0 / self.sampling.temp) + g
        targets = mx.argmax(scores, axis=-1)
        if self.sampling.greedy:  # log_softmax keeps the order: the argmax's is the max, bitwise
            chosen = mx.max(logprobs, axis=-1)
        else:
            chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        return Verdict(targets, chosen, top)

    def walk(self, tree: Tree, tokens: list[int], verdict: Verdict, length: int):
        """``(accepted path, next token, log-probability of each emitted token, top
        log-probabilities or None)`` from an evaluated verdict over the node ``tokens``
        after ``length`` tokens."""
        if self.host_rule is None and tree.size == 1:  # a plain step (the most common one)
            return [0], verdict.targets.item(), [verdict.chosen.item()], self._top_rows(verdict.top, [0])
        if self.host_rule is None:
            path, nxt = verify_greedy(tree, tokens, verdict.targets.tolist())
            chosen = verdict.chosen.tolist()
            return path, nxt, [chosen[i] for i in path], self._top_rows(verdict.top, path)
        uniforms = [np.random.default_rng([self.entropy, length + d]).random() for d in range(tree.depth + 1)]
        path, nxt = self.host_rule(tree, tokens, np.array(verdict.probs), uniforms)
        lp = np.array(verdict.logprobs)
        emitted = [tokens[i] for i in path[1:]] + [nxt]
        return path, nxt, [float(lp[i, t]) for i, t in zip(path, emitted)], self._top_rows(verdict.top, path)


@dataclass
class Step:
    """What one forward pass over a draft tree decided (read back on the host)."""

    tree: Tree
    node_tokens: list[int]
    path: list[int]  # accepted nodes, root first
    next_token: int  # the target's token after the accepted path
    logprobs: list[float]  # of each emitted token
    top_logprobs: list | None  # per emitted token: [(id, log-probability)] most likely first, or None
    hidden: mx.array  # (H,) final hidden state at the last accepted node
    mid: mx.array | None  # (H,) the captured layer's input there (msa heads)
    path_hidden: mx.array | None = None  # (P, H) features of the accepted path (eagle heads)

    @cached_property
    def emitted(self) -> list[int]:
        """The tokens this step emits: the accepted drafts, then ``next_token``."""
        return [self.node_tokens[i] for i in self.path[1:]] + [self.next_token]


@dataclass
class InFlight:
    """A step queued on the device (``mx.async_eval``) and not yet read back."""

    tree: Tree
    # (N,) int32 (a lone root: uint32); the root may still be computed by the step before
    node_tokens: mx.array
    start: int  # cache slot of the root; its tree's entries follow, then a step queued after it
    length: int  # tokens up to and including the root (the step before's, + 1, when queued after it)
    history: mx.array | None  # (length,) int32 the tokens up to the root, only for logits processors
    verdict: Verdict
    hidden: mx.array  # (N, H)
    mids: mx.array | None  # (N, H) the captured layers' inputs, or None
    last: mx.array | None  # () int32 the last accepted node, decided on the device, when a step may follow
    observed: bool  # whether adaptive speculation learns from this step's time
    tells_drafter: bool  # whether the drafter learns from what this step accepted


def captures(drafter) -> tuple[tuple[int, ...] | int | None, bool]:
    """``(layers whose inputs the forward captures, whether they fuse into the drafter's
    features)``: the msa heads' layer, or the fused layers of eagle heads (EAGLE-3),
    whose features are the final hidden states followed by these."""
    capture = getattr(drafter, "capture", None)
    if capture is not None:
        return capture, False
    fuse = tuple(getattr(drafter, "fuse_layers", ()))
    return (fuse, True) if fuse else (None, False)


def prefill(model, cache, ids: list[int], drafter, step_size: int, kv: KVSettings):
    """The prompt's keys/values into ``cache`` (a :class:`~mlx_stream.generate.PromptCache`,
    reusing its common prefix with ``ids``) in chunks of ``step_size`` tokens.

    Returns:
        ``(logits (V,), hidden (H,), mid (H,) or None, reused, features (P, F))``: the last
        position's logits, final hidden state and captured layer input, the tokens reused
        from the cache, and the prefilled positions' features (``F = H``, or more with
        fused layers).
    """
    reused = cache.reuse(ids, kv.start if kv.bits is not None else None)
    rest = ids[reused:]
    if kv.mlx_lm_prefill:
        body = rest[:-1]
        pieces = [body[i : i + step_size] for i in range(0, len(body), step_size)] + [rest[-1:]]
    else:
        pieces = [rest[i : i + step_size] for i in range(0, len(rest), step_size)]
    chunks, (capture, fused) = [], captures(drafter)
    for piece in pieces:
        logits, h, mids = model.family.prefill_forward(model.backbone, mx.array(piece), cache.layers, capture)
        hidden, mid = h[-1], (mids[-1] if mids is not None else None)
        h = mx.concatenate([h, mids], axis=-1) if fused else h
        mx.eval(h, [c.state for c in cache.layers])
        quantize_cache(cache.layers, kv.bits, kv.group_size, kv.start)
        evict(cache.layers)
        chunks.append(h)
    cache.tokens = list(ids)
    draft = draft_cache_of(drafter)
    if draft is not None:
        # a draft model's prompt is prefilled here too (as mlx-lm does), so the first
        # step drafts at decoding cost and prompt_tps covers both models' prefill; its
        # time per token is what the draft model later spends catching up with tokens
        # decoded plainly (adaptive speculation counts it in each try)
        tic = time.perf_counter()
        draft.sync(ids, step_size)
        mx.eval([c.state for c in draft.layers])
        if draft.fed >= 16:  # (a few tokens' time is a forward's fixed cost, not a rate)
            draft.catch_up = (time.perf_counter() - tic) / draft.fed
    return logits, hidden, mid, reused, mx.concatenate(chunks) if len(chunks) > 1 else chunks[0]


# Which steps the pipeline may queue before the step before is read back, and with what
# tree (asked by StepPipeline and by the greedy replay, train/replay.py, alike).


def draft_cache_of(drafter):
    """The :class:`~mlx_stream.drafters.draft_model.DraftCache` of a draft-model drafter (a
    :class:`LookupDrafter` may wrap it), or None."""
    return getattr(getattr(drafter, "base", drafter), "draft_cache", None)


def queues_steps(drafter) -> bool:
    """Whether the decode loop may queue ``drafter``'s steps before the step before is
    read back: plain steps, and steps whose tree is its static one (not for heads that
    read the KV cache or every verified position, nor for trees that change per step,
    except a :class:`LookupDrafter`'s when no chain joins). Beside a draft model, whose
    own steps wait for the host, the plain steps adaptive speculation takes instead are
    queued like any others: they do not touch its cache, which catches up with the tokens
    when it next drafts."""
    if draft_cache_of(drafter) is not None:
        return True
    return (
        getattr(drafter, "capture", None) is None
        and not getattr(drafter, "reads_path", False)
        and (not proposes(drafter) or isinstance(drafter, LookupDrafter))
    )


def queued_drafter(drafter):
    """The static drafter that drafts a step the decode loop queues before its root token
    reaches the host (:meth:`HeadsDrafter.draft_queued`): ``drafter`` itself, or the base
    of a :class:`LookupDrafter`; None when it has none (dynamic trees, heads that read the
    KV cache or every verified position)."""
    base = drafter.base if isinstance(drafter, LookupDrafter) else drafter
    ok = hasattr(base, "draft_queued") and getattr(base, "capture", None) is None
    return base if ok and not getattr(base, "reads_path", False) else None


def drafts_own_tree(drafter) -> bool:
    """Whether the step just proposed by ``drafter`` is its base's own tree, of a drafter
    whose tree changes step by step (a dynamic tree, a draft model's), with no
    prompt-lookup chain joined: a step adaptive speculation may time as drafting's."""
    if isinstance(drafter, LookupDrafter):
        if drafter._pending is not None:
            return False
        drafter = drafter.base
    return getattr(drafter, "dynamic_tree", False)


def is_static_step(tree: Tree, queued, depth: int) -> bool:
    """Whether a step proposed at most ``depth`` deep drafts nothing or exactly
    ``queued``'s static tree (no prompt-lookup chain joined): a step the loop may queue
    the next one behind (:func:`queued_tree`)."""
    return tree.size == 1 or (queued is not None and tree == queued.tree.truncate(depth))


def queued_tree(drafter, queued, tokens: Sequence[int], spare: int, drafts_on: bool) -> Tree | None:
    """The tree of the step after the one in flight, when the loop may queue it before
    reading the one in flight back; None when it must wait for the host.

    The step in flight is rooted at ``tokens[-1]`` and leaves the next step at least
    ``spare`` tokens of depth (< 0: no room for a next step that it knows of). The next
    step drafts ``queued``'s static tree truncated to ``spare`` (plain when
    ``drafts_on`` is False, ``spare < 1`` or the drafter drafts nothing); it waits when a
    prompt-lookup chain may join it (:meth:`LookupDrafter.may_chain_after`, which counts
    the gate's skips) or when it should draft and ``queued`` is None
    (:func:`queued_drafter`). Shared by :func:`mlx_stream.stream_generate` and the greedy
    replay (``train/replay.py``), so that the two take the same steps."""
    if spare < 0:
        return None
    if isinstance(drafter, LookupDrafter) and drafter.may_chain_after(tokens):
        return None
    if not (drafts_on and spare >= 1 and drafter.tree.size > 1):
        return no_drafts()
    return None if queued is None else queued.tree.truncate(spare)


class StepPipeline:
    """The steps of one generation: each launched on the device, then finished on the host,
    with the step after a static one queued before that one is finished.

    Args:
        model: the :class:`~mlx_stream.model.SpeculativeModel`.
        cache: the generation's :class:`~mlx_stream.generate.PromptCache`.
        verify: the :class:`TreeVerifier`.
        drafter: the :class:`~mlx_stream.drafters.Drafter`.
        kv: the :class:`KVSettings`.
        policy: adaptive speculation (:class:`~mlx_stream.adaptive.SpeculationPolicy`), or None.

    Steps are queued ahead only where their shape is known before the step before is read
    back: plain steps, or the static tree of heads that draft from lazy inputs
    (:func:`~mlx_stream.drafters.queued_drafter`), with no prompt-lookup match pending;
    never with a host verification rule or a bounded cache.
    """

    def __init__(self, model, cache, verify: TreeVerifier, drafter, kv: KVSettings, policy=None):
        self.model, self.cache, self.verify, self.drafter, self.kv = model, cache, verify, drafter, kv
        self.policy = policy
        self.capture, self.fused = captures(drafter)
        self.reads_path = getattr(drafter, "reads_path", False)  # eagle heads read every verified position
        self.pipelined = verify.verifier is None and kv.max_kv_size is None and queues_steps(drafter)
        self.windowed = getattr(model.family, "windowed", False)
        # recurrent hybrids: no step queued behind a drafted one (its rows await the host's pick)
        self.recurrent = getattr(model.family, "recurrent", False)
        self.chain_offsets = getattr(model.family, "CHAIN_OFFSETS", False)
        self.queued = queued_drafter(drafter) if self.pipelined else None
        self._decided: bool | None = None  # the policy's choice for the next step, when asked early
        self._root_node = mx.array(0, dtype=mx.int32)  # a plain step's accepted node
        # asked once: typing's runtime-protocol isinstance costs ~20 us, every step
        self.times_steps = isinstance(drafter, StepTimer)
        self.learns = isinstance(drafter, AcceptanceObserver)

    def _drafts_on(self, depth: int) -> bool:
        # adaptive speculation decides on the drafter's own tree (lookup chains join when they
        # match); a choice made while the step before was queued is used first
        if self._decided is not None:
            on, self._decided = self._decided, None
            return depth >= 1 and on
        return depth >= 1 and (self.policy is None or self.policy.use_drafts())

    def start(self, tokens: list[int], last: Step, depth: int) -> InFlight:
        """Propose the step after ``last`` on the host (at most ``depth`` deep) and launch it.
        ``tokens``: prompt + output, ending with its root ``last.next_token``."""
        drafts_on = self._drafts_on(depth)
        if depth < 1:
            tree, drafts = no_drafts(), mx.zeros((0,), dtype=mx.int32)
        else:
            tree, drafts = propose(
                self.drafter,
                last.path_hidden if self.reads_path else last.hidden,
                tokens,
                depth,
                last.mid,
                self.cache.layers if getattr(self.drafter, "capture", None) is not None else None,
                base=drafts_on,
                noise=self.verify.draft_noise(len(tokens)),
            )
        static = self.pipelined and is_static_step(tree, self.queued, depth)
        expected = self.drafter.tree.truncate(depth).size if drafts_on else 1  # no chain joined
        root = mx.array([last.next_token], dtype=mx.int32)
        hist = mx.array(tokens, dtype=mx.int32) if self.verify.processors else None
        return self.launch(
            len(tokens),
            root,
            tree,
            drafts,
            hist,
            static=static,
            observed=depth >= 1 and (static or tree.size == expected or drafts_own_tree(self.drafter)),
            tells_drafter=tree.size > 1 or not static,
        )

    def queue_after(self, prev: InFlight, tokens: list[int], depth: int) -> InFlight | None:
        """The step after ``prev`` (in flight, rooted at ``tokens[-1]``), queued before
        ``prev`` is read back where its shape is known already: it may draft ``spare`` deep
        whatever ``prev`` emits; rooted at prev's (lazy) next token and drafted from the
        hidden state at prev's (lazy) last accepted node. None where it must wait."""
        spare = depth - prev.tree.depth - 1
        if prev.last is None or spare < 0 or ((self.windowed or self.recurrent) and prev.tree.size > 1):
            return None  # (a sliding window's mask needs the positions of prev's entries)
        on = spare >= 1 and (self.policy is None or self.policy.use_drafts())
        tree = queued_tree(self.drafter, self.queued, tokens, spare, on)
        if tree is None or (self.verify.processors and prev.tree.size > 1):  # the history's length is lazy
            self._decided = on
            return None
        if prev.tree.size == 1:  # its one node's target (uint32; a tree's node tokens are int32)
            root = prev.verdict.targets
        else:
            root = prev.verdict.targets[prev.last].reshape(1)
        if tree.size > 1:
            shift = prev.tree.arrays[0][prev.last] if prev.tree.size > 1 else None
            noise = self.verify.draft_noise(len(tokens) + 1, shift, prev.tree.depth)
            length = len(tokens) + 1 if shift is None else shift + (len(tokens) + 1)
            drafts = self.queued.draft_queued(prev.hidden[prev.last], root, noise=noise, length=length)
            drafts = drafts[: tree.size - 1]
        else:
            drafts = None  # (a lone root: no drafts to concatenate)
        hist = None if prev.history is None else mx.concatenate([prev.history, root.astype(mx.int32)])
        return self.launch(
            len(tokens) + 1,
            root,
            tree,
            drafts,
            hist,
            prev,
            static=True,
            observed=spare >= 1,
            tells_drafter=tree.size > 1,
        )

    def launch(
        self,
        length: int,
        root: mx.array,
        tree: Tree,
        drafts: mx.array | None,
        history: mx.array | None = None,
        prev: InFlight | None = None,
        *,
        static: bool,
        observed: bool,
        tells_drafter: bool,
    ) -> InFlight:
        """One forward over ``tree`` rooted at ``root`` ``(1,)`` with ``(N - 1,)`` drafts,
        queued and not read back. ``length``: the tokens up to and including the root.
        With ``prev``, the step in flight before it, the root is prev's next token (still
        lazy) and ``length`` is the tokens up to prev's root + 1: what depends on how many
        of prev's drafts are accepted stays on the device (the root's position, the mask
        hiding prev's rejected entries, the noise rows); :meth:`finish` compacts prev's
        entries once it reads prev. ``static``: a step may be queued after this one."""
        fam, backbone, layers = self.model.family, self.model.backbone, self.cache.layers
        # every op recorded here is host work where the device is fast: none is spent on
        # what the host already knows (a lone root, positions, the trees' constant arrays)
        if tree.size == 1:
            node_tokens = root
        else:
            node_tokens = mx.concatenate([root.astype(mx.int32), drafts.astype(mx.int32)])
        # causal over the cache (inside the window, for a bounded one), ancestors-only inside the tree
        shift, spread, mask = None, 0, attention_mask(layers, tree)
        if prev is not None and prev.tree.size > 1:
            prev_depths, prev_mask = prev.tree.arrays[:2]
            shift, spread = prev_depths[prev.last], prev.tree.depth
            seen = prev_mask[prev.last]  # (N_prev,) prev's accepted path
            n, head = tree.size, prev.start
            mask = mx.concatenate(
                [
                    mx.ones((n, head), dtype=mx.bool_),
                    mx.broadcast_to(seen, (n, prev.tree.size)),
                    tree.arrays[1],
                ],
                axis=1,
            )
        if self.chain_offsets and tree.size > 1 and tree.is_chain:  # the root's position, as rope takes it
            positions = length - 1 if shift is None else shift + (length - 1)
        elif shift is None:
            positions = mx.array(
                [length - 1] if tree.size == 1 else tree.depths + (length - 1), dtype=mx.int32
            )
        else:
            positions = tree.arrays[0] + (shift + (length - 1))
        logits, h, mids = fam.tree_forward(backbone, node_tokens, positions, mask, layers, self.capture)
        verdict = self.verify.judge(tree, node_tokens, logits, length, history, shift, spread)
        if not static:
            last = None
        elif tree.size == 1:  # its one node (made once: every op is host work)
            last = self._root_node
        else:
            last = accepted_node(tree, node_tokens, verdict.targets)
        quantize_cache(layers, self.kv.bits, self.kv.group_size, self.kv.start)
        # a key/value cache's new entries are read by this forward's attention, so they are
        # computed with it; other caches (recurrent state) are queued themselves
        states = [c.state for c in layers if type(c) is not TreeKVCache]
        mx.async_eval(node_tokens, verdict.arrays(), h, mids, last, states)
        start = cache_offset(layers) - tree.size
        return InFlight(
            tree, node_tokens, start, length, history, verdict, h, mids, last, observed, tells_drafter
        )

    def finish(self, step: InFlight, after: InFlight | None = None) -> Step:
        """The one host sync of a launched step: its accepted path, kept in the cache, with
        the entries of ``after``, the step queued after it, moved down behind that path.

        Raises:
            RuntimeError: the device's acceptance (that a step queued after this one was
                built on) differs from the host's walk (an internal invariant).
        """
        mx.eval(step.node_tokens, step.verdict.arrays(), step.last)
        toks = step.node_tokens.tolist()
        path, nxt, lps, tops = self.verify.walk(step.tree, toks, step.verdict, step.length)
        if step.last is not None and step.tree.size > 1 and path[-1] != step.last.item():
            raise RuntimeError(f"device acceptance {step.last.item()} differs from the host's path {path}")
        n, layers = step.tree.size, self.cache.layers
        queued = cache_offset(layers) - step.start - n  # entries of the step queued after it
        if n > 1:  # (a plain step's entry is already where it stays)
            keep_path(layers, step.start, path + list(range(n, n + queued)))
        self.cache.tokens.extend(toks[i] for i in path)
        if after is not None:  # its entries now follow the accepted path
            after.start = step.start + len(path)
        path_hidden = None
        if self.reads_path:  # eagle heads: their features of the accepted path
            feats = mx.concatenate([step.hidden, step.mids], axis=-1) if self.fused else step.hidden
            path_hidden = feats[mx.array(path)]
        mid = step.mids[path[-1]] if step.mids is not None else None
        return Step(step.tree, toks, path, nxt, lps, tops, step.hidden[path[-1]], mid, path_hidden)

    def observe(self, step: InFlight, done: Step, seconds: float) -> None:
        """What the policy and the drafter learn from a finished step that took
        ``seconds`` (from the end of the step before, the caller's time left out)."""
        if self.policy is not None and step.observed:
            self.policy.observe(step.tree.size > 1, seconds, len(done.path))
        if self.times_steps:
            self.drafter.observe_time(step.tree.size, seconds)
        if step.tells_drafter and self.learns:  # learns (prompt lookup)
            self.drafter.observe(done.tree, done.node_tokens, done.emitted)
