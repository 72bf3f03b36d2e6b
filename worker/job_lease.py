"""One run of a backfill job at a time on any machine: a lease in the workers' Redis Cluster.

The checkpoint's lock (worker/backfill.py: hold_job_lock) keeps out a second run on one machine;
runs on two machines, or an old pod still alive beside its replacement, each hold a lock of their
own and would each write every result. The lease is a key set only while absent, with an expiry
its holder renews. A run writes results only while it is sure it still holds the lease: from
before the renewal it sent, plus the lease's length, less a margin for clocks. One that cannot
renew in time (paused, cut off from Redis, or outlived by its lease) stops writing and fails.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import socket
import time
from datetime import datetime, timezone

import structlog

LEASE_S = 30.0
DRIFT_S = 1.0  # how far this machine's clock may run behind Redis's over one lease
# 1: renewed; 0: another run holds it; -1: gone (expired, or lost with a Redis master that failed over
# before it was copied): a run elsewhere may have held it meanwhile, so it is not taken again
_RENEW = ("local v = redis.call('GET', KEYS[1]) if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) "
          "return 1 elseif v then return 0 end return -1")
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

log = structlog.get_logger("sluice.backfill")


class LeaseHeld(RuntimeError):
    """Another run of the job holds its lease."""


class LeaseUnavailable(RuntimeError):
    """The lease could not be taken: Redis could not be reached, or refused."""

    def __init__(self, redis_settings, exc: BaseException):
        from worker.redis_seeds import redacted

        super().__init__(f"the job's lease could not be taken in Redis at {redacted(redis_settings.url)} ({exc!r}); "
                         "without it a run of this job on another machine would not be seen. Once Redis answers, "
                         "the same command starts; --no-lease runs without it where no other machine runs this job")


class LeaseLost(RuntimeError):
    """This run can no longer be sure it holds the lease; it writes nothing more."""


def lease_key(prefix: str, job: str) -> str:
    return f"{prefix}:backfill:{{{job}}}:lease"


class JobLease:
    def __init__(self, client, key: str, job: str, lease_s: float = LEASE_S, on_lost=lambda: None,
                 clock=time.monotonic):
        self.client, self.key, self.job, self.lease_s = client, key, job, lease_s
        self.on_lost, self.clock = on_lost, clock
        self.holder = (f"{socket.gethostname()} pid {os.getpid()} since "
                       f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ} ({secrets.token_hex(4)})")
        self.valid_until = -math.inf
        self.lost: str | None = None
        self._task: asyncio.Task | None = None

    async def acquire(self, wait_s: float | None = None, waiting=lambda holder: None) -> None:
        """Takes the lease. One held by a run that stopped without releasing it (killed) ends on its own:
        this waits up to `wait_s` (by default a little over one lease) for that, calling `waiting` with
        the holder, then raises `LeaseHeld`; a holder still alive renews it and keeps it."""
        deadline = self.clock() + (self.lease_s * 1.2 + 2 if wait_s is None else wait_s)
        told = None
        while True:
            sent = self.clock()
            if await self.client.set(self.key, self.holder, nx=True, px=self._ms()):
                break
            holder = await self.client.get(self.key)
            who = holder.decode(errors="replace") if holder else "a run whose lease ended a moment ago"
            if self.clock() >= deadline:
                raise LeaseHeld(f"job {self.job} is running elsewhere: {who} holds its lease ({self.key}) and "
                                "kept it while this run waited; stop that run first, or wait for it")
            if who != told:
                waiting(who)
                told = who
            await asyncio.sleep(min(1.0, self.lease_s / 10))
        self.valid_until = sent + self.lease_s - self._margin()
        self._task = asyncio.create_task(self._renew_loop(), name="sluice-backfill-lease")

    def check(self) -> None:
        """Raises `LeaseLost` unless this run is sure it still holds the lease."""
        if self.lost is None and self.clock() >= self.valid_until:
            self._lose(f"its lease was not renewed within {self.lease_s:.0f} s")
        if self.lost is not None:
            raise LeaseLost(f"job {self.job} stopped writing results: {self.lost}, so another run may hold it; "
                            "what this run wrote is in its checkpoint, and the same command continues the job")

    async def renew(self) -> bool:
        """One renewal; False once the lease is lost. Errors (Redis away) propagate; the lease holds
        until `valid_until` regardless."""
        sent = self.clock()
        if sent >= self.valid_until:
            self._lose(f"its lease was not renewed within {self.lease_s:.0f} s")
            return False
        renewed = await self.client.eval(_RENEW, 1, self.key, self.holder, self._ms())
        if renewed == 1:
            self.valid_until = sent + self.lease_s - self._margin()
            return True
        self._lose("another run took its lease" if renewed == 0 else
                   "its lease was gone from Redis (lost in a failover, or ended)")
        return False

    async def _renew_loop(self) -> None:
        wait = self.lease_s / 3
        while self.lost is None:
            await asyncio.sleep(wait)
            try:
                async with asyncio.timeout(max(0.1, self.valid_until - self.clock())):
                    await self.renew()
                wait = self.lease_s / 3
            except Exception as exc:  # noqa: BLE001 - Redis away: retry until the lease ends
                if self.clock() >= self.valid_until:
                    self._lose(f"its lease could not be renewed ({exc!r})")
                else:
                    log.warning("backfill_lease_renewal_failed", job=self.job, error=repr(exc))
                    wait = min(1.0, self.lease_s / 10)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            log.error("backfill_lease_lost", job=self.job, why=why)
            self.on_lost()

    async def release(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.lost is None and self.valid_until > -math.inf:
            try:  # only its own: a lease another run took is left alone
                async with asyncio.timeout(5):
                    await self.client.eval(_RELEASE, 1, self.key, self.holder)
            except Exception as exc:  # noqa: BLE001 - it expires on its own
                log.warning("backfill_lease_release_failed", job=self.job, error=repr(exc))

    def _margin(self) -> float:
        return min(DRIFT_S, self.lease_s / 10)

    def _ms(self) -> int:
        return int(self.lease_s * 1000)


async def connect(redis_settings, timeout_s: float = 2.0):
    """A Redis Cluster client for the lease, from the workers' settings (URL, credentials, TLS)."""
    from worker.redis_client import cluster_client

    client = cluster_client(redis_settings, timeout_s)
    try:
        async with asyncio.timeout(timeout_s * 2):
            await client.initialize()
    except BaseException:
        await client.aclose()
        raise
    return client
