"""When a backfill stops waiting: requests out and not one answered for `--stall-s`.

Without it a job whose workers are gone, or whose tenant's limits refuse every request
(`overloaded`, published again after each hint), would wait for ever with only its progress
lines to show it. Pure Python, no I/O: the clock is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL_S = 900.0


class Stalled(RuntimeError):
    """The job's requests went unanswered for `stall_s`: no worker reads their topic, or the tenant's
    limits refuse every one of them. What was done is checkpointed."""


@dataclass
class ReplyClock:
    """How long the job has had requests out without a single final reply. Only a `done` or `error`
    counts: an `overloaded` answer published again is no progress."""

    since: float | None = None  # monotonic: the last reply, or when requests went out after none were

    def waited(self, in_flight: int, now: float) -> float:
        if not in_flight:
            self.since = None
            return 0.0
        if self.since is None:
            self.since = now
        return now - self.since

    def replied(self, now: float) -> None:
        self.since = now
