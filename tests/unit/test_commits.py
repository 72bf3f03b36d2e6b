"""Commits: on the timer, and as soon as every record read is finished, but not once per request."""

import asyncio

from tests.unit.harness import J, Memory, running, until
from worker.commits import IDLE_COMMIT_GAP_S, Commits
from worker.offsets import OffsetTracker


async def test_a_burst_is_committed_when_its_last_record_finishes():
    mem = Memory(group_commit_interval_ms=60_000)  # the timer would not commit within this test
    for i in range(6):
        mem.send("standard", J({"id": f"b{i}", "prompt": "hello", "max_tokens": 3}), key=f"b{i}".encode())
    mem.send("realtime", b"{not json")  # a dead letter finishes its offset too
    async with running(mem):
        assert await until(lambda: len(mem.finals()) == 6 and mem.dead_letters())
        assert await until(mem.all_committed, timeout=5), mem.broker.committed


class _Consumer:
    def __init__(self, tp):
        self.tp, self.calls = tp, []

    def assignment(self):
        return {self.tp}

    def highwater(self, tp):
        return None

    async def commit(self, offsets):
        self.calls.append((asyncio.get_running_loop().time(), dict(offsets)))


async def test_idle_commits_are_spaced_and_the_last_finish_is_committed():
    tp = ("t", 0)
    tracker, consumer = OffsetTracker(), _Consumer(tp)
    commits = Commits(consumer, tracker, interval_s=60)
    task = asyncio.create_task(commits.run())
    try:
        for offset in range(40):  # a trickle: each request finished before the next is read
            tracker.take(tp, offset)
            tracker.finish(tp, offset)
            await asyncio.sleep(0.005)
        assert await until(lambda: consumer.calls and consumer.calls[-1][1] == {tp: 40}, timeout=2), consumer.calls
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    times = [t for t, _ in consumer.calls]
    assert 1 <= len(times) < 40
    assert all(b - a >= IDLE_COMMIT_GAP_S * 0.9 for a, b in zip(times, times[1:])), times
    assert [o[tp] for _, o in consumer.calls] == sorted(o[tp] for _, o in consumer.calls)


async def test_nothing_is_committed_early_while_a_record_is_unfinished():
    tp = ("t", 0)
    tracker, consumer = OffsetTracker(), _Consumer(tp)
    task = asyncio.create_task(Commits(consumer, tracker, interval_s=60).run())
    try:
        tracker.take(tp, 0)
        tracker.take(tp, 1)
        tracker.finish(tp, 1)  # 0 still running: not drained, and the watermark would not move anyway
        await asyncio.sleep(0.3)
        assert consumer.calls == []
        tracker.finish(tp, 0)
        assert await until(lambda: consumer.calls == [(consumer.calls[0][0], {tp: 2})] if consumer.calls else False,
                           timeout=2), consumer.calls
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
