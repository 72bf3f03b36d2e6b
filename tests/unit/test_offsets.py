"""The offset watermark never passes an unfinished record, whatever the completion order."""

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.offsets import OffsetTracker


@st.composite
def schedules(draw):
    """Records of a few partitions taken in order, finished in a random order, commits in between."""
    n = draw(st.integers(1, 60))
    parts = draw(st.lists(st.sampled_from(["p0", "p1", "p2"]), min_size=n, max_size=n))
    starts = {p: draw(st.integers(0, 1000)) for p in ("p0", "p1", "p2")}
    records = []
    for p in parts:
        records.append((p, starts[p]))
        starts[p] += draw(st.integers(1, 3))  # compacted topics leave gaps
    order = draw(st.permutations(range(n)))
    commit_points = draw(st.sets(st.integers(0, n), max_size=n))
    return records, order, commit_points


@settings(max_examples=400, deadline=None)
@given(schedules())
def test_commit_never_passes_unfinished(schedule):
    records, order, commit_points = schedule
    tracker = OffsetTracker()
    for p, off in records:
        tracker.take(p, off)
    finished: set[int] = set()
    last: dict[str, int] = {}
    for step, i in enumerate(order):
        if step in commit_points:
            offsets = tracker.to_commit()
            for p, committed in offsets.items():
                unfinished = [off for j, (q, off) in enumerate(records) if q == p and j not in finished]
                assert all(committed <= off for off in unfinished), (p, committed, unfinished)
                assert committed > last.get(p, -1), "commits only move forward"
                last[p] = committed
            tracker.committed(offsets)
        finished.add(i)
        tracker.finish(*records[i])
    # Everything finished: each partition commits one past its highest offset.
    final = tracker.to_commit()
    for p in {p for p, _ in records}:
        top = max(off for q, off in records if q == p)
        assert final.get(p, last.get(p)) == top + 1


def test_revoked_partition_is_forgotten():
    t = OffsetTracker()
    t.take("a", 5)
    t.forget(["a"])
    t.finish("a", 5)  # a late finish of a revoked record is ignored
    assert t.to_commit() == {}


def test_offsets_must_increase():
    t = OffsetTracker()
    t.take("a", 5)
    try:
        t.take("a", 4)
    except ValueError:
        return
    raise AssertionError("taking an older offset must fail")


def test_records_retention_removed_move_the_watermark_only_past_what_is_still_pending():
    tracker = OffsetTracker()
    tracker.skip_to("p0", 6)  # nothing taken: offsets 0-5 are gone unread
    assert tracker.to_commit() == {"p0": 6}
    tracker.take("p1", 3)
    tracker.skip_to("p1", 10)  # 4-9 gone while 3 is still running
    assert tracker.to_commit() == {"p0": 6, "p1": 3}
    tracker.finish("p1", 3)
    assert tracker.to_commit()["p1"] == 10
    tracker.take("p1", 10)
    tracker.skip_to("p1", 5)  # an older position never moves it back
    assert tracker.next_offset("p1") == 11
