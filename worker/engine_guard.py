"""An engine never outlives its worker.

vLLM runs the engine core and its model runner in child processes. When the worker is killed
with SIGKILL (OOM killer, `kill -9`, a chaos test) they are re-parented and keep running, and
their polling loops eat CPU that the next worker on the machine needs. So before the engine
starts, a small guard process (`python -m worker.engine_guard`, in its own session so a
terminal's Ctrl-C leaves it alone) is started, and told over a pipe the pids and start times of
the processes the engine starts, as they appear while it loads (a worker is likeliest to be
OOM-killed while it loads: before, one killed then left a 3 GB engine core running) and once it
is up. It holds nothing else: when the pipe closes without a clean stand-down, because the worker
died, it kills those processes that are still the same processes (pid and start time) and exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PROC = Path("/proc")
STAND_DOWN = b"stand-down"  # the last line of a clean shutdown
KILLED_WAIT_S = 1.0  # how long `end_descendants` waits for what it SIGKILLed to go
CLOSE_WAIT_S = 2.0  # how long the engine's processes may outlast its shutdown before they are killed
FOLLOW_S = 0.25  # how often the processes under a loading engine are looked for
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time


def stat_fields(pid: int, proc: Path = PROC) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 first); None if gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(fields: list[str]) -> float:
    """User and system CPU seconds of a process from its stat fields (fields 14 and 15)."""
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def start_time(pid: int, proc: Path = PROC) -> int | None:
    fields = stat_fields(pid, proc)
    return int(fields[19]) if fields else None  # field 22: start time in clock ticks since boot


def _still(fields: list[str] | None, started: int) -> bool:
    """Stat fields of the same process (its start time) that is not a zombie."""
    return fields is not None and fields[0] != "Z" and int(fields[19]) == started


def running(pid: int, started: int, proc: Path = PROC) -> bool:
    """The same process (pid and start time) still exists and is not a zombie."""
    return _still(stat_fields(pid, proc), started)


def parents(proc: Path = PROC) -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out = {}
    if not proc.is_dir():  # not Linux: nothing to read, nothing guarded
        return out
    for entry in proc.iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name), proc)
            if fields:
                out[int(entry.name)] = int(fields[1])
    return out


def resident_bytes(pid: int, proc: Path = PROC) -> int:
    """A process's resident memory (VmRSS); 0 if it is gone or a kernel thread."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def started_environ(pid: int, proc: Path = PROC) -> dict[str, str] | None:
    """The environment a process started with (what its loader, libgomp and oneDNN read); None if gone."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    pairs = [item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item]
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def resident_bytes_below(root: int, proc: Path = PROC) -> int:
    """The resident memory of every process below `root`, summed."""
    return sum(resident_bytes(pid, proc) for pid in descendants(parents(proc), root))


def descendants(parent_of: dict[int, int], root: int) -> list[int]:
    """Every process below `root`, parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], sorted(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return out


class EngineGuard:
    """Started around engine creation: `before()`, create the engine, `watch()`; `close()` after shutdown.
    A guard process that dies before `close()` (the OOM killer, a stray `kill`) is started again by
    `revive()`, and told every process watched so far: while the engine loads the follower thread
    revives it, once the engine is up the worker's guard watch (`worker/supervisor.py`)."""

    def __init__(self):
        self._before: set[int] = set()
        self._watched: dict[int, int] = {}  # pid -> start time, each told to the guard
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # the follower thread and the event loop both write to the guard
        self._loaded = threading.Event()
        self._follower: threading.Thread | None = None

    def before(self) -> None:
        """Start the guard, then tell it of every process started below this one from now on."""
        self._before = set(descendants(parents(), os.getpid()))
        self._spawn()
        self._follower = threading.Thread(target=self._follow, name="engine-guard-follow", daemon=True)
        self._follower.start()

    def _spawn(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "worker.engine_guard"], stdin=subprocess.PIPE,
                                      start_new_session=True, close_fds=True)
        self._write("".join(f"{p} {t}\n" for p, t in self._watched.items()))

    def _write(self, text: str) -> None:
        try:
            self._proc.stdin.write(text.encode())
            self._proc.stdin.flush()
        except OSError:  # the guard died: `revive()` starts another and tells it everything
            pass

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def revive(self) -> int | None:
        """Start the guard again if it has died before `close()`; returns the new guard's pid."""
        with self._lock:
            if self._proc is None or self._proc.poll() is None:
                return None
            died = self._proc.returncode
            self._spawn()
            pid = self._proc.pid
        guard_restarted("engine", died, pid)
        return pid

    def _follow(self) -> None:
        while not self._loaded.wait(FOLLOW_S):
            self.revive()
            self._tell_new()

    def _tell_new(self) -> None:
        with self._lock:
            guard = self._proc.pid if self._proc else None
            for pid in descendants(parents(), os.getpid()):
                if pid in self._before or pid in self._watched or pid == guard or ends_by_itself(pid):
                    continue
                started = start_time(pid)
                if started is not None and self._proc is not None:
                    self._watched[pid] = started
                    self._write(f"{pid} {started}\n")

    def watch(self) -> list[int]:
        """Once the engine is up: the last of its processes told to the guard; returns every watched pid."""
        self._loaded.set()
        if self._follower is not None:
            self._follower.join()
        self._tell_new()
        return list(self._watched)

    def cpu_times(self, proc: Path = PROC) -> dict[int, float]:
        """CPU seconds used so far by each watched process that is still the same process, running."""
        out = {}
        for pid, started in list(self._watched.items()):
            fields = stat_fields(pid, proc)
            if _still(fields, started):
                out[pid] = cpu_seconds(fields)
        return out

    def close(self, wait_s: float = CLOSE_WAIT_S) -> list[int]:
        """After the engine's shutdown: what it started should have ended with it. Whatever is still
        running after `wait_s` is killed: an engine core that vLLM took for dead and so never stopped
        (it does when the forkserver that started it dies: the core's exit status can no longer be
        read, and it kept running, 3 GB of memory, after its worker had exited). Then the guard stands
        down. Returns the pids killed.

        (Python's resource tracker is not watched: it ends with this process as usual.)
        """
        self._loaded.set()  # an engine that failed to start was never watched
        if self._follower is not None:
            self._follower.join()
            self._follower = None
        deadline = time.monotonic() + wait_s
        while self._left() and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = kill_survivors(f"{p} {t}" for p, t in self._left())
        self._watched = {}
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.write(STAND_DOWN + b"\n")
                proc.stdin.close()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):  # a guard that died meanwhile has nothing to stand down
                proc.kill()
        return killed

    def _left(self) -> list[tuple[int, int]]:
        return [(p, t) for p, t in self._watched.items() if running(p, t)]


def guard_restarted(guard: str, returncode: int, pid: int) -> None:
    """Logged and counted by whichever guard was started again (imported here: the guard processes
    themselves need neither)."""
    import structlog

    from worker import metrics

    metrics.guard_restarts.labels(guard).inc()
    structlog.get_logger("sluice.guards").warning(
        "guard_restarted", guard=guard, died_with=returncode, pid=pid,
        note="a worker killed while its guard was down would not have been covered")


def ends_by_itself(pid: int, proc: Path = PROC) -> bool:
    """Python's resource tracker: it removes the shared memory the engine's processes leave, and
    exits once this process has gone, so it is left to do both."""
    try:
        return b"multiprocessing.resource_tracker" in (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return True  # gone already


def end_descendants(grace_s: float, proc: Path = PROC, kill=os.kill, clock=time.monotonic, sleep=time.sleep,
                    root: int | None = None) -> list[int]:
    """End every process below this one (the engine core, its workers, the forkserver), as a worker
    stopped while its engine is still loading must: SIGTERM first (vLLM's engine core shuts down on
    it), SIGKILL whatever is left after `grace_s`, and wait for it to go. A process signalled is
    followed until it has gone, even once its parent went first and it is no longer below this one;
    and the tree is looked at again each round, since the loading thread may start another
    meanwhile. Returns the pids signalled."""
    root = os.getpid() if root is None else root
    deadline = clock() + grace_s
    signalled: dict[int, int] = {}  # pid -> start time: the same process, not a later one with its pid
    while True:
        below = [p for p in descendants(parents(proc), root) if not ends_by_itself(p, proc)]
        alive = {p: t for p in below if (t := start_time(p, proc)) is not None and running(p, t, proc)}
        alive.update((p, t) for p, t in signalled.items() if running(p, t, proc))
        if not alive:
            return sorted(signalled)
        late = clock() >= deadline
        for pid, started in alive.items():
            if late or pid not in signalled:
                try:
                    kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                signalled[pid] = started
        if clock() >= deadline + KILLED_WAIT_S:  # a SIGKILLed process is gone in milliseconds; not one in D state
            return sorted(signalled)
        sleep(0.05)


def kill_survivors(lines, proc: Path = PROC, kill=os.kill) -> list[int]:
    """Kill each listed process that still has the same start time; returns the pids killed."""
    killed = []
    for line in lines:
        pid, started = (int(x) for x in line.split())
        if running(pid, started, proc):
            try:
                kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lines = [ln for ln in sys.stdin.buffer.read().splitlines() if ln.strip()]  # returns when the pipe closes
    if lines and lines[-1] == STAND_DOWN:
        return
    kill_survivors(ln.decode() for ln in lines)


if __name__ == "__main__":
    main()
