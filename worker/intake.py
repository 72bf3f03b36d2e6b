"""Intake: one loop per latency class reads records, decodes them, and hands each one on.

Per-record isolation: nothing a record carries (value, key, headers, depth, encoding,
size, field values) can raise out of here. Every record ends as a job for the
dispatcher, an `error` reply or a dead letter, and its offset is owned by the
offset tracker until then. A record the Kafka client itself cannot parse (a header
key that is not UTF-8, a corrupt batch, a batch compressed with a codec it cannot
decode) is found by reading one record at a time, dead-lettered with its
coordinates, and skipped.

Backpressure: a class whose waiting queue is full has its partitions paused; the
loop keeps polling, so group membership is never at risk. Each loop stamps
`Liveness.polled` after every successful poll; the monitor fails the worker when
a loop stops polling.

Waiting: a loop asks for every partition of its topic and waits up to `IDLE_WAIT_MS`.
The consumer's background fetches wake it as soon as records arrive, for partitions
assigned before or during the wait, so an idle worker does not wake with every fetch.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
import uuid

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError

from schemas import BadRequest, ErrorCode, RequestCodec
from topics import Topic
from worker import metrics
from worker.read_position import UNPOSITIONED, reposition
from worker.runner import Job
from worker.tenancy import Tenancy, Unauthenticated
from worker.unparseable import UNPARSEABLE, RecordRef, read_one_at_a_time

log = structlog.get_logger("sluice.intake")
MAX_REJECTS_IN_FLIGHT = 256
# How long a loop with nothing to read waits for records. The consumer's fetches wake it as soon as
# records arrive, so a longer wait costs no latency; a shorter one only spends CPU waking for nothing.
IDLE_WAIT_MS = 1000
# How long fetches may keep failing with an error the client calls not retriable (the topic's read
# permission revoked, say) before the loop fails the worker: retrying it would only stall the class
# behind a green /readyz until the intake stall check (minutes).
REFUSED_FETCH_LIMIT_S = 3.0
# How far ahead of the worker's clock a producer's clock may run before its timestamps are not believed.
CLOCK_SKEW_MS = 60_000


def arrival_ms(stamp: int, now_ms: int, retention_ms: int | None) -> tuple[int, bool]:
    """When a record arrived, for its place in its class's queue and its latency, and whether its
    timestamp was believed. CreateTime is the producer's to set: a timestamp of 0 would put a record
    ahead of every other of its class and add decades to the latency histograms. A timestamp older
    than the topic keeps records, or further ahead than clock skew explains, gives way to the read
    time; one slightly ahead is taken as now."""
    oldest = now_ms - retention_ms if retention_ms else 1
    if stamp < oldest or stamp > now_ms + CLOCK_SKEW_MS:
        return now_ms, False
    return min(stamp, now_ms), True


def loop_name(topic: Topic) -> str:
    """An intake loop's name (liveness, pauses, its task): the class, plus the tenant of a tenant-dedicated topic."""
    return topic.latency_class if topic.tenant is None else f"{topic.latency_class}/{topic.tenant}"


def _keep_what_was_read(exc: KafkaError, got: dict, cls: str) -> None:
    """A read failed after earlier reads returned records. Those are behind the consumer's positions
    already: dropped, they would never be read again. So they are kept, and the client raises the
    error again on a later read. With nothing read, the failure is the loop's to handle."""
    if not got:
        raise exc
    log.warning("fetch_failed_after_records", cls=cls, error=repr(exc)[:300])


class FetchRefused(Exception):
    """The broker keeps refusing a request topic's fetches for a reason retrying will not change."""


class Intake:
    def __init__(self, consumer, codec: RequestCodec, tracker, dispatcher, replies, answers, liveness,
                 default_reply_topic: str, poll_ms: int, stopping=lambda: False, redis_wait_s: float = 10.0,
                 tenancy: Tenancy | None = None):
        self.consumer, self.codec, self.tracker = consumer, codec, tracker
        self.dispatcher, self.replies, self.answers, self.liveness = dispatcher, replies, answers, liveness
        self.default_reply_topic = default_reply_topic
        self.poll_ms = poll_ms
        self.stopping = stopping  # belt and braces beside cancellation
        self.redis_wait_s = redis_wait_s
        self.tenancy = tenancy if tenancy is not None else Tenancy("single", "default", {}, default_reply_topic)
        # attempt tokens: unique per job run, across processes and restarts
        self.owner_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._attempts = itertools.count()
        self.paused: dict[str, bool] = {}  # by loop name (worker/intake.py: loop_name)
        self._paused_count: dict[str, int] = {}

    async def run(self, topic: Topic, policy) -> None:
        """The loop of one request topic; it ends only when the worker stops (an exception here is a
        worker failure). A class's shared topic and its tenant-dedicated topics share its queue."""
        cls, loop = topic.latency_class, loop_name(topic)
        self.paused.setdefault(loop, False)
        refused_since: float | None = None  # when fetches began failing with errors not retriable
        while not self.stopping():
            tps = [tp for tp in self.consumer.assignment() if tp.topic == topic.name]
            if not tps or not self._backpressure(cls, loop, tps) or self.dispatcher.rejects >= MAX_REJECTS_IN_FLIGHT:
                self.liveness.polled(loop)
                await asyncio.sleep(self.poll_ms / 1000)
                continue
            room = max(1, min(policy.batch_size, policy.max_waiting - self.dispatcher.scheduler.waiting(cls)))
            wanted = self._wanted(topic.name, tps)
            generations = {tp: self.tracker.generation(tp) for tp in wanted}
            try:
                got = await self._fetch(wanted, room, policy.window_ms, cls)
            except KafkaError as exc:
                # Not stamped as a poll: a fetch that keeps failing trips the intake stall check.
                metrics.intake_errors.labels(cls, "fetch").inc()
                log.warning("fetch_failed", cls=cls, topic=topic.name, error=repr(exc), retriable=exc.retriable)
                # aiokafka marks its own timeouts (a lookup during a broker outage) not retriable; they are
                retriable = exc.retriable or isinstance(exc, KafkaTimeoutError)
                refused_since = None if retriable else refused_since or time.monotonic()
                if refused_since is not None and time.monotonic() - refused_since >= REFUSED_FETCH_LIMIT_S:
                    raise FetchRefused(f"{topic.name} cannot be read: {exc!r}, not retriable, "
                                       f"for {REFUSED_FETCH_LIMIT_S:g} s") from exc
                await asyncio.sleep(0.5)
                continue
            refused_since = None
            self.liveness.polled(loop)
            # A rebalance during the fetch: what was read from a revoked partition is the new owner's.
            # If the partition came straight back, the fetch may have read on from the committed offset
            # it restarted at: go back there, or those records would be skipped.
            for tp in [tp for tp in got if not self._still_ours(tp, generations)]:
                del got[tp]
                if tp in self.consumer.assignment():
                    await self._rewind(tp)
            jobs = [job for tp, records in got.items() for record in records
                    if (job := self.take(topic, tp, record)) is not None]
            if jobs:
                await self._schedule(cls, jobs, generations, loop)
            # not held while the next fetch waits: an idle worker would keep its last batch's
            # records and prompts (up to batch_size x SLUICE_MAX_RECORD_BYTES) alive
            got = jobs = job = None

    def _wanted(self, topic: str, tps: list) -> list:
        """Every partition of the topic: a wait then also returns records of partitions assigned
        during it, rather than waiting for the next turn (the consumer returns only assigned ones)."""
        parts = self.consumer.partitions_for_topic(topic)
        return [TopicPartition(topic, p) for p in sorted(parts)] if parts else tps

    async def _fetch(self, tps, room: int, window_ms: int, cls: str) -> dict:
        got: dict = {}
        try:
            got = await self.consumer.getmany(*tps, timeout_ms=max(self.poll_ms, IDLE_WAIT_MS), max_records=room)
            n = sum(map(len, got.values()))
            if n and n < room and window_ms:
                # Micro-batch: give the window a chance to fill before admitting.
                await asyncio.sleep(window_ms / 1000)
                more = await self.consumer.getmany(*tps, timeout_ms=0, max_records=room - n)
                for tp, recs in more.items():
                    got.setdefault(tp, []).extend(recs)
        except UNPARSEABLE as exc:
            await self._read_carefully(tps, room, got, exc, cls)
        except UNPOSITIONED as exc:
            await reposition(self.consumer, exc, cls, self.tracker)
        except KafkaError as exc:  # the window's second read
            _keep_what_was_read(exc, got, cls)
        return got

    async def _read_carefully(self, tps, room: int, got: dict, first: BaseException, cls: str) -> None:
        """After a parse failure: rewind each partition to the first record not yet taken, read
        one record at a time, and turn each one that cannot be parsed into a `RecordRef`.

        The failed fetch may have moved positions past records it never handed out, so the
        rewind point is the first offset not yet taken: the tracker knows it for a partition this
        worker has read since it was assigned; otherwise nothing was taken since the assignment,
        so it is the group's committed offset, or the beginning. What was read stays in `got` when a
        later partition's read fails.
        """
        log.warning("unparseable_record_in_fetch", error=repr(first)[:300])
        assigned = self.consumer.assignment()
        for tp in [tp for tp in tps if tp in assigned]:  # only an assigned partition can be sought
            start = self.tracker.next_offset(tp)
            if start is None:
                start = await self.consumer.committed(tp)
            if start is None:
                await self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, start)
            try:
                await read_one_at_a_time(self.consumer, tp, room, self.poll_ms, got)
            except UNPOSITIONED as exc:
                await reposition(self.consumer, exc, cls, self.tracker)
            except KafkaError as exc:
                _keep_what_was_read(exc, got, cls)
                return

    async def _rewind(self, tp) -> None:
        committed = await self.consumer.committed(tp)
        if committed is None:
            await self.consumer.seek_to_beginning(tp)
        else:
            self.consumer.seek(tp, committed)

    def _still_ours(self, tp, generations: dict) -> bool:
        return tp in self.consumer.assignment() and self.tracker.generation(tp) == generations.get(tp)

    def take(self, topic: Topic, tp, record) -> Job | None:
        """Own the record; a valid one comes back as a job, anything else is answered here. Never raises."""
        cls = topic.latency_class
        try:
            self.tracker.take(tp, record.offset)
        except ValueError:
            log.warning("record_already_taken", cls=cls, partition=tp.partition, offset=record.offset)
            return None
        metrics.records_consumed.labels(cls).inc()
        try:
            if isinstance(record, RecordRef):
                self.dispatcher.spawn(self.replies.unreadable(cls, record), cls, tp, record.offset)
                return None
            return self.job_of(topic, tp, record)
        except Unauthenticated as exc:
            # No reply: the address in an unauthenticated record is not trusted. The DLQ keeps the bytes.
            metrics.unauthenticated.labels(cls).inc()
            log.warning("record_unauthenticated", cls=cls, partition=tp.partition, offset=record.offset, reason=str(exc))
            self._reject(cls, tp, record, BadRequest(ErrorCode.INVALID_REQUEST, f"unauthenticated: {exc}"))
        except BadRequest as bad:
            self._reject(cls, tp, record, bad)
        except Exception as exc:  # noqa: BLE001 - one record never ends the loop
            log.exception("record_failed", cls=cls, partition=tp.partition, offset=record.offset)
            metrics.intake_errors.labels(cls, "record").inc()
            self._reject(cls, tp, record, self._internal(record, exc))
        return None

    def job_of(self, topic: Topic, tp, record) -> Job:
        """The record as a job: decoded, its tenant authenticated. Raises `BadRequest` or
        `Unauthenticated` for a record that cannot run (and anything a hostile record provokes)."""
        request = self.codec.decode(record.value, record.headers, record.key)
        tenant = self.tenancy.tenant_of(record, request, topic)
        refused = self.tenancy.reply_to_refused(tenant, request.reply_to)
        if refused is not None:  # answered on the default reply topic, never on the refused one
            raise BadRequest(ErrorCode.INVALID_REQUEST, refused, request.id, tenant=tenant)
        arrived, believed = arrival_ms(record.timestamp, int(time.time() * 1000), topic.retention_ms)
        if not believed:
            metrics.untrusted_timestamps.labels(topic.latency_class).inc()
        return Job(request, topic.latency_class, topic.priority, request.reply_to or self.default_reply_topic,
                   tp, record.offset, record.timestamp, tenant=tenant, arrived_ms=arrived)

    def new_owner(self) -> str:
        """A new attempt token: unique per run of a request, across processes and restarts."""
        return f"{self.owner_id}#{next(self._attempts)}"

    def _internal(self, record, exc: BaseException) -> BadRequest:
        message = f"internal error reading the record: {type(exc).__name__}"
        try:
            return self.codec.bad_request(ErrorCode.INTERNAL, message, record.value, record.headers, record.key)
        except Exception:  # noqa: BLE001 - no address can be read: dead-letter it
            return BadRequest(ErrorCode.INTERNAL, message)

    def _reject(self, cls: str, tp, record, bad: BadRequest) -> None:
        self.dispatcher.rejects += 1
        self.dispatcher.spawn(self.replies.reject(cls, record, bad), cls, tp, record.offset,
                              on_done=self.dispatcher.reject_done)

    async def _schedule(self, cls: str, jobs: list[Job], generations: dict, loop: str | None = None) -> None:
        """Stored answers are re-sent; progress left by a dead owner rides along; the rest wait for admission."""
        jobs = [job for job in jobs if not self.dispatcher.land(job)]  # already running here, handed over
        jobs = await self._refuse_unusable_reply_topics(cls, jobs)
        if not jobs:
            return
        owners = [self.new_owner() for _ in jobs]
        ids, streamed = [job.state_id for job in jobs], [job.request.stream for job in jobs]
        stored = await self.answers.lookup_many(ids, streamed, owners)
        # Redis unavailable: wait a while (a master failover takes seconds) rather than run records that
        # may have been answered already; past the wait they run unchecked, and their replies say so.
        # The wait counts from the outage's first failed call, not per batch: once an outage has
        # outlasted it, every batch waiting again would leave each class one batch per wait.
        since = self.answers.unavailable_since
        give_up = (time.monotonic() if since is None else since) + self.redis_wait_s
        while not self.answers.available and time.monotonic() < give_up and not self.stopping():
            self.liveness.polled(loop or cls)
            await asyncio.sleep(0.25)
            stored = await self.answers.lookup_many(ids, streamed, owners)
        claimed = self.answers.available  # the claims went through: these attempts can be fenced
        for job, owner, (answer, progress) in zip(jobs, owners, stored):
            if self.tracker.generation(job.tp) != generations.get(job.tp):
                continue  # revoked during the lookup: the new owner reads it again
            try:
                job.progress = progress  # an earlier owner died mid-stream: continue after its last token
                job.owner = owner if claimed and answer is None else ""  # an answered id was not claimed
                job.checked = claimed
                reply = self.replies.decode_stored(answer) if answer is not None else None
                limit = self.tenancy.max_in_flight(job.tenant)
                if reply is not None:
                    self.dispatcher.spawn(self.replies.resend(job, reply), cls, job.tp, job.offset)
                elif limit and self.dispatcher.tenant_in_flight(job.tenant) >= limit:
                    self.dispatcher.spawn(self.replies.overloaded(
                        job, f"{limit} requests in flight on this worker (its limit)",
                        self.tenancy.retry_after_ms(job.tenant)), cls, job.tp, job.offset)
                elif wait_ms := self.tenancy.rates.retry_after_ms(job.tenant):
                    self.dispatcher.spawn(self.replies.overloaded(job, "used its token rate (tokens_per_s)", wait_ms),
                                          cls, job.tp, job.offset)
                else:
                    self.dispatcher.add(cls, job)
            except Exception as exc:  # noqa: BLE001 - answered `internal`, never the end of the loop
                log.exception("job_failed", cls=cls, request_id=job.request.id)
                metrics.intake_errors.labels(cls, "record").inc()
                ref = RecordRef(job.tp.topic, job.tp.partition, job.offset, key=job.request.id.encode())
                self._reject(cls, job.tp, ref,
                             BadRequest(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}",
                                        job.request.id, job.request.reply_to))
        metrics.waiting.labels(cls).set(self.dispatcher.scheduler.waiting(cls))
        self.dispatcher.wake.set()

    async def _refuse_unusable_reply_topics(self, cls: str, jobs: list[Job]) -> list[Job]:
        """The jobs whose `reply_to` can take replies; the others are answered `invalid_request` on the
        default reply topic, as a `reply_to` outside the tenant's pattern is."""
        topics = {job.reply_to for job in jobs if job.reply_to != self.default_reply_topic}
        if not topics:
            return jobs
        try:
            unusable = await self.replies.emitter.unusable_reply_topics(topics)
        except Exception:  # noqa: BLE001 - never the end of the loop: sending finds out as before
            log.exception("reply_topic_lookup_failed", cls=cls)
            return jobs
        kept = []
        for job in jobs:
            why = unusable.get(job.reply_to)
            if why is None:
                kept.append(job)
                continue
            ref = RecordRef(job.tp.topic, job.tp.partition, job.offset, key=job.request.id.encode())
            self._reject(cls, job.tp, ref, BadRequest(ErrorCode.INVALID_REQUEST, f"reply_to {job.reply_to!r} {why}",
                                                      job.request.id, tenant=job.tenant))
        return kept

    def _backpressure(self, cls: str, loop: str, tps) -> bool:
        """Pause this loop's partitions while its class's waiting queue is full; True when reading."""
        scheduler = self.dispatcher.scheduler
        if scheduler.should_pause(cls):
            if not self.paused[loop]:
                log.info("partitions_paused", cls=cls, loop=loop, waiting=scheduler.waiting(cls))
            self.paused[loop] = True
        elif self.paused[loop] and scheduler.should_resume(cls):
            self.paused[loop] = False
            self.consumer.resume(*tps)
            log.info("partitions_resumed", cls=cls, loop=loop, waiting=scheduler.waiting(cls))
        if self.paused[loop]:
            self.consumer.pause(*tps)  # again each time: a rebalance may have added partitions
        self._paused_count[loop] = len(tps) if self.paused[loop] else 0
        metrics.paused_partitions.labels(cls).set(
            sum(n for name, n in self._paused_count.items() if name.split("/")[0] == cls))
        return not self.paused[loop]
