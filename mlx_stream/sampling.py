"""Target distributions shared by plain and speculative decoding.

Both paths turn logits into the same processed distribution at every position, so
verification compares drafts against exactly what plain sampling would draw from.
The semantics are mlx-lm's (``mlx_lm.sample_utils``):

1. logits processors ``f(tokens, logits) -> logits`` (repetition penalty, logit bias,
   ...; ``make_logits_processors``) see every token before the position, the token at
   the position included; at a tree node that is the emitted prefix plus the node's
   ancestors and the node itself;
2. ``logprobs = logits - logsumexp(logits)``: what mlx-lm reports as log-probabilities;
3. greedy (``temp == 0``) takes the argmax of those; otherwise top-p, min-p and top-k
   mask ``logprobs`` (mlx-lm's ``apply_top_p``, ``apply_min_p``, ``apply_top_k``, in
   ``make_sampler``'s order) and the token is drawn from ``softmax(masked / temp)``.

The draw is ``argmax(masked / temp + g)`` with ``g`` standard Gumbel noise keyed by
(seed, position) (:class:`GumbelNoise`): the Gumbel-max trick, which is how
``mx.random.categorical`` samples too. Drafters perturb their own scores with the same
noise (:class:`DraftNoise`), so a draft matches the target's draw whenever the two
distributions roughly agree, while the draw itself never depends on what was drafted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


MIN_TEMP = 1e-6  # below it, logits / temp overflows float32 (use 0: greedy)


def check_sampling(temp: float) -> None:
    """Raise ``ValueError`` for a negative (or non-finite) temperature, or a positive one
    below :data:`MIN_TEMP`."""
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temp!r}")
    if 0 < temp < MIN_TEMP:
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMP}, got {temp!r}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def make_processors(
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    vocab_size: int | None = None,
) -> list[LogitsProcessor]:
    """mlx-lm's logits processors (``make_logits_processors``, its default context of
    the last 20 tokens for the penalties), checked first.

    Raises:
        ValueError: ``repetition_penalty`` not a finite number > 0 (1 = none); a penalty
            that is not a finite number; a ``logit_bias`` key that is not a token id (in
            ``[0, vocab_size)`` when given) or a value that is not a finite number.
    """
    from mlx_lm.sample_utils import make_logits_processors

    if repetition_penalty is not None and not (_finite(repetition_penalty) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be a number > 0 (1 = none), got {repetition_penalty!r}")
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if v is not None and not _finite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    for t, b in (logit_bias or {}).items():
        if (
            isinstance(t, bool)
            or not isinstance(t, int)
            or t < 0
            or (vocab_size is not None and t >= vocab_size)
        ):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {t!r}")
        if not _finite(b):
            raise ValueError(f"logit_bias values must be finite numbers, got {b!r} for token {t}")
    return make_logits_processors(
        logit_bias={int(t): float(b) for t, b in logit_bias.items()} if logit_bias else None,
        repetition_penalty=None if repetition_penalty is None else float(repetition_penalty),
        presence_penalty=None if presence_penalty is None else float(presence_penalty),
        frequency_penalty=None if frequency_penalty is None else float(frequency_penalty),
    )


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from the processed logits (mlx-lm's ``make_sampler``).

    Attributes:
        temp: temperature; 0 is greedy (argmax; the filters below then do nothing).
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 keeps every token.
        min_p: drop tokens less likely than ``min_p`` times the most likely one, in
            [0, 1]; 0 keeps every token.
        min_tokens_to_keep: min-p never keeps fewer tokens than this (>= 1).
    """

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    def check(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first parameter out of range.

        ``top_k`` must be below ``vocab_size`` when it is given (as mlx-lm requires)."""
        check_sampling(self.temp)
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not MIN_TEMP <= self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in [{MIN_TEMP}, 1] (1 disables it), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if vocab_size is not None and self.top_k >= vocab_size:
            raise ValueError(f"top_k must be below the vocabulary size {vocab_size}, got {self.top_k}")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, (int, float))
            or not 0 <= self.min_p <= 1
        ):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if (
            isinstance(self.min_tokens_to_keep, bool)
            or not isinstance(self.min_tokens_to_keep, int)
            or self.min_tokens_to_keep < 1
        ):
            raise ValueError(f"min_tokens_to_keep must be an integer >= 1, got {self.min_tokens_to_keep!r}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def mask(self, logprobs: mx.array) -> mx.array:
        """Apply top-p, min-p and top-k (mlx-lm's functions and order) to ``(..., V)``
        float32 log-probabilities; masked entries become ``-inf``."""
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        if self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def distribution(self, logprobs: mx.array) -> mx.array:
        """The sampling distribution ``softmax(mask(logprobs) / temp)``: ``(..., V)`` ->
        ``(..., V)`` float32, rows summing to 1.

        Raises:
            ValueError: ``temp == 0`` (greedy decoding takes the argmax instead).
        """
        if self.temp <= 0:
            raise ValueError("distribution() needs temp > 0; greedy decoding uses the argmax")
        return mx.softmax(self.mask(logprobs.astype(mx.float32)) * (1.0 / self.temp), axis=-1)


class GumbelNoise:
    """Standard Gumbel noise keyed by (seed, position): one ``(V,)`` float32 vector per
    position of the sequence, the same whatever else runs.

    With it the token at position ``pos`` is ``argmax(masked / temp + row(pos))``, an exact
    draw from ``softmax(masked / temp)`` (the Gumbel-max trick; Gumbel 1954, Maddison et
    al. 2014), independent across positions. A drafter that proposes ``argmax(s + row(pos))``
    for its own scores ``s`` (log-probabilities of a draft distribution q, over a
    temperature) matches that draw with probability at least (1 - TV) / (1 + TV), TV the
    total-variation distance between q and the target's distribution, and the draw is the
    same whatever was drafted: plain and speculative decoding emit the same tokens for a
    seed (drafter-invariant speculative sampling: Daliri, Musco and Suresh 2024, "Coupling
    without communication and drafter-invariant speculative decoding", sec. 3).

    Rows are computed on the device when first asked for and kept while their position may
    still be asked for (positions at or after the last ``start`` given to :meth:`rows`).

    Args:
        entropy: the seed's entropy (``numpy.random.SeedSequence(seed).entropy``).
        vocab_size: V.
    """

    def __init__(self, entropy: int, vocab_size: int):
        self.entropy, self.vocab_size = entropy, vocab_size
        # position p's key is the p-th output of a splitmix64 stream seeded from the entropy
        # (Steele et al. 2014): ~1 us on the host, where a SeedSequence per position took ~20
        # (host work every sampled step)
        self._base = _splitmix64(entropy ^ (entropy >> 64))
        self._rows: dict[int, mx.array] = {}

    def row(self, position: int) -> mx.array:
        """``(V,)`` float32: the noise of the token at ``position`` (lazy)."""
        if position not in self._rows:
            key = mx.random.key(_splitmix64(self._base + position * _GAMMA))
            self._rows[position] = _gumbel(self.vocab_size)(key)
        return self._rows[position]

    def rows(self, start: int, n: int) -> mx.array:
        """``(n, V)`` float32: the noise of positions ``start .. start + n - 1``; rows of
        positions before ``start`` are forgotten."""
        for p in [p for p in self._rows if p < start]:
            del self._rows[p]
        if n == 1:
            return self.row(start)[None]
        return mx.stack([self.row(start + i) for i in range(n)])


@functools.cache
def _gumbel(vocab_size: int) -> Callable[[mx.array], mx.array]:
    # compiled: 2 ops a row instead of 15 (each op is host work on a fast device), the same
    # values as mx.random.gumbel's
    return mx.compile(lambda key: mx.random.gumbel(shape=(vocab_size,), key=key))


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class DraftNoise:
    """What a drafter needs to couple its drafts with the target's sampled tokens.

    Attributes:
        temp: the target's sampling temperature (> 0); draft scores are divided by it.
        noise: the run's :class:`GumbelNoise`.
        start: the position of the tokens drafted at depth 1 (the root's position + 1).
        shift: for a step queued before the host knows its root's position: ``()`` int32
            (lazy), the position is ``start + shift``; None: ``start``.
        spread: the largest ``shift`` may be.
    """

    temp: float
    noise: GumbelNoise
    start: int
    shift: mx.array | None = None
    spread: int = 0

    def perturb(self, logits: mx.array, depth: int, ids: mx.array | None = None) -> mx.array:
        """``(..., V')`` draft logits at tree depth ``depth`` (>= 1) -> ``logits / temp +
        g``, ``g`` the noise of that depth's position restricted to the token ids ``ids``
        (``(V',)``; None: the whole vocabulary). Their argmax (top-k) are the drafts."""
        pos = self.start + depth - 1
        if self.shift is None:
            g = self.noise.row(pos)
        else:  # every position the shift may give, then the one it gives (on the device)
            g = mx.stack([self.noise.row(pos + k) for k in range(self.spread + 1)])[self.shift]
        if ids is not None:
            g = g[ids]
        return logits.astype(mx.float32) * (1.0 / self.temp) + g


def log_softmax(logits: mx.array) -> mx.array:
    """``logits - logsumexp(logits)`` over the last axis, float32."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def process_logits(
    processors: Sequence[LogitsProcessor],
    history: mx.array,
    node_tokens: mx.array,
    paths: Sequence[mx.array],
    logits: mx.array,
) -> mx.array:
    """Apply mlx-lm logits processors at every node of a draft tree.

    Node i's processors see ``history`` followed by the tokens of the non-root nodes
    on its path (root excluded, node i included), i.e. exactly the tokens plain
    decoding would have fed before predicting the token after node i.

    Args:
        processors: ``f(tokens (L,) int32, logits (1, V)) -> (1, V)``, applied in order.
        history: ``(L,)`` int32, every token up to and including the root.
        node_tokens: ``(N,)`` int32, the tree's tokens (``node_tokens[0]`` is the root).
        paths: per node, ``(d,)`` int32 indices of its non-root path nodes.
        logits: ``(N, V)`` the target's logits at the nodes.

    Returns:
        ``(N, V)`` processed logits (unchanged when there are no processors).
    """
    if not processors:
        return logits
    rows = []
    for i, path in enumerate(paths):
        tokens = mx.concatenate([history, node_tokens[path]]) if path.size else history
        row = logits[i : i + 1]
        for proc in processors:
            row = proc(tokens, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)
