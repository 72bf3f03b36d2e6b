"""Where a request partition's reading starts when the group has no offset for it, or the broker no
longer holds the one it has.

The worker's consumer runs with `auto_offset_reset="none"`, so the Kafka client reports both cases
instead of moving the position itself (with an info-level log line at most). A partition the group never committed is read from its
beginning, as `earliest` would. An offset below the partition's first record means retention (or
an administrator's DeleteRecords) removed records before any worker read them: they are gone, and
the worker says how many (`sluice_records_expired_total`, an error log line) before it reads on from
the first record left. `earliest` would have skipped them uncounted.
"""

from __future__ import annotations

import structlog
from aiokafka.errors import NoOffsetForPartitionError, OffsetOutOfRangeError

from worker import metrics

log = structlog.get_logger("sluice.intake")

# what the consumer's fetch raises for a partition whose position must be chosen here
UNPOSITIONED = (OffsetOutOfRangeError, NoOffsetForPartitionError)


def positions_of(exc: BaseException) -> dict:
    """{partition: offset it stood at, None when the group has none} from aiokafka's error."""
    if isinstance(exc, OffsetOutOfRangeError):
        found = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
        return dict(found)
    return {tp: None for tp in exc.args if hasattr(tp, "partition")}


async def reposition(consumer, exc: BaseException, cls: str, tracker=None) -> dict:
    """Seek each partition named by `exc` that is still assigned; returns {partition: records expired}.
    Past expired records, `tracker` (worker/offsets.py) may commit the first record left."""
    assigned = consumer.assignment()
    at = {tp: off for tp, off in positions_of(exc).items() if tp in assigned}
    fresh = [tp for tp, off in at.items() if off is None]
    if fresh:  # no committed offset: a new group, or one whose offsets expired
        await consumer.seek_to_beginning(*fresh)
    stale = {tp: off for tp, off in at.items() if off is not None}
    if not stale:
        return {}
    begins = await consumer.beginning_offsets(list(stale))
    ends = await consumer.end_offsets(list(stale))
    expired = {}
    for tp, off in stale.items():
        first, end = begins[tp], ends[tp]
        if off < first:
            expired[tp] = first - off
            metrics.records_expired.labels(cls).inc(first - off)
            log.error("records_expired_unread", cls=cls, topic=tp.topic, partition=tp.partition, expired=first - off,
                      from_offset=off, to_offset=first,
                      note="the topic's retention (or DeleteRecords) removed them before any worker read them")
            consumer.seek(tp, first)
            if tracker is not None:
                tracker.skip_to(tp, first)
        elif off > end:
            # the topic deleted and created again, or its log cut short: its records start over
            log.warning("offset_beyond_log_end", cls=cls, topic=tp.topic, partition=tp.partition, offset=off,
                        log_start=first, log_end=end)
            consumer.seek(tp, first)
        else:  # in range by now (records appended since): read it again
            log.warning("offset_out_of_range_read_again", cls=cls, topic=tp.topic, partition=tp.partition, offset=off,
                        log_start=first, log_end=end)
            consumer.seek(tp, off)
    return expired
