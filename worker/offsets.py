"""Per-partition contiguous watermark: commit only below the oldest unfinished record.

Requests finish out of order. For each partition we remember the offsets taken
and not yet finished; the committable offset (Kafka's "next offset to read") is
the smallest unfinished offset, or one past the highest finished offset when
nothing is pending. Pure Python, no I/O.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class _Partition:
    pending: set[int] = field(default_factory=set)
    heap: list[int] = field(default_factory=list)  # pending offsets, lazily pruned
    next_offset: int | None = None  # one past the highest offset taken
    committed: int | None = None
    first_offset: int | None = None  # the first offset taken: where the group stood at assignment


class OffsetTracker:
    def __init__(self):
        self._parts: dict[object, _Partition] = {}
        self._generations: dict[object, int] = {}  # bumped when a partition is forgotten (revoked)
        self.on_drained = lambda: None  # called when a finish leaves no record of any partition unfinished

    def take(self, tp, offset: int) -> None:
        """A record was read and is now owned until `finish`."""
        p = self._parts.setdefault(tp, _Partition())
        if p.next_offset is not None and offset < p.next_offset:
            raise ValueError(f"{tp}: offset {offset} taken after {p.next_offset - 1}")
        if p.first_offset is None:
            p.first_offset = offset
        p.pending.add(offset)
        heapq.heappush(p.heap, offset)
        p.next_offset = offset + 1

    def skip_to(self, tp, offset: int) -> None:
        """The partition's records below `offset` are gone (retention removed them before they were
        read): none of them will be taken, so the watermark may move up to `offset` once nothing
        taken below it is pending. Without this the group's offset stayed below them until a later
        record finished: lag that no worker could read down, and the same records counted again by
        the next owner."""
        p = self._parts.setdefault(tp, _Partition())
        if p.next_offset is None or offset > p.next_offset:
            p.next_offset = offset

    def next_offset(self, tp) -> int | None:
        """One past the highest offset taken from `tp`, or None if nothing was taken yet."""
        p = self._parts.get(tp)
        return None if p is None else p.next_offset

    def finish(self, tp, offset: int) -> None:
        p = self._parts.get(tp)
        if p is None or offset not in p.pending:
            return  # partition revoked meanwhile, or finished twice
        p.pending.discard(offset)
        if not p.pending and not any(q.pending for q in self._parts.values()):
            self.on_drained()

    def committable(self, tp) -> int | None:
        """The offset to commit for `tp` (next to read), or None if nothing new."""
        p = self._parts.get(tp)
        if p is None or p.next_offset is None:
            return None
        while p.heap and p.heap[0] not in p.pending:
            heapq.heappop(p.heap)
        watermark = p.heap[0] if p.heap else p.next_offset
        if p.committed is not None and watermark <= p.committed:
            return None
        return watermark

    def last_committed(self, tp) -> int | None:
        """The group's committed offset for `tp` as this worker knows it: its own last commit, or before that
        the first offset it took (where the group stood at assignment); None before it took anything."""
        p = self._parts.get(tp)
        return None if p is None else p.committed if p.committed is not None else p.first_offset

    def to_commit(self) -> dict:
        """Every partition with a new watermark; call `committed` once it is stored."""
        return {tp: off for tp in self._parts if (off := self.committable(tp)) is not None}

    def committed(self, offsets: dict) -> None:
        for tp, off in offsets.items():
            if tp in self._parts:
                self._parts[tp].committed = off

    def pending(self, tp=None) -> int:
        if tp is not None:
            p = self._parts.get(tp)
            return len(p.pending) if p else 0
        return sum(len(p.pending) for p in self._parts.values())

    def forget(self, tps) -> None:
        """Partitions revoked: their records now belong to another worker."""
        for tp in tps:
            self._parts.pop(tp, None)
            self._generations[tp] = self._generations.get(tp, 0) + 1

    def generation(self, tp) -> int:
        """Changes each time `tp` is revoked: records read before a revoke are not ours to take after it,
        even when the partition came back (the consumer reads it again from the committed offset)."""
        return self._generations.get(tp, 0)

    def partitions(self) -> list:
        return list(self._parts)
