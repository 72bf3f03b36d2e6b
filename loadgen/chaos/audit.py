"""The auditor: what a reader may rely on, checked on every record a chaos run produced.

Pure bookkeeping (no Kafka, no clock), fed by the runner and table-tested. The columns that
must be zero (`FAILURES`):

- `lost`: a valid request sent and acknowledged by the broker with no `done` or `error`;
- `seq_conflicts`: two token records of one request with the same seq and different text, neither
  marked `unchecked` (an attempt that ran without Redis says so; those are `signalled_conflicts`);
- `torn_streams`: a `done` whose token records are not seqs 0..seq-1 joining to its text, or
  token records for a request sent with `stream: false`;
- `differing_finals`: two final replies for one request that differ in what a reader reads, neither
  marked `unchecked`;
- `fuzz_unaccounted`: a fuzzed record with neither a final reply for the id it carries nor a
  dead letter naming its coordinates;
- `commit_violations`: a committed offset seen while an earlier record of that partition had
  no final reply or dead letter produced yet, and no later record with its id was still
  uncommitted (one that took the id over and owes its answer);
- `uncommitted`: a partition whose committed offset never reached its end;
- `malformed_replies`: a record on the reply topic that does not decode as a reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import DoneReply, ErrorReply, ReplyCodec, TokenReply

FAILURES = ("lost", "seq_conflicts", "torn_streams", "differing_finals", "fuzz_unaccounted", "commit_violations",
            "uncommitted", "malformed_replies")
Coords = tuple[str, int, int]  # topic, partition, offset


def _content(final) -> tuple:
    """What a reader reads in a final reply (`resumed` and usage aside)."""
    if isinstance(final, ErrorReply):
        return ("error", final.code)
    return ("done", final.seq, final.text, final.finish_reason,
            tuple(sorted((final.scores or {}).items())))


@dataclass
class _Request:
    streamed: bool
    tokens: dict[int, tuple[str, bool]] = field(default_factory=dict)  # seq -> (first text, unchecked)
    conflicts: int = 0
    signalled: int = 0  # conflicts where one side was marked unchecked
    finals: list = field(default_factory=list)


class Audit:
    def __init__(self):
        self.codec = ReplyCodec()
        self.requests: dict[str, _Request] = {}
        self.fuzz: dict[Coords, str | None] = {}  # coordinates -> the id a reply would carry
        self.record_ids: dict[Coords, str | None] = {}  # every sent record -> its id (None: dead letter expected)
        self.final_ms: dict[str, int] = {}  # any id -> earliest final reply's timestamp
        self.dead_ms: dict[Coords, int] = {}
        self.malformed = 0
        self.uncommitted: list[str] = []
        self.snapshots: list[tuple[int, dict]] = []
        self.by_id: dict[str, list[Coords]] = {}  # id -> every record sent with it

    # --- what was sent
    def sent(self, rid: str, streamed: bool, coords: Coords) -> None:
        self.requests.setdefault(rid, _Request(streamed))
        self.record_ids[coords] = rid
        self.by_id.setdefault(rid, []).append(coords)

    def fuzzed(self, coords: Coords, reply_id: str | None) -> None:
        self.fuzz[coords] = reply_id
        self.record_ids[coords] = reply_id
        if reply_id is not None:
            self.by_id.setdefault(reply_id, []).append(coords)

    # --- what came out
    def reply(self, value: bytes, ts_ms: int) -> object | None:
        try:
            r = self.codec.decode(value)
        except Exception:  # anything that is not a reply is a finding, never a crash of the auditor
            self.malformed += 1
            return None
        req = self.requests.get(r.id)
        if isinstance(r, TokenReply):
            if req is not None:
                text, unchecked = req.tokens.setdefault(r.seq, (r.text, r.unchecked))
                if text != r.text:
                    if unchecked or r.unchecked:
                        req.signalled += 1
                    else:
                        req.conflicts += 1
            return r
        if r.id not in self.final_ms or ts_ms < self.final_ms[r.id]:
            self.final_ms[r.id] = ts_ms
        if req is not None:
            req.finals.append(r)
        return r

    def dead_letter(self, coords: Coords, ts_ms: int) -> None:
        self.dead_ms[coords] = min(ts_ms, self.dead_ms.get(coords, ts_ms))

    def ended_ms(self, coords: Coords) -> int | None:
        """When the record at `coords` was first answered (final reply for its id, or its dead letter)."""
        times = [t for t in (self.dead_ms.get(coords), self.final_ms.get(self.record_ids.get(coords) or "")) if t]
        return min(times) if times else None

    def committed(self, at_ms: int, offsets: dict[tuple[str, int], int]) -> None:
        """A snapshot of the group's committed offsets, read at `at_ms`. Checked at the end, when every
        reply has been read: each record below an offset must have been answered before `at_ms`."""
        self.snapshots.append((at_ms, dict(offsets)))

    def _check_commits(self) -> list[str]:
        # Offsets below one already checked at an earlier snapshot were answered before that one.
        checked: dict[tuple[str, int], int] = {}
        out = []
        for at_ms, offsets in sorted(self.snapshots, key=lambda s: s[0]):
            for (topic, partition), committed in offsets.items():
                start = checked.get((topic, partition), 0)
                for o in range(start, committed):
                    coords = (topic, partition, o)
                    if coords not in self.record_ids:
                        continue  # not sent by this run (a producer retry's duplicate, say)
                    ended = self.ended_ms(coords)
                    if (ended is None or ended > at_ms) and not self._owed_elsewhere(coords, offsets):
                        out.append(f"{topic}[{partition}] committed {committed} at {at_ms} before offset {o} "
                                   f"was answered ({ended})")
                checked[(topic, partition)] = max(start, committed)
        return out

    def ends(self, committed: dict[tuple[str, int], int], end: dict[tuple[str, int], int]) -> None:
        self.uncommitted = [f"{t}[{p}] committed {committed.get((t, p))} of {e}" for (t, p), e in sorted(end.items())
                            if e and committed.get((t, p), 0) < e]

    # --- the verdict
    def pending(self) -> int:
        """Requests still without a final reply and fuzzed records not yet accounted for."""
        return (sum(not r.finals for r in self.requests.values())
                + sum(self._unaccounted(c, rid) for c, rid in self.fuzz.items()))

    def _unaccounted(self, coords: Coords, rid: str | None) -> bool:
        return coords not in self.dead_ms and not (rid is not None and rid in self.final_ms)

    def _owed_elsewhere(self, coords: Coords, offsets: dict) -> bool:
        """A later record with the same id took the id over (fencing): it answers for both, and while
        it is not committed its answer is still owed, so committing the earlier one loses nothing."""
        rid = self.record_ids.get(coords)
        return rid is not None and any(
            c != coords and o >= offsets.get((t, p), 0) for c in self.by_id.get(rid, ()) for t, p, o in [c])

    @property
    def violations(self) -> list[str]:
        return self._check_commits()

    def counts(self) -> dict[str, int]:
        torn = differing = signalled_finals = 0
        for r in self.requests.values():
            if not r.finals:
                continue
            if len({_content(f) for f in r.finals}) > 1:
                if any(getattr(f, "unchecked", False) for f in r.finals):
                    signalled_finals += 1
                else:
                    differing += 1
            done = next((f for f in r.finals if isinstance(f, DoneReply)), None)
            if not r.streamed:
                torn += bool(r.tokens)
            elif r.signalled:
                continue  # two attempts' streams, one marked unchecked: no single stream to join
            elif done is not None and r.tokens and (
                    sorted(r.tokens) != list(range(done.seq))
                    or "".join(r.tokens[s][0] for s in range(done.seq)) != done.text):
                torn += 1
            elif done is not None and not r.tokens and done.seq:
                torn += 1
        finals = [r.finals[0] for r in self.requests.values() if r.finals]
        return {
            "requests": len(self.requests),
            "done": sum(isinstance(f, DoneReply) for f in finals),
            "error": sum(isinstance(f, ErrorReply) for f in finals),
            "resumed": sum(isinstance(f, DoneReply) and bool(f.resumed) for f in finals),
            "lost": sum(not r.finals for r in self.requests.values()),
            "seq_conflicts": sum(r.conflicts for r in self.requests.values()),
            "signalled_conflicts": sum(r.signalled for r in self.requests.values()) + signalled_finals,
            "torn_streams": torn,
            "differing_finals": differing,
            "fuzzed": len(self.fuzz),
            "fuzz_dead_letters": sum(c in self.dead_ms for c in self.fuzz),
            "fuzz_unaccounted": sum(self._unaccounted(c, rid) for c, rid in self.fuzz.items()),
            "commit_violations": len(self._check_commits()),
            "uncommitted": len(self.uncommitted),
            "malformed_replies": self.malformed,
        }

    def lost_ids(self) -> list[str]:
        return sorted(rid for rid, r in self.requests.items() if not r.finals)

    def errors_by_code(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.requests.values():
            if r.finals and isinstance(r.finals[0], ErrorReply):
                out[str(r.finals[0].code)] = out.get(str(r.finals[0].code), 0) + 1
        return out


def failed(counts: dict[str, int]) -> list[str]:
    return [name for name in FAILURES if counts.get(name)]
