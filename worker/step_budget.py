"""Admission by step budget (`SLUICE_ADMISSION=step`): how much lower-class work may run beside a
higher class, read from the engine's own step times. Pure Python, no I/O.

An engine step costs a fixed part, a part per decoded token and a (smaller) part per prompt token
it prefills. A streamed request waits one step per token, so work admitted beside it stretches its
latency by the factor its steps grow. With `fixed + per_token * r` the decode step of the r tokens
the classes above put in each step, the classes below may add `(stretch - 1) * (fixed / per_token + r)`
decode tokens' worth to each step and keep that stretch; a lower request costs one decoded token
per step plus its prompt spread over its output, at the prompt token's price.

The worker sees the engine's steps from vLLM's step stats (or, for another engine, as bursts of
outputs: `StepClock`). Each step is one sample (seconds, decoded tokens, prompt tokens); `StepModel`
fits the three parts online, forgetting old samples, and says nothing until the samples spread
enough to tell them apart. Until then admission keeps the fixed contended caps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class StepClock:
    """Engine steps from the times the worker receives them.

    `output(now, tokens, prompt_tokens)` is called for every step report or engine output: a burst
    is calls less than `gap_s` apart; a step's duration is from the start of the burst before it
    to its own start, and its tokens are its burst's. A step is reported once the next burst begins
    (only then is it whole). `idle()` says the engine ran out of work, so the next burst does not
    end a step of its own.
    """

    def __init__(self, on_step, gap_s: float = 0.003, max_step_s: float = 10.0):
        self.on_step = on_step  # (seconds, decoded tokens, prompt tokens)
        self.gap_s, self.max_step_s = gap_s, max_step_s
        self.steps = 0  # bursts seen: the pace of admissions under a step budget
        self._prev_start: float | None = None
        self._start: float | None = None
        self._last = -math.inf
        self._tokens = self._prompt = 0

    def output(self, now: float, tokens: int, prompt_tokens: int = 0) -> bool:
        """Count one output; True when it begins a new burst (a new step)."""
        if now - self._last <= self.gap_s:
            self._tokens += tokens
            self._prompt += prompt_tokens
            self._last = now
            return False
        if self._prev_start is not None and self._start is not None:
            seconds = self._start - self._prev_start
            if 0 < seconds <= self.max_step_s:
                self.on_step(seconds, self._tokens, self._prompt)
        self._prev_start, self._start, self._last = self._start, now, now
        self._tokens, self._prompt = tokens, prompt_tokens
        self.steps += 1
        return True

    def idle(self) -> None:
        self._prev_start = self._start = None
        self._last = -math.inf
        self._tokens = self._prompt = 0


@dataclass(frozen=True)
class StepFit:
    fixed: float  # seconds
    per_token: float  # seconds per decoded token in the step
    per_prompt_token: float  # seconds per prompt token prefilled in it (per_token until measured)


@dataclass
class StepModel:
    """Least squares of step seconds on decoded and prompt tokens per step, each sample weighing
    `decay` times the next."""

    decay: float = 0.995  # about 200 steps of memory
    min_samples: float = 30.0
    min_spread: float = 1.0  # decoded tokens: the standard deviation needed to tell fixed from per token
    min_prompt_spread: float = 1.0  # prompt tokens: the same, to price them apart from decoded ones
    _sums: list[float] | None = None  # n, d, p, y, dd, pp, dp, dy, py

    def add(self, seconds: float, tokens: float, prompt_tokens: float = 0.0) -> None:
        if self._sums is None:
            self._sums = [0.0] * 9
        d, p, y = tokens, prompt_tokens, seconds
        for i, v in enumerate((1.0, d, p, y, d * d, p * p, d * p, d * y, p * y)):
            self._sums[i] = self._sums[i] * self.decay + v

    @property
    def n(self) -> float:
        return self._sums[0] if self._sums else 0.0

    def fit(self) -> StepFit | None:
        """The three parts, or None while the samples cannot tell them apart."""
        if self.n < self.min_samples:
            return None
        n, sd, sp, sy, sdd, spp, sdp, sdy, spy = self._sums
        md, mp, my = sd / n, sp / n, sy / n
        cdd, cpp, cdp = sdd / n - md * md, spp / n - mp * mp, sdp / n - md * mp
        cdy, cpy = sdy / n - md * my, spy / n - mp * my
        if cdd < self.min_spread ** 2:
            return None
        det = cdd * cpp - cdp * cdp
        if cpp >= self.min_prompt_spread ** 2 and det > 1e-9 * cdd * cpp:
            per_token, per_prompt = (cdy * cpp - cpy * cdp) / det, (cpy * cdd - cdy * cdp) / det
        else:  # no prefill among the samples: decoded tokens alone, prompt tokens priced alike
            per_token = cdy / cdd
            per_prompt = None
        fixed = my - per_token * md - (per_prompt or 0.0) * mp
        if per_token <= 0 or fixed <= 0:
            return None
        if per_prompt is None or per_prompt <= 0:
            per_prompt = per_token
        return StepFit(fixed, per_token, per_prompt)


def tokens_allowed(fixed: float, per_token: float, above_tokens: float, stretch: float) -> float:
    """Tokens per step the classes below may add while those above put `above_tokens` in each step,
    keeping the step within `stretch` times what it would be without them."""
    return (stretch - 1.0) * (fixed / per_token + above_tokens)


@dataclass
class StepBudget:
    """The step model, the clock that feeds it, and what each class's requests put in a step."""

    stretch: float = 1.2
    model: StepModel | None = None
    # per class: prompt tokens per generated token of its finished requests (moving average)
    prompt_ratio: dict[str, float] | None = None
    ratio_weight: float = 0.1

    def __post_init__(self):
        if self.stretch <= 1.0:
            raise ValueError("step stretch must be above 1.0")
        self.model = self.model or StepModel()
        self.prompt_ratio = dict(self.prompt_ratio or {})
        self.clock = StepClock(self.model.add)

    def finished(self, cls: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request of `cls` left the engine: its prompt is part of what it cost per step."""
        if completion_tokens <= 0:
            return
        ratio = prompt_tokens / completion_tokens
        old = self.prompt_ratio.get(cls)
        self.prompt_ratio[cls] = ratio if old is None else old + self.ratio_weight * (ratio - old)

    def cost(self, cls: str, fit: StepFit) -> float:
        """Decoded tokens' worth a running request of `cls` adds to each step: its own token, and its
        prompt spread over its output at the prompt token's price."""
        return 1.0 + self.prompt_ratio.get(cls, 0.0) * fit.per_prompt_token / fit.per_token

    def caps(self, above_tokens: float, below: list[tuple[str, int]]) -> dict[str, int] | None:
        """Caps for the classes below the busy ones, in priority order, sharing one budget: each gets
        what the budget leaves after the running requests of the classes before it. `below` is
        (class, running) pairs. None while the model cannot say."""
        fit = self.model.fit()
        if fit is None:
            return None
        budget = tokens_allowed(fit.fixed, fit.per_token, above_tokens, self.stretch)
        out = {}
        for cls, running in below:
            cost = self.cost(cls, fit)
            out[cls] = max(0, math.floor(budget / cost))
            budget -= running * cost
        return out
