"""The fault schedule of a chaos run and how each fault is applied.

Kinds: `kill` (SIGKILL a worker mid-stream; the pool restarts it), `pause` (SIGSTOP a worker past
the group's session timeout, then SIGCONT: a zombie that wakes up), `join` (one more worker),
`leave` (SIGTERM a worker, which drains; not replaced), `redis` (SIGKILL a Redis Cluster master,
restart it after its replica took over), `broker` (SIGSTOP the broker past the producers'
request timeout, then SIGCONT).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from worker import devstack

KINDS = ("kill", "pause", "join", "leave", "redis", "broker")
# Spread over the sending window: at least 3 kills, a pause, a join and a leave, a Redis master, a broker pause.
DEFAULT = "kill,join,pause,kill,redis,leave,broker,kill"


class FaultError(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str


def schedule(spec: str, window_s: float) -> list[Fault]:
    """'kill,join,...' spread evenly over the sending window, starting after a tenth of it."""
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise FaultError(f"unknown fault {bad[0]!r}: use {', '.join(KINDS)}")
    step = window_s * 0.85 / max(1, len(kinds))
    return [Fault(round(window_s * 0.1 + i * step, 1), k) for i, k in enumerate(kinds)]


def _redis_nodes(cli: str) -> list[tuple[int, str]]:
    """(port, flags) of the cluster's nodes, asked of whichever node answers."""
    for port in devstack.REDIS_PORTS:
        try:
            out = subprocess.run([cli, "-h", devstack.HOST, "-p", str(port), "cluster", "nodes"],
                                 capture_output=True, text=True, timeout=3).stdout
        except subprocess.TimeoutExpired:
            continue
        rows = [(int(p[1].split(":")[1].split("@")[0]), p[2]) for p in (ln.split() for ln in out.splitlines())
                if len(p) > 2]
        if rows:
            return rows
    raise FaultError("no Redis Cluster node answers")


def _pid(svc: devstack.Service, state: Path) -> int:
    try:
        return int(svc.pidfile(state).read_text())
    except (OSError, ValueError):
        raise FaultError(f"{svc.name} was not started by `sluice dev up` in {state}: its faults need its pid") from None


def check_stack(state: Path, kinds: set[str]) -> None:
    """Fail before the run when a scheduled fault could not be applied."""
    if "broker" in kinds:
        _pid(devstack.BROKER, state)
    if "redis" in kinds:
        for svc in devstack.REDIS:
            _pid(svc, state)


class Injector:
    def __init__(self, pool, state: Path, rng: random.Random, session_timeout_s: float, request_timeout_s: float,
                 redis_down_s: float = 8.0):
        self.pool, self.state, self.rng = pool, state.resolve(), rng
        self.session_timeout_s, self.request_timeout_s, self.redis_down_s = session_timeout_s, request_timeout_s, redis_down_s
        self.spans: list[tuple[float, float, str]] = []  # (start, end, label) in seconds since t0
        self._stopped: list[int] = []  # pids under SIGSTOP, resumed whatever happens

    def _now(self) -> float:
        return round(time.monotonic() - self.pool.t0, 2)

    async def apply(self, fault: Fault) -> str:
        start = self._now()
        detail = await getattr(self, f"_{fault.kind}")()
        self.spans.append((start, self._now(), f"{fault.kind} {detail}".strip()))
        self.pool.note(fault.kind, detail, at=start)
        return detail

    async def _kill(self) -> str:
        m = self.pool.signal(self.rng, signal.SIGKILL)
        return m.name if m else "(no worker)"

    async def _pause(self) -> str:
        m = self.pool.targets() and self.rng.choice(self.pool.targets())
        if not m:
            return "(no worker)"
        await self._freeze(m.proc.pid, self.session_timeout_s + 5, m)
        return f"{m.name} {self.session_timeout_s + 5:.0f}s"

    async def _join(self) -> str:
        self.pool.size += 1
        return self.pool.spawn().name

    async def _leave(self) -> str:
        targets = self.pool.targets()
        if len(targets) < 2:
            return "(kept the last worker)"
        m = self.rng.choice(targets)
        m.leaving = True
        self.pool.size -= 1
        m.proc.terminate()
        return m.name

    async def _redis(self) -> str:
        _, cli = devstack.redis_binaries()
        masters = [p for p, flags in await asyncio.to_thread(_redis_nodes, cli) if "master" in flags and "fail" not in flags]
        port = self.rng.choice(masters)
        svc = next(s for s in devstack.REDIS if s.port == port)
        os.kill(_pid(svc, self.state), signal.SIGKILL)
        await asyncio.sleep(self.redis_down_s)  # its replica is promoted after the node timeout (2 s)
        # `sluice dev up` restarts the dead node, which rejoins as a replica, and waits for cluster_state:ok
        await asyncio.to_thread(devstack.up, self.state, lambda *_: None)
        return f"master {port}"

    async def _broker(self) -> str:
        seconds = self.request_timeout_s + 5
        await self._freeze(_pid(devstack.BROKER, self.state), seconds)
        return f"{seconds:.0f}s"

    async def _freeze(self, pid: int, seconds: float, member=None) -> None:
        os.kill(pid, signal.SIGSTOP)
        self._stopped.append(pid)
        if member is not None:
            member.paused = True
        try:
            await asyncio.sleep(seconds)
        finally:
            self._resume(pid)
            if member is not None:
                member.paused = False

    def _resume(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        if pid in self._stopped:
            self._stopped.remove(pid)

    def resume_all(self) -> None:
        for pid in list(self._stopped):
            self._resume(pid)
