"""Turning `--from` / `--to` (an offset or an ISO time) into per-partition offsets.

Works on any Kafka-protocol broker: a time is found by bisecting offsets on
record timestamps (assumed non-decreasing within a partition, as CreateTime from
one producer is), because some brokers answer time lookups wrongly; and a
partition's end is found by reading its last batch, because some report the end
as one past the first offset of that batch.
"""

from __future__ import annotations

from datetime import datetime, timezone

from aiokafka import AIOKafkaConsumer, TopicPartition


class RangeError(ValueError):
    """A bound that cannot be understood; the message says what is accepted."""


class SourceChanged(RuntimeError):
    """The source partition ends below where the job had read to: the topic was deleted and created
    again, so offsets no longer name the job's events."""


def past_the_source(partition: int, at: int, begin: int, end: int, range_end: int) -> int:
    """Where the job goes on when the broker says `at` is out of a source partition's range
    [`begin`, `end`): the log start when retention removed events the job had not read yet (how many
    is `begin - at`, up to the range's end), never the partition's end, as a consumer's "latest"
    reset would (every event left in the range unread, the job complete). A partition ending below
    `at` raises `SourceChanged`."""
    if at < begin:
        return begin
    raise SourceChanged(f"partition {partition} of the source now holds offsets {begin}-{end}, below offset {at} "
                        f"that this job had read to (its range ends at {range_end}): was the topic deleted and created "
                        "again? Its offsets no longer name the job's events; not going on. Start a job with another "
                        "--name for the new topic")


def parse_bound(text: str | None) -> int | datetime | None:
    """None (open), an offset, or an aware datetime."""
    if text is None or text in ("", "start", "end"):
        return None
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise RangeError(f"bound {text!r} is neither an offset nor an ISO-8601 time "
                         f"(e.g. 1200 or 2026-11-01T00:00:00Z)") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


async def _record_at_or_after(consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int):
    consumer.seek(tp, offset)
    for _ in range(20):
        batch = await consumer.getmany(tp, timeout_ms=500, max_records=1)
        recs = batch.get(tp)
        if recs:
            return recs[0]
    return None


async def true_end(consumer: AIOKafkaConsumer, tp: TopicPartition, reported: int, begin: int) -> int:
    """One past the last offset, by reading from the reported end's batch onward."""
    if reported <= begin:
        return begin
    consumer.seek(tp, max(begin, reported - 1))
    last = reported - 1
    while True:
        batch = await consumer.getmany(tp, timeout_ms=300)
        recs = batch.get(tp)
        if not recs:
            return last + 1
        last = max(last, recs[-1].offset)


async def offset_for_time(consumer: AIOKafkaConsumer, tp: TopicPartition, when: datetime, lo: int, hi: int) -> int:
    """The first offset in [lo, hi) whose record timestamp is >= `when`; hi if none."""
    target = int(when.timestamp() * 1000)
    while lo < hi:
        mid = (lo + hi) // 2
        rec = await _record_at_or_after(consumer, tp, mid)
        if rec is None or rec.offset >= hi:
            hi = mid
        elif rec.timestamp >= target:
            hi = mid
        else:
            lo = rec.offset + 1
    return lo


async def resolve(consumer: AIOKafkaConsumer, topic: str, start: str | None, stop: str | None) -> dict[int, list[int]]:
    """{partition: [first offset, end offset (exclusive)]} for every partition of `topic`."""
    first, last = parse_bound(start), parse_bound(stop)
    parts = consumer.partitions_for_topic(topic)
    if not parts:
        await consumer._client.force_metadata_update()
        parts = consumer.partitions_for_topic(topic)
    if not parts:
        raise RangeError(f"source topic {topic!r} does not exist")
    tps = [TopicPartition(topic, p) for p in sorted(parts)]
    consumer.assign(tps)
    begins = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    out: dict[int, list[int]] = {}
    for tp in tps:
        begin = begins[tp]
        end = await true_end(consumer, tp, ends[tp], begin)

        async def place(bound, default: int) -> int:
            if bound is None:
                return default
            if isinstance(bound, int):
                return min(max(bound, begin), end)
            return await offset_for_time(consumer, tp, bound, begin, end)

        lo = await place(first, begin)
        hi = await place(last, end)
        out[tp.partition] = [lo, max(lo, hi)]
    return out
