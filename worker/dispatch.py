"""Dispatch: admission (the pure policy decides) and the per-record tasks that answer requests.

One loop admits waiting jobs into the engine whenever something changes, and
suspends lower-class jobs the policy picks when a higher class needs their slots.
Every per-record task (a request running, a rejection, a re-sent answer) is spawned
here; when it ends its offset is finished in the tracker. A per-record task that
raises (the engine died, replies could not be produced for too long, a bug) fails
the worker: its offset stays uncommitted, and another worker takes the partition.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from worker import metrics
from worker.engine import EngineDead
from worker.policy import Running, Scheduler, choose_suspensions
from worker.replies import Fenced
from worker.runner import Job, Suspended

log = structlog.get_logger("sluice.dispatch")


@dataclass(frozen=True)
class HandedOver:
    """What a handed-over job's task is filed under instead of a partition: no revoke here aborts it,
    and it finishes no offset (worker/handoff.py)."""

    state_id: str


class NoReport:
    """Where the dispatcher reports the requests entering and leaving the engine (`RunReport` in the
    worker: its group guard names them if the worker dies)."""

    def started(self, job: Job) -> None:
        pass

    def ended(self, job: Job) -> None:
        pass


class Dispatcher:
    def __init__(self, scheduler: Scheduler, tracker, supervisor, liveness):
        self.scheduler, self.tracker, self.supervisor, self.liveness = scheduler, tracker, supervisor, liveness
        self.runner = None  # set by the worker (the runner needs `release_slot` from here)
        self.replies = None
        self.tasks: dict[asyncio.Task, object] = {}  # per-record task -> its partition
        self.engine_jobs: dict[asyncio.Task, Job] = {}  # tasks holding an engine slot
        self.rejects = 0
        self._live: dict[str, set[int]] = {}  # tenant -> its jobs waiting, running or suspended (quotas)
        self.wake = asyncio.Event()  # something to admit, or a slot freed
        self.steps_reported = False  # the engine reports its steps (`engine_step`); else outputs time them
        self.runs = NoReport()
        self.handed_over: dict[str, Job] = {}  # by state id: jobs a dead worker's guard handed here

    def add(self, cls: str, job: Job) -> None:
        self._live.setdefault(job.tenant, set()).add(id(job))
        self.scheduler.add(cls, job, job.arrived_ms, job.request.deadline_ms)

    def add_handed_over(self, job: Job) -> None:
        """A dead worker's request, claimed here before the group moved its partition: it waits and runs
        as any other, but finishes no offset until its record is read here (`land`)."""
        job.handed_over = True
        self.handed_over[job.state_id] = job
        self.add(job.latency_class, job)
        self.wake.set()

    def land(self, job: Job) -> bool:
        """`job` was read from a partition assigned here: if its request was handed over and runs here
        already (the same record), that run is now the record's, and True (nothing else to do for it)."""
        running = self.handed_over.get(job.state_id)
        if running is None or (running.tp, running.offset) != (job.tp, job.offset):
            return False
        del self.handed_over[job.state_id]
        running.handed_over = False
        for task, key in list(self.tasks.items()):
            if key == HandedOver(running.state_id):
                self.tasks[task] = job.tp  # a revoke of the partition now aborts it, as any other
        metrics.handoff.labels("landed").inc()
        log.info("handoff_landed", request_id=job.request.id, partition=job.tp.partition, offset=job.offset)
        return True

    @staticmethod
    def _key(job: Job):
        """What a job's task is filed under: its partition, or `HandedOver` until it lands."""
        return HandedOver(job.state_id) if job.handed_over else job.tp

    def tenant_in_flight(self, tenant: str) -> int:
        return len(self._live.get(tenant, ()))

    def _forget(self, job: Job) -> None:
        live = self._live.get(job.tenant)
        if live is not None:
            live.discard(id(job))
            if not live:
                del self._live[job.tenant]

    def engine_output(self, tokens: int, prompt_tokens: int = 0) -> None:
        """Every output a request gets: the engine moved (stall detector). Under admission "step", with
        an engine that does not report its steps, the outputs' bursts time them instead."""
        self.liveness.engine_moved()
        if not self.steps_reported:
            self.engine_step(tokens, prompt_tokens)

    def engine_step(self, tokens: int, prompt_tokens: int = 0) -> None:
        """One engine step (or burst of outputs) with its decoded and prefilled prompt tokens: under
        admission "step" it feeds the step model, and a new step may let the next lower-class request in."""
        budget = self.scheduler.step_budget
        if budget is None or not budget.clock.output(time.monotonic(), tokens, prompt_tokens):
            return
        fit = budget.model.fit()
        if fit is not None:
            metrics.engine_step.labels("fixed").set(fit.fixed)
            metrics.engine_step.labels("per_token").set(fit.per_token)
            metrics.engine_step.labels("per_prompt_token").set(fit.per_prompt_token)
        if self.scheduler.waiting():
            self.wake.set()

    def busy(self) -> bool:
        """Work waits for or holds an engine slot: the engine should be making progress."""
        return bool(self.engine_jobs) or self.scheduler.waiting() > 0

    def in_flight(self) -> int:
        return len(self.tasks) + self.scheduler.waiting()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            admitted, expired = self.scheduler.admit(int(time.time() * 1000))
            if admitted:
                self.liveness.engine_moved()  # admission is progress too: the stall clock restarts
            for cls, job in expired:
                self.spawn(self.runner.expire(job), cls, self._key(job), job.offset, job=job)
            for cls, job in admitted:
                job.slot_released = False
                task = self.spawn(self.runner.serve(job), cls, self._key(job), job.offset, job=job)
                self.engine_jobs[task] = job
                self.runs.started(job)
            admitted = expired = job = task = None  # an idle worker holds no request while it waits
            self._suspend()
            for p in self.scheduler.policies:
                metrics.waiting.labels(p.name).set(self.scheduler.waiting(p.name))
                metrics.in_engine.labels(p.name).set(self.scheduler.running(p.name))
                metrics.admission_cap.labels(p.name).set(self.scheduler.cap(p.name))
            if self.scheduler.waiting():
                # Deadlines move with the clock: look again soon even if nothing else happens.
                asyncio.get_running_loop().call_later(0.05, self.wake.set)

    def _suspend(self) -> None:
        excess = self.scheduler.overcommitted()
        if not excess:
            return
        running = [Running(job, job.latency_class, len(job.generated), job.suspend.is_set())
                   for job in self.engine_jobs.values() if not job.slot_released]
        for job in choose_suspensions(excess, running):
            job.suspend.set()

    def release_slot(self, job: Job) -> None:
        """Free the job's engine slot (once), as soon as it no longer generates."""
        if not job.slot_released:
            job.slot_released = True
            self.scheduler.release(job.latency_class)
            budget = self.scheduler.step_budget
            if budget is not None:
                if job.engine_done_at is not None and job.prompt_ids is not None:  # finished, not suspended
                    budget.finished(job.latency_class, len(job.prompt_ids), len(job.generated))
                if self.scheduler.running() == 0:
                    budget.clock.idle()  # the next output does not end a step that ran
            self.wake.set()

    def drop(self, partitions: set) -> list:
        """Waiting jobs of revoked partitions: never started, the new owner reads them again."""
        dropped = self.scheduler.remove(lambda job: job.tp in partitions and not job.handed_over)
        for job in dropped:
            self._forget(job)
        return dropped

    def _still_ours(self, key) -> bool:
        return isinstance(key, HandedOver) or key in self.tracker.partitions()  # handed over: ours until it ends

    def _finish_offset(self, key, offset: int) -> None:
        if not isinstance(key, HandedOver):  # a handed-over job that never landed owns no offset here
            self.tracker.finish(key, offset)

    def reject_done(self) -> None:
        self.rejects -= 1

    def spawn(self, coro, cls: str, tp, offset: int, on_done=None, job: Job | None = None) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks[task] = tp
        task.add_done_callback(lambda t: self._finished(t, cls, tp, offset, on_done, job))
        return task

    def _finished(self, task: asyncio.Task, cls: str, tp, offset: int, on_done, live_job: Job | None = None) -> None:
        self.tasks.pop(task, None)
        suspended = not task.cancelled() and isinstance(task.exception(), Suspended)
        if live_job is not None:
            tp = self._key(live_job)  # a handed-over job may have landed meanwhile
            if live_job.handed_over and not suspended and self.handed_over.get(live_job.state_id) is live_job:
                del self.handed_over[live_job.state_id]
        if live_job is not None and not (suspended and self._still_ours(tp)):
            self._forget(live_job)  # answered, failed or given up: no longer counts against its tenant
        if on_done is not None:
            on_done()
        job = self.engine_jobs.pop(task, None)
        if job is not None:
            self.release_slot(job)
            self.runs.ended(job)
        if task.cancelled():
            return  # not answered: the record stays uncommitted and is read again
        exc = task.exception()
        if exc is None:
            if job is not None:  # answered: its latency steers the caps of the classes below (admission "slo")
                now_ms = int(time.time() * 1000)
                self.scheduler.observe(cls, now_ms - job.arrived_ms, now_ms)
            self._finish_offset(tp, offset)
            return
        if isinstance(exc, Fenced):
            # A later run holds the request's claim and answers its id: this run sent nothing more,
            # and its record is done. (A later record with the same id here, or, for a worker that was
            # paused too long, another worker; then this one's commit is refused by the group anyway.)
            metrics.fenced.inc()
            log.warning("attempt_fenced", request_id=exc.job.request.id, partition=getattr(tp, "partition", None),
                        offset=offset)
            self._finish_offset(tp, offset)
            return
        if isinstance(exc, Suspended):
            if self._still_ours(tp):  # wait for a slot again
                self.add(cls, exc.job)
            return
        if isinstance(exc, EngineDead):
            metrics.engine_up.set(0)
            self.supervisor.fail(f"engine dead: {exc}", drain=False)
        else:
            log.error("reply_failed", error=repr(exc), partition=getattr(tp, "partition", None), offset=offset,
                      exc_info=exc)
            # Without its answer produced, the offset must not be committed: stop and let
            # the group hand the partition to a healthy worker.
            self.supervisor.fail(f"replies failed: {exc!r}")
