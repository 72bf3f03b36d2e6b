"""A partition whose group offset the broker no longer holds: what retention removed unread is counted
and named, reading goes on from the first record left, and nothing already read is dropped."""

import asyncio

import pytest
from aiokafka.errors import NoOffsetForPartitionError, OffsetOutOfRangeError, TopicAuthorizationFailedError
from aiokafka.structs import TopicPartition

from tests.unit.harness import CATALOG, J, Memory, running, until
from worker import metrics
from worker.doubles import MemoryBroker, MemoryConsumer
from worker.read_position import reposition

STANDARD = CATALOG.request_topic("standard").name


def expired(cls: str) -> float:
    return metrics.REGISTRY.get_sample_value("sluice_records_expired_total", {"class": cls}) or 0.0


def send(mem: Memory, n: int, first: int = 0, partition: int = 0) -> None:
    for i in range(first, first + n):
        mem.broker.append(STANDARD, J({"id": f"r{i}", "prompt": "hello", "max_tokens": 2}), f"r{i}".encode(),
                          partition=partition)


async def test_records_retention_removed_unread_are_counted_and_the_rest_answered():
    mem = Memory(partitions=1)
    send(mem, 10)
    tp = TopicPartition(STANDARD, 0)
    mem.broker.committed[tp] = 2  # the group read r0 and r1, then stopped
    mem.broker.delete_records(tp, 6)  # retention took r0-r5 meanwhile: r2-r5 were never read
    before = expired("standard")
    async with running(mem):
        assert await until(lambda: len(mem.finals()) == 4 and mem.all_committed()), (mem.finals(), mem.broker.committed)
    assert sorted(mem.finals()) == ["r6", "r7", "r8", "r9"]
    assert expired("standard") - before == 4


async def test_the_group_commits_past_records_retention_removed_even_with_nothing_left_to_read():
    """Every record the group had not read is gone. Its offset moves to the log start at once: left
    below it, the group's lag stayed at 4 with nothing to read (a lag-based autoscaler keeps a worker
    for it), and the next owner of the partition counted the same 4 again."""
    mem = Memory(partitions=1)
    send(mem, 6)
    tp = TopicPartition(STANDARD, 0)
    mem.broker.committed[tp] = 2
    mem.broker.delete_records(tp, 6)
    before = expired("standard")
    async with running(mem):
        assert await until(lambda: mem.broker.committed.get(tp) == 6), mem.broker.committed
    assert expired("standard") - before == 4
    mem.consumer = MemoryConsumer(mem.broker)  # a restart, or the next owner
    async with running(mem):
        assert await until(lambda: mem.consumer.assignment())
        await asyncio.sleep(0.3)
    assert expired("standard") - before == 4 and mem.finals() == {}


async def test_a_group_without_offsets_reads_from_the_first_record_left():
    mem = Memory(partitions=1)
    send(mem, 5)
    mem.broker.delete_records(TopicPartition(STANDARD, 0), 3)
    before = expired("standard")
    async with running(mem):
        assert await until(lambda: len(mem.finals()) == 2 and mem.all_committed())
    assert sorted(mem.finals()) == ["r3", "r4"]
    assert expired("standard") == before  # nothing the group owned was lost: it had no offset


async def test_records_read_before_another_partition_fails_are_kept():
    # partition 0 is read first; partition 1's offset is below its log start. The Kafka client returns
    # partition 0's records and raises partition 1's error on the next read (the micro-batch window's)
    mem = Memory(partitions=2)
    send(mem, 3, partition=0)
    send(mem, 4, first=10, partition=1)
    p0, p1 = TopicPartition(STANDARD, 0), TopicPartition(STANDARD, 1)
    mem.broker.committed[p0] = 0
    mem.broker.committed[p1] = 1
    mem.broker.delete_records(p1, 2)
    async with running(mem):
        assert await until(lambda: len(mem.finals()) == 5 and mem.all_committed()), (mem.finals(), mem.broker.committed)
    assert sorted(mem.finals()) == ["r0", "r1", "r12", "r13", "r2"]


async def test_records_read_before_the_window_read_fails_are_kept():
    # the micro-batch window's second read raises a broker error: what the first read returned is
    # already behind the positions, and was dropped before
    mem = Memory(partitions=1)
    send(mem, 3)
    real_getmany, failed = mem.consumer.getmany, []

    async def getmany(*tps, timeout_ms=0, max_records=None):
        if timeout_ms == 0 and not failed:
            failed.append(True)
            raise TopicAuthorizationFailedError(STANDARD)
        return await real_getmany(*tps, timeout_ms=timeout_ms, max_records=max_records)

    mem.consumer.getmany = getmany
    async with running(mem):
        assert await until(lambda: len(mem.finals()) == 3 and mem.all_committed()), (mem.finals(), mem.broker.committed)
    assert failed


async def test_records_read_one_at_a_time_are_kept_when_a_later_partition_is_out_of_range():
    # a record the client cannot parse sends the loop to read each partition one record at a time;
    # partition 1's offset is below its log start, and partition 0's records were read before it
    mem = Memory(partitions=2)
    send(mem, 3, partition=0)
    send(mem, 4, first=10, partition=1)
    p0, p1 = TopicPartition(STANDARD, 0), TopicPartition(STANDARD, 1)
    mem.broker.committed.update({p0: 0, p1: 1})
    mem.broker.delete_records(p1, 2)
    mem.consumer.unreadable.add((p0, 1))
    before = expired("standard")
    async with running(mem):
        assert await until(lambda: len(mem.finals()) == 4 and mem.dead_letters() and mem.all_committed()), (
            mem.finals(), mem.broker.committed)
    assert sorted(mem.finals()) == ["r0", "r12", "r13", "r2"]
    assert mem.dead_letter_sources() == {(STANDARD, 0, 1)}
    assert expired("standard") - before == 1


def _consumer(records: int, log_start: int, committed: dict[int, int | None]):
    broker = MemoryBroker(partitions=len(committed))
    for p in committed:
        for i in range(records):
            broker.append("t", b"v", partition=p)
        broker.delete_records(TopicPartition("t", p), log_start)
    consumer = MemoryConsumer(broker)
    consumer._assigned = {TopicPartition("t", p) for p in committed}
    consumer._position = {TopicPartition("t", p): off for p, off in committed.items()}
    return consumer


@pytest.mark.parametrize("error, position, then, lost", [
    (NoOffsetForPartitionError(TopicPartition("t", 0)), None, 4, 0),  # a new group: its beginning
    (OffsetOutOfRangeError({TopicPartition("t", 0): 1}), 1, 4, 3),  # below the log start: 3 lost
    (OffsetOutOfRangeError({TopicPartition("t", 0): 12}), 12, 4, 0),  # past the end: the log started over
    (OffsetOutOfRangeError({TopicPartition("t", 0): 6}), 6, 6, 0),  # in range by now: read from there
])
async def test_reposition(error, position, then, lost):
    consumer = _consumer(records=10, log_start=4, committed={0: position})
    before = expired("batch")
    found = await reposition(consumer, error, "batch")
    assert await consumer.position(TopicPartition("t", 0)) == then
    assert sum(found.values()) == lost == expired("batch") - before


async def test_reposition_leaves_a_partition_no_longer_assigned():
    consumer = _consumer(records=10, log_start=4, committed={0: 1})
    consumer._assigned = set()
    assert await reposition(consumer, OffsetOutOfRangeError({TopicPartition("t", 0): 1}), "batch") == {}
    assert consumer._position[TopicPartition("t", 0)] == 1
