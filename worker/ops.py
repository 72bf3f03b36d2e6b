"""`/metrics`, `/healthz` and `/readyz` on one small asyncio HTTP server."""

from __future__ import annotations

import asyncio
import json

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker import metrics


class OpsServer:
    def __init__(self, host: str, port: int, status):
        self.host, self.port = host, port
        self.status = status  # callable -> (ready: bool, details: dict)
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        if self.port:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            path = line.decode("latin-1").split(" ")[1] if line.count(b" ") >= 2 else "/"
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            code, ctype, body = self._route(path.split("?")[0])
            head = f"HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    def _route(self, path: str) -> tuple[str, str, bytes]:
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(metrics.REGISTRY)
        if path == "/healthz":
            return "200 OK", "application/json", b'{"status":"alive"}'
        if path == "/readyz":
            ready, details = self.status()
            body = json.dumps({"ready": ready, **details}).encode()
            return ("200 OK" if ready else "503 Service Unavailable"), "application/json", body
        return "404 Not Found", "text/plain", b"not found\n"
