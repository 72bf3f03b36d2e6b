"""Admission policy: which waiting request enters the engine next. Pure Python, no I/O.

Classes are served in priority order (realtime, standard, batch). Each class
has its own cap on requests in the engine; while a higher class has work
(waiting or running, or had some within the last `hold_ms`), lower classes are
held to a smaller `contended` cap, but never below `min_in_engine`, so batch
keeps progressing under a realtime stream. The hold matters: admitted work
cannot be taken back, so a lower class that filled the engine during a gap
between two realtime requests would slow the next one.
Within a class: earliest deadline first, then oldest first. A request whose
deadline has passed is expired here and never reaches the engine.

vLLM's priority scheduling orders its own waiting queue, but does not stop
admitted batch work from filling every step; bounding what enters is what keeps
realtime latency flat.

With `admission = "slo"` the contended cap is not fixed: it follows the latency
of the classes above (`SloCap`), so batch fills the engine as far as realtime
stays within its objective, and gives slots back when it does not.

With `admission = "step"` it follows the engine's measured step time
(worker/step_budget.py): lower classes get the tokens per step that keep the busy
class's steps within `stretch` of what its own tokens cost, and enter at most one
per engine step, so their prefills do not land in one step together.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from worker.step_budget import StepBudget


@dataclass(frozen=True)
class ClassPolicy:
    name: str
    priority: int  # lower runs first; also passed to vLLM
    max_in_engine: int  # cap when no higher class has work
    contended_in_engine: int  # cap while a higher class has work
    min_in_engine: int = 1  # floor under contention: no starvation
    max_waiting: int = 256  # past this, the class's partitions are paused
    window_ms: int = 0  # intake micro-batch window
    batch_size: int = 64  # intake micro-batch size
    target_ms: int | None = None  # latency objective (reported, not enforced)

    def __post_init__(self):
        if not (0 < self.min_in_engine <= self.contended_in_engine <= self.max_in_engine):
            raise ValueError(f"{self.name}: need 0 < min_in_engine <= contended_in_engine <= max_in_engine")


@dataclass(frozen=True)
class Running:
    """A request holding an engine slot, as the suspension choice sees it."""

    item: Any
    cls: str
    generated: int  # tokens generated so far
    suspending: bool  # already asked to leave


def choose_suspensions(excess: dict[str, int], running: list[Running]) -> list:
    """Which running items to suspend so each class gives back `excess[cls]` slots.

    Those already suspending count toward the excess; of the rest, the ones with the
    fewest generated tokens go first: they lose the least if their KV is evicted meanwhile.
    """
    chosen = []
    for cls, n in excess.items():
        mine = [r for r in running if r.cls == cls]
        n -= sum(r.suspending for r in mine)
        candidates = sorted((r for r in mine if not r.suspending), key=lambda r: r.generated)
        chosen += [r.item for r in candidates[:max(0, n)]]
    return chosen


@dataclass
class SloCap:
    """A lower class's contended cap, steered by the end-to-end latency of a higher class (AIMD).

    A higher-class answer within `headroom` of its objective lets one more lower-class request in,
    but only while the lower class is using its whole cap (a cap nobody tests is not evidence);
    one over its objective halves the cap, at most once per objective's length, because requests
    admitted before the cut still finish late and must not cut it again.
    """

    floor: int
    ceiling: int
    value: int
    headroom: float = 0.8
    _cut_ms: int = -(1 << 62)

    def observe(self, latency_ms: float, target_ms: int, now_ms: int, at_cap: bool) -> None:
        if latency_ms > target_ms:
            if now_ms - self._cut_ms >= target_ms:
                self.value, self._cut_ms = max(self.floor, self.value // 2), now_ms
        elif latency_ms <= self.headroom * target_ms and at_cap:
            self.value = min(self.ceiling, self.value + 1)


_NO_DEADLINE = 1 << 62


@dataclass(order=True)
class _Entry:
    deadline_ms: int
    arrived_ms: int
    tie: int
    item: Any = field(compare=False)


class Scheduler:
    def __init__(self, policies: list[ClassPolicy], max_in_engine: int, hold_ms: int = 5000,
                 admission: str = "fixed", step_stretch: float = 1.2):
        self.policies = sorted(policies, key=lambda p: p.priority)
        # admission "slo": a class below one with an objective gets a cap that follows that objective
        self.slo_caps: dict[str, SloCap] = {} if admission != "slo" else {
            p.name: SloCap(p.min_in_engine, p.max_in_engine, p.contended_in_engine) for p in self.policies
            if any(h.target_ms for h in self.policies if h.priority < p.priority)}
        # admission "step": caps from the engine's step time (fed through `step_budget.clock`)
        self.step_budget = StepBudget(step_stretch) if admission == "step" else None
        self._paced_step = -1  # the engine step of the last admission under a step budget
        self.hold_ms = hold_ms
        self._busy_ms: dict[str, int] = {p.name: -(1 << 62) for p in self.policies}
        self._now_ms = 0
        self.by_name = {p.name: p for p in self.policies}
        self.max_in_engine = max_in_engine
        self._waiting: dict[str, list[_Entry]] = {p.name: [] for p in self.policies}
        self._running: dict[str, int] = {p.name: 0 for p in self.policies}
        self._tie = itertools.count()

    def add(self, cls: str, item, arrived_ms: int, deadline_ms: int | None = None) -> None:
        entry = _Entry(_NO_DEADLINE if deadline_ms is None else deadline_ms, arrived_ms, next(self._tie), item)
        heapq.heappush(self._waiting[cls], entry)

    def waiting(self, cls: str | None = None) -> int:
        return len(self._waiting[cls]) if cls else sum(map(len, self._waiting.values()))

    def running(self, cls: str | None = None) -> int:
        return self._running[cls] if cls else sum(self._running.values())

    def release(self, cls: str) -> None:
        """A request admitted earlier has finished (or failed) and left the engine."""
        self._running[cls] -= 1

    def remove(self, predicate) -> list:
        """Take waiting items out (their partitions were revoked); returns them."""
        removed = []
        for name, queue in self._waiting.items():
            keep = [e for e in queue if not predicate(e.item)]
            removed += [e.item for e in queue if predicate(e.item)]
            heapq.heapify(keep)
            self._waiting[name] = keep
        return removed

    def _busy(self, p: ClassPolicy) -> bool:
        return bool(self._waiting[p.name] or self._running[p.name]) or self._now_ms - self._busy_ms[p.name] < self.hold_ms

    def cap(self, cls: str) -> int:
        return self._cap(cls)[0]

    def _cap(self, cls: str) -> tuple[int, bool]:
        """(cap, whether the step budget set it)."""
        policy = self.by_name[cls]
        top = next((p for p in self.policies if p.priority < policy.priority and self._busy(p)), None)
        if top is None:
            return policy.max_in_engine, False
        if self.step_budget is not None:
            caps = self.step_budget.caps(self._running[top.name], [
                (p.name, self._running[p.name]) for p in self.policies if p.priority > top.priority])
            if caps is not None:
                return min(policy.max_in_engine, max(policy.min_in_engine, caps[cls])), True
        slo_cap = self.slo_caps.get(cls)
        return (slo_cap.value if slo_cap is not None else policy.contended_in_engine), False

    def observe(self, cls: str, latency_ms: float, now_ms: int) -> None:
        """A request of `cls` was answered `latency_ms` after it was produced: steer the caps below it."""
        policy = self.by_name[cls]
        if not policy.target_ms:
            return
        for lower in self.policies:
            slo_cap = self.slo_caps.get(lower.name)
            if lower.priority > policy.priority and slo_cap is not None:
                slo_cap.observe(latency_ms, policy.target_ms, now_ms, self._running[lower.name] >= slo_cap.value)

    def overcommitted(self) -> dict[str, int]:
        """How many running requests each class should give back while a higher class has work.

        Admitted work slows every engine step, so a realtime request running beside a
        full batch still pays for it: the excess is suspended, not just kept out.
        """
        out = {}
        for p in self.policies:
            higher = [h.name for h in self.policies if h.priority < p.priority]
            higher_active = any(self._waiting[h] or self._running[h] for h in higher)
            cap, measured = self._cap(p.name)
            # a measured cap moves with every step: one request of slack, so a wobble suspends nothing
            excess = self._running[p.name] - max(cap, p.min_in_engine) - int(measured)
            if higher_active and excess > 0:
                out[p.name] = excess
        return out

    def should_pause(self, cls: str) -> bool:
        return len(self._waiting[cls]) >= self.by_name[cls].max_waiting

    def should_resume(self, cls: str) -> bool:
        return len(self._waiting[cls]) <= self.by_name[cls].max_waiting // 2

    def admit(self, now_ms: int) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """(admitted, expired) as (class, item) pairs, admitted in the order they should start."""
        self._now_ms = now_ms
        for p in self.policies:
            if self._waiting[p.name] or self._running[p.name]:
                self._busy_ms[p.name] = now_ms
        expired: list[tuple[str, Any]] = []
        for p in self.policies:
            # the heap is ordered by deadline first: every passed deadline is at its top (a scan of the
            # whole queue at each admission cost O(waiting) per request, O(backlog^2) for a backfill)
            queue = self._waiting[p.name]
            while queue and queue[0].deadline_ms <= now_ms:
                expired.append((p.name, heapq.heappop(queue).item))
        admitted: list[tuple[str, Any]] = []
        for p in self.policies:
            queue = self._waiting[p.name]
            # The floor applies even when the engine is full, so lower classes never starve.
            while queue and self._running[p.name] < (cap := self._cap(p.name))[0] and (
                self.running() < self.max_in_engine or self._running[p.name] < p.min_in_engine
            ):
                if cap[1]:  # under a step budget: one admission per engine step (an idle engine takes one)
                    step = self.step_budget.clock.steps
                    if step == self._paced_step and self.running() > 0:
                        break
                    self._paced_step = step
                admitted.append((p.name, heapq.heappop(queue).item))
                self._running[p.name] += 1
        return admitted, expired
