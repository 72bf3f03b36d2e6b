"""A worker that dies leaves its consumer group at once, instead of after its session timeout.

A worker killed by SIGKILL or the OOM killer, or one that crashes, sends no LeaveGroup: the
coordinator keeps its partitions assigned to it until its heartbeats have been missing for the
session timeout (10 s by default), and only then do the survivors take them over. A worker that
is paused is not dead, so the session timeout cannot be short without evicting live workers.

So a small guard process (`python -m worker.group_guard`, in its own session so a kill of the
worker's process group leaves it alone, as `worker/engine_guard.py`'s) holds the read end of a
pipe from the worker. The worker sends it the connection settings and group once, then its
member id after each join, and `stand-down` when it stops cleanly (its consumer has left the
group itself). When the pipe closes without a stand-down, the worker is gone: a pipe closes only
when the process holding its write end has exited, never while it is paused. The guard then
sends the coordinator a LeaveGroup for the last member id and exits. The group rebalances at
once; the survivors learn of it at their next heartbeat.

It covers the worker process dying while the guard lives (a crash, SIGKILL, the OOM killer). A
container or machine that goes away takes the guard with it; the session timeout still covers that.

The worker also tells the guard each request it starts in the engine (`run {...}`: its claim token,
id, tenant, class, topic, partition and offset) and each it ends there (`end <token>`). A guard whose
worker died logs the requests it was running (`worker_died_running`): which readers saw a stream stop
mid-way, to be continued by whoever the group gives the partition to. With the handoff on
(SLUICE_GROUP_HANDOFF, worker/handoff.py) the guard also adds them to the group's handoff stream in
Redis, and a surviving worker continues each of them at once, before the rebalance. The worker's writes never
wait for the guard: a guard that does not read (paused) has its backlog dropped and is told `reset`
and what runs now once it reads again, so what it names is at worst what ran when it stopped reading.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

import msgspec

from worker.engine_guard import guard_restarted
from worker.settings import KafkaSettings

STAND_DOWN = "stand-down"
MEMBER = "member "
RUN = "run "
END = "end "
RESET = "reset"
# What the worker keeps for a guard that does not read before dropping it (and sending `reset` and the
# requests running then): far more than a second of a busy worker's lines.
MAX_PENDING_BYTES = 1 << 20
FLUSH_S = 0.005  # how long the worker's lines may wait to go out together (each write is a system call)
_RUN = RUN.encode()
_encode = msgspec.json.Encoder().encode  # one encoder, reused: a line per request entering the engine
RUNS_LOGGED = 1000  # a dying worker's report names at most this many requests
HANDOFF_KEEP = 1000  # entries a group's handoff stream keeps (about that many deaths)


class GuardState:
    """What the worker has told its guard, a line at a time. Lines it cannot read (a half line cut
    by a dropped backlog) are skipped."""

    def __init__(self):
        self.member = ""
        self.stood_down = False
        self.runs: dict[str, dict] = {}  # claim token -> the request it runs in the engine

    def feed(self, line: str) -> None:
        if line == STAND_DOWN:
            self.stood_down = True
            return
        self.stood_down = False  # a stand-down only counts as the last word
        if line.startswith(MEMBER):
            self.member = line[len(MEMBER):]
        elif line == RESET:
            self.runs.clear()
        elif line.startswith(END):
            self.runs.pop(line[len(END):], None)
        elif line.startswith(RUN):
            try:
                run = json.loads(line[len(RUN):])
                self.runs[str(run["owner"])] = run
            except (ValueError, KeyError, TypeError):
                pass

    def member_to_leave(self) -> str | None:
        """The member id to take out of the group once the pipe has closed: the last one the worker
        sent, unless it stood down (or never joined)."""
        return None if self.stood_down or not self.member else self.member

    def running(self) -> list[dict]:
        """The requests the worker had in its engine when it died (none after a stand-down)."""
        return [] if self.stood_down else list(self.runs.values())


def member_to_leave(lines: list[str]) -> str | None:
    state = GuardState()
    for line in lines:
        state.feed(line)
    return state.member_to_leave()


async def leave_group(kafka_options: dict, group_id: str, member_id: str, timeout_s: float) -> int:
    """Send LeaveGroup for `member_id` to `group_id`'s coordinator; returns the Kafka error code."""
    from aiokafka import AIOKafkaClient
    from aiokafka.client import CoordinationType
    from aiokafka.protocol.group import LeaveGroupRequest

    client = AIOKafkaClient(**kafka_options, client_id="sluice-group-guard")
    try:
        async with asyncio.timeout(timeout_s):
            await client.bootstrap()
            node = await client.coordinator_lookup(CoordinationType.GROUP, group_id)
            response = await client.send(node, LeaveGroupRequest(group_id, member_id))
        return response.error_code
    finally:
        await client.close()


class GroupGuard:
    """Started once the worker's consumer exists; `joined()` after each assignment; `close()` after
    the consumer has stopped (it left the group itself). A guard that dies while the worker runs
    (the OOM killer, a stray `kill`) is started again by `revive()`, told the same settings, the
    last member id and the requests running. `running()` and `ended()` as requests enter and leave the engine."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._first = ""
        self._member = ""
        self._stderr = None
        self._runs: dict[str, bytes] = {}  # claim token -> its `run` line, for a revived or reset guard
        self._pending = bytearray()  # written as the pipe takes it, never waiting for the guard
        self._lock = threading.Lock()  # `close` runs in a thread
        self._flush_at: asyncio.TimerHandle | asyncio.Handle | None = None

    def start(self, kafka: KafkaSettings, group_id: str, timeout_s: float, stderr=None, handoff=None) -> None:
        """`stderr`: where the guard's log lines go (the worker's own stderr by default). `handoff`:
        (RedisSettings, stream key) where a dead worker's running requests are handed over, or None."""
        self._first = msgspec.json.encode({"kafka": kafka, "group": group_id, "timeout_s": timeout_s,
                                           "handoff": {"redis": handoff[0], "key": handoff[1]} if handoff else None,
                                           }).decode()
        self._stderr = stderr
        self._spawn()

    def _spawn(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "worker.group_guard"], stdin=subprocess.PIPE,
                                      stderr=self._stderr, start_new_session=True, close_fds=True)
        fd = self._proc.stdin.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        with self._lock:
            self._pending = bytearray(self._everything(self._first))
        self._flush()

    @property
    def active(self) -> bool:
        return self._proc is not None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _everything(self, first: str = "") -> bytes:
        """What a guard that has heard nothing (new, or whose backlog was dropped) needs to hear."""
        lines = [first.encode() + b"\n"] if first else [b"\n", RESET.encode() + b"\n"]
        if self._member:
            lines.append(f"{MEMBER}{self._member}\n".encode())
        return b"".join(lines + list(self._runs.values()))

    def joined(self, member_id: str) -> None:
        if member_id:
            self._member = member_id
            self._send(MEMBER + member_id)

    def running(self, owner: str, run: dict) -> None:
        """A request began running in the engine under claim token `owner` (`run` names it)."""
        if self._proc is None or not owner:
            return
        run["owner"] = owner
        line = _RUN + _encode(run) + b"\n"
        self._runs[owner] = line
        self._queue(line)

    def ended(self, owner: str) -> None:
        """The request of claim token `owner` no longer runs in the engine (answered, suspended, aborted)."""
        if self._runs.pop(owner, None) is not None and self._proc is not None:
            self._queue(f"{END}{owner}\n".encode())

    def _queue(self, line: bytes) -> None:
        """Lines from the event loop go out together, at most FLUSH_S after the first of them: one
        write for every request that started or ended meanwhile. A worker that dies within that
        leaves the newest lines unsent; those requests are left to the rebalance (an unsent `end`
        names a request already answered, which a survivor finds answered and leaves)."""
        with self._lock:
            self._pending += line
        if self._flush_at is None:
            try:
                self._flush_at = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)
            except RuntimeError:  # no loop (a test, a thread): now
                self._flush()

    def revive(self) -> int | None:
        """Start the guard again if it has died before `close()`; returns the new guard's pid."""
        if self._proc is None or self._proc.poll() is None:
            return None
        died = self._proc.returncode
        self._spawn()
        guard_restarted("group", died, self._proc.pid)
        return self._proc.pid

    def _send(self, line: str) -> None:
        with self._lock:
            self._pending += line.encode() + b"\n"
        self._flush()

    def _flush(self) -> None:
        """Write what the pipe takes now. A guard that is not reading (paused) would fill the pipe, and
        waiting for it would hold the worker's event loop, so nothing here waits: what the pipe does
        not take waits here, is tried again shortly, and past MAX_PENDING_BYTES is replaced by `reset`
        and the requests running then."""
        self._flush_at = None
        with self._lock:
            if self._proc is None or not self._pending:
                return
            try:
                del self._pending[:os.write(self._proc.stdin.fileno(), self._pending)]
            except BlockingIOError:
                pass
            except (OSError, ValueError):  # the guard is gone: `revive()` starts another and tells it everything
                self._pending.clear()
                return
            if len(self._pending) > MAX_PENDING_BYTES:
                self._pending = bytearray(self._everything())
            if not self._pending:
                return
        try:
            self._flush_at = asyncio.get_running_loop().call_later(0.1, self._flush)
        except RuntimeError:
            pass

    def close(self) -> None:
        if self._proc is None:
            return
        with self._lock:
            proc, self._proc = self._proc, None
            self._pending.clear()  # moot once it stands down
            self._runs.clear()
        # a line break first ends any half line already written; a guard that does not read within
        # 2 s (paused) is killed instead: this worker's consumer has left the group itself
        rest = f"\n{STAND_DOWN}\n".encode()
        deadline = time.monotonic() + 2
        try:
            fd = proc.stdin.fileno()
            while rest:
                try:
                    rest = rest[os.write(fd, rest):]
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the guard does not read") from None
                    time.sleep(0.01)
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


async def hand_over(redis_settings, key: str, runs: list[dict], timeout_s: float) -> str:
    """Add a dead worker's running requests to its group's handoff stream; returns the entry's id."""
    from worker.redis_client import cluster_client

    started = time.monotonic()
    client = cluster_client(redis_settings, timeout_s)
    try:
        async with asyncio.timeout(timeout_s * 2):
            await client.initialize()
            connected = time.monotonic()
            entry = await client.xadd(key, {"runs": json.dumps(runs[:RUNS_LOGGED]), "at": repr(time.time())},
                                      maxlen=HANDOFF_KEEP, approximate=True)
        _log("handoff_timing", connect_s=round(connected - started, 3), add_s=round(time.monotonic() - connected, 3))
        return entry.decode() if isinstance(entry, bytes) else str(entry)
    finally:
        await client.aclose()


async def after_death(config: dict, member_id: str | None, runs: list[dict]) -> None:
    """The dead worker's member out of its group and its running requests handed over, both at once."""
    started = time.monotonic()

    async def leave():
        kafka = msgspec.convert(config["kafka"], KafkaSettings)
        try:
            code = await leave_group(kafka.options(), config["group"], member_id, config["timeout_s"])
        except Exception as exc:  # noqa: BLE001 - the session timeout still takes the partitions away
            _log("group_leave_failed", group=config["group"], member_id=member_id, error=repr(exc)[:300])
        else:
            _log("group_left_for_dead_worker", group=config["group"], member_id=member_id, error_code=code,
                 seconds=round(time.monotonic() - started, 3))

    async def hand():
        from worker.settings import RedisSettings

        handoff = config["handoff"]
        try:
            entry = await hand_over(msgspec.convert(handoff["redis"], RedisSettings), handoff["key"], runs,
                                    config["timeout_s"])
        except Exception as exc:  # noqa: BLE001 - the group's rebalance still moves them
            _log("handoff_failed", group=config["group"], requests=len(runs), error=repr(exc)[:300])
        else:
            _log("handed_over", group=config["group"], requests=len(runs), entry=entry,
                 seconds=round(time.monotonic() - started, 3))

    steps = ([leave()] if member_id is not None else []) + ([hand()] if runs and config.get("handoff") else [])
    if steps:
        await asyncio.gather(*steps)


def _log(event: str, **fields) -> None:
    """One JSON line on stderr, like the worker's own log lines."""
    stamp = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    print(json.dumps({**fields, "event": event, "logger": "sluice.group_guard", "level": "warning",
                      "timestamp": stamp}), file=sys.stderr, flush=True)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import aiokafka  # noqa: F401 - imported before it is needed: the leave is sent as soon as the worker dies

    first = sys.stdin.readline()
    if not first:
        return
    config = msgspec.json.decode(first)
    if config.get("handoff"):
        import redis.asyncio.cluster  # noqa: F401 - likewise for the handoff
    state = GuardState()
    for line in sys.stdin:  # ends when the pipe closes
        state.feed(line.rstrip("\n"))
    runs = state.running()
    asyncio.run(after_death(config, state.member_to_leave(), runs))
    if runs:
        _log("worker_died_running", group=config["group"], requests=len(runs), running=runs[:RUNS_LOGGED],
             note="these requests stopped mid-way; whoever the group gives their partitions to continues them")


if __name__ == "__main__":
    main()
