"""The image's first process: keeps `sluice worker` off PID 1, so that its guards outlive it.

    python -m worker.container_init sluice worker

When the first process of a PID namespace dies, the kernel kills every other process in it. With
the worker as the container's PID 1, a SIGKILLed worker would take its group guard
(worker/group_guard.py) with it before the guard could send its LeaveGroup. So this process starts
the command as its child and stays as the parent of everything below: it passes the signals a
container runtime sends on to the child, reaps every process left to it (it is a child subreaper,
so this holds outside a container too), and once the command has exited waits up to
`LINGER_S` for what is left (the guards finishing their work) before it exits with the
command's status (128 + the signal's number for a command killed by a signal).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
LINGER_S = 10.0
PR_SET_CHILD_SUBREAPER = 36


def status_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal's number."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of the namespace's PID 1."""
    if os.getpid() != 1 and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m worker.container_init COMMAND [ARGS...]", file=sys.stderr)
        return 2
    become_subreaper()
    # held until the handlers below are in place: a SIGTERM sent right after the fork is forwarded,
    # not taken with this process's default action
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = os.fork()
    if child == 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: _forward(child, signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    code, deadline = None, None
    while True:
        try:
            if deadline is None:
                pid, status = os.wait()
            else:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    if time.monotonic() > deadline:
                        break  # what is still left ends with this process (or its namespace)
                    time.sleep(0.05)
                    continue
        except ChildProcessError:
            break  # nothing left
        if pid == child:
            code, deadline = status_code(status), time.monotonic() + LINGER_S
    return 0 if code is None else code


def _forward(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
