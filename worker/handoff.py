"""Handoff: a dead worker's streams go on at once on a survivor, not after the group's rebalance.

A worker that dies mid-stream leaves its readers waiting until the group gives its partitions to
another worker: the guard's LeaveGroup starts that at once, but the rebalance itself takes seconds
(the embedded broker holds every rejoin for half the session timeout). With SLUICE_GROUP_HANDOFF the
dead worker's guard also adds the requests it had in its engine (its `run` lines) to the group's
handoff stream in Redis (worker/group_guard.py), and every worker of the group watches that stream.
For each request one survivor wins its claim, taken only from the dead run (`AnswerStore.adopt`:
compare and set), reads the request's record at its offset without a group, and runs it from the
stored progress as any resumed request, except that it finishes no offset of this worker's.

The rebalance still happens, and whoever the group gives the partition to reads the record again:
a worker that runs the handed-over request already makes that run the record's (`Dispatcher.land`);
any other claims the request as always, which fences the handed-over run (its work is wasted, never
doubled: from then on only the new claim writes progress or the answer), or finds the answer stored
and sends the `done` again. Everything here is best effort: an entry that cannot be read, a record
that cannot be fetched, Redis away, leave the request to the rebalance, as without the handoff.
"""

from __future__ import annotations

import asyncio
import json
import time

import structlog
from aiokafka import TopicPartition

from worker import metrics
from worker.answers import ADOPTED, ANSWERED, TAKEN

log = structlog.get_logger("sluice.handoff")
BLOCK_MS = 2000  # one wait for new entries; the client's socket timeout is longer
READ_RECORD_S = 5.0  # how long fetching the handed-over records may take before they are left to the rebalance


def handoff_key(prefix: str, group_id: str) -> str:
    """The group's handoff stream (one cluster slot per group)."""
    return f"{prefix}:handoff:{{{group_id}}}"


def runs_of(fields: dict) -> tuple[list[dict], float | None]:
    """A stream entry's runs and when the guard wrote it; ([], None) for an entry that cannot be read."""
    try:
        runs = json.loads(fields[b"runs"])
        at = float(fields[b"at"]) if b"at" in fields else None
    except (KeyError, ValueError, TypeError):
        return [], None
    if not isinstance(runs, list):
        return [], None
    return [r for r in runs if isinstance(r, dict) and {"owner", "id", "tenant", "topic", "partition", "offset"} <= r.keys()], at


class Handoff:
    """The watch of the group's handoff stream; `run()` is one supervised task that never ends by itself."""

    def __init__(self, settings, topics: dict, intake, dispatcher, answers, consumer_factory=None):
        self.settings, self.topics = settings, topics  # topic name -> Topic, the ones this worker reads
        self.intake, self.dispatcher, self.answers = intake, dispatcher, answers
        self.key = handoff_key(settings.redis.key_prefix, settings.group.id)
        self._consumer_factory = consumer_factory or self._kafka_consumer
        self._consumer = None

    def _kafka_consumer(self):
        from aiokafka import AIOKafkaConsumer

        s = self.settings
        return AIOKafkaConsumer(**s.kafka.options(), client_id=f"{s.kafka.client_id}-handoff", group_id=None,
                                enable_auto_commit=False, auto_offset_reset="none", fetch_max_wait_ms=100,
                                isolation_level=s.kafka.isolation_level,
                                max_partition_fetch_bytes=max(1 << 20, 2 * s.limits.max_record_bytes))

    async def run(self) -> None:
        from worker.redis_client import cluster_client

        client, last, backoff = None, None, 1.0
        try:
            while True:
                try:
                    if client is None:
                        client = cluster_client(self.settings.redis, BLOCK_MS / 1000 + 3)
                        await client.initialize()
                    if last is None:  # from the stream's end: deaths before this worker started are not its
                        tail = await client.xrevrange(self.key, count=1)
                        last = tail[0][0] if tail else b"0-0"
                    got = await client.xread({self.key: last}, count=16, block=BLOCK_MS)
                    for _, entries in (got.items() if isinstance(got, dict) else got or []):
                        for entry_id, fields in entries:
                            last = entry_id
                            runs, at = runs_of(fields)
                            if runs:
                                await self.take(runs, at)
                    backoff = 1.0
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - never the end of the worker: the rebalance still moves them
                    log.warning("handoff_watch_failed", error=repr(exc)[:300], retry_in_s=backoff)
                    if client is not None:
                        await _close(client.aclose())
                    client = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)  # Redis away for long: a line every 10 s, not every second
        finally:
            if client is not None:
                await _close(client.aclose())
            if self._consumer is not None:
                await _close(self._consumer.stop())

    async def take(self, runs: list[dict], at: float | None) -> None:
        """Claim each run this worker can serve from its dead owner, read their records, and run them."""
        if self.intake.stopping():
            return
        claimed = []
        for run in runs:
            topic = self.topics.get(run["topic"])
            if topic is None or str(run["owner"]).startswith(self.intake.owner_id + "#"):
                continue  # a class this worker does not serve (or, impossibly, its own run)
            owner = self.intake.new_owner()
            state_id = f"{run['tenant']}:{run['id']}"
            status, progress = await self.answers.adopt(state_id, True, str(run["owner"]), owner)
            if status == ADOPTED:
                claimed.append((run, topic, owner, progress))
            else:
                metrics.handoff.labels({ANSWERED: "answered", TAKEN: "taken"}.get(status, "failed")).inc()
        if not claimed:
            return
        try:
            records = await self._read([(run["topic"], int(run["partition"]), int(run["offset"]))
                                        for run, *_ in claimed])
        except Exception as exc:  # noqa: BLE001 - left to the rebalance
            log.warning("handoff_read_failed", error=repr(exc)[:300])
            records = {}
        for run, topic, owner, progress in claimed:
            tp = TopicPartition(run["topic"], int(run["partition"]))
            record = records.get((tp, int(run["offset"])))
            try:
                if record is None:
                    raise LookupError("its record was not read")
                job = self.intake.job_of(topic, tp, record)
                if job.state_id != f"{run['tenant']}:{run['id']}":
                    raise LookupError("its record names another request")
            except Exception as exc:  # noqa: BLE001 - a hostile or missing record is the rebalance owner's to answer
                metrics.handoff.labels("failed").inc()
                log.warning("handoff_not_run", request_id=run["id"], partition=tp.partition, offset=run["offset"],
                            error=repr(exc)[:300])
                continue
            job.owner, job.checked = owner, True
            job.progress = progress if job.request.stream else None
            self.dispatcher.add_handed_over(job)
            metrics.handoff.labels("adopted").inc()
            log.info("handoff_adopted", request_id=job.request.id, partition=tp.partition, offset=job.offset,
                     stored_chunks=len(progress.chunks) if progress is not None else 0,
                     since_death_s=round(time.time() - at, 3) if at else None)

    async def _read(self, wanted: list[tuple[str, int, int]]) -> dict:
        """{(tp, offset): record} for each (topic, partition, offset) read within READ_RECORD_S."""
        if self._consumer is None:
            self._consumer = self._consumer_factory()
            await self._consumer.start()
        consumer = self._consumer
        by_tp: dict = {}
        for topic, partition, offset in wanted:
            by_tp.setdefault(TopicPartition(topic, partition), set()).add(offset)
        consumer.assign(list(by_tp))
        for tp, offsets in by_tp.items():
            consumer.seek(tp, min(offsets))
        found: dict = {}
        end = time.monotonic() + READ_RECORD_S
        try:
            while len(found) < len(wanted) and time.monotonic() < end:
                got = await consumer.getmany(*[tp for tp, offsets in by_tp.items()
                                               if any((tp, o) not in found for o in offsets)], timeout_ms=200)
                for tp, records in got.items():
                    for record in records:
                        if record.offset in by_tp.get(tp, ()):
                            found[(tp, record.offset)] = record
                    if records and records[-1].offset >= max(by_tp[tp]):
                        consumer.pause(tp)
        finally:
            consumer.assign([])  # nothing fetched in the background until the next handoff
        return found


async def _close(awaitable) -> None:
    try:
        async with asyncio.timeout(5):
            await awaitable
    except Exception:  # noqa: BLE001 - closing a client that failed
        pass
