"""Records the Kafka client itself cannot parse, and reading past them.

A header key that is not UTF-8, a corrupt batch or a batch compressed with a codec the client
cannot decode fails the whole fetch, and with it every partition of that fetch, at every retry.
Reading such a partition one record at a time finds the record, which the caller answers by its
coordinates, and moves on. Shared by the worker's intake and the backfill reader.
"""

from __future__ import annotations

from aiokafka.errors import CorruptRecordException, UnsupportedCodecError

UNPARSEABLE = (UnicodeDecodeError, CorruptRecordException, UnsupportedCodecError)


class RecordRef:
    """A record known by its coordinates only: one the client could not parse (`error` set), or a
    job's record when a rejection has no record object at hand."""

    def __init__(self, topic: str, partition: int, offset: int, error: BaseException | None = None,
                 key: bytes | None = None):
        self.topic, self.partition, self.offset = topic, partition, offset
        self.key, self.value = key, None
        self.headers = ()
        self.timestamp = 0
        self.error = error


async def read_one_at_a_time(consumer, tp, limit: int, wait_ms: int, got: dict) -> None:
    """Up to `limit` records of `tp` from its current position, one per fetch, appended to `got`;
    a record that cannot be parsed becomes a `RecordRef` carrying the error and is stepped over.
    Stops early when a fetch returns nothing."""
    for _ in range(limit):
        try:
            recs = await consumer.getmany(tp, timeout_ms=wait_ms, max_records=1)
        except UNPARSEABLE as exc:
            offset = await consumer.position(tp)
            got.setdefault(tp, []).append(RecordRef(tp.topic, tp.partition, offset, exc))
            consumer.seek(tp, offset + 1)
            continue
        if not recs:
            return
        for part, records in recs.items():
            got.setdefault(part, []).extend(records)
