"""The Worker composes intake, runner, emitter, offset commits and ops.

Tasks: one intake loop (reads records, pauses partitions when full), one commit
loop, and one task per request taken (bounded by `max_in_flight`).
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from schemas import BadRequest, ErrorReply, RequestCodec
from topics import Catalog
from worker import metrics
from worker.answers import AnswerStore
from worker.emitter import Emitter
from worker.engine import Engine, EngineDead
from worker.offsets import OffsetTracker
from worker.runner import Job, Runner
from worker.settings import Settings

log = structlog.get_logger("sluice.worker")


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: "Worker"):
        self.worker = worker

    async def on_partitions_revoked(self, revoked):
        await self.worker._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        log.info("partitions_assigned", partitions=sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned))


class Worker:
    def __init__(self, settings: Settings, catalog: Catalog, engine: Engine):
        self.settings, self.catalog, self.engine = settings, catalog, engine
        self.codec = RequestCodec(settings.limits())
        self.tracker = OffsetTracker()
        kafka = settings.kafka_common()
        self.emitter = Emitter(kafka, settings.kafka_idempotence, catalog.dlq.name, settings.kafka_client_id)
        self.answers = AnswerStore(settings.redis_url, settings.redis_key_prefix, settings.redis_ttl_s,
                                   settings.redis_timeout_ms)
        self.consumer = AIOKafkaConsumer(
            **kafka,
            client_id=f"{settings.kafka_client_id}-consumer",
            group_id=settings.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
            max_partition_fetch_bytes=max(1 << 20, 2 * settings.max_record_bytes),
        )
        self.runner = Runner(engine, self.emitter, self.answers, settings.limits(), self.is_running)
        self._classes = {t.name: t for t in catalog.requests}
        self._tasks: dict[asyncio.Task, tuple] = {}  # request task -> (tp, class)
        self._intake_task: asyncio.Task | None = None
        self._commit_task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._failed: BaseException | None = None
        self._paused = False
        self.ready = False

    # -- lifecycle ---------------------------------------------------------------
    def is_running(self) -> bool:
        return not self._stopping.is_set() or bool(self._tasks)

    async def start(self) -> None:
        await self.answers.start()
        await self.emitter.start()
        self.consumer.subscribe([t.name for t in self.catalog.requests], listener=_Rebalance(self))
        await self.consumer.start()
        metrics.engine_up.set(1)
        self._intake_task = asyncio.create_task(self._intake(), name="sluice-intake")
        self._commit_task = asyncio.create_task(self._commit_loop(), name="sluice-commit")
        self.ready = True
        log.info("worker_started", group=self.settings.group_id, topics=list(self._classes))

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: stop reading, let in-flight requests finish within the grace period, commit."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        self.ready = False
        self._stopping.set()
        if self._intake_task:
            self._intake_task.cancel()
            await asyncio.gather(self._intake_task, return_exceptions=True)
        pending = list(self._tasks)
        if pending:
            log.info("draining", in_flight=len(pending), grace_s=grace)
            done, not_done = await asyncio.wait(pending, timeout=grace) if grace > 0 else (set(), set(pending))
            for task in not_done:
                task.cancel()  # cancelling the engine stream aborts the request in vLLM
            await asyncio.gather(*not_done, return_exceptions=True)
            if not_done:
                log.warning("drain_timeout", abandoned=len(not_done))
        if self._commit_task:
            self._commit_task.cancel()
            await asyncio.gather(self._commit_task, return_exceptions=True)
        await self._commit()
        await self.consumer.stop()
        await self.emitter.stop()
        await self.answers.stop()
        log.info("worker_stopped")

    async def run_until(self, stop_event: asyncio.Event) -> None:
        """Run until `stop_event` is set or the engine dies; raises EngineDead in that case."""
        waiter = asyncio.create_task(stop_event.wait())
        try:
            await asyncio.wait([waiter, self._intake_task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        await self.stop()
        if self._failed is not None:
            raise self._failed

    # -- intake ------------------------------------------------------------------
    async def _intake(self) -> None:
        limit = self.settings.max_in_flight
        while not self._stopping.is_set():
            self._backpressure(limit)
            room = max(1, limit - len(self._tasks))
            try:
                batches = await self.consumer.getmany(timeout_ms=100, max_records=room)
            except KafkaError as exc:
                log.warning("fetch_failed", error=repr(exc), retriable=exc.retriable)
                await asyncio.sleep(0.5)
                continue
            for tp, records in batches.items():
                for record in records:
                    self._take(tp, record)
            if self._failed is not None:
                return

    def _backpressure(self, limit: int) -> None:
        """Pause every assigned partition while the worker holds `limit` requests."""
        full = len(self._tasks) >= limit
        assigned = self.consumer.assignment()
        if full and not self._paused:
            self.consumer.pause(*assigned)
            self._paused = True
            metrics.paused_partitions.set(len(assigned))
        elif not full and self._paused:
            self.consumer.resume(*assigned)
            self._paused = False
            metrics.paused_partitions.set(0)

    def _take(self, tp, record) -> None:
        topic = self._classes[record.topic]
        cls = topic.latency_class
        metrics.records_consumed.labels(cls).inc()
        self.tracker.take(tp, record.offset)
        try:
            request = self.codec.decode(record.value, record.headers, record.key)
        except BadRequest as bad:
            coro = self._reject(tp, record, bad)
        else:
            job = Job(request, cls, topic.priority, request.reply_to or self.catalog.replies.name,
                      tp, record.offset, record.timestamp)
            coro = self.runner.serve(job)
        task = asyncio.create_task(coro)
        self._tasks[task] = (tp, cls)
        metrics.in_flight.labels(cls).inc()
        task.add_done_callback(lambda t, tp=tp, off=record.offset: self._finished(t, tp, off))

    async def _reject(self, tp, record, bad: BadRequest) -> None:
        if bad.id is not None:
            topic = bad.reply_to or self.catalog.replies.name
            await self.emitter.final(topic, ErrorReply(bad.id, bad.code, bad.message), self.is_running)
            route = "reply"
        else:
            await self.emitter.dead_letter(record, bad.code.value, bad.message, self.is_running)
            route = "dlq"
        metrics.bad_records.labels(bad.code.value, route).inc()
        log.info("bad_record", code=bad.code.value, route=route, topic=record.topic, partition=record.partition,
                 offset=record.offset, request_id=bad.id, reason=bad.message)

    def _finished(self, task: asyncio.Task, tp, offset: int) -> None:
        _, cls = self._tasks.pop(task)
        metrics.in_flight.labels(cls).dec()
        if task.cancelled():
            return  # not answered: the record stays uncommitted and is read again
        exc = task.exception()
        if exc is None:
            self.tracker.finish(tp, offset)
            return
        if isinstance(exc, EngineDead):
            log.error("engine_dead", error=str(exc))
            metrics.engine_up.set(0)
        else:
            log.error("reply_failed", error=repr(exc), partition=tp.partition, offset=offset)
        # Without its answer produced, the offset must not be committed: stop and let
        # the group hand the partition to a healthy worker.
        if self._failed is None:
            self._failed = exc
            self._stopping.set()

    # -- offsets -----------------------------------------------------------------
    async def _commit_loop(self) -> None:
        interval = self.settings.commit_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            await self._commit()

    async def _commit(self, only=None) -> None:
        assigned = self.consumer.assignment()
        offsets = {tp: off for tp, off in self.tracker.to_commit().items()
                   if tp in assigned and (only is None or tp in only)}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self.tracker.committed(offsets)
            metrics.commits.labels("ok").inc()
        except KafkaError as exc:
            metrics.commits.labels("failed").inc()
            log.warning("commit_failed", error=repr(exc))

    async def _on_revoked(self, revoked: set) -> None:
        """Give in-flight requests of revoked partitions a moment, commit, then let go."""
        if not revoked:
            return
        end = time.monotonic() + min(10.0, self.settings.drain_grace_s)
        while time.monotonic() < end and any(self.tracker.pending(tp) for tp in revoked):
            await asyncio.sleep(0.05)
        await self._commit(only=revoked)
        self.tracker.forget(revoked)
        log.info("partitions_revoked", partitions=sorted(f"{tp.topic}[{tp.partition}]" for tp in revoked))

    def in_flight(self) -> int:
        return len(self._tasks)
