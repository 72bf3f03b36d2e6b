"""An engine never outlives its worker.

vLLM runs the engine core and its model runner in child processes. When the worker is killed
with SIGKILL (OOM killer, `kill -9`, a chaos test) they are re-parented and keep running, and
their polling loops eat CPU that the next worker on the machine needs. So after the engine
starts, a small guard process (`python -m worker.engine_guard`, in its own session so a
terminal's Ctrl-C leaves it alone) is told the engine's pids and start times over a pipe. It
holds nothing else: when the pipe closes without a clean stand-down, because the worker died, it
kills those processes that are still the same processes (pid and start time) and exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

PROC = Path("/proc")
STAND_DOWN = b"stand-down"  # the last line of a clean shutdown


def stat_fields(pid: int, proc: Path = PROC) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 first); None if gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def start_time(pid: int, proc: Path = PROC) -> int | None:
    fields = stat_fields(pid, proc)
    return int(fields[19]) if fields else None  # field 22: start time in clock ticks since boot


def running(pid: int, started: int, proc: Path = PROC) -> bool:
    """The same process (pid and start time) still exists and is not a zombie."""
    fields = stat_fields(pid, proc)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == started


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
    """Started around engine creation: `before()`, create the engine, `watch()`; `close()` after shutdown."""

    def __init__(self):
        self._before: set[int] = set()
        self._proc: subprocess.Popen | None = None

    def before(self) -> None:
        self._before = set(descendants(parents(), os.getpid()))

    def watch(self) -> list[int]:
        """Hand the processes started since `before()` to a guard; returns their pids."""
        new = [p for p in descendants(parents(), os.getpid()) if p not in self._before]
        lines = "".join(f"{p} {t}\n" for p in new if (t := start_time(p)) is not None)
        if not lines:
            return []
        self._proc = subprocess.Popen([sys.executable, "-m", "worker.engine_guard"], stdin=subprocess.PIPE,
                                      start_new_session=True, close_fds=True)
        self._proc.stdin.write(lines.encode())
        self._proc.stdin.flush()
        return new

    def close(self) -> None:
        """After a clean engine shutdown: the guard stands down without killing anything.

        (What is left, such as multiprocessing's resource tracker, ends with this process as usual.)
        """
        if self._proc is not None:
            self._proc.stdin.write(STAND_DOWN + b"\n")
            self._proc.stdin.close()
            self._proc.wait(timeout=10)
            self._proc = None


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
