"""How long the partitions the worker would read now have waited for an answer to their fetches.

A broker that answers metadata but not fetches (the leader of a partition cut off from this worker
while another broker still answers; a broker whose fetch handling hangs) leaves every poll
returning empty: the Kafka client logs each fetch's timeout and retries for ever, the intake loops
keep polling, and the topic watch's metadata asks are answered. The partitions went unread behind
a green `/readyz` (by hand: 3 minutes, a request unanswered, until the fetches were let through),
and the group, still seeing a live member, gave them to no other worker.

A partition is waiting when it is assigned, not paused by backpressure and holds no fetched
records the worker has not taken yet (the Kafka client fetches none for it then). Its wait starts
when it began waiting or at its last fetch answer, whichever is later; an empty answer counts (an
idle partition is answered every fetch wait).
"""

from __future__ import annotations

from typing import Callable

from worker.logs import partition_name


def answer_marks(consumer) -> dict:
    """Each waiting partition of `consumer` -> a mark that changes with every fetch answer for it.

    aiokafka keeps no public count of fetch answers: the mark is the time stamp its fetcher sets on
    a partition's state for every answer without error (`last_poll_timestamp` reads it too). The
    in-memory double keeps its own (`worker/doubles.py`)."""
    own = getattr(consumer, "answer_marks", None)
    if own is not None:
        return own()
    subscription = consumer._subscription.subscription
    assignment = subscription.assignment if subscription is not None else None
    if assignment is None:
        return {}
    buffered = consumer._fetcher._records
    marks = {}
    for tp in assignment.tps:
        state = assignment.state_value(tp)
        if not state.paused and tp not in buffered:
            marks[tp] = state.timestamp
    return marks


class FetchWatch:
    """Samples `marks()` (each monitor tick) and says which waiting partition has waited longest."""

    def __init__(self, marks: Callable[[], dict]):
        self._marks = marks
        self._since: dict = {}  # partition -> (its mark, when it was last answered or began waiting)

    def sample(self, now: float) -> None:
        since = {}
        for tp, mark in self._marks().items():
            seen = self._since.get(tp)
            since[tp] = seen if seen is not None and seen[0] == mark else (mark, now)
        self._since = since

    def forget(self) -> None:
        """Count every wait afresh from the next sample: while no broker answers at all, that outage
        has its own bound, and fetches resuming after it get this one in full."""
        self._since = {}

    def discount(self, shift) -> None:
        """Each wait's start through `shift` (`worker/supervisor.py: unseen`): time the worker did not run."""
        self._since = {tp: (mark, shift(at)) for tp, (mark, at) in self._since.items()}

    def longest(self, now: float) -> float:
        """Seconds the partition that has waited longest has waited (0.0 when none waits)."""
        return now - min(at for _, at in self._since.values()) if self._since else 0.0

    def waiting(self, now: float, at_least_s: float) -> list[str]:
        """The partitions that have waited at least `at_least_s`, longest first, as `topic[partition]`."""
        late = sorted((at, partition_name(tp)) for tp, (_, at) in self._since.items()
                      if now - at >= at_least_s)
        return [name for _, name in late]
