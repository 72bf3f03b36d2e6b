"""Worker processes of a chaos run: started, watched, restarted when they exit (as a Deployment
would), and the targets of process faults (SIGKILL, SIGSTOP/SIGCONT, SIGTERM)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Member:
    name: str
    proc: subprocess.Popen
    port: int
    paused: bool = False
    leaving: bool = False  # asked to leave: not restarted when it exits
    was_ready: bool = False  # answered /readyz 200 once: its engine is loaded and it has joined


@dataclass
class Pool:
    env: dict
    logs: Path
    size: int
    restart_delay_s: float = 2.0
    events: list = field(default_factory=list)  # (seconds since t0, what, detail)
    t0: float = field(default_factory=time.monotonic)
    members: list[Member] = field(default_factory=list)
    _started: int = 0

    def note(self, what: str, detail: str = "", at: float | None = None) -> None:
        self.events.append((round(time.monotonic() - self.t0, 2) if at is None else at, what, detail))
        self.events.sort(key=lambda e: e[0])

    def spawn(self) -> Member:
        self._started += 1
        name, port = f"w{self._started}", free_port()
        log = (self.logs / f"{name}.log").open("wb")
        # Its own process group, like a container: whatever it started goes when it goes (`_reap`).
        proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker"], stdout=log, stderr=subprocess.STDOUT,
                                env={**self.env, "SLUICE_METRICS_PORT": str(port)}, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        m = Member(name, proc, port)
        self.members.append(m)
        self.note("start", name)
        return m

    async def start(self, timeout_s: float) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for _ in range(self.size):
            self.spawn()
        await self.wait_ready(timeout_s)
        for m in self.members:
            m.was_ready = True

    async def wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while len(self.alive()) < self.size or not all(ready(m.port) for m in self.alive()):
            for m in self.members:
                if m.proc.poll() is not None:
                    tail = (self.logs / f"{m.name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"worker {m.name} exited with {m.proc.returncode} at start:\n{tail}")
            if time.monotonic() > end:
                raise RuntimeError(f"workers not ready within {timeout_s:.0f}s; see {self.logs}")
            await asyncio.sleep(0.5)

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.proc.poll() is None]

    def targets(self) -> list[Member]:
        """Members a fault may hit: running, not paused, not leaving; serving ones first (a worker
        still loading its engine holds no requests to lose)."""
        alive = [m for m in self.alive() if not m.paused and not m.leaving]
        return [m for m in alive if m.was_ready] or alive

    async def watch(self) -> None:
        """Restart members that exit, keeping `size` workers, and record every exit."""
        while True:
            for m in list(self.members):
                rc = m.proc.poll()
                if rc is None:
                    if not m.was_ready and not m.paused and await asyncio.to_thread(ready, m.port):
                        m.was_ready = True
                        self.note("ready", m.name)
                    continue
                self.members.remove(m)
                _reap(m)
                self.note("exit", f"{m.name} rc={rc}")
                if not m.leaving and len(self.members) < self.size:
                    await asyncio.sleep(self.restart_delay_s)
                    self.spawn()
            await asyncio.sleep(0.2)

    def signal(self, rng: random.Random, sig: signal.Signals) -> Member | None:
        targets = self.targets()
        if not targets:
            return None
        m = rng.choice(targets)
        os.kill(m.proc.pid, sig)
        return m

    def stop_all(self, grace_s: float = 30) -> None:
        for m in self.members:
            if m.paused:
                os.kill(m.proc.pid, signal.SIGCONT)
            if m.proc.poll() is None:
                m.leaving = True
                m.proc.terminate()
        end = time.monotonic() + grace_s
        for m in self.members:
            try:
                m.proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait()
            _reap(m)


def _reap(m: Member) -> None:
    """Kill what is left of a member's process group (an engine whose worker died while loading it
    has no guard yet), as a container runtime does when a container's main process exits."""
    try:
        os.killpg(m.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
