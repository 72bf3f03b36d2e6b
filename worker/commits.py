"""Commits: the offset watermark of every owned partition goes to the group, on a timer and on revoke."""

from __future__ import annotations

import asyncio

import structlog
from aiokafka.errors import KafkaError

from worker import metrics

log = structlog.get_logger("sluice.commits")


class Commits:
    def __init__(self, consumer, tracker, interval_s: float):
        self.consumer, self.tracker, self.interval_s = consumer, tracker, interval_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.commit()

    async def commit(self, only=None) -> None:
        """Commit each partition's watermark (only those in `only`, if given). A broker error is retried next time."""
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
