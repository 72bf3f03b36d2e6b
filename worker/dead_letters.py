"""`sluice dlq show | replay`: what the workers dead-lettered, and publishing it again once the
cause is fixed (a tenant key the workers lacked, a reply topic created since).

A replay publishes a dead letter's original key, value and own headers to the request topic it
came from, so a signed record still verifies. It never writes anywhere but the workers' request
topics, and skips what it cannot send back whole: a dead letter cut to fit (read the source record
itself) and a record the Kafka client could not read (its bytes are only in the source).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from datetime import datetime, timezone

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import OffsetOutOfRangeError

from schemas import dlq
from worker.backfill_range import resolve
from worker.consumer_stop import stop_consumer


class ListingBroken(RuntimeError):
    """A dead-letter partition's offsets no longer hold what the listing read: the topic was deleted
    and created again while it was read."""


@dataclass(frozen=True)
class DeadLetter:
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple

    @property
    def fields(self) -> dict[str, str]:
        return dlq.parse(self.headers)

    @property
    def code(self) -> str:
        return self.fields.get(dlq.ERROR_CODE, "?")

    @property
    def source(self) -> tuple[str, int, int] | None:
        f = self.fields
        try:
            return f[dlq.SOURCE_TOPIC], int(f[dlq.SOURCE_PARTITION]), int(f[dlq.SOURCE_OFFSET])
        except (KeyError, ValueError):
            return None

    def why_not_replayable(self, request_topics: set[str]) -> str | None:
        if self.source is None:
            return "no source named"
        if self.source[0] not in request_topics:
            return "its source is not a request topic of the workers"
        if dlq.TRUNCATED in self.fields:
            return "cut to fit: read the source record itself"
        if not self.value and self.key is None:
            return "the Kafka client could not read it: its bytes are only in the source"
        return None

    def line(self) -> str:
        when = datetime.fromtimestamp(self.timestamp_ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        where = "{}:{}:{}".format(*self.source) if self.source else "?"
        key = (self.key or b"").decode("utf-8", "replace")[:60]
        value = repr((self.value or b"")[:80])
        message = self.fields.get(dlq.ERROR_MESSAGE, "")
        cut = " (cut to fit)" if dlq.TRUNCATED in self.fields else ""
        return f"{when}  {where}  {self.code}: {message}{cut}\n    key={key!r} value={value}"


async def read(kafka_opts: dict, topic: str, since: str | None = None, code: str | None = None,
               last: int | None = None) -> tuple[int, list[DeadLetter], int]:
    """(how many, the dead letters, how many retention removed while they were read) of `topic` from
    `since` (an ISO time or an offset; None: the beginning) with `code` only if given, oldest first;
    with `last`, only the newest `last` are kept (a large dead-letter topic is counted, not held in
    memory)."""
    # "none": a position that retention passed raises rather than jumping (the default, "latest",
    # would end the listing there without a word)
    consumer = AIOKafkaConsumer(**kafka_opts, enable_auto_commit=False, fetch_max_wait_ms=50,
                                auto_offset_reset="none")
    await consumer.start()
    out: list = []  # a heap of (timestamp, partition, offset, letter) when `last`
    count = removed = 0

    def keep(rec) -> None:
        nonlocal count
        letter = DeadLetter(rec.partition, rec.offset, rec.timestamp, rec.key, rec.value, tuple(rec.headers or ()))
        if code is not None and letter.code != code:
            return
        count += 1
        item = (letter.timestamp_ms, rec.partition, rec.offset, letter)
        if last is None:
            out.append(item)
        elif last > 0:
            (heapq.heappush if len(out) < last else heapq.heappushpop)(out, item)

    try:
        ranges = await resolve(consumer, topic, since, None)
        for p, (lo, hi) in ranges.items():
            if lo < hi:
                tp = TopicPartition(topic, p)
                consumer.assign([tp])
                removed += await read_range(consumer, tp, lo, hi, keep)
    finally:
        await stop_consumer(consumer)
    return count, [item[3] for item in sorted(out, key=lambda item: item[:3])], removed


async def read_range(consumer, tp: TopicPartition, lo: int, hi: int, keep) -> int:
    """Hands `keep` every record of `tp` in [lo, hi) still there, oldest first, and returns how many
    retention removed before they were read. Raises `ListingBroken` when the partition's offsets no
    longer reach where reading was (the topic created again)."""
    removed = 0
    consumer.seek(tp, lo)
    while (at := await consumer.position(tp)) < hi:
        try:
            batch = await consumer.getmany(tp, timeout_ms=500)
        except OffsetOutOfRangeError:
            begin = (await consumer.beginning_offsets([tp]))[tp]
            if begin <= at:
                raise ListingBroken(f"{tp.topic} partition {tp.partition}: offset {at} is out of range though the "
                                    f"first record left is {begin}: was the topic deleted and created again?") from None
            removed += min(begin, hi) - at
            consumer.seek(tp, min(begin, hi))
            continue
        for rec in batch.get(tp, []):
            if rec.offset >= hi:
                break
            keep(rec)
    return removed


async def replay(kafka_opts: dict, letters: list[DeadLetter], request_topics: set[str],
                 dry_run: bool = False) -> tuple[list[DeadLetter], list[tuple[DeadLetter, str]]]:
    """(sent, [(skipped, why)]); each sent one acknowledged by the broker unless `dry_run`."""
    sendable = [d for d in letters if d.why_not_replayable(request_topics) is None]
    skipped = [(d, why) for d in letters if (why := d.why_not_replayable(request_topics)) is not None]
    if sendable and not dry_run:
        producer = AIOKafkaProducer(**kafka_opts, acks="all", linger_ms=5, max_request_size=16 << 20)
        await producer.start()
        try:
            futures = [await producer.send(d.source[0], d.value, key=d.key, headers=dlq.own_headers(d.headers))
                       for d in sendable]
            for future in futures:
                await future
        finally:
            await producer.stop()
    return sendable, skipped
