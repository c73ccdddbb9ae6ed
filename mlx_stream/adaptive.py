"""Adaptive speculation: send drafts to the forward pass only while they pay.

A step with drafts costs more than a plain step (c(N) > 1 for an N-node tree, plus
drafting and verification) and pays back only through accepted drafts. When
acceptance is low (unpredictable text, high temperature) speculation is slower than
plain decoding; the policy then decodes plainly and re-tries drafts now and then.
Either way the output is unchanged: a plain step is the same loop with a root-only tree.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class SpeculationPolicy:
    """Chooses, step by step, between drafting and plain decoding, by measured throughput.

    Keeps the last ``window`` wall times of drafting steps and of plain steps (seconds,
    drafting and verification included) and a moving average (weight ``decay``) of the
    tokens a drafting step emits, and drafts when ``tokens / median t_draft >= 1 /
    median t_plain``, i.e. when the
    measured tau of drafting steps covers their measured relative cost (the online form
    of the tau / c(N) criterion; cf. dynamic speculation lookahead, Mamou et al. 2024,
    and "SmartSpec", Liu et al. 2024). The first ``warmup`` steps alternate the two
    modes and the first observation of each mode is dropped (one-time costs); after
    that the losing mode is still tried every ``explore_every`` steps, so the estimates
    follow drift; plain decoding is not re-tried while drafting wins by more than
    ``sure_margin``. Medians make one slow step (another process, a page fault) harmless.

    Attributes:
        explore_every: steps between tries of the mode not chosen.
        window: observations kept per mode.
        warmup: initial steps that alternate drafting and plain decoding.
        decay: weight of a new drafting step in the tokens' moving average, in (0, 1].
        sure_margin: drafting throughput over plain throughput above which plain
            steps are no longer tried.
    """

    explore_every: int = 16
    window: int = 8
    warmup: int = 6
    decay: float = 0.3
    sure_margin: float = 1.5
    t_draft: list = field(default_factory=list)
    t_plain: list = field(default_factory=list)
    tokens: float | None = None
    _since_explore: int = 0
    _step: int = 0
    _seen: set = field(default_factory=set)

    def advantage(self) -> float | None:
        """Drafting's throughput over plain decoding's, or None until both were timed."""
        if not self.t_draft or not self.t_plain:
            return None
        return self.tokens / statistics.median(self.t_draft) * statistics.median(self.t_plain)

    def use_drafts(self) -> bool:
        """Whether the next step sends the drafts to the forward pass."""
        self._step += 1
        adv = self.advantage()
        if self._step <= self.warmup or adv is None:
            return self._step % 2 == 1
        best = adv >= 1.0
        self._since_explore += 1
        if self._since_explore >= self.explore_every and (not best or adv < self.sure_margin):
            self._since_explore = 0
            return not best
        return best

    def observe(self, drafted: bool, seconds: float, tokens: int) -> None:
        """Record one step: whether it drafted, its wall time (s) and the tokens it emitted."""
        if drafted:
            self.tokens = tokens if self.tokens is None else self.tokens + self.decay * (tokens - self.tokens)
        if drafted not in self._seen:  # the first step of each mode pays one-time costs
            self._seen.add(drafted)
            return
        if drafted:
            self.t_draft = (self.t_draft + [seconds])[-self.window :]
        else:
            self.t_plain = (self.t_plain + [seconds])[-self.window :]
