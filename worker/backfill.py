"""`sluice backfill`: score a bounded range of a topic through the workers, one result per event.

Each source record becomes a non-streaming score request on the batch topic (so
realtime traffic keeps its priority in the workers); each reply becomes one
result record in the output topic, keyed by the event id and tagged with the job
and the source partition/offset in its headers.

Exactly one result per event across crashes: a checkpoint file holds, per
source partition, the offset below which every record has an acknowledged
result, and, per output partition, the offset from which results of records
above that watermark may lie. A restarted job reads the output from there,
skips every source record that already has a result, and carries on. A job
started without its checkpoint (lost with a machine or a pod's disk) reads the
whole output for results of its own, as the results carry the job's name. Requests
re-sent after a restart reuse their ids, so a worker that already answered one
replies from its answer store instead of scoring it again.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import OffsetOutOfRangeError, TopicAlreadyExistsError

from loadgen.burst import ReplyReader
from schemas import DoneReply, ErrorCode, ErrorReply, dlq
from schemas.codec import json_depth_exceeds, not_unicode_at, salvaged_field, without_bom
from schemas.events import BackfillResult
from worker.backfill_range import past_the_source, resolve, true_end
from worker.backfill_stall import STALL_S, ReplyClock, Stalled
from worker.consumer_stop import stop_consumer
from worker.job_lease import LEASE_S, JobLease, LeaseUnavailable, lease_key
from worker.unparseable import UNPARSEABLE, RecordRef, read_one_at_a_time
from worker.offsets import OffsetTracker

JOB_HEADER = "x-sluice-backfill"
SOURCE_HEADER = "x-sluice-source"  # "partition:offset" of the event in the source topic
BINS = 10
SCAN_STALL_S = 60.0  # reading the output for earlier results: this long without a record fails the job


@dataclass(frozen=True)
class Job:
    source: str
    out: str
    template: str
    start: str | None = None
    stop: str | None = None
    labels: tuple[str, ...] | None = None
    max_tokens: int = 0  # > 0 asks for a generated rationale per event
    name: str | None = None

    @property
    def id(self) -> str:
        """Stable across restarts of the same command: names the checkpoint and the request ids."""
        if self.name:
            return self.name
        spec = json.dumps([self.source, self.out, self.template, self.start, self.stop, self.labels, self.max_tokens])
        return "bf" + hashlib.sha256(spec.encode()).hexdigest()[:10]


def render_summary(cp: "Checkpoint", seconds: float) -> str:
    lines = [f"events {cp.events}, errors {cp.errors}, {seconds:.1f} s "
             f"({cp.events / seconds if seconds else 0:.1f} events/s)"]
    if cp.expired:
        lines.append(f"{cp.expired} events of the range were removed by the source's retention before they were "
                     "read: no result for them")
    if cp.label:
        lines.append(f"P({cp.label}) histogram:")
        top = max(cp.hist) or 1
        for i, n in enumerate(cp.hist):
            lines.append(f"  {i / BINS:.1f}-{(i + 1) / BINS:.1f} {n:7d} {'#' * round(40 * n / top)}")
    return "\n".join(lines)


class Checkpoint(msgspec.Struct):
    job: str
    ranges: dict[int, list[int]]  # source partition -> [first, end)
    done: dict[int, int]  # source partition -> every offset below has a result
    scan_from: dict[int, int]  # output partition -> results above `done` lie at or after this
    events: int = 0
    errors: int = 0
    hist: list[int] = msgspec.field(default_factory=lambda: [0] * BINS)
    label: str | None = None
    seconds: float = 0.0
    complete: bool = False
    expired: int = 0  # events of the range the source's retention removed before the job read them

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self))
        os.replace(tmp, path)  # atomic: a kill leaves the old or the new file, never half

    @classmethod
    def load(cls, path: Path) -> "Checkpoint | None":
        try:
            return msgspec.json.decode(path.read_bytes(), type=cls)
        except FileNotFoundError:
            return None


class JobRunning(RuntimeError):
    pass


class RequestRefused(RuntimeError):
    """The broker refused a request the job published (the topic's own record limit, permissions):
    its event would wait for a reply for ever."""


class OutputUnreadable(RuntimeError):
    """The job's output cannot be read to its end for earlier results: going on could write results twice."""


class DeadLettered(RuntimeError):
    """The workers dead-lettered one of the job's requests: no reply will come for it (a tenant's
    signature refused, say), and every other request of the job would go the same way."""


def hold_job_lock(path: Path, job: str) -> int:
    """An exclusive lock for one run of a job over one checkpoint; the kernel drops it when the process
    ends, however it ends. Two runs over one checkpoint would each write every result."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JobRunning(f"job {job} is already running over {path.with_suffix('.json')} (it holds {path}); "
                         "wait for it, or stop it and run this command again to continue") from None
    return fd


def out_topic(name: str, partitions: int, source: dict) -> NewTopic:
    """The output topic, created as durable as the source (`source`: the source as the admin client
    describes it). One replica would lose results with a broker and, where the cluster asks for two
    in-sync replicas, refuse every acknowledged write."""
    # the fewest: a partition being moved lists its old and new replicas together for a while
    replicas = min((len(p["replicas"]) for p in source["partitions"]), default=1)
    return NewTopic(name, partitions, max(replicas, 1))


def result_from_reply(reply, event_id: str, source: str, p: int, o: int, template: str) -> BackfillResult:
    if isinstance(reply, ErrorReply):
        return BackfillResult(event_id=event_id, topic=source, partition=p, offset=o, template=template,
                              error_code=reply.code.value, error=reply.message)
    scores = reply.scores or {}
    return BackfillResult(event_id=event_id, topic=source, partition=p, offset=o, template=template, scores=scores,
                          label=max(scores, key=scores.get) if scores else None, text=reply.text)


class Backfill:
    def __init__(self, settings, catalog, job: Job, state_dir: str | Path = ".sluice/backfill",
                 max_in_flight: int = 512, latency_class: str = "batch", progress=None, log=print, signer=None,
                 lease: bool = True, lease_s: float = LEASE_S, stall_s: float = STALL_S):
        self.s, self.catalog, self.job = settings, catalog, job
        self.stall_s = stall_s  # 0: wait for replies however long they take
        # across machines, one run at a time (worker/job_lease.py); False only where no other machine runs it
        self.use_lease, self.lease_s = lease, lease_s
        self.lease: JobLease | None = None
        self.path = Path(state_dir) / f"{job.id}.json"
        self.max_in_flight = max_in_flight
        self.signer = signer  # schemas.signing.Signer: the tenant's topic and signed records
        self.request_topic = catalog.request_topic(latency_class, signer.tenant if signer else None).name
        self.progress = progress  # callable(total, initial) -> object with update(n) and close(), or None
        self.log = log
        self.stop = asyncio.Event()
        self._enc = msgspec.json.Encoder()
        # results whose source offset is above the checkpointed watermark: (p, o) -> (out partition, offset, result)
        self._landed: dict[tuple[int, int], tuple[int, int, BackfillResult]] = {}
        # each unanswered request as published (value, headers): one answered `overloaded` is published again
        self._published: dict[str, tuple[bytes, list]] = {}
        self.republished = 0

    # -- setup -----------------------------------------------------------------

    async def _ensure_out_topic(self, partitions: int) -> None:
        admin = AIOKafkaAdminClient(**self.s.kafka.options())
        await admin.start()
        try:
            if self.job.out not in await admin.list_topics():
                (source,) = await admin.describe_topics([self.job.source])
                await admin.create_topics([out_topic(self.job.out, partitions, source)])
        except TopicAlreadyExistsError:
            pass
        finally:
            await admin.close()

    async def _out_span(self, consumer) -> tuple[dict[int, int], dict[int, int]]:
        """Per output partition, its first offset and one past its last."""
        # asked by name: a refresh covers only the topics the consumer was assigned (the source, here),
        # and an output found with no partitions would be scanned for nothing
        parts = await consumer._client._wait_on_metadata(self.job.out)
        tps = [TopicPartition(self.job.out, p) for p in sorted(parts)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        begins = await consumer.beginning_offsets(tps)
        return ({tp.partition: begins[tp] for tp in tps},
                {tp.partition: await true_end(consumer, tp, ends[tp], begins[tp]) for tp in tps})

    def _scan_from(self, after: dict[int, int]) -> dict[int, int]:
        """Per output partition, where a restart must read from: the lowest result not yet settled
        below the watermark, else `after`."""
        lows: dict[int, int] = {}
        for q, off, _ in self._landed.values():
            lows[q] = min(lows.get(q, off), off)
        return {q: lows.get(q, at) for q, at in after.items()}

    async def _scan_out(self, consumer, scan_from: dict[int, int], ends: dict[int, int]) -> None:
        """Results this job wrote after its last checkpoint (found again, never written twice). Read up
        to each partition's end: stopping short would write the results beyond it again."""
        tps = {p: TopicPartition(self.job.out, p) for p, at in scan_from.items() if at < ends.get(p, 0)}
        if not tps:
            return
        consumer.assign(list(tps.values()))
        await self._seek_in_output(consumer, {tp: scan_from[p] for p, tp in tps.items()})
        dec = msgspec.json.Decoder(BackfillResult)
        job = self.job.id.encode()
        reading, quiet_since = dict(tps), time.monotonic()
        while reading:
            try:
                batch = await consumer.getmany(*reading.values(), timeout_ms=500)
            except OffsetOutOfRangeError as exc:  # the output's retention moved on during the scan
                out_of_range = exc.args[0] if exc.args else {}
                if not await self._seek_in_output(consumer, out_of_range):
                    raise OutputUnreadable(f"{self.job.out} offsets {out_of_range} are out of range, yet none is below "
                                       "its partition's first record: was the output topic deleted and created "
                                       "again? Not going on, which could write results twice") from exc
                continue
            if batch:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > SCAN_STALL_S:
                raise OutputUnreadable(f"{self.job.out} partitions {sorted(reading)} could not be read to their ends "
                                   f"for {SCAN_STALL_S:.0f} s; not going on, which could write results twice")
            for recs in batch.values():
                for rec in recs:
                    headers = dict(rec.headers or ())
                    if headers.get(JOB_HEADER) != job:
                        continue
                    p, o = (int(x) for x in headers[SOURCE_HEADER].decode().split(":"))
                    self._landed.setdefault((p, o), (rec.partition, rec.offset, dec.decode(rec.value)))
            for p in list(reading):
                if await consumer.position(reading[p]) >= ends[p]:
                    del reading[p]

    @staticmethod
    async def _seek_in_output(consumer, positions: dict) -> bool:
        """Seek each output partition to its position, or to its first record where the output's retention
        removed the ones before; whether any position moved. Results that went with retention cannot be
        found by any scan; the Kafka client's own reset would jump to the partition's end and skip the
        ones still there, which the job would then write twice."""
        begins = await consumer.beginning_offsets(list(positions))
        for tp, at in positions.items():
            consumer.seek(tp, max(at, begins[tp]))
        return any(at < begins[tp] for tp, at in positions.items())

    # -- the run ---------------------------------------------------------------

    async def run(self) -> Checkpoint:
        """Score what is left of the range; returns the checkpoint (`complete` unless stopped).
        Raises `JobRunning` while another run of this job holds its checkpoint, `LeaseHeld` while a run
        elsewhere holds its lease, `LeaseLost` when this run stopped because it could no longer be sure
        it held the lease."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = hold_job_lock(self.path.with_suffix(".lock"), self.job.id)
        try:
            cp = await self._run()
        finally:
            if self.lease is not None:
                await self.lease.release()
                await self._lease_client.aclose()
            os.close(lock)
        if self.lease is not None and self.lease.lost is not None and not cp.complete:
            self.lease.check()  # raises: stopped because the lease was lost, which is not a plain "stopped"
        return cp

    async def _take_lease(self) -> None:
        """Before the output is read: a run elsewhere holding the lease may be writing results."""
        from worker import job_lease

        try:
            client = await job_lease.connect(self.s.redis)
        except Exception as exc:  # noqa: BLE001 - one line for the command
            raise LeaseUnavailable(self.s.redis, exc) from None
        lease = JobLease(client, lease_key(self.s.redis.key_prefix, self.job.id), self.job.id, self.lease_s,
                         on_lost=self.stop.set)
        try:
            await lease.acquire(waiting=lambda who: self.log(
                f"backfill {self.job.id}: waiting for the job's lease, held by {who}; a run that was killed "
                f"leaves it for up to {self.lease_s:.0f} s"))
        except BaseException as exc:
            await client.aclose()
            if isinstance(exc, Exception) and not isinstance(exc, job_lease.LeaseHeld):
                raise LeaseUnavailable(self.s.redis, exc) from None
            raise
        self.lease, self._lease_client = lease, client

    async def _run(self) -> Checkpoint:
        t0 = time.monotonic()
        cp = Checkpoint.load(self.path)
        if cp is not None and cp.complete:
            return cp  # nothing left to do: a finished job writes nothing more
        probe = AIOKafkaConsumer(**self.s.kafka.options(), enable_auto_commit=False, fetch_max_wait_ms=50,
                                 isolation_level=self.s.kafka.isolation_level, auto_offset_reset="none")
        try:
            await probe.start()
            if self.use_lease:
                await self._take_lease()
            if cp is None:
                ranges = await resolve(probe, self.job.source, self.job.start, self.job.stop)
                await self._ensure_out_topic(len(ranges))
                begins, ends = await self._out_span(probe)
                # No checkpoint here, yet a run of this job elsewhere (another machine, a pod whose disk went
                # with it) may have written results: the whole output is read for them, so none is written twice.
                await self._scan_out(probe, begins, ends)
                cp = Checkpoint(self.job.id, ranges, {p: r[0] for p, r in ranges.items()}, self._scan_from(ends))
                cp.save(self.path)
                self.log(f"backfill {self.job.id}: {sum(e - s for s, e in ranges.values())} events in "
                         f"{len(ranges)} partitions of {self.job.source} -> {self.job.out}")
                if self._landed:
                    self.log(f"backfill {self.job.id}: {len(self._landed)} results already in {self.job.out} "
                             "from an earlier run without this checkpoint; not written again")
            else:
                self.log(f"backfill {self.job.id}: resuming from {self.path}")
                await self._scan_out(probe, cp.scan_from, (await self._out_span(probe))[1])
        finally:
            await stop_consumer(probe)
        if not cp.complete:
            try:
                await self._score(cp)
            finally:
                cp.seconds += time.monotonic() - t0
                cp.save(self.path)
        return cp

    def _fold(self, cp: Checkpoint) -> None:
        """Results below the watermark are settled: count them into the checkpoint."""
        for key in [k for k in self._landed if k[1] < cp.done[k[0]]]:
            add_to(cp, self._landed.pop(key)[2])

    def counts(self, cp: Checkpoint) -> Checkpoint:
        """The checkpoint's counts plus results not folded yet (for an interrupted run's summary)."""
        view = msgspec.structs.replace(cp, hist=list(cp.hist))
        for _, _, res in self._landed.values():
            add_to(view, res)
        return view

    async def _score(self, cp: Checkpoint) -> None:
        job, source = self.job, self.job.source
        reader = ReplyReader(self.s.kafka.options(), self.catalog.replies.name)
        await reader.start()
        dead = ReplyReader(self.s.kafka.options(), self.catalog.dlq.name, decode=False)
        await dead.start()
        producer = AIOKafkaProducer(**self.s.kafka.options(), acks="all", linger_ms=5)
        await producer.start()
        # "none": a position out of the source's range raises, never jumps to the partition's end
        consumer = AIOKafkaConsumer(**self.s.kafka.options(), enable_auto_commit=False, fetch_max_wait_ms=50,
                                    isolation_level=self.s.kafka.isolation_level, auto_offset_reset="none")
        await consumer.start()
        tracker = OffsetTracker()
        pending: dict[str, tuple[int, int, str]] = {}  # request id -> (partition, offset, event id)
        slots = asyncio.Semaphore(self.max_in_flight)
        tps = {p: TopicPartition(source, p) for p, (_, e) in cp.ranges.items() if cp.done[p] < e}
        out_next: dict[int, int] = dict(cp.scan_from)  # per output partition: past our last acked result
        failures: list[BaseException] = []
        clock = ReplyClock()
        total = sum(e - s for s, e in cp.ranges.values())
        bar = self.progress(total, cp.events + len(self._landed)) if self.progress else None
        result_enc = msgspec.json.Encoder()

        def checkpoint() -> None:
            for tp, off in tracker.to_commit().items():
                cp.done[tp.partition] = off
            tracker.committed({tps[p]: cp.done[p] for p in tps})
            self._fold(cp)
            cp.scan_from = self._scan_from({q: out_next.get(q, cp.scan_from.get(q, 0)) for q in out_next})
            cp.save(self.path)

        async def emit(p: int, o: int, res: BackfillResult) -> None:
            try:
                if self.lease is not None:
                    self.lease.check()  # no result without the lease: another run may be writing them
                fut = await producer.send(job.out, result_enc.encode(res), key=res.event_id.encode(),
                                          headers=[(JOB_HEADER, job.id.encode()), (SOURCE_HEADER, f"{p}:{o}".encode())])
                meta = await fut
            except Exception as exc:  # never checkpoint past an event without its result
                failures.append(exc)
                self.stop.set()
                return
            out_next[meta.partition] = max(out_next.get(meta.partition, 0), meta.offset + 1)
            self._landed[(p, o)] = (meta.partition, meta.offset, res)
            tracker.finish(tps[p], o)
            slots.release()
            if bar:
                bar.update(1)

        def refused(rid: str, exc: BaseException) -> None:
            failures.append(RequestRefused(
                f"the broker refused request {rid} of job {job.id} on {self.request_topic}: {exc!r}; nothing is "
                f"written for it. Fix that, then the same command continues from the checkpoint"))
            self.stop.set()

        async def publish_again(rid: str, after_ms: int) -> None:
            # the workers' hint, plus up to a fifth more, so that refused requests do not return together
            await asyncio.sleep(after_ms / 1000 * (1 + random.random() / 5))
            if rid in pending and not self.stop.is_set():
                value, headers = self._published[rid]
                try:
                    await (await producer.send(self.request_topic, value, key=rid.encode(), headers=headers))
                except Exception as exc:  # its event would wait for a reply for ever: stop, as a failed result does
                    failures.append(exc)
                    self.stop.set()

        async def replies() -> None:
            while True:
                async for reply in reader.records(timeout_ms=100):
                    if not isinstance(reply, (DoneReply, ErrorReply)) or reply.id not in pending:
                        continue
                    if isinstance(reply, ErrorReply) and reply.code == ErrorCode.OVERLOADED:
                        # not run and not stored (the wire contract): published again with its id, never a result
                        self.republished += 1
                        later.add(asyncio.create_task(publish_again(reply.id, reply.retry_after_ms or 1000)))
                        later.difference_update([t for t in later if t.done()])
                        continue
                    p, o, event_id = pending.pop(reply.id)  # a repeated final finds nothing pending
                    clock.replied(time.monotonic())
                    self._published.pop(reply.id, None)
                    asyncio.create_task(emit(p, o, result_from_reply(reply, event_id, source, p, o, job.template)))

        async def dead_letters() -> None:
            # a request dead-lettered gets no reply: without this the job would wait for it for ever
            while True:
                async for rec in dead.records(timeout_ms=500):
                    rid = (rec.key or b"").decode("utf-8", "replace")
                    if rid in pending:
                        why = dlq.parse(rec.headers)
                        failures.append(DeadLettered(
                            f"the workers dead-lettered request {rid} of job {job.id} "
                            f"({why.get(dlq.ERROR_CODE, '?')}: {why.get(dlq.ERROR_MESSAGE, '')}) "
                            f"and would do the same with the rest; nothing is written for it. Fix that, then the same "
                            f"command continues from the checkpoint"))
                        self.stop.set()
                        return

        async def checkpoints() -> None:
            while True:
                await asyncio.sleep(1.0)
                checkpoint()
                if bar:
                    bar.update(0)  # progress lines keep coming while nothing moves (workers away, say)
                waited = clock.waited(len(pending), time.monotonic())
                if self.stall_s and waited >= self.stall_s:
                    overloaded = (f"; {self.republished} were answered overloaded and published again, so the "
                                  "tenant's limits may refuse them all" if self.republished else "")
                    failures.append(Stalled(
                        f"no reply for {waited:.0f} s to any of the {len(pending)} requests of job {job.id} in "
                        f"flight on {self.request_topic}{overloaded}. Are workers running and reading that topic? "
                        f"What was done is checkpointed; the same command continues (--stall-s {self.stall_s:g})"))
                    self.stop.set()
                    return

        async def intake() -> None:
            consumer.assign(list(tps.values()))
            for p, tp in tps.items():
                consumer.seek(tp, cp.done[p])
            # where the checkpoint stands, checked against the source first: a broker that answers a
            # fetch beyond a partition's end with nothing (as the embedded one does) would leave the job
            # waiting there for ever
            await self._reposition_outside_source(consumer, {tp: cp.done[p] for p, tp in tps.items()}, cp)
            reading = set(tps)
            while reading:
                wanted = [tps[p] for p in reading]
                try:
                    batch = await consumer.getmany(*wanted, timeout_ms=200, max_records=256)
                except UNPARSEABLE:
                    batch = await read_one_by_one(consumer, wanted, tracker, cp.done)
                except OffsetOutOfRangeError as exc:
                    await self._reposition_outside_source(consumer, exc.args[0] if exc.args else {}, cp)
                    continue
                for tp, recs in batch.items():
                    end = cp.ranges[tp.partition][1]
                    for rec in recs:
                        if rec.offset >= end:
                            break
                        tracker.take(tp, rec.offset)
                        if (tp.partition, rec.offset) in self._landed:
                            tracker.finish(tp, rec.offset)  # its result is already in the output
                            continue
                        await slots.acquire()
                        if self.stop.is_set():
                            return
                        if isinstance(rec, RecordRef):
                            await emit(rec.partition, rec.offset, self._unreadable_result(rec))
                        else:
                            await self._submit(producer, rec, pending, emit, refused)
                for p in list(reading):
                    if await consumer.position(tps[p]) >= cp.ranges[p][1]:
                        reading.discard(p)
            while pending or tracker.pending():
                await asyncio.sleep(0.1)

        later: set[asyncio.Task] = set()
        tasks = [asyncio.create_task(replies()), asyncio.create_task(checkpoints()), asyncio.create_task(dead_letters())]

        def ended(task: asyncio.Task) -> None:  # a reader that died would leave the job waiting for replies
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())
                self.stop.set()

        for task in tasks:
            task.add_done_callback(ended)
        work = asyncio.create_task(intake())
        stopped = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait([work, stopped], return_when=asyncio.FIRST_COMPLETED)
            finished = work.done() and not work.cancelled() and work.exception() is None and not failures
            if work.done() and work.exception() is not None:
                raise work.exception()
            await producer.flush()
            await asyncio.sleep(0.05)  # acknowledged sends record themselves
            checkpoint()
            if failures:
                raise failures[0]
            if finished:
                cp.done = {p: r[1] for p, r in cp.ranges.items()}
                self._fold(cp)
                cp.complete = True
        finally:
            for t in (*tasks, work, stopped, *later):
                t.cancel()
            await asyncio.gather(*tasks, work, stopped, *later, return_exceptions=True)
            if self.republished:
                self.log(f"backfill {job.id}: {self.republished} requests were answered overloaded (the tenant's "
                         "limits) and published again after the workers' hint")
            if bar:
                bar.close()
            await stop_consumer(consumer)
            await producer.stop()
            await reader.stop()
            await dead.stop()

    async def _reposition_outside_source(self, consumer, positions: dict, cp: Checkpoint) -> None:
        """Of `positions`, those outside their source partition (the broker said so, or the partition's
        offsets show it): on past what retention removed (counted), or `SourceChanged`."""
        tps = list(positions)
        begins, ends = await consumer.beginning_offsets(tps), await consumer.end_offsets(tps)
        for tp, at in positions.items():
            if begins[tp] <= at <= ends[tp]:
                continue
            end = ends[tp] if at < begins[tp] else await true_end(consumer, tp, ends[tp], begins[tp])  # some
            if begins[tp] <= at <= end:  # brokers report less than the end; reading it moved the position
                consumer.seek(tp, at)
                continue
            range_end = cp.ranges[tp.partition][1]
            to = past_the_source(tp.partition, at, begins[tp], end, range_end)
            lost = min(to, range_end) - at
            cp.expired += lost
            self.log(f"backfill {self.job.id}: {lost} events of partition {tp.partition} ({at}-{min(to, range_end) - 1}) "
                     "were removed by the source's retention before this job read them; no result for them")
            consumer.seek(tp, to)

    def _unreadable_result(self, rec: RecordRef) -> BackfillResult:
        return BackfillResult(event_id=f"{rec.partition}:{rec.offset}", topic=self.job.source, partition=rec.partition,
                              offset=rec.offset, template=self.job.template, error_code="invalid_request",
                              error=f"the Kafka client could not read this source record: {rec.error!r}"[:512])

    async def _submit(self, producer, rec, pending, emit, refused) -> None:
        """One source record -> one score request (or, if it is not an event at all or too large to be
        one, an error result). `refused(request id, error)`: the broker refused the request."""
        p, o = rec.partition, rec.offset
        key = (rec.key or b"").decode("utf-8", "replace")
        raw = without_bom(rec.value or b"")  # read as the workers read requests
        depth = self.s.limits.max_nesting_depth - 1  # the event nests one level inside its request
        try:
            if json_depth_exceeds(raw, depth):  # counted before the decoder recurses into it
                raise ValueError(f"the event nests deeper than {depth} levels (or its brackets do not balance)")
            event = msgspec.json.decode(raw)
            if not isinstance(event, dict):
                raise ValueError("the record is not a JSON object")
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # (nesting is counted first)
            # well-formed JSON that is not Unicode text (a lone surrogate escape) still names its event
            where = not_unicode_at(raw) if isinstance(exc, msgspec.DecodeError) else None
            eid = salvaged_field(raw, "id") if where else None
            await emit(p, o, BackfillResult(event_id=eid or key or f"{p}:{o}", topic=self.job.source, partition=p,
                                            offset=o, template=self.job.template, error_code="invalid_request",
                                            error=f"source record is not Unicode text: {where}" if where
                                            else f"source record is not a JSON event: {exc}"))
            return
        eid = event.get("id")
        event_id = eid if isinstance(eid, str) and eid else (key or f"{p}:{o}")
        rid = f"{self.job.id}-{p}-{o}"
        body = {"id": rid, "kind": "score", "template": self.job.template, "event": event, "stream": False,
                "max_tokens": self.job.max_tokens, "reply_to": self.catalog.replies.name}
        if self.job.labels:
            body["labels"] = list(self.job.labels)
        value = self._enc.encode(body)
        limit = self.s.worker.max_produce_bytes
        if len(value) + len(rid) > limit:  # the Kafka client would refuse it, at every run of the job
            await emit(p, o, BackfillResult(event_id=event_id, topic=self.job.source, partition=p, offset=o,
                                            template=self.job.template, error_code="payload_too_large",
                                            error=f"the score request for this event is {len(value)} bytes; "
                                                  f"requests are at most SLUICE_MAX_PRODUCE_BYTES ({limit})"))
            return
        headers = self.signer.headers(rid.encode(), value) if self.signer else []
        pending[rid] = (p, o, event_id)
        self._published[rid] = (value, headers)
        future = await producer.send(self.request_topic, value, key=rid.encode(), headers=headers)

        def delivered(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                refused(rid, f.exception())

        future.add_done_callback(delivered)


async def read_one_by_one(consumer, tps: list, tracker: OffsetTracker, done: dict[int, int]) -> dict:
    """After a fetch failed to parse: each partition from its first record not yet taken, one record
    at a time, with a `RecordRef` for each record that cannot be parsed. A fetch that fails hands out
    nothing of any partition, so without this one record would stop the job at every run."""
    out: dict = {}
    for tp in tps:
        start = tracker.next_offset(tp)
        consumer.seek(tp, done[tp.partition] if start is None else start)
        await read_one_at_a_time(consumer, tp, 256, 200, out)
    return out


def add_to(cp: Checkpoint, res: BackfillResult) -> None:
    cp.events += 1
    if res.error_code:
        cp.errors += 1
    elif res.scores:
        cp.label = list(res.scores)[-1]
        cp.hist[min(BINS - 1, int(res.scores[cp.label] * BINS))] += 1
