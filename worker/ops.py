"""`/metrics`, `/healthz` and `/readyz` on aiohttp's HTTP server.

`/metrics` is one scrape target for everything a worker knows: sluice's own registry
(`worker/metrics.py`) and the process-wide registry where vLLM's engine metrics
(`vllm:*`) and the process collectors live.
"""

from __future__ import annotations

import asyncio
import json
import os

import prometheus_client
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker import engine_guard, metrics


def exposition() -> bytes:
    return generate_latest(metrics.REGISTRY) + generate_latest(prometheus_client.REGISTRY)


class OpsServer:
    def __init__(self, host: str, port: int, status):
        self.host, self.port = host, port
        self.status = status  # callable -> (ready: bool, details: dict)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        if not self.port:
            return
        app = web.Application(client_max_size=1024)  # GETs only: no request bodies
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        # keep-alive connections idle longer than this are closed; no access log: probes every few seconds
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=15, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, shutdown_timeout=1).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _request) -> web.Response:
        metrics.ready.set(1 if self.status()[0] else 0)
        # the engine core is a process of its own: its growth shows nowhere else on this target
        metrics.engine_memory.set(await asyncio.to_thread(engine_guard.resident_bytes_below, os.getpid()))
        return web.Response(body=exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def _readyz(self, _request) -> web.Response:
        ready, details = self.status()
        return web.Response(body=json.dumps({"ready": ready, **details}).encode(), status=200 if ready else 503,
                            content_type="application/json")
