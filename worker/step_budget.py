"""Admission by step budget (`SLUICE_ADMISSION=step`): how much lower-class work may run beside a
higher class, read from the engine's own step times. Pure Python, no I/O.

An engine step costs a fixed part plus a part per token in the step (`bench/isolation.py` fits the
same line over whole runs). A streamed request waits one step per token, so work admitted beside it
stretches its latency by the factor its steps grow. With `fixed + per_token * r` the step of the r
tokens the classes above put in each step, the classes below may add
`(stretch - 1) * (fixed / per_token + r)` tokens to each step and keep that stretch.

The worker sees the engine's steps as bursts of outputs: the outputs of one step reach it together,
the next step's one step later (`StepClock`). Each step is one sample (seconds, tokens); `StepModel`
fits the line online, forgetting old samples, and says nothing until the samples spread enough to
tell the two parts apart. Until then admission keeps the fixed contended caps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class StepClock:
    """Engine steps from the times the worker receives outputs.

    `output(now, tokens)` is called for every engine output: a burst is outputs less than `gap_s`
    apart; a step's duration is from the start of the burst before it to its own start, and its
    tokens are its burst's. A step is reported once the next burst begins (only then is it whole).
    `idle()` says the engine ran out of work, so the next burst does not end a step of its own.
    """

    def __init__(self, on_step, gap_s: float = 0.003, max_step_s: float = 10.0):
        self.on_step = on_step  # (seconds, tokens)
        self.gap_s, self.max_step_s = gap_s, max_step_s
        self.steps = 0  # bursts seen: the pace of admissions under a step budget
        self._prev_start: float | None = None
        self._start: float | None = None
        self._last = -math.inf
        self._tokens = 0

    def output(self, now: float, tokens: int) -> bool:
        """Count one output; True when it begins a new burst (a new step)."""
        if now - self._last <= self.gap_s:
            self._tokens += tokens
            self._last = now
            return False
        if self._prev_start is not None and self._start is not None:
            seconds = self._start - self._prev_start
            if 0 < seconds <= self.max_step_s:
                self.on_step(seconds, self._tokens)
        self._prev_start, self._start, self._last, self._tokens = self._start, now, now, tokens
        self.steps += 1
        return True

    def idle(self) -> None:
        self._prev_start = self._start = None
        self._last = -math.inf
        self._tokens = 0


@dataclass
class StepModel:
    """Least squares of step seconds on tokens per step, each sample weighing `decay` times the next."""

    decay: float = 0.995  # about 200 steps of memory
    min_samples: float = 30.0
    min_spread: float = 2.0  # tokens: the standard deviation of tokens per step needed to fit two parts
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, seconds: float, tokens: float) -> None:
        d = self.decay
        self.n = self.n * d + 1.0
        self.sx = self.sx * d + tokens
        self.sy = self.sy * d + seconds
        self.sxx = self.sxx * d + tokens * tokens
        self.sxy = self.sxy * d + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the samples cannot tell them apart."""
        if self.n < self.min_samples:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var < self.min_spread ** 2:
            return None
        per_token = (self.sxy / self.n - mx * my) / var
        fixed = my - per_token * mx
        if per_token <= 0 or fixed <= 0:
            return None
        return fixed, per_token


def tokens_allowed(fixed: float, per_token: float, above_tokens: float, stretch: float) -> float:
    """Tokens per step the classes below may add while those above put `above_tokens` in each step,
    keeping the step within `stretch` times what it would be without them."""
    return (stretch - 1.0) * (fixed / per_token + above_tokens)


@dataclass
class StepBudget:
    """The step model, the clock that feeds it, and what each class's requests put in a step."""

    stretch: float = 1.2
    model: StepModel | None = None
    # per class: tokens a request puts in the engine per generated token ((prompt + output) / output)
    cost: dict[str, float] | None = None
    cost_weight: float = 0.1

    def __post_init__(self):
        if self.stretch <= 1.0:
            raise ValueError("step stretch must be above 1.0")
        self.model = self.model or StepModel()
        self.cost = dict(self.cost or {})
        self.clock = StepClock(self.model.add)

    def finished(self, cls: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request of `cls` left the engine: its prompt is part of what it cost per step."""
        if completion_tokens <= 0:
            return
        ratio = (prompt_tokens + completion_tokens) / completion_tokens
        old = self.cost.get(cls)
        self.cost[cls] = ratio if old is None else old + self.cost_weight * (ratio - old)

    def caps(self, above_tokens: float, below: list[tuple[str, int]]) -> dict[str, int] | None:
        """Caps for the classes below the busy ones, in priority order, sharing one budget: each gets
        what the budget leaves after the running requests of the classes before it. `below` is
        (class, running) pairs. None while the model cannot say."""
        fit = self.model.fit()
        if fit is None:
            return None
        budget = tokens_allowed(*fit, above_tokens, self.stretch)
        out = {}
        for cls, running in below:
            cost = self.cost.get(cls, 1.0)
            out[cls] = max(0, math.floor(budget / cost))
            budget -= running * cost
        return out
