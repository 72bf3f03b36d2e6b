"""Commits: the offset watermark of every owned partition goes to the group, on a timer, as soon as
every record read is finished (a burst answered), and on revoke."""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka.errors import KafkaError

from worker import metrics

log = structlog.get_logger("sluice.commits")

# Commits made because the worker went idle come no closer together than this: a trickle of requests,
# each answered before the next arrives, would otherwise commit once per request.
IDLE_COMMIT_GAP_S = 0.05


class Commits:
    def __init__(self, consumer, tracker, interval_s: float, classes: dict[str, str] | None = None):
        self.consumer, self.tracker, self.interval_s = consumer, tracker, interval_s
        self.classes = classes or {}  # request topic -> latency class, for the lag gauge
        self._lag_series: set[tuple[str, str]] = set()
        # every record read is finished: commit now rather than at the next tick, so a burst's
        # offsets (and the lag the group shows) do not wait up to a whole interval after its last answer
        self._drained = asyncio.Event()
        tracker.on_drained = self._drained.set
        # since when offsets have waited for a commit that succeeds (None while there are none), and the
        # last error: a worker that answers but can never commit (refused, or a commit that never
        # returns) would look healthy while every record it answered waits to be read and answered
        # again; the monitor fails it past `SLUICE_COMMIT_OUTAGE_S`
        self.waiting_since: float | None = None
        self.last_error: str = ""

    def outage_for(self) -> float:
        """Seconds offsets have waited for a successful commit (0 when none wait)."""
        return 0.0 if self.waiting_since is None else time.monotonic() - self.waiting_since

    def discount(self, shift) -> None:
        """The wait's start through `shift` (`worker/supervisor.py: unseen`): time the worker did not run."""
        self.waiting_since = shift(self.waiting_since)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            since = loop.time()
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._drained.wait()
                await asyncio.sleep(max(0.0, min(self.interval_s, IDLE_COMMIT_GAP_S) - (loop.time() - since)))
            except TimeoutError:
                pass
            self._drained.clear()
            await self.commit()
            try:
                self.report_lag()
            except Exception:  # a gauge must never stop commits
                log.exception("lag report failed")

    def report_lag(self) -> None:
        """Consumer lag per class and partition: the log end offset the last fetch saw minus the committed offset."""
        series = set()
        for tp in self.consumer.assignment():
            cls = self.classes.get(tp.topic)
            end = self.consumer.highwater(tp)
            committed = self.tracker.last_committed(tp)
            if cls is None or end is None or committed is None:
                continue
            key = (cls, str(tp.partition))
            metrics.consumer_lag.labels(*key).set(max(0, end - committed))
            series.add(key)
        for gone in self._lag_series - series:  # revoked partitions: another member reports them
            try:
                metrics.consumer_lag.remove(*gone)
            except KeyError:  # another worker in this process (tests) removed it first
                pass
        self._lag_series = series

    async def commit(self, only=None) -> None:
        """Commit each partition's watermark (only those in `only`, if given). A broker error is retried next time."""
        assigned = self.consumer.assignment()
        offsets = {tp: off for tp, off in self.tracker.to_commit().items()
                   if tp in assigned and (only is None or tp in only)}
        if not offsets:
            if only is None:
                self.waiting_since = None  # nothing waits (revoked partitions took theirs away)
            return
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        try:
            await self.consumer.commit(offsets)
            self.tracker.committed(offsets)
            metrics.commits.labels("ok").inc()
            self.waiting_since, self.last_error = None, ""
        except KafkaError as exc:
            metrics.commits.labels("failed").inc()
            log.warning("commit_failed", error=repr(exc))
            self.last_error = repr(exc)
