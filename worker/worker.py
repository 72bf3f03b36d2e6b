"""The Worker composes intake, admission, runner, emitter, offset commits and ops.

Tasks: one intake loop per latency class (micro-batched reads, per-class
pause/resume), one dispatcher (admission policy -> engine), one commit loop,
and one task per request admitted (bounded by the per-class engine caps).
Nothing queues without bound: a class whose waiting queue is full has its
partitions paused, which keeps the consumer polling and the group membership.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from schemas import BadRequest, ErrorCode, ErrorReply, RequestCodec
from schemas.templates import Templates
from topics import Catalog, Topic
from worker import metrics
from worker.answers import AnswerStore
from worker.emitter import Emitter
from worker.engine import Engine, EngineDead
from worker.offsets import OffsetTracker
from worker.policy import ClassPolicy, Scheduler
from worker.runner import Job, Runner, Suspended
from worker.settings import Settings

log = structlog.get_logger("sluice.worker")
MAX_REJECTS_IN_FLIGHT = 256


def class_policy(topic: Topic) -> ClassPolicy:
    return ClassPolicy(topic.latency_class, topic.priority, topic.max_in_engine, topic.contended_in_engine,
                       topic.min_in_engine, topic.max_waiting, topic.window_ms, topic.batch_size, topic.slo_ms)


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
        self.emitter = Emitter(kafka, settings.kafka_idempotence, catalog.dlq.name, settings.kafka_client_id,
                               default_reply_topic=catalog.replies.name)
        self.answers = AnswerStore(settings.redis_url, settings.redis_key_prefix, settings.redis_ttl_s,
                                   settings.redis_timeout_ms, progress_ttl_s=settings.progress_ttl_s)
        self.consumer = AIOKafkaConsumer(
            **kafka,
            client_id=f"{settings.kafka_client_id}-consumer",
            group_id=settings.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=settings.kafka_fetch_max_wait_ms,
            max_partition_fetch_bytes=max(1 << 20, 2 * settings.max_record_bytes),
        )
        self.runner = Runner(engine, self.emitter, self.answers, settings.limits(), self.is_running,
                             settings.stream_chunk_tokens, settings.stream_chunk_ms, self._release_slot,
                             Templates(settings.templates_dir))
        self._topics = {t.name: t for t in catalog.requests}
        self.scheduler = Scheduler([class_policy(t) for t in catalog.requests], settings.max_num_seqs,
                                   settings.contention_hold_ms)
        self._tasks: dict[asyncio.Task, object] = {}  # answer task -> its partition
        self._engine_jobs: dict[asyncio.Task, Job] = {}  # tasks holding an engine slot
        self._rejects = 0
        self._loops: list[asyncio.Task] = []
        self._commit_task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # something to admit, or a slot freed
        self._stopping = asyncio.Event()
        self._failed: BaseException | None = None
        self.paused: dict[str, bool] = {t.latency_class: False for t in catalog.requests}
        self.ready = False

    # -- lifecycle ---------------------------------------------------------------
    def is_running(self) -> bool:
        return not self._stopping.is_set() or bool(self._tasks)

    async def start(self) -> None:
        await self.answers.start()
        await self.emitter.start()
        self.consumer.subscribe(list(self._topics), listener=_Rebalance(self))
        await self.consumer.start()
        metrics.engine_up.set(1)
        self._loops = [asyncio.create_task(self._intake(t), name=f"sluice-intake-{t.latency_class}")
                       for t in self.catalog.requests]
        self._loops.append(asyncio.create_task(self._dispatch(), name="sluice-dispatch"))
        self._commit_task = asyncio.create_task(self._commit_loop(), name="sluice-commit")
        self.ready = True
        log.info("worker_started", group=self.settings.group_id, topics=list(self._topics))

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: stop reading and admitting, let running requests finish within the grace period, commit."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        self.ready = False
        self._stopping.set()
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        pending = list(self._tasks)
        if pending:
            log.info("draining", in_flight=len(pending), waiting=self.scheduler.waiting(), grace_s=grace)
            _, not_done = await asyncio.wait(pending, timeout=grace) if grace > 0 else (set(), set(pending))
            for task in not_done:
                task.cancel()  # cancelling the engine stream aborts the request in vLLM
            await asyncio.gather(*not_done, return_exceptions=True)
            if not_done:
                log.warning("drain_timeout", abandoned=len(not_done))
        # Requests still waiting were never started: left uncommitted, another worker reads them.
        if self._commit_task:
            self._commit_task.cancel()
            await asyncio.gather(self._commit_task, return_exceptions=True)
        await self._commit()
        await self.consumer.stop()
        await self.emitter.stop()
        await self.answers.stop()
        log.info("worker_stopped")

    async def run_until(self, stop_event: asyncio.Event) -> None:
        """Run until `stop_event` is set or a request could not be answered (engine dead, broker gone)."""
        waiter = asyncio.create_task(stop_event.wait())
        failed = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([waiter, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            failed.cancel()
        await self.stop()
        if self._failed is not None:
            raise self._failed

    # -- intake ------------------------------------------------------------------
    async def _intake(self, topic: Topic) -> None:
        cls, policy = topic.latency_class, class_policy(topic)
        poll_ms = self.settings.kafka_fetch_max_wait_ms
        while not self._stopping.is_set():
            tps = [tp for tp in self.consumer.assignment() if tp.topic == topic.name]
            if not tps or not self._backpressure(cls, tps) or self._rejects >= MAX_REJECTS_IN_FLIGHT:
                await asyncio.sleep(poll_ms / 1000)
                continue
            room = max(1, min(policy.batch_size, policy.max_waiting - self.scheduler.waiting(cls)))
            try:
                got = await self.consumer.getmany(*tps, timeout_ms=poll_ms, max_records=room)
                n = sum(map(len, got.values()))
                if n and n < room and policy.window_ms:
                    # Micro-batch: give the window a chance to fill before admitting.
                    await asyncio.sleep(policy.window_ms / 1000)
                    more = await self.consumer.getmany(*tps, timeout_ms=0, max_records=room - n)
                    for tp, recs in more.items():
                        got.setdefault(tp, []).extend(recs)
            except KafkaError as exc:
                log.warning("fetch_failed", error=repr(exc), retriable=exc.retriable)
                await asyncio.sleep(0.5)
                continue
            jobs = [job for tp, records in got.items() for record in records
                    if (job := self._take(topic, tp, record)) is not None]
            if not jobs:
                continue
            stored = await self.answers.lookup_many([job.request.id for job in jobs],
                                                    [job.request.stream for job in jobs])
            owned = set(self.tracker.partitions())  # a rebalance may have run during the lookup
            for job, (answer, progress) in zip(jobs, stored):
                if job.tp not in owned:
                    continue
                job.progress = progress  # an earlier owner died mid-stream: continue after its last token
                if answer is not None:
                    self._spawn(self.runner.resend(job, answer), cls, job.tp, job.offset)
                else:
                    self.scheduler.add(cls, job, job.timestamp_ms, job.request.deadline_ms)
            metrics.waiting.labels(cls).set(self.scheduler.waiting(cls))
            self._wake.set()

    def _backpressure(self, cls: str, tps) -> bool:
        """Pause the class's partitions while its waiting queue is full; True when reading."""
        if self.scheduler.should_pause(cls):
            if not self.paused[cls]:
                log.info("partitions_paused", cls=cls, waiting=self.scheduler.waiting(cls))
            self.paused[cls] = True
        elif self.paused[cls] and self.scheduler.should_resume(cls):
            self.paused[cls] = False
            self.consumer.resume(*tps)
            log.info("partitions_resumed", cls=cls, waiting=self.scheduler.waiting(cls))
        if self.paused[cls]:
            self.consumer.pause(*tps)  # again each time: a rebalance may have added partitions
        metrics.paused_partitions.labels(cls).set(len(tps) if self.paused[cls] else 0)
        return not self.paused[cls]

    def _take(self, topic: Topic, tp, record) -> Job | None:
        """Own the record; a bad one is answered at once, a valid one returned as a job."""
        cls = topic.latency_class
        metrics.records_consumed.labels(cls).inc()
        self.tracker.take(tp, record.offset)
        try:
            request = self.codec.decode(record.value, record.headers, record.key)
        except BadRequest as bad:
            self._rejects += 1
            self._spawn(self._reject(tp, record, bad), cls, tp, record.offset)
            return None
        return Job(request, cls, topic.priority, request.reply_to or self.catalog.replies.name,
                   tp, record.offset, record.timestamp)

    async def _reject(self, tp, record, bad: BadRequest) -> None:
        try:
            if bad.id is not None:
                topic = bad.reply_to or self.catalog.replies.name
                await self.emitter.final(topic, ErrorReply(bad.id, bad.code, bad.message), self.is_running)
                route = "reply"
            else:
                await self.emitter.dead_letter(record, bad.code.value, bad.message, self.is_running)
                route = "dlq"
        finally:
            self._rejects -= 1
        metrics.bad_records.labels(bad.code.value, route).inc()
        log.info("bad_record", code=bad.code.value, route=route, topic=record.topic, partition=record.partition,
                 offset=record.offset, request_id=bad.id, reason=bad.message)

    # -- admission ---------------------------------------------------------------
    async def _dispatch(self) -> None:
        while not self._stopping.is_set():
            await self._wake.wait()
            self._wake.clear()
            admitted, expired = self.scheduler.admit(int(time.time() * 1000))
            for cls, job in expired:
                self._spawn(self._expire(job), cls, job.tp, job.offset)
            for cls, job in admitted:
                job.slot_released = False
                task = self._spawn(self.runner.serve(job), cls, job.tp, job.offset)
                self._engine_jobs[task] = job
            self._preempt()
            for p in self.scheduler.policies:
                metrics.waiting.labels(p.name).set(self.scheduler.waiting(p.name))
                metrics.in_engine.labels(p.name).set(self.scheduler.running(p.name))
            if self.scheduler.waiting():
                # Deadlines move with the clock: look again soon even if nothing else happens.
                asyncio.get_running_loop().call_later(0.05, self._wake.set)

    def _preempt(self) -> None:
        """Suspend lower-class requests holding slots a waiting higher class needs."""
        for cls, excess in self.scheduler.overcommitted().items():
            jobs = [j for j in self._engine_jobs.values() if j.latency_class == cls and not j.slot_released]
            excess -= sum(j.suspend.is_set() for j in jobs)
            # Those with the least generated lose the least if their KV is evicted meanwhile.
            for job in sorted((j for j in jobs if not j.suspend.is_set()), key=lambda j: len(j.generated))[:excess]:
                job.suspend.set()

    async def _expire(self, job: Job) -> None:
        reply = ErrorReply(job.request.id, ErrorCode.DEADLINE_EXCEEDED,
                           f"deadline {job.request.deadline_ms} passed before the request ran")
        await self.emitter.final(job.reply_to, reply, self.is_running)
        metrics.requests_completed.labels(job.latency_class, ErrorCode.DEADLINE_EXCEEDED.value).inc()

    def _release_slot(self, job: Job) -> None:
        """Free the job's engine slot (once), as soon as it no longer generates."""
        if not job.slot_released:
            job.slot_released = True
            self.scheduler.release(job.latency_class)
            self._wake.set()

    def _spawn(self, coro, cls: str, tp, offset: int) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks[task] = tp
        task.add_done_callback(lambda t: self._finished(t, cls, tp, offset))
        return task

    def _finished(self, task: asyncio.Task, cls: str, tp, offset: int) -> None:
        self._tasks.pop(task, None)
        job = self._engine_jobs.pop(task, None)
        if job is not None:
            self._release_slot(job)
        if task.cancelled():
            return  # not answered: the record stays uncommitted and is read again
        exc = task.exception()
        if exc is None:
            self.tracker.finish(tp, offset)
            return
        if isinstance(exc, Suspended):
            if tp in self.tracker.partitions():  # still ours: wait for a slot again
                job = exc.job
                self.scheduler.add(cls, job, job.timestamp_ms, job.request.deadline_ms)
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
        # Waiting requests were never started: the new owner reads them again.
        dropped = self.scheduler.remove(lambda job: job.tp in revoked)
        end = time.monotonic() + min(10.0, self.settings.drain_grace_s)
        while time.monotonic() < end and any(tp in revoked for tp in self._tasks.values()):
            await asyncio.sleep(0.05)
        await self._commit(only=revoked)
        self.tracker.forget(revoked)
        log.info("partitions_revoked", partitions=sorted(f"{tp.topic}[{tp.partition}]" for tp in revoked),
                 waiting_dropped=len(dropped))

    def in_flight(self) -> int:
        return len(self._tasks) + self.scheduler.waiting()
