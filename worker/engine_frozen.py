"""A busy engine that has stopped: no output, and its processes use no CPU. Pure Python, no I/O.

A step that takes long (a long prefill on CPU) keeps the engine's processes computing, while a
frozen engine core (SIGSTOPped, deadlocked, stuck in a device call that sleeps) uses none. So
while the engine holds requests, the monitor samples the CPU seconds of each engine process;
when no output came for a whole window and those processes used under `min_share` of one core
over it, the engine is taken for frozen, long before the stall bound (`SLUICE_ENGINE_STALL_S`),
which stays for an engine that computes and never outputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class FrozenWatch:
    window_s: float  # 0: off
    min_share: float = 0.02  # of one core, over the window: a computing engine uses one or more
    max_gap_s: float = 2.0  # samples further apart (the loop was held, the worker stopped) start over
    _samples: deque = field(default_factory=deque)  # (monotonic seconds, {pid: CPU seconds})

    def sample(self, now: float, cpu: dict[int, float] | None) -> None:
        """The engine's processes' CPU seconds now; None when the engine holds no requests (or its
        processes cannot be read), which starts the window over."""
        if cpu is None or (self._samples and now - self._samples[-1][0] > self.max_gap_s):
            self._samples.clear()
        if cpu is None or self.window_s <= 0:
            return
        self._samples.append((now, cpu))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()  # the oldest kept sample is the last one at or before the window's start

    def used(self, now: float) -> float | None:
        """CPU seconds the engine's processes used over the last window; None while the samples do
        not span it unbroken, or no process was seen at both ends (one that ended is the health
        check's to report)."""
        if not self._samples or self._samples[0][0] > now - self.window_s:
            return None
        first, last = self._samples[0][1], self._samples[-1][1]
        both = first.keys() & last.keys()
        if not both:
            return None
        return sum(last[pid] - first[pid] for pid in both)

    def frozen(self, now: float, progress_at: float) -> float | None:
        """The CPU seconds used over the window when the engine made no progress in all of it and
        its processes used almost none: it is frozen. None otherwise."""
        if self.window_s <= 0 or now - progress_at < self.window_s:
            return None
        used = self.used(now)
        if used is None or used >= self.min_share * self.window_s:
            return None
        return used
