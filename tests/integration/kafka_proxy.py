"""A broker of a test's own behind a proxy it controls, for faults the embedded broker cannot make.

The broker (Tansu, memory storage) listens on one port and advertises the proxy's, so every
connection a client makes (bootstrap, group coordinator, partition leaders) goes through the proxy.
"""

from __future__ import annotations

import asyncio
import struct
import subprocess

from worker import devstack

HOST = "127.0.0.1"
FETCH = 1  # the Kafka protocol's api key of a Fetch request


async def listening(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30) -> None:
    """Until `proc` accepts connections on `port`; fails at once if it exits, or after `timeout_s`."""
    for _ in range(int(timeout_s * 10)):
        if devstack.port_open(port):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}")
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port}")


async def start_broker_behind(broker_port: int, proxy_port: int) -> subprocess.Popen:
    """A Tansu broker on `broker_port` that advertises `proxy_port`; returns once it accepts connections."""
    url = f"tcp://{HOST}:{broker_port}"
    proc = subprocess.Popen([devstack.tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url",
                             f"tcp://{HOST}:{proxy_port}", "--storage-engine", "memory://tansu/"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        await listening(broker_port, proc, "the test's broker", timeout_s=10)
    except RuntimeError:
        proc.kill()
        raise
    return proc


async def pipe(src, dst) -> None:
    """Bytes from `src` to `dst` until either side closes; then `dst` is closed."""
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        dst.close()


def _is_fetch_of(frame: bytes, client_id: str) -> bool:
    """Whether a request frame is a Fetch sent by `client_id`: the request header is the api key
    (int16), api version (int16), correlation id (int32), then the client id (int16 length, bytes)."""
    if struct.unpack(">h", frame[:2])[0] != FETCH:
        return False
    size = struct.unpack(">h", frame[8:10])[0]
    return size >= 0 and frame[10:10 + size] == client_id.encode()


class FetchHoldingProxy:
    """Passes Kafka requests on frame by frame. While `hold_fetches_of` names a client id, a connection
    on which that client sends a Fetch is held from that request on: nothing more it sends reaches
    the broker, so that client's fetches are never answered, while its other connections (metadata,
    the group coordinator) and every other client are served. Holding the whole connection keeps the
    answers a client waits for in order. `held` counts the connections held so far."""

    def __init__(self, listen_port: int, broker_port: int):
        self.listen_port, self.broker_port = listen_port, broker_port
        self.hold_fetches_of: str | None = None
        self.held = 0
        self._server = None
        self._writers: set = set()
        self._connections: set = set()

    async def start(self) -> "FetchHoldingProxy":
        self._server = await asyncio.start_server(self._serve, HOST, self.listen_port)
        return self

    async def _serve(self, reader, writer) -> None:
        self._connections.add(asyncio.current_task())
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.broker_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        answers = asyncio.ensure_future(pipe(up_reader, writer))
        held = False
        try:
            while True:
                size = await reader.readexactly(4)
                frame = await reader.readexactly(struct.unpack(">i", size)[0])
                if not held and self.hold_fetches_of is not None and _is_fetch_of(frame, self.hold_fetches_of):
                    held = True
                    self.held += 1
                if not held:
                    up_writer.write(size + frame)
                    await up_writer.drain()
        except (asyncio.IncompleteReadError, OSError):
            pass
        finally:
            up_writer.close()
            answers.cancel()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()
        if self._connections:  # each ends on its closed streams; left pending, the loop's close would cancel them
            await asyncio.wait(self._connections, timeout=5)
