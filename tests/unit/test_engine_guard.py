"""The engine guard's process bookkeeping, on a fake /proc."""

import os
import subprocess
import sys
import time

from worker import engine_guard as g


def fake_proc(tmp_path, procs):
    """procs: pid -> (ppid, state, start time); the command names have spaces and parentheses."""
    for pid, (ppid, state, start) in procs.items():
        rest = [state, str(ppid)] + ["0"] * 17 + [str(start)] + ["0"] * 5
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (VLLM::Engine (x)) " + " ".join(rest) + "\n")
    (tmp_path / "self").mkdir()
    return tmp_path


def test_descendants_walk_the_whole_tree_and_nothing_else():
    parent_of = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert g.descendants(parent_of, 10) == [11, 13, 12]
    assert g.descendants(parent_of, 12) == []
    assert g.descendants(parent_of, 99) == []


def test_parents_and_start_times_read_from_proc(tmp_path):
    proc = fake_proc(tmp_path, {10: (1, "S", 500), 11: (10, "R", 600)})
    assert g.parents(proc) == {10: 1, 11: 10}
    assert g.start_time(11, proc) == 600 and g.start_time(12, proc) is None
    assert g.parents(tmp_path / "no-proc-here") == {}  # not Linux: nothing guarded, nothing fails


def test_only_the_same_live_processes_are_killed(tmp_path):
    proc = fake_proc(tmp_path, {10: (1, "S", 500), 11: (1, "S", 999), 12: (1, "Z", 700)})
    killed = []
    lines = ["10 500", "11 600", "12 700", "13 800"]  # alive / pid reused / zombie / gone
    assert g.kill_survivors(lines, proc, kill=lambda pid, sig: killed.append(pid)) == [10]
    assert killed == [10]


def test_the_guard_kills_what_it_watches_when_its_pipe_closes():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        guard = subprocess.Popen([sys.executable, "-m", "worker.engine_guard"], stdin=subprocess.PIPE)
        guard.stdin.write(f"{victim.pid} {g.start_time(victim.pid)}\n".encode())
        guard.stdin.close()  # as when the worker dies
        guard.wait(timeout=30)
        assert victim.wait(timeout=10) == -9
    finally:
        victim.kill()


def _gone(pid: int, started: int, within_s: float = 10) -> bool:
    end = time.monotonic() + within_s
    while g.running(pid, started) and time.monotonic() < end:
        time.sleep(0.1)
    alive = g.running(pid, started)
    if alive:
        __import__("os").kill(pid, 9)
    return not alive


OWNER = """
import subprocess, sys, time
from worker.engine_guard import EngineGuard
guard = EngineGuard()
guard.before()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(guard.watch(), flush=True)
time.sleep(120)
"""


def test_a_sigkilled_owner_takes_its_engine_processes_with_it():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    watched = eval(owner.stdout.readline())
    assert len(watched) == 1
    started = g.start_time(watched[0])
    assert g.running(watched[0], started)
    owner.kill()  # SIGKILL: no cleanup of its own
    owner.wait()
    assert _gone(watched[0], started)


TRACKER = "# multiprocessing.resource_tracker\nimport time; time.sleep(120)"  # named as Python's resource tracker


LOADING_OWNER = """
import subprocess, sys, time
from worker.engine_guard import EngineGuard
guard = EngineGuard()
guard.before()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(engine.pid, flush=True)
time.sleep(120)  # still loading: watch() is never reached
"""


def test_an_owner_sigkilled_while_its_engine_loads_takes_the_engine_with_it():
    owner = subprocess.Popen([sys.executable, "-c", LOADING_OWNER], stdout=subprocess.PIPE, text=True)
    engine = int(owner.stdout.readline())
    started = g.start_time(engine)
    time.sleep(4 * g.FOLLOW_S)  # the guard has been told of it
    owner.kill()
    owner.wait()
    assert _gone(engine, started), "the engine outlived its owner, killed while the engine loaded"


def test_a_close_kills_only_what_outlived_the_engine_shutdown():
    guard = g.EngineGuard()
    guard.before()
    ended = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])  # ends with the engine
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # vLLM took it for dead
    tracker = subprocess.Popen([sys.executable, "-c", TRACKER])
    try:
        assert set(guard.watch()) == {ended.pid, left.pid}  # the tracker ends by itself once its owner has gone
        t0 = time.monotonic()
        assert guard.close(wait_s=1.0) == [left.pid]
        assert 1.0 <= time.monotonic() - t0 < 5
        assert ended.wait(timeout=5) == 0 and left.wait(timeout=5) == -9
        assert tracker.poll() is None
    finally:
        for p in (ended, left, tracker):
            p.kill()
            p.wait()


def test_cpu_times_count_what_a_watched_process_computes_and_nothing_while_it_is_stopped():
    guard = g.EngineGuard()
    guard.before()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    short = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        assert set(guard.watch()) == {spin.pid, short.pid}
        short.wait(timeout=10)
        first = guard.cpu_times()
        assert set(first) == {spin.pid}  # the one that ended is no longer counted
        time.sleep(1.0)
        computing = guard.cpu_times()[spin.pid] - first[spin.pid]
        assert computing >= 0.1, computing  # a core's worth, less what other processes take from it
        os.kill(spin.pid, 19)  # SIGSTOP
        time.sleep(0.05)
        stopped_at = guard.cpu_times()[spin.pid]
        time.sleep(0.5)
        assert guard.cpu_times()[spin.pid] == stopped_at
    finally:
        spin.kill()
        short.kill()
        for p in (spin, short):
            p.wait()
        guard.close(wait_s=0)


def test_a_close_after_a_clean_shutdown_waits_for_nothing():
    guard = g.EngineGuard()
    guard.before()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert guard.watch() == [child.pid]
    child.kill()
    child.wait()  # the engine's shutdown ended it
    t0 = time.monotonic()
    assert guard.close(wait_s=30) == []
    assert time.monotonic() - t0 < 1


# A stand-in for what a loading engine leaves under the worker: a child that ends on SIGTERM with a
# grandchild that ignores it (orphaned once its parent has gone), and Python's resource tracker.
IGNORES_TERM = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print(os.getpid(), flush=True); time.sleep(120)")
TREE = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", {IGNORES_TERM!r}], stdout=subprocess.PIPE, text=True)
print(grandchild.stdout.readline().strip(), flush=True)  # once it ignores SIGTERM
time.sleep(120)
'''], stdout=subprocess.PIPE, text=True)
tracker = subprocess.Popen([sys.executable, "-c", {TRACKER!r}])
print(child.pid, child.stdout.readline().strip(), tracker.pid, flush=True)
time.sleep(120)
"""


def test_end_descendants_terms_then_kills_and_follows_orphans():
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        child, grandchild, tracker = (int(p) for p in root.stdout.readline().split())
        started = {p: g.start_time(p) for p in (child, grandchild, tracker)}
        t0 = time.monotonic()
        signalled = g.end_descendants(1.0, root=root.pid)
        took = time.monotonic() - t0
        assert signalled == sorted([child, grandchild])  # the tracker is left to end itself
        # the child ended on SIGTERM; its orphaned grandchild, which ignores it, was killed after the grace
        assert not g.running(child, started[child]) and not g.running(grandchild, started[grandchild])
        assert 1.0 <= took < 5, took
        assert g.running(tracker, started[tracker])
    finally:
        for pid in g.descendants(g.parents(), root.pid):
            with __import__("contextlib").suppress(ProcessLookupError):
                __import__("os").kill(pid, 9)
        root.kill()
        root.wait()


def test_end_descendants_returns_as_soon_as_everything_ended():
    root = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                             "print(p.pid, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        child = int(root.stdout.readline())
        t0 = time.monotonic()
        assert g.end_descendants(30.0, root=root.pid) == [child]
        assert time.monotonic() - t0 < 5
    finally:
        root.kill()
        root.wait()


REVIVING_OWNER = """
import subprocess, sys, time
from worker.engine_guard import EngineGuard
guard = EngineGuard()
guard.before()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
guard.watch()
print(engine.pid, guard.pid, flush=True)
sys.stdin.readline()  # the test has killed the guard
print("revived", guard.revive(), guard.revive(), flush=True)  # started again once: the second finds it running
time.sleep(120)
"""


def test_a_guard_killed_under_a_running_engine_is_started_again_and_still_covers_it():
    owner = subprocess.Popen([sys.executable, "-c", REVIVING_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        engine, first = (int(x) for x in owner.stdout.readline().split())
        started = g.start_time(engine)
        __import__("os").kill(first, 9)
        time.sleep(0.3)  # the owner reaps it in revive(); killed, it held nothing
        assert g.running(engine, started)
        owner.stdin.write("killed\n")
        owner.stdin.flush()
        second, again = next(line for line in owner.stdout if line.startswith("revived")).split()[1:]  # after its log line
        assert second != "None" and int(second) != first and again == "None"
        owner.kill()  # the worker dies: the new guard ends the engine
        owner.wait()
        assert _gone(engine, started), "the engine outlived its owner after its guard was started again"
    finally:
        owner.kill()


LOADING_GUARD_KILLED = """
import subprocess, sys, time
from worker.engine_guard import EngineGuard
guard = EngineGuard()
guard.before()
print(guard.pid, flush=True)
sys.stdin.readline()  # the test has killed the guard
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(engine.pid, flush=True)
time.sleep(120)  # still loading
"""


def test_a_guard_killed_while_the_engine_loads_is_started_again_by_the_follower():
    owner = subprocess.Popen([sys.executable, "-c", LOADING_GUARD_KILLED], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        __import__("os").kill(int(owner.stdout.readline()), 9)
        owner.stdin.write("killed\n")
        owner.stdin.flush()
        engine = int(owner.stdout.readline())
        started = g.start_time(engine)
        time.sleep(6 * g.FOLLOW_S)  # a new guard, told of the engine process
        owner.kill()
        owner.wait()
        assert _gone(engine, started), "the engine outlived its owner, whose guard was killed while it loaded"
    finally:
        owner.kill()


def test_a_close_after_the_guard_died_still_kills_the_leftovers():
    guard = g.EngineGuard()
    guard.before()
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        guard.watch()
        __import__("os").kill(guard.pid, 9)
        time.sleep(0.2)
        assert guard.close(wait_s=0.2) == [left.pid]
        assert left.wait(timeout=5) == -9
    finally:
        left.kill()
        left.wait()


def test_started_environ_is_what_a_process_started_with():
    child = subprocess.Popen([sys.executable, "-c", "import os, time; os.environ['LATER'] = '1'; print(flush=True); "
                              "time.sleep(30)"], env={**os.environ, "SLUICE_TEST_STARTED": "yes"},
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # past its exec: before, /proc shows the environment of this process
        env = g.started_environ(child.pid)
        assert env["SLUICE_TEST_STARTED"] == "yes" and "LATER" not in env
    finally:
        child.kill()
        child.wait()
    assert g.started_environ(child.pid) is None  # gone
