"""Adaptive speculation: send drafts to the forward pass only while they pay.

A step with drafts costs more than a plain step (c(N) > 1 for an N-node tree, plus
drafting and verification) and pays back only through accepted drafts. When
acceptance is low (unpredictable text, high temperature) speculation is slower than
plain decoding; the policy then decodes plainly and re-tries drafts now and then.
Either way the output is unchanged: a plain step is the same loop with a root-only tree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationPolicy:
    """Chooses, step by step, between drafting and plain decoding, by measured throughput.

    Keeps exponential moving averages of the wall time of a drafting step and of a
    plain step (seconds, drafting and verification included) and of the tokens a
    drafting step emits, and drafts when ``tokens / t_draft >= 1 / t_plain``, i.e.
    when the measured tau of drafting steps covers their measured relative cost (the
    online form of the tau / c(N) criterion; cf. dynamic speculation lookahead,
    Mamou et al. 2024, and "SmartSpec", Liu et al. 2024). The losing mode is still
    tried every ``explore_every`` steps, so the estimates follow drift; plain decoding
    is not re-tried while drafting wins by more than ``sure_margin``.

    Attributes:
        explore_every: steps between tries of the mode not chosen.
        decay: weight of a new observation in the moving averages, in (0, 1].
        sure_margin: drafting throughput over plain throughput above which plain
            steps are no longer tried.
    """

    explore_every: int = 16
    decay: float = 0.25
    sure_margin: float = 1.5
    t_draft: float | None = None
    t_plain: float | None = None
    tokens: float | None = None
    _since_explore: int = 0
    _step: int = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.decay * (new - old)

    def advantage(self) -> float | None:
        """Drafting's throughput over plain decoding's, or None until both were timed."""
        if self.t_draft is None or self.t_plain is None or self.tokens is None:
            return None
        return (self.tokens / self.t_draft) * self.t_plain

    def use_drafts(self) -> bool:
        """Whether the next step sends the drafts to the forward pass."""
        self._step += 1
        adv = self.advantage()
        if adv is None:  # time one drafting step, then one plain step
            return self.t_draft is None
        best = adv >= 1.0
        self._since_explore += 1
        if self._since_explore >= self.explore_every and (not best or adv < self.sure_margin):
            self._since_explore = 0
            return not best
        return best

    def observe(self, drafted: bool, seconds: float, tokens: int) -> None:
        """Record one step: whether it drafted, its wall time (s) and the tokens it emitted."""
        if drafted:
            self.t_draft = self._ema(self.t_draft, seconds)
            self.tokens = self._ema(self.tokens, float(tokens))
        else:
            self.t_plain = self._ema(self.t_plain, seconds)
