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

import mlx.core as mx
import numpy as np

from .adaptive import SpeculationPolicy
from .cache import TreeQuantizedKVCache, cache_offset, can_rewind, keep_path, make_tree_cache, trim_cache
from .checks import require_drafter, require_int, require_tokenizer, require_unicode
from .drafters.base import Drafter, NoDrafter
from .model import require_model
from .models import head_dim
from .sampling import LogitsProcessor, SamplingParams
from .speculation import check_prompt_lookup, check_tree_spec, make_drafter
from .steps import KVSettings, Step, StepPipeline, TreeVerifier, check_kv, draft_cache_of, prefill
from .tree import Tree, no_drafts


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
        draft: the draft model's own cache (:class:`~mlx_stream.drafters.draft_model.DraftCache`)
            when one drafts, else None.
        source: what a prompt-cache file's tokens were made from, when the file says
            (``mlx-stream cache-prompt``): ``{"system": str | None, "prompt": str | None,
            "raw": bool}``; ``prompt`` set means the cache ends in an open user turn that
            the next prompt continues. None otherwise.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
    """

    def __init__(self, model, max_kv_size: int | None = None):
        require_model(model)
        if max_kv_size is not None:
            require_int(max_kv_size, "max_kv_size", 1)
        self.backbone, self.max_kv_size = model.backbone, max_kv_size
        self.layers = make_tree_cache(model.backbone, max_kv_size)
        self.tokens: list[int] = []
        self.draft = None
        self.source: dict | None = None

    def reset(self) -> None:
        """Forget everything."""
        self.layers[:] = make_tree_cache(self.backbone, self.max_kv_size)
        self.tokens = []
        self.draft = None
        self.source = None

    def draft_cache(self, draft_model):
        """The cache of ``draft_model`` (a :class:`~mlx_stream.drafters.draft_model.DraftModel`)
        that goes with this one: made on first use, kept across calls (it follows the
        tokens it is given), replaced when another draft model asks."""
        from .drafters.draft_model import DraftCache

        if self.draft is None or self.draft.draft is not draft_model:
            self.draft = DraftCache(draft_model)
        return self.draft

    @property
    def quantization(self) -> tuple[int, int] | None:
        """``(bits, group_size)`` once the entries are stored quantized, else None."""
        c = next((c for c in self.layers if isinstance(c, TreeQuantizedKVCache)), None)
        return (c.bits, c.group_size) if c is not None else None

    def shared_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the cache holds (its common prefix with them)."""
        n, limit = 0, min(len(self.tokens), len(ids))
        while n < limit and self.tokens[n] == ids[n]:
            n += 1
        return n

    def drop_to(self, length: int) -> None:
        """Drop the entries past ``length`` tokens (a step launched and not kept); where a
        layer cannot (a recurrent state that has read them), forget everything instead:
        the next call prefills from nothing, as a fresh cache would."""
        if can_rewind(self.layers, length):
            trim_cache(self.layers, length)
        else:
            self.reset()

    def reuse(self, ids: Sequence[int], quantized_kv_start: int | None = None) -> int:
        """Trim the cache to its longest common prefix with ``ids``, leaving at least
        one token of ``ids`` to prefill. Returns the number of tokens reused.

        Where trimming cannot give what a fresh cache would (a bounded cache whose
        window was full, or quantized entries the prompt would have kept in full
        precision below ``quantized_kv_start``), the cache is reset instead."""
        n = min(self.shared_prefix(ids), len(ids) - 1)
        if n < len(self.tokens) and (
            not can_rewind(self.layers, n)
            or (self.quantization is not None and (quantized_kv_start is None or n < quantized_kv_start))
        ):
            self.reset()
            return 0
        trim_cache(self.layers, n)
        if n < len(self.tokens):
            self.source = None  # no longer what the file was made from
        self.tokens = self.tokens[:n]
        return n


_PROMPT_FORMS = "a string, or a 1-D sequence of token ids (a list of ints, a 1-D mx.array or numpy array)"


def encode_prompt(tokenizer, prompt, vocab_size: int | None = None) -> list[int]:
    """The token ids :func:`stream_generate` decodes for ``prompt``: text is encoded as
    ``mlx_lm.stream_generate`` does (no second BOS when the text starts with one); a
    1-D sequence of token ids (list, tuple, ``mx.array``, numpy array) is taken as it is.

    Raises:
        ValueError: any other form (a batch of prompts, nested lists, floats, strings
            among the ids), ids outside ``[0, vocab_size)`` when ``vocab_size`` is given,
            or text that is not valid Unicode (lone surrogates: bytes that were not UTF-8).
    """
    if isinstance(prompt, str):
        require_unicode(prompt, "the prompt")
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


def _check_kinds(
    stop, logits_processors, prefill_step_size, adaptive, drafter, prompt_cache, verifier
) -> None:
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a str, a list of str or None, got {type(stop).__name__}")
    for s in [stop] if isinstance(stop, str) else stop or []:
        require_unicode(s, "a stop string")
    if logits_processors is not None:
        if not isinstance(logits_processors, Sequence) or not all(callable(p) for p in logits_processors):
            raise TypeError(
                "logits_processors must be a list of callables (tokens, logits) -> logits, as mlx-lm's, "
                f"got {type(logits_processors).__name__}"
            )
    require_int(prefill_step_size, "prefill_step_size", 1)
    if adaptive is not None and not isinstance(adaptive, bool):
        raise TypeError(
            f"adaptive must be True, False or None (on where the model drafts), got {type(adaptive).__name__}"
        )
    if drafter is not None:
        require_drafter(drafter)
    if prompt_cache is not None and not isinstance(prompt_cache, PromptCache):
        raise TypeError(
            f"prompt_cache must be a PromptCache (PromptCache(model) or mlx_stream.cache_prompt), "
            f"got {type(prompt_cache).__name__}"
        )
    if verifier is not None and not callable(verifier):
        raise TypeError(f"verifier must be a callable or None, got {type(verifier).__name__}")


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
    draft_model=None,
    num_draft_tokens: int | None = None,
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
            either way. None: on when drafting with the model's heads or draft model,
            off for a custom ``drafter`` and for an explicit ``num_draft_tokens`` chain
            (drafted at every step, as mlx-lm does).
        prompt_lookup: the most tokens drafted per step by prompt lookup
            (:class:`~mlx_stream.drafters.lookup.LookupDrafter`, joined to the heads' tree
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
        draft_model: a separate draft model drafts instead of the heads (Leviathan et
            al. 2023; a :class:`~mlx_stream.drafters.draft_model.DraftModel` from
            :func:`mlx_stream.load_draft`, or ``load(..., draft_model=SPEC)``, which sets
            ``model.draft_model``, the default here): EAGLE-2's dynamic tree from its
            logits, coupled to the target's draws when sampling
            (:class:`~mlx_stream.drafters.draft_model.DraftModelDrafter`; ``tree="dynamic:N[,W[,D]]"``
            sets its node budget, width and depth). Its KV cache lives in the ``prompt_cache``
            beside the target's, so a chat reuses both. ``False``: the heads draft even
            where ``model.draft_model`` is set.
        num_draft_tokens: the draft model drafts a chain of this many tokens instead
            of a tree (mlx-lm's ``num_draft_tokens``).

    Yields:
        :class:`GenerationResponse`; the last one has ``finish_reason`` set.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: bad parameters, an empty prompt, text that is not valid Unicode
            (a prompt or stop string with bytes that were not UTF-8), or a prompt that does not fit
            in the context window (checked before any forward pass).
    """
    require_model(model)
    require_tokenizer(tokenizer)
    sampling = SamplingParams(temp, top_p, top_k, min_p, min_tokens_to_keep)
    kv = KVSettings(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    check_generation(max_tokens, sampling, model.args.vocab_size)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs must be an integer >= 0, got {top_logprobs!r}")
    _check_kinds(stop, logits_processors, prefill_step_size, adaptive, drafter, prompt_cache, verifier)
    check_tree_spec(tree)
    check_prompt_lookup(prompt_lookup)
    ids, unknown = _prompt_ids(model, tokenizer, prompt, prompt_cache, kv)
    ctx = model.context_length if max_kv_size is None else None  # a bounded cache: positions run on
    if adaptive is None:  # an explicit chain (num_draft_tokens, as mlx-lm's) drafts at every step
        adaptive = drafter is None and num_draft_tokens is None
    cache = prompt_cache if prompt_cache is not None else PromptCache(model, max_kv_size)
    if drafter is None:
        drafter = _model_drafter(model, cache, tree, prompt_lookup, sampling, draft_model, num_draft_tokens)
    _check_drafter(drafter, kv)
    entropy = np.random.SeedSequence(seed).entropy
    verify = TreeVerifier(
        sampling,
        list(logits_processors or []),
        verifier,
        entropy,
        model.args.vocab_size,
        top_logprobs,
        unknown,
    )
    if cache.quantization is not None and cache.quantization != (kv_bits, kv_group_size):
        cache.reset()  # quantized for other settings: recompute
    emitter = _Emitter(tokenizer, max_tokens, [stop] if isinstance(stop, str) else list(stop or []))
    pipe = StepPipeline(
        model, cache, verify, drafter, kv, SpeculationPolicy() if adaptive and drafter.tree.size > 1 else None
    )

    # prefill; the last hidden state gives the first token and feeds the heads
    tic = time.perf_counter()
    logits, hidden, mid, reused, prompt_hidden = prefill(model, cache, ids, drafter, prefill_step_size, kv)
    step = _first_step(verify, ids, logits, hidden, mid, prompt_hidden)
    prompt_tps = (len(ids) - reused) / (time.perf_counter() - tic)
    if pipe.policy is not None and draft_cache_of(drafter) is not None:
        pipe.policy.catch_up = draft_cache_of(drafter).catch_up

    # Each step is launched (queued on the device) before the step before it is handed to
    # the caller, and read back after: the device computes while the host serves the
    # caller and builds the next graph. Where the step after it has a shape known before
    # its acceptance is read (StepPipeline.queue_after), that one is queued too.
    tic = last_end = time.perf_counter()
    tokens = list(ids)  # prompt + output; the root (the last emitted token) is last
    in_flight, n_fwd = None, 0  # the step launched and not read back; decoding passes so far
    while True:
        tokens.extend(step.emitted)
        room = (ctx - len(tokens)) if ctx is not None else None  # tokens that may still follow
        delta, kept, reason = emitter.push(step.emitted, out_of_room=room is not None and room <= 0)
        response = _response(step, delta, kept, reason, emitter, len(ids), reused, prompt_tps, n_fwd, tic)
        if reason is not None:
            if in_flight is not None:  # its forward wrote the root's entries and its drafts'
                keep_path(cache.layers, in_flight.start, [0])  # the root's (a recurrent layer: its row)
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
        if in_flight is None:  # nothing queued: the drafter proposes this step on the host
            in_flight = pipe.start(tokens, step, depth)
        # the first token waits for one graph only (as mlx-lm's): the step after it is not
        # queued ahead, so time to first token is not two graphs' recording
        ahead = pipe.queue_after(in_flight, tokens, depth) if n_fwd else None
        paused = time.perf_counter()
        try:
            yield response
        except GeneratorExit:  # closed by the caller: drop the launched steps' keys/values
            cache.drop_to(len(cache.tokens))
            raise
        paused = time.perf_counter() - paused
        step = pipe.finish(in_flight, ahead)
        end = time.perf_counter()
        pipe.observe(in_flight, step, end - last_end - paused)  # the caller's time left out
        in_flight, last_end, n_fwd = ahead, end, n_fwd + 1


def _prompt_ids(model, tokenizer, prompt, prompt_cache: PromptCache | None, kv: KVSettings):
    # the prompt's ids, after the tokens of a prompt cache loaded from an mlx-lm file whose
    # ids it does not know (-1: the prompt continues them, as in mlx_lm.generate
    # --prompt-cache-file), and how many of those there are; checked against the context
    # window and the KV settings
    ids = encode_prompt(tokenizer, prompt, model.args.vocab_size)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    unknown = 0
    if prompt_cache is not None:
        while unknown < len(prompt_cache.tokens) and prompt_cache.tokens[unknown] == -1:
            unknown += 1
        q = prompt_cache.quantization
        if unknown and q is not None and q != (kv.bits, kv.group_size):
            raise ValueError(
                f"this prompt cache holds tokens quantized with kv_bits={q[0]}, kv_group_size={q[1]} "
                "that cannot be recomputed (their ids are unknown): pass the same kv_bits and kv_group_size"
            )
        ids = [-1] * unknown + ids
    ctx = model.context_length if kv.max_kv_size is None else None
    if ctx is not None and len(ids) >= ctx:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the model's context window is {ctx}: shorten the prompt"
        )
    check_kv(kv, head_dim(model.backbone))
    if prompt_cache is not None and prompt_cache.max_kv_size != kv.max_kv_size:
        raise ValueError(
            f"the prompt cache was made with max_kv_size={prompt_cache.max_kv_size}, this call asks for "
            f"{kv.max_kv_size}: make the PromptCache with the same max_kv_size"
        )
    return ids, unknown


def _model_drafter(model, cache, tree, prompt_lookup, sampling, draft_model, num_draft_tokens):
    # the model's own drafter: its draft model (given, else the loaded one; False: none),
    # whose KV cache lives in the prompt cache, else its heads; prompt lookup beside
    from .drafters.draft_model import DraftModel

    if draft_model is None:
        draft_model = getattr(model, "draft_model", None)
    return make_drafter(
        model,
        tree,
        prompt_lookup,
        sampled=not sampling.greedy,
        draft_model=draft_model or None,
        num_draft_tokens=num_draft_tokens,
        draft_cache=cache.draft_cache(draft_model) if isinstance(draft_model, DraftModel) else None,
    )


def _check_drafter(drafter, kv: KVSettings) -> None:
    # whether the KV settings allow drafting with this drafter
    if kv.bits is not None and not isinstance(drafter, NoDrafter):
        raise ValueError(
            "kv_bits cannot be combined with drafting: a draft tree's keys come from one batched "
            "pass and differ from one-token-at-a-time decoding by float rounding (~1e-6), which "
            "quantization can turn into a whole quantization step, so the output could drift from "
            "plain decoding's; decode plainly with it (heads=None and prompt_lookup=0; --no-heads "
            "on the command line), or bound memory with max_kv_size instead"
        )
    if getattr(drafter, "capture", None) is not None and (kv.max_kv_size is not None or kv.bits is not None):
        raise ValueError(
            "these heads read the backbone's cached keys/values (multi-stream attention), which "
            "max_kv_size and kv_bits change; decode them without those options"
        )
    if draft_cache_of(drafter) is not None and kv.max_kv_size is not None:
        raise ValueError(
            "max_kv_size bounds the target's cache but not a draft model's, whose cache would grow "
            "without bound: decode with the draft model without max_kv_size, or bound memory "
            "with the heads or plain decoding"
        )


def _first_step(verify: TreeVerifier, ids: list[int], logits, hidden, mid, prompt_hidden) -> Step:
    # the prefill's last position as a step over the root-only tree: the first token
    root, node = no_drafts(), mx.array([ids[-1]], dtype=mx.int32)
    verdict = verify.judge(
        root,
        node,
        logits[None],
        len(ids),
        mx.array(ids, dtype=mx.int32) if verify.processors else None,
    )
    mx.eval(verdict.arrays())
    path, y, lps, tops = verify.walk(root, [ids[-1]], verdict, len(ids))
    return Step(root, [ids[-1]], path, y, lps, tops, hidden, mid, prompt_hidden)


def _response(step: Step, delta, kept, reason, emitter, n_prompt, reused, prompt_tps, n_fwd, tic):
    n = len(emitter.tokens)
    return GenerationResponse(
        text=delta,
        tokens=kept,
        accepted=len(step.path) - 1,
        prompt_tokens=n_prompt,
        prompt_tps=prompt_tps,
        generation_tokens=n,
        generation_tps=n / max(time.perf_counter() - tic, 1e-9),
        forward_passes=n_fwd,
        peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason=reason,
        tau=(n + emitter.eos_hit - 1) / n_fwd if n_fwd else 0.0,
        logprobs=step.logprobs[: len(kept)],
        top_logprobs=step.top_logprobs[: len(kept)] if step.top_logprobs is not None else None,
        drafted=step.tree.size - 1,
        cached_tokens=reused,
    )


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
