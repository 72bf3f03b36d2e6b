"""Final answers in Redis Cluster, keyed by request id: the idempotency record.

A request id is the producer's idempotency key. When a worker answers a request
it stores the encoded final reply (`done` or `error`) with a TTL; a record that
arrives again with the same id gets that stored reply re-sent instead of a second
run. Lookups are pipelined per intake batch; writes are queued and pipelined by
one background task, so neither holds an engine slot. A worker that dies between
producing a reply and writing its answer leaves that id to be run again if it
is repeated; the offset watermark does not depend on this store. Redis trouble degrades, never stops: every call has a short timeout, and
after a failure Redis is left alone for a back-off period while requests are
served without the check.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from worker import metrics

log = structlog.get_logger("sluice.answers")
# RedisClusterException ("no reachable node") is not a RedisError.
REDIS_DOWN = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


class AnswerStore:
    def __init__(self, url: str, prefix: str, ttl_s: int, timeout_ms: int, backoff_s: float = 2.0):
        self.url, self.prefix, self.ttl_s = url, prefix, ttl_s
        self.timeout = timeout_ms / 1000
        self.backoff_s = backoff_s
        self._client: RedisCluster | None = None
        self._down_until = 0.0
        self.available = False
        self._pending: list[tuple[str, bytes]] = []
        self._flush_wanted = asyncio.Event()
        self._writer: asyncio.Task | None = None

    def key(self, request_id: str) -> str:
        # The hash tag keeps every key of one request in one slot (multi-key ops later).
        return f"{self.prefix}:req:{{{request_id}}}:answer"

    async def start(self) -> None:
        await self._connect()
        self._writer = asyncio.create_task(self._write_loop(), name="sluice-answers-writer")

    def put_later(self, request_id: str, final_reply: bytes, limit: int = 10_000) -> None:
        """Queue an answer for the writer; bounded, oldest dropped first while Redis is away."""
        self._pending.append((request_id, final_reply))
        if len(self._pending) > limit:
            del self._pending[: len(self._pending) - limit]
        self._flush_wanted.set()

    async def _write_loop(self) -> None:
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            await asyncio.sleep(0.002)  # let a few more answers join this round
            await self.flush()

    async def flush(self) -> None:
        batch, self._pending = self._pending, []
        await self.put_many(batch)

    async def _connect(self) -> bool:
        try:
            client = RedisCluster.from_url(self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
                                           cluster_error_retry_attempts=1)
            await asyncio.wait_for(client.initialize(), self.timeout * 4)
            self._client = client
            self._mark(True)
            return True
        except REDIS_DOWN as exc:
            self._mark(False, exc)
            return False

    def _mark(self, ok: bool, exc: Exception | None = None) -> None:
        if ok != self.available:
            if ok:
                log.info("redis_available", url=self.url)
            else:
                log.warning("redis_unavailable", url=self.url, error=repr(exc))
        self.available = ok
        metrics.redis_up.set(1 if ok else 0)
        if not ok:
            self._down_until = time.monotonic() + self.backoff_s

    async def _call(self, fn):
        if not self.available and time.monotonic() < self._down_until:
            return None
        if self._client is None and not await self._connect():
            return None
        try:
            result = await asyncio.wait_for(fn(self._client), self.timeout * 4)
            self._mark(True)
            return result
        except REDIS_DOWN as exc:
            self._mark(False, exc)
            return None

    async def get(self, request_id: str) -> bytes | None:
        return await self._call(lambda c: c.get(self.key(request_id)))

    async def get_many(self, request_ids: list[str]) -> list[bytes | None]:
        """Stored answers for a batch of ids in one pipelined round per node; Nones when degraded."""
        if not request_ids:
            return []

        async def run(c):
            pipe = c.pipeline()
            for rid in request_ids:
                pipe.get(self.key(rid))
            return await pipe.execute()

        found = await self._call(run)
        return list(found) if found is not None else [None] * len(request_ids)

    async def put(self, request_id: str, final_reply: bytes) -> None:
        await self._call(lambda c: c.set(self.key(request_id), final_reply, ex=self.ttl_s))

    async def put_many(self, items: list[tuple[str, bytes]]) -> None:
        async def run(c):
            pipe = c.pipeline()
            for rid, payload in items:
                pipe.set(self.key(rid), payload, ex=self.ttl_s)
            return await pipe.execute()

        if items:
            await self._call(run)

    async def ping(self) -> bool:
        return bool(await self._call(lambda c: c.ping()))

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
            await self.flush()
        if self._client is not None:
            try:
                await self._client.aclose()
            except REDIS_DOWN:
                pass
            self._client = None
