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
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

import msgspec

from worker.engine_guard import guard_restarted
from worker.settings import KafkaSettings

STAND_DOWN = "stand-down"
MEMBER = "member "


def member_to_leave(lines: list[str]) -> str | None:
    """The member id to take out of the group once the pipe has closed: the last one the worker
    sent, unless it stood down (or never joined)."""
    if lines and lines[-1] == STAND_DOWN:
        return None
    members = [line[len(MEMBER):] for line in lines if line.startswith(MEMBER)]
    return (members[-1] or None) if members else None


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
    (the OOM killer, a stray `kill`) is started again by `revive()`, told the same settings and the
    last member id."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._first = ""
        self._member = ""
        self._stderr = None

    def start(self, kafka: KafkaSettings, group_id: str, timeout_s: float, stderr=None) -> None:
        """`stderr`: where the guard's one log line goes (the worker's own stderr by default)."""
        self._first = msgspec.json.encode({"kafka": kafka, "group": group_id, "timeout_s": timeout_s}).decode()
        self._stderr = stderr
        self._spawn()

    def _spawn(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "worker.group_guard"], stdin=subprocess.PIPE,
                                      stderr=self._stderr, start_new_session=True, close_fds=True)
        self._send(self._first)
        if self._member:
            self._send(MEMBER + self._member)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def joined(self, member_id: str) -> None:
        if member_id:
            self._member = member_id
            self._send(MEMBER + member_id)

    def revive(self) -> int | None:
        """Start the guard again if it has died before `close()`; returns the new guard's pid."""
        if self._proc is None or self._proc.poll() is None:
            return None
        died = self._proc.returncode
        self._spawn()
        guard_restarted("group", died, self._proc.pid)
        return self._proc.pid

    def _send(self, line: str) -> None:
        if self._proc is None:
            return
        try:
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:  # the guard is gone: `revive()` starts another
            pass

    def close(self) -> None:
        if self._proc is not None:
            self._send(STAND_DOWN)
            proc, self._proc = self._proc, None
            try:
                proc.stdin.close()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


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
    lines = [line.rstrip("\n") for line in sys.stdin]  # returns when the pipe closes
    member_id = member_to_leave(lines)
    if member_id is None:
        return
    started = time.monotonic()
    kafka = msgspec.convert(config["kafka"], KafkaSettings)
    try:
        code = asyncio.run(leave_group(kafka.options(), config["group"], member_id, config["timeout_s"]))
    except Exception as exc:  # noqa: BLE001 - the session timeout still takes the partitions away
        _log("group_leave_failed", group=config["group"], member_id=member_id, error=repr(exc)[:300])
        return
    _log("group_left_for_dead_worker", group=config["group"], member_id=member_id, error_code=code,
         seconds=round(time.monotonic() - started, 3))


if __name__ == "__main__":
    main()
