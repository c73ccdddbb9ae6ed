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
    the host's work included: the graph built, submitted and read back, the drafter's
    own forwards, verification; so on a device where a forward is nearly free the host's
    share decides) and a moving average (weight ``decay``) of the tokens a drafting step
    emits, and drafts when ``tokens / median t_draft >= 1 / median t_plain``, i.e. when
    the measured tau of drafting steps covers their measured relative cost (the online form
    of the tau / c(N) criterion; cf. dynamic speculation lookahead, Mamou et al. 2024,
    and "SmartSpec", Liu et al. 2024).

    The steps alternate, drafting first, until each mode has a kept observation (the first
    of each mode pays one-time costs and is dropped), then the faster mode is chosen. The other
    mode is tried again now and then so the estimates follow drift: plain decoding every
    ``explore_every`` steps while drafting wins by less than ``sure_margin``; drafting, while
    it loses, once per its measured loss over ``explore_budget`` steps (a try costs
    ``L = (t_draft - tokens * t_plain) / t_plain`` plain steps), at least every
    ``explore_every`` and at most every ``max_explore`` steps, so a drafter that cannot pay
    here (a useless draft model, or any drafter where the host's work per step outweighs
    its tau) costs about ``explore_budget`` of the time. A drafter that must first catch up
    with the tokens decoded plainly since its last try (a draft model prefills them into its
    own cache: ``catch_up`` seconds per token) costs ``L + I * catch_up / t_plain`` plain steps
    a try after ``I`` plain steps, so tries come every ``L / (explore_budget - catch_up /
    t_plain)`` steps, or every ``max_explore`` where the catch-up alone exceeds the budget.
    Medians make one slow step harmless.

    Attributes:
        explore_every: the fewest steps between tries of the mode not chosen.
        explore_budget: the share of decoding time tries of a losing drafter may cost.
        max_explore: the most steps between tries of a losing drafter.
        window: observations kept per mode.
        warmup: initial steps that alternate drafting and plain decoding (0: only until
            both modes are measured).
        decay: weight of a new drafting step in the tokens' moving average, in (0, 1].
        sure_margin: drafting throughput over plain throughput above which plain
            steps are no longer tried.
        catch_up: seconds per token a drafting try spends first on each token decoded
            plainly since the drafter last ran (a draft model's prefill of them; 0 for
            drafters that read the target's states).
    """

    explore_every: int = 16
    explore_budget: float = 0.01
    max_explore: int = 512
    window: int = 8
    warmup: int = 0
    decay: float = 0.3
    sure_margin: float = 1.5
    catch_up: float = 0.0
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

    def explore_interval(self, drafting_wins: bool) -> int:
        """Steps between tries of the mode not chosen (see the class docstring)."""
        if drafting_wins:
            return self.explore_every
        t_plain = statistics.median(self.t_plain)
        loss = (statistics.median(self.t_draft) - self.tokens * t_plain) / t_plain
        room = self.explore_budget - self.catch_up / t_plain  # the budget the catch-up leaves
        if room <= 0:
            return self.max_explore
        return int(min(self.max_explore, max(self.explore_every, loss / room)))

    def use_drafts(self) -> bool:
        """Whether the next step sends the drafts to the forward pass."""
        self._step += 1
        adv = self.advantage()
        if self._step <= self.warmup:
            return self._step % 2 == 1
        if adv is None:  # alternating (drafting first) until both modes are measured
            if self.t_draft or self.t_plain:  # the one not yet measured (a queued step is
                return not self.t_draft  # decided before the step before is observed)
            return self._step % 2 == 1
        best = adv >= 1.0
        self._since_explore += 1
        if self._since_explore >= self.explore_interval(best) and (not best or adv < self.sure_margin):
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
