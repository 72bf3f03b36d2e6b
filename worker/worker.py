"""The Worker composes the stages under one supervisor.

Stages, each owning its long-lived task(s):
- intake (worker/intake.py): one loop per latency class; decode, per-record isolation, backpressure;
- dispatch (worker/dispatch.py): admission and suspension (policy in worker/policy.py), per-record tasks;
- runner (worker/runner.py): one request through the engine, streamed tokens;
- replies (worker/replies.py): every final reply and dead letter, with its metrics;
- commits (worker/commits.py): the per-partition watermark to the group;
- supervisor (worker/supervisor.py): owns the tasks above plus a health monitor; any of them
  ending, or a failed health check, makes the worker not ready, drains it, and exits non-zero.

Clients are passed in (aiokafka consumer and producer and the Redis answer store in
production; the in-memory doubles of worker/doubles.py in unit tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import structlog
from aiokafka import ConsumerRebalanceListener

from schemas import RequestCodec
from schemas.templates import Templates
from topics import Catalog, Topic
from worker import early_join, metrics, sealing
from worker.answers import AnswerStore
from worker.commits import Commits
from worker.consumer_stop import stop_consumer
from worker.dispatch import Dispatcher
from worker.emitter import Emitter, kafka_producer
from worker.engine import Engine
from worker.fetch_watch import FetchWatch, answer_marks
from worker.group_guard import GroupGuard, leave_group
from worker.handoff import Handoff, handoff_key
from worker.intake import Intake, loop_name
from worker.logs import partition_name
from worker.offsets import OffsetTracker
from worker.policy import ClassPolicy, Scheduler
from worker.replies import Replies
from worker.runner import Runner
from worker.settings import Settings
from worker.supervisor import Liveness, Supervisor, monitor, watch_guards, watch_topics
from worker.tenancy import Tenancy

log = structlog.get_logger("sluice.worker")
# After the grace and the aborts, how long final replies already on their way may take.
REVOKE_FINISH_S = 8.0
# Each client's stop after a failed start gets this long: a consumer whose join the coordinator held
# waits for that join request's timeout (SLUICE_KAFKA_REQUEST_TIMEOUT_MS) before it stops.
START_CLEANUP_S = 5.0


def freeze_heap(young_threshold: int) -> tuple[int, int, int]:
    """Keep what start-up loaded out of the cyclic garbage collector's way, and collect the young
    generation less often; returns the collector's thresholds before, for `thaw_heap`.

    The worker process holds torch, vLLM, transformers and the tokenizer for as long as it lives.
    Every full collection walked them all while the event loop, and every stream on it, stood
    still. Frozen after a collection, they are never walked again. Requests read ahead and waiting
    grow the heap by tens of objects each, so at Python's default of 700 a young collection ran
    every few dozen requests, and its survivors were walked again in the middle generation
    (what each cost and gained: bench/RESULTS.md, overhead).
    """
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *before[1:])
    return before


def thaw_heap(thresholds: tuple[int, int, int]) -> None:
    """Undo `freeze_heap`: what lived at start may be garbage now (tests and benches start many workers)."""
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def closed_topics(catalog: Catalog) -> frozenset[str]:
    """Topics no request may name as its `reply_to`, whatever the tenancy pattern allows."""
    return frozenset([*(t.name for t in catalog.requests), catalog.dlq.name,
                      *([catalog.audit.name] if catalog.audit else [])])


def class_policy(topic: Topic) -> ClassPolicy:
    return ClassPolicy(topic.latency_class, topic.priority, topic.max_in_engine, topic.contended_in_engine,
                       topic.min_in_engine, topic.max_waiting, topic.window_ms, topic.batch_size, topic.slo_ms)


def kafka_consumer(settings: Settings):
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        **settings.kafka.options(),
        client_id=f"{settings.kafka.client_id}-consumer",
        group_id=settings.group.id,
        enable_auto_commit=False,
        # "none": a position the broker no longer holds is reported, not moved in silence; the worker
        # counts what retention removed unread and reads from the beginning where the group has no
        # offset (worker/read_position.py)
        auto_offset_reset="none",
        fetch_max_wait_ms=settings.kafka.fetch_max_wait_ms,
        isolation_level=settings.kafka.isolation_level,
        session_timeout_ms=settings.group.session_timeout_ms,
        heartbeat_interval_ms=settings.group.heartbeat_ms(),
        max_partition_fetch_bytes=max(1 << 20, 2 * settings.limits.max_record_bytes),
        metadata_max_age_ms=settings.kafka.metadata_max_age_ms,
    )


def answer_store(settings: Settings) -> AnswerStore:
    return AnswerStore(settings.redis.client_url(), settings.redis.key_prefix, settings.redis.ttl_s, settings.redis.timeout_ms,
                       progress_ttl_s=settings.progress.ttl_s, sealer=sealing.load(settings.redis.encryption_keys_file),
                       client_options=settings.redis.client_options())


class RunReport:
    """Tells the group guard each claimed request that enters and leaves the engine, so that a dead
    worker's guard can name them (worker/group_guard.py)."""

    def __init__(self, guard: GroupGuard):
        self.guard = guard

    def started(self, job) -> None:
        if job.owner and self.guard.active:
            self.guard.running(job.owner, {"id": job.request.id, "tenant": job.tenant, "cls": job.latency_class,
                                           "topic": getattr(job.tp, "topic", None),
                                           "partition": getattr(job.tp, "partition", None), "offset": job.offset})

    def ended(self, job) -> None:
        if job.owner:
            self.guard.ended(job.owner)


class GroupJoinTimeout(Exception):
    """The worker's first group join did not complete within SLUICE_GROUP_JOIN_S."""


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: "Worker"):
        self.worker = worker

    async def on_partitions_revoked(self, revoked):
        self.worker.liveness.group_left()  # aiokafka calls this as every rejoin begins
        await self.worker._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        self.worker.liveness.group_joined()
        # aiokafka keeps the member id on its coordinator; the guard needs it to leave for a dead worker
        coordinator = getattr(self.worker.consumer, "_coordinator", None)
        self.worker.group_guard.joined(getattr(coordinator, "member_id", ""))
        log.info("partitions_assigned", partitions=sorted(map(partition_name, assigned)),
                 generation=getattr(coordinator, "generation", None))
        self.worker.hold_while_loading(assigned)


class Worker:
    def __init__(self, settings: Settings, catalog: Catalog, engine: Engine | None, *, consumer=None, producer=None,
                 answers=None):
        closed = closed_topics(catalog)  # every class's request topics, not only those this pool serves
        catalog = catalog.serving(settings.worker.classes.split(","))
        self.settings, self.catalog, self.engine = settings, catalog, engine
        self.consumer = consumer if consumer is not None else kafka_consumer(settings)
        producer = producer if producer is not None else kafka_producer(
            settings.kafka.options(), settings.kafka.idempotence, settings.kafka.client_id, settings.worker.max_produce_bytes,
            settings.kafka.request_timeout_ms)
        self.answers = answers if answers is not None else answer_store(settings)
        self.supervisor = Supervisor()
        self.liveness = Liveness([loop_name(t) for t in catalog.requests])
        self.fetches = FetchWatch(lambda: answer_marks(self.consumer))
        self.tracker = OffsetTracker()
        self.emitter = Emitter(producer, catalog.dlq.name, default_reply_topic=catalog.replies.name,
                               outage_s=settings.health.reply_outage_s, max_record_bytes=settings.worker.max_produce_bytes)
        self._stopping = asyncio.Event()
        self._gc_thresholds: tuple[int, int, int] | None = None  # the collector's, before start (freeze_heap)
        audit = catalog.audit
        self.replies = Replies(self.emitter, self.answers, catalog.replies.name, self.is_running,
                               audit_topic=audit.name if audit is not None else None,
                               audit_content=settings.worker.audit_content, model=getattr(engine, "fingerprint", ""))
        self._topics = {t.name: t for t in catalog.requests}
        # one queue and admission policy per class: its shared topic's (tenant-dedicated topics join it)
        self.scheduler = Scheduler([class_policy(catalog.request_topic(c)) for c in dict.fromkeys(
                                    t.latency_class for t in catalog.requests)], settings.engine.max_num_seqs,
                                   settings.worker.contention_hold_ms, settings.worker.admission,
                                   settings.worker.step_stretch)
        self.dispatch = Dispatcher(self.scheduler, self.tracker, self.supervisor, self.liveness)
        self.dispatch.replies = self.replies
        self.intake = Intake(self.consumer, RequestCodec(settings.limits), self.tracker, self.dispatch, self.replies,
                             self.answers, self.liveness, catalog.replies.name, settings.kafka.fetch_max_wait_ms,
                             stopping=lambda: self.supervisor.stopping, redis_wait_s=settings.redis.lookup_wait_s,
                             tenancy=Tenancy.from_settings(settings.tenancy, catalog.replies.name, closed))
        self.replies.worker_name = self.intake.owner_id
        self.replies.charge = self.intake.tenancy.rates.charge
        self.commits = Commits(self.consumer, self.tracker, settings.group.commit_interval_ms / 1000,
                               classes={t.name: t.latency_class for t in catalog.requests})
        metrics.start_series(t.latency_class for t in catalog.requests)
        for t in catalog.requests:
            if t.slo_ms is not None:
                metrics.class_slo.labels(t.latency_class).set(t.slo_ms / 1000)
        self.group_guard = GroupGuard()  # started with a real consumer (worker/group_guard.py)
        self.dispatch.runs = RunReport(self.group_guard)
        self.handoff = (Handoff(settings, self._topics, self.intake, self.dispatch, self.answers)
                        if settings.group.handoff and settings.group.leave_on_death else None)
        self._started = False
        self._joining: asyncio.Future | None = None  # the consumer's start: the group join (`begin_join`)
        self._alone_watch: asyncio.Task | None = None  # `join_when_alone`
        self._held_while_loading: set = set()  # `hold_while_loading`
        self.engine = self.runner = None
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: Engine) -> None:
        """The loaded engine, before `start`. A worker is built before its engine has loaded when it may
        join its group meanwhile (`join_when_alone`)."""
        s = self.settings
        self.engine = engine
        self.runner = Runner(engine, self.emitter, self.answers, s.limits, self.is_running,
                             s.stream.chunk_tokens, s.stream.chunk_ms, self.dispatch.release_slot,
                             Templates(s.worker.templates_dir), replies=self.replies,
                             on_progress=self.dispatch.engine_output, save_min_tokens=s.kv.save_min_tokens)
        self.dispatch.runner = self.runner
        self.replies.model = getattr(engine, "fingerprint", "")
        if self.scheduler.step_budget is not None and hasattr(engine, "watch_steps"):
            engine.watch_steps(self.dispatch.engine_step)  # vLLM reports each step: exact tokens and times
            self.dispatch.steps_reported = True

    def join_when_alone(self) -> None:
        """While the engine loads: join the group as soon as it has no live member (worker/early_join.py)."""
        s = self.settings
        self._alone_watch = asyncio.ensure_future(early_join.when_alone(
            s.kafka.options(), s.group.id, self.begin_join, timeout_s=s.kafka.request_timeout_ms / 1000))

    async def _stop_alone_watch(self) -> None:
        if self._alone_watch is not None:
            self._alone_watch.cancel()
            await asyncio.gather(self._alone_watch, return_exceptions=True)
            self._alone_watch = None

    def begin_join(self) -> None:
        """Subscribe, start the group guard, and start the consumer's join; `start` awaits it."""
        if self._joining is not None:
            return
        s = self.settings
        self.consumer.subscribe(list(self._topics), listener=_Rebalance(self))
        if s.group.leave_on_death and hasattr(self.consumer, "_coordinator"):  # aiokafka's, not a test double
            self.group_guard.start(s.kafka, s.group.id, timeout_s=s.kafka.request_timeout_ms / 1000,
                                   handoff=(s.redis, handoff_key(s.redis.key_prefix, s.group.id))
                                   if self.handoff is not None else None)
        self.liveness.group_left()
        # returns once the group has assigned this worker its partitions
        self._joining = asyncio.ensure_future(self.consumer.start())

    def hold_while_loading(self, assigned) -> None:
        """Partitions assigned before the engine is attached are not fetched until `start`: the client
        would fetch every few tens of milliseconds for the whole load, on the cores that load."""
        if self.engine is None and assigned:
            self.consumer.pause(*assigned)
            self._held_while_loading.update(assigned)

    async def abandon(self) -> None:
        """The engine did not load (or the worker was stopped while it loaded): leave the group if it was
        joined meanwhile, and close every client, within START_CLEANUP_S each."""
        await self._stop_alone_watch()
        if self._joining is not None:
            self._joining.cancel()
            await asyncio.gather(self._joining, return_exceptions=True)
        for stop in (self._stop_consumer, self._close_group_guard, self.emitter.stop, self.answers.stop):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(START_CLEANUP_S):
                    await stop()

    @property
    def paused(self) -> dict[str, bool]:
        """By class: true while any of its request topics is paused."""
        out: dict[str, bool] = {}
        for loop, paused in self.intake.paused.items():
            cls = loop.split("/")[0]
            out[cls] = out.get(cls, False) or paused
        return out

    @property
    def ready(self) -> bool:
        return self._started and not self._stopping.is_set() and self.supervisor.failure is None

    # -- lifecycle ---------------------------------------------------------------
    def is_running(self) -> bool:
        return not self._stopping.is_set() or bool(self.dispatch.tasks)

    async def start(self) -> None:
        s = self.settings
        # before any client starts: nothing here may leave one running
        await self._stop_alone_watch()  # loaded: from here the worker joins now, whoever is in the group
        for name, reason in self.runner.unusable_templates().items():
            log.warning("template_unusable", template=name, reason=reason)  # its requests: invalid_request
        started = []  # each client's stop, listed before its start: a stop also closes a half-done start
        try:
            started.append(self.answers.stop)
            await self.answers.start()
            started.append(self.emitter.stop)
            await self.emitter.start()
            started.append(self._close_group_guard)  # a guard never started closes as a no-op
            self.begin_join()  # begun while the engine loaded, where the group had no member (`join_when_alone`)
            join = asyncio.timeout(s.health.group_join_s)
            try:
                async with join:
                    await self._joining
            except TimeoutError:
                if not join.expired():
                    raise
                raise GroupJoinTimeout(
                    f"the consumer group {s.group.id} did not take this worker in within {s.health.group_join_s:g} s "
                    f"(SLUICE_GROUP_JOIN_S): the coordinator held the join (a member that does not rejoin, "
                    f"a broker that does not answer)") from None
            held, self._held_while_loading = self._held_while_loading & self.consumer.assignment(), set()
            if held:
                self.consumer.resume(*held)
        except BaseException:
            # whichever client could not start: all are closed, not left to the process exit. The consumer
            # first, as in `stop` (it leaves the group before the guard stands down), and even when an
            # earlier client failed: it was built with the worker, and aiokafka logs "Unclosed
            # AIOKafkaConsumer" for one never stopped
            for stop in [self.consumer.stop, *reversed(started)]:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(START_CLEANUP_S):
                        await stop()
            raise
        metrics.engine_up.set(1)
        self._gc_thresholds = freeze_heap(s.ops.gc_young_threshold)
        sup = self.supervisor
        sup.watch("answer-writer", getattr(self.answers, "writer", None))
        sup.watch("producer", self.emitter.background_task())
        for t in self.catalog.requests:
            sup.spawn(f"intake-{loop_name(t)}", self.intake.run(t, class_policy(t)))
        sup.spawn("dispatch", self.dispatch.run())
        sup.spawn("commits", self.commits.run())
        sup.spawn("monitor", monitor(sup, self.liveness, self.engine, self.dispatch.busy, self.emitter, self.commits,
                                     stall_s=s.health.engine_stall_s, poll_stall_s=s.health.intake_stall_s,
                                     health_interval_s=s.health.engine_health_interval_s, outage_s=s.health.reply_outage_s,
                                     commit_outage_s=s.health.commit_outage_s, group_join_s=s.health.group_join_s,
                                     broker_outage_s=s.health.broker_outage_s, frozen_s=s.health.engine_frozen_s,
                                     fetches=self.fetches, fetch_outage_s=s.health.fetch_outage_s))
        guards = [g for g in (self.group_guard, getattr(self.engine, "guard", None)) if g is not None]
        sup.spawn("guard-watch", watch_guards(sup, guards))
        if self.handoff is not None and self.group_guard.active:
            sup.spawn("handoff", self.handoff.run())
        sup.spawn("topic-watch", watch_topics(sup, self.emitter.own_topics_unusable,
                                              [t.name for t in self.catalog.topic], s.health.topic_check_interval_s,
                                              liveness=self.liveness))
        self._started = True
        log.info("worker_started", group=s.group.id, topics=list(self._topics))

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: stop reading and admitting, let running requests finish within the grace period, commit."""
        grace = self.settings.worker.drain_grace_s if grace_s is None else grace_s
        self._stopping.set()
        await self.supervisor.stop()  # intake, dispatch, commits and the monitor end here
        pending = list(self.dispatch.tasks)
        if pending:
            log.info("draining", in_flight=len(pending), waiting=self.scheduler.waiting(), grace_s=grace)
            _, not_done = await asyncio.wait(pending, timeout=grace) if grace > 0 else (set(), set(pending))
            for task in not_done:
                task.cancel()  # cancelling the engine stream aborts the request in vLLM
            await asyncio.gather(*not_done, return_exceptions=True)
            if not_done:
                log.warning("drain_timeout", abandoned=len(not_done))
        if self.dispatch.steps_reported:
            self.engine.watch_steps(None)  # the engine may outlive this worker (tests, benchmarks)
        # Requests still waiting were never started: left uncommitted, another worker reads them.
        for step in (self._final_commit, self._stop_consumer, self._close_group_guard, self.emitter.stop,
                     self.answers.stop):
            began = time.monotonic()
            try:
                await step()
            except Exception as exc:  # noqa: BLE001 - the rest of the shutdown still runs
                log.warning("stop_step_failed", step=getattr(step, "__qualname__", str(step)), error=repr(exc))
            if time.monotonic() - began > 1.0:  # which step a stuck shutdown waited on
                log.info("stop_step_slow", step=getattr(step, "__qualname__", str(step)),
                         seconds=round(time.monotonic() - began, 1))
        if self._gc_thresholds is not None:
            thaw_heap(self._gc_thresholds)
            self._gc_thresholds = None
        log.info("worker_stopped", failure=self.supervisor.failure)

    async def _final_commit(self) -> None:
        """The drain's commit, bounded: one that never returns (the reason this worker failed, maybe)
        still leaves the consumer time to leave the group, so the others take its partitions now."""
        async with asyncio.timeout(self.settings.worker.stop_margin_s / 2):
            await self.commits.commit()

    async def _stop_consumer(self) -> None:
        """Stop the consumer, which leaves the group so that the others take its partitions now.

        aiokafka sends that LeaveGroup only from generation 1 up; the embedded broker numbers a new
        group's first generation 0, so a worker stopped then would hold its partitions for the
        session timeout. In that case the leave is sent here.
        """
        coordinator = getattr(self.consumer, "_coordinator", None)
        member, generation = getattr(coordinator, "member_id", ""), getattr(coordinator, "generation", -1)
        await stop_consumer(self.consumer)
        if generation == 0 and member:
            code = await leave_group(self.settings.kafka.options(), self.settings.group.id, member,
                                     self.settings.kafka.request_timeout_ms / 1000)
            log.info("group_left", generation=generation, error_code=code)

    async def _close_group_guard(self) -> None:
        """After the consumer has left the group itself: the guard stands down."""
        await asyncio.to_thread(self.group_guard.close)

    async def run_until(self, stop_event: asyncio.Event, on_stopping=None) -> int:
        """Serve until `stop_event` is set (0) or the worker fails (1); drains either way.

        `on_stopping(deadline_s)` is called as the drain begins, with how long the whole shutdown may take.
        """
        waiter = asyncio.create_task(stop_event.wait())
        failed = asyncio.create_task(self.supervisor.failed.wait())
        try:
            await asyncio.wait([waiter, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            failed.cancel()
        # an engine that cannot run finishes nothing in a drain: its requests are let go at once, and
        # the consumer leaves the group so that the other workers take its partitions now
        grace = self.settings.worker.drain_grace_s if self.supervisor.drain else 0.0
        if on_stopping is not None:
            on_stopping(grace + self.settings.worker.stop_margin_s)
        await self.stop(grace)
        return 1 if self.supervisor.failure is not None else 0

    def health(self) -> tuple[bool, dict]:
        now = time.monotonic()
        details = {
            "redis": "up" if self.answers.available else "degraded",
            "in_flight": self.in_flight(),
            "engine_progress_age_s": round(now - self.liveness.engine_progress, 1) if self.dispatch.busy() else 0.0,
            "intake_poll_age_s": {cls: round(now - at, 1) for cls, at in self.liveness.polls.items()},
            "reply_outage_s": round(self.emitter.outage_for(), 1),
            "commit_outage_s": round(self.commits.outage_for(), 1),
            "out_of_group_s": round(self.liveness.out_of_group_for(now), 1),
            "broker_outage_s": round(self.liveness.broker_outage_for(now), 1),
            "fetch_wait_s": round(self.fetches.longest(now), 1),
        }
        if self.supervisor.failure is not None:
            details["failure"] = self.supervisor.failure
        elif self._stopping.is_set():
            details["stopping"] = True
        elif not self._started:
            details["starting"] = "joining the consumer group"  # the engine is loaded: what else holds a start
        return self.ready, details

    # -- rebalance ---------------------------------------------------------------
    async def _on_revoked(self, revoked: set) -> None:
        """Let go of revoked partitions before the group moves them (inside the rebalance timeout).

        Waiting and suspended jobs are dropped (never started, or resumable from their progress).
        Running requests get `SLUICE_REVOKE_GRACE_S` to finish; those still generating are then
        aborted (cancelling the stream aborts them in the engine; every token record they sent has
        its progress stored, so the new owner continues after it). Final replies already on their
        way are awaited. Finished offsets are committed; unfinished ones are read again by the new
        owner. Nothing of a revoked partition keeps running here, so a request never runs twice
        in one process.
        """
        if not revoked:
            return
        dropped = self.dispatch.drop(revoked)
        tasks = [t for t, tp in self.dispatch.tasks.items() if tp in revoked]
        aborted = 0
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.worker.revoke_grace_s)
            for task in pending:
                job = self.dispatch.engine_jobs.get(task)
                if job is not None and not job.slot_released:  # still generating: abort it
                    task.cancel()
                    aborted += 1
            if pending:
                _, stuck = await asyncio.wait(pending, timeout=REVOKE_FINISH_S)
                for task in stuck:  # a final reply the broker did not take in time: read again by the new owner
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        await self.commits.commit(only=revoked)
        self.tracker.forget(revoked)
        metrics.revoke_aborted.inc(aborted)
        log.info("partitions_revoked", partitions=sorted(map(partition_name, revoked)),
                 waiting_dropped=len(dropped), aborted=aborted)

    def in_flight(self) -> int:
        return self.dispatch.in_flight()
