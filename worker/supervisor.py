"""Owns the worker's long-lived tasks and says whether the worker can do its job.

Every long-lived task (each class's intake, dispatch, commits, the health monitor,
the answer writer, the producer's sender) is spawned or watched here. A task that
ends while the worker is not stopping is a failure: the worker turns not-ready at
once, stops taking work, drains what it can within the grace period, and exits
non-zero so that it is restarted. Health checks (engine health, a stalled engine,
an intake loop that stopped polling, replies that cannot be produced) fail it the
same way. A worker is healthy or gone, never half-alive.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from worker import metrics
from worker.engine_frozen import FrozenWatch
from worker.fetch_watch import FetchWatch
from worker.reply_batches import BrokerUnanswered

log = structlog.get_logger("sluice.supervisor")

# A monitor tick this late means the worker itself did not run: its process stopped (SIGSTOP, a paused
# VM or container, a stalled host) or its event loop was held. Well above a long garbage collection.
SUSPENDED_S = 5.0


def unseen(late_s: float, now: float):
    """The time stamps of the monitor's waits with the `late_s` seconds the worker did not run taken out.

    Nothing the worker watches could answer it while it did not run, and nothing it would fail could
    happen in it: after a pause past a bound (by hand, 150 s), every wait counted from before it read as
    past its bound at the first tick, and the worker exited naming a fault it never had (`fetches
    unanswered`, no broker at fault). A stamp from before the pause moves on by its length (never past
    `now`); one taken since the worker woke is kept. A fault that outlasts the pause is still failed,
    once its whole bound has passed while the worker runs."""
    woke_by = now - late_s / 2  # stamps are from before the pause (at most a tick into it) or after it

    def shift(at: float | None) -> float | None:
        return at if at is None or at > woke_by else min(at + late_s, now)
    return shift


class Supervisor:
    def __init__(self):
        self._tasks: dict[asyncio.Task, str] = {}
        self._spawned: set[str] = set()
        self.stopping = False
        self.failure: str | None = None
        self.drain = True  # whether the shutdown after a failure waits for running requests
        self.failed = asyncio.Event()

    def spawn(self, name: str, coro) -> asyncio.Task:
        self._spawned.add(name)
        return self.watch(name, asyncio.create_task(coro, name=f"sluice-{name}"))

    def watch(self, name: str, task: asyncio.Task | None) -> asyncio.Task | None:
        """Supervise a task created elsewhere (a client's background task)."""
        if task is None:
            return None
        self._tasks[task] = name
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        name = self._tasks.pop(task, "?")
        if self.stopping:
            return
        if task.cancelled():
            self.fail(f"{name} was cancelled")
        elif task.exception() is not None:
            exc = task.exception()
            self.fail(f"{name} failed: {exc!r}")  # first: not ready however long the traceback takes to render
            log.error("task_failed", task=name, error=repr(exc), exc_info=exc)
        else:
            self.fail(f"{name} ended")

    def fail(self, reason: str, drain: bool = True) -> None:
        """The worker can no longer do its job: not ready from now on; `failed` wakes the drain.
        `drain=False`: the engine cannot run, so no running request could finish in a drain."""
        if self.failure is not None:
            return
        self.failure = reason
        self.drain = drain
        metrics.worker_failures.labels(reason.split(" ", 1)[0]).inc()
        log.error("worker_failed", reason=reason)
        self.failed.set()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel and await every task spawned here (watched client tasks belong to their clients).

        A task that swallows its cancellation (Python 3.11's `wait_for` can) must not hold
        the shutdown: after `timeout_s` it is named in the log and left behind.
        """
        self.stopping = True
        tasks = [t for t, name in self._tasks.items() if not t.done() and name in self._spawned]
        for t in tasks:
            t.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=timeout_s)
            for t in stuck:
                log.error("task_ignored_cancel", task=self._tasks.get(t, t.get_name()))


async def watch_topics(supervisor: Supervisor, unusable, topics: list[str], interval_s: float,
                       confirm: int = 2, liveness: Liveness | None = None) -> None:
    """Fail the worker when one of its own topics is gone: deleted (an operator's script, a removed
    KafkaTopic resource) or no longer described for its credentials.

    The Kafka client retries a deleted topic's fetches for ever behind a green `/readyz`, and a
    class would go unserved without a word. `unusable(topics)` asks the broker without creating
    anything; a topic must be named `confirm` times in a row. When no broker answers it raises
    `BrokerUnanswered`: that goes to `liveness` (the monitor bounds it), and names no topic.
    """
    strikes: dict[str, int] = {}
    if liveness is not None:
        liveness.broker_answered()  # the start's group join was the last answer, not the worker's creation
    while supervisor.failure is None:
        await asyncio.sleep(interval_s)
        try:
            found = await unusable(topics)
        except BrokerUnanswered as exc:
            if liveness is not None:
                liveness.broker_unanswered(str(exc))
            continue
        if liveness is not None:
            liveness.broker_answered()
        strikes = {t: strikes.get(t, 0) + 1 for t in found}
        gone = {t: why for t, why in found.items() if strikes[t] >= confirm}
        if gone:
            supervisor.fail("topics of the worker " + "; ".join(f"{t} {why}" for t, why in sorted(gone.items()))
                            + " (create them with `sluice topics apply`, or restore the KafkaTopic resources)")



async def watch_guards(supervisor: Supervisor, guards, interval_s: float = 1.0) -> None:
    """Start again any guard process (engine, group) that died while the worker runs.

    A guard is the worker's insurance for its own death: the engine guard kills the engine's processes,
    the group guard takes the worker out of its group. One killed under a running worker (the OOM
    killer picks large processes, but an operator's `pkill python` picks any) left no trace, and the
    worker's later death went uncovered. Its loss does not stop the worker serving, so it is restarted
    (`guard_restarted`, `sluice_guard_restarts_total`), not failed. A restart that cannot be made
    (no memory to start a process) is tried again each interval.
    """
    failing: set[int] = set()
    while supervisor.failure is None:
        await asyncio.sleep(interval_s)
        for i, guard in enumerate(guards):
            try:
                guard.revive()
                failing.discard(i)
            except OSError as exc:
                if i not in failing:
                    log.error("guard_restart_failed", guard=type(guard).__name__, error=repr(exc))
                failing.add(i)

class Liveness:
    """Time stamps the health monitor reads: engine progress, each intake loop's last poll, since
    when the worker has been outside its consumer group (None: a member), and when a broker last
    answered the topic watch."""

    def __init__(self, classes):
        now = time.monotonic()
        self.engine_progress = now
        self.polls = {cls: now for cls in classes}
        self.out_of_group_since: float | None = None
        self.broker_answered_at = now
        self.broker_silence: str | None = None  # why the latest ask got no answer; None once one does

    def discount(self, shift) -> None:
        """Every stamp through `shift` (`unseen`): the time the worker did not run taken out."""
        self.engine_progress = shift(self.engine_progress)
        self.polls = {cls: shift(at) for cls, at in self.polls.items()}
        self.out_of_group_since = shift(self.out_of_group_since)
        self.broker_answered_at = shift(self.broker_answered_at)

    def broker_answered(self) -> None:
        self.broker_answered_at = time.monotonic()
        self.broker_silence = None

    def broker_unanswered(self, why: str) -> None:
        self.broker_silence = why

    def broker_outage_for(self, now: float) -> float:
        """Seconds since a broker last answered, once an ask has gone unanswered (0 while they answer):
        counted from the last answer, so the check's interval does not add to the bound."""
        return 0.0 if self.broker_silence is None else now - self.broker_answered_at

    def group_left(self) -> None:
        """A join begins (at start, or a rebalance revoked this worker's partitions)."""
        if self.out_of_group_since is None:
            self.out_of_group_since = time.monotonic()

    def group_joined(self) -> None:
        self.out_of_group_since = None

    def out_of_group_for(self, now: float) -> float:
        return 0.0 if self.out_of_group_since is None else now - self.out_of_group_since

    def engine_moved(self) -> None:
        self.engine_progress = time.monotonic()

    def polled(self, cls: str) -> None:
        self.polls[cls] = time.monotonic()


async def monitor(supervisor: Supervisor, liveness: Liveness, engine, busy, emitter, commits, *, stall_s: float,
                  poll_stall_s: float, health_interval_s: float, outage_s: float, commit_outage_s: float,
                  group_join_s: float, broker_outage_s: float = 120.0, frozen_s: float = 0.0,
                  fetches: FetchWatch | None = None, fetch_outage_s: float = 0.0, tick_s: float = 0.5) -> None:
    """Fail the worker when the engine is dead or stalled, an intake loop stopped, replies cannot go out,
    offsets cannot be committed, a rejoin of its consumer group does not complete, or no broker has
    answered for `broker_outage_s`, or a partition it would read has had no fetch answered for
    `fetch_outage_s` (`worker/fetch_watch.py`).

    `busy()` is true while requests wait for or hold an engine slot: only then does a
    lack of engine progress mean a stall. A busy engine whose processes also stopped using CPU for
    `frozen_s` is frozen (`worker/engine_frozen.py`), found well before the stall bound.
    """
    last_health = resumed_at = time.monotonic()
    health: asyncio.Task | None = None  # the engine's health check under way
    health_asked_at = last_health
    frozen = FrozenWatch(frozen_s)
    try:
        while supervisor.failure is None:
            asleep = time.monotonic()
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            late = now - asleep - tick_s
            metrics.event_loop_lag.observe(max(0.0, late))
            if late > SUSPENDED_S:
                resumed_at = now
                shift = unseen(late, now)
                for watch in (liveness, emitter, commits, fetches):
                    if watch is not None:
                        watch.discount(shift)
                log.warning("worker_resumed", unseen_s=round(late, 1),
                            note="the worker did not run (process stopped, VM paused, event loop held): "
                                 "its health bounds leave this time out")
            if busy():
                frozen.sample(now, engine.cpu_times())
                if now - liveness.engine_progress > stall_s:
                    supervisor.fail(f"engine stalled: work waiting and no engine progress for "
                                    f"{now - liveness.engine_progress:.0f} s (SLUICE_ENGINE_STALL_S={stall_s:g})", drain=False)
                elif (used := frozen.frozen(now, liveness.engine_progress)) is not None:
                    supervisor.fail(f"engine frozen: requests in the engine and no progress for "
                                    f"{now - liveness.engine_progress:.0f} s, while its processes used {used:.2f} s of CPU "
                                    f"(SLUICE_ENGINE_FROZEN_S={frozen_s:g})", drain=False)
            else:
                frozen.sample(now, None)
                liveness.engine_moved()  # idle is not stalled: the clock starts when work arrives
            for cls, at in liveness.polls.items():
                if now - at > poll_stall_s:
                    supervisor.fail(f"intake {cls} stopped polling {now - at:.0f} s ago "
                                    f"(SLUICE_INTAKE_STALL_S={poll_stall_s:g})")
            if emitter.outage_for() > outage_s:
                supervisor.fail(f"replies could not be produced for {emitter.outage_for():.0f} s "
                                f"(SLUICE_REPLY_OUTAGE_S={outage_s:g})")
            if commits.outage_for() > commit_outage_s:
                supervisor.fail(f"offsets could not be committed for {commits.outage_for():.0f} s "
                                f"(SLUICE_COMMIT_OUTAGE_S={commit_outage_s:g}): {commits.last_error[:300] or 'no answer from the broker'}")
            if liveness.out_of_group_for(now) > group_join_s:
                # a join the coordinator holds raises nothing: aiokafka waits on it for ever
                supervisor.fail(f"group rejoin not completed after {liveness.out_of_group_for(now):.0f} s "
                                f"(SLUICE_GROUP_JOIN_S={group_join_s:g}): outside its consumer group the worker reads nothing")
            if liveness.broker_outage_for(now) > broker_outage_s:
                # an idle worker has no reply or commit to fail: its consumer retries an unreachable
                # broker for ever, and every poll still returns (empty) behind a green /readyz
                supervisor.fail(f"broker unanswered for {liveness.broker_outage_for(now):.0f} s "
                                f"(SLUICE_BROKER_OUTAGE_S={broker_outage_s:g}): {liveness.broker_silence}")
            if fetches is not None and fetch_outage_s:
                if liveness.broker_silence is not None:
                    fetches.forget()  # a broker that answers nothing is the outage above, with its own bound
                    metrics.fetch_wait.set(0)
                else:
                    fetches.sample(now)
                    metrics.fetch_wait.set(waited := fetches.longest(now))
                    if waited > fetch_outage_s:
                        unread = fetches.waiting(now, fetch_outage_s)
                        named = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
                        supervisor.fail(f"fetches unanswered for {waited:.0f} s (SLUICE_FETCH_OUTAGE_S={fetch_outage_s:g}): "
                                        f"{named} unread: no broker answers this worker's fetches for them")
            if health is not None and health.done():
                failed = asyncio.CancelledError() if health.cancelled() else health.exception()
                health = None
                if failed is not None and health_asked_at < resumed_at:
                    # the worker stopped while the engine was asked: an engine stopped with it had no time to
                    # answer before the check's bound ran out. Asked again, not failed
                    log.warning("engine_health_asked_again", failed=repr(failed)[:200])
                    last_health = -float("inf")
                elif failed is not None:
                    metrics.engine_up.set(0)
                    supervisor.fail(f"engine unhealthy: {failed!r}", drain=False)
            if health is None and now - last_health >= health_interval_s and supervisor.failure is None:
                # a task of its own: the monitor's ticks, and so its sight of time the worker did not run, go on meanwhile
                last_health = health_asked_at = now
                health = asyncio.create_task(_engine_health(engine, max(1.0, health_interval_s)), name="sluice-engine-health")
    finally:
        if health is not None:
            health.cancel()


async def _engine_health(engine, answer_s: float) -> None:
    async with asyncio.timeout(answer_s + 5):  # the engine's own bound, and a margin for a hung check
        await engine.check_health(answer_s)
