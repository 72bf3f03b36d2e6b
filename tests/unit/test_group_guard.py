"""The group guard: which member it takes out of the group, and that it acts only when the pipe
closes without a stand-down (the broker side is tests/integration/test_group_guard.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from worker.group_guard import END, MEMBER, RESET, RUN, STAND_DOWN, GuardState, member_to_leave
from worker.settings import KafkaSettings


@pytest.mark.parametrize("lines, expected", [
    ([], None),                                                 # died before it ever joined
    ([MEMBER + "m-1"], "m-1"),                                  # died holding partitions
    ([MEMBER + "m-1", MEMBER + "m-2"], "m-2"),                  # rejoined under a new id: the last one
    ([MEMBER + "m-1", STAND_DOWN], None),                       # stopped cleanly: its consumer left itself
    ([MEMBER + "m-1", STAND_DOWN, MEMBER + "m-2"], "m-2"),      # a stand-down only counts as the last word
    ([MEMBER], None),                                           # an empty id names nobody
])
def test_member_to_leave(lines, expected):
    assert member_to_leave(lines) == expected


def _guard(lines: list[str], handoff=None) -> tuple[int, str, float]:
    """Run the guard process with these lines after its config, then close its pipe."""
    config = msgspec.json.encode({"kafka": KafkaSettings(bootstrap="127.0.0.1:9", request_timeout_ms=1000),
                                  "group": "g", "timeout_s": 1.0, "handoff": handoff}).decode()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "worker.group_guard"], input="\n".join([config, *lines]) + "\n",
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr, time.monotonic() - started


def test_a_closed_pipe_after_a_member_makes_the_guard_try_to_leave():
    # nothing listens on port 9: the attempt fails within its timeout, is logged, and the guard exits
    rc, err, _ = _guard([MEMBER + "m-1"])
    assert rc == 0
    line = json.loads(err.strip().splitlines()[-1])
    assert line["event"] == "group_leave_failed" and line["member_id"] == "m-1" and line["group"] == "g"


def test_a_stand_down_makes_the_guard_exit_without_a_word():
    rc, err, _ = _guard([MEMBER + "m-1", STAND_DOWN])
    assert rc == 0 and err == ""


def test_a_guard_that_died_is_started_again_with_the_settings_and_the_last_member(tmp_path):
    from worker.group_guard import GroupGuard

    log = open(tmp_path / "guard.log", "w+")
    guard = GroupGuard()
    guard.start(KafkaSettings(bootstrap="127.0.0.1:9", request_timeout_ms=1000), "g", timeout_s=1.0, stderr=log)
    guard.joined("m-1")
    guard.joined("m-2")
    first = guard.pid
    assert guard.revive() is None  # running: nothing to do
    __import__("os").kill(first, 9)
    end = time.monotonic() + 5
    while (second := guard.revive()) is None and time.monotonic() < end:
        time.sleep(0.05)
    assert second is not None and second != first
    guard._proc.stdin.close()  # as when the worker dies: the pipe closes without a stand-down
    guard._proc.wait(timeout=30)
    log.seek(0)
    line = json.loads(log.read().strip().splitlines()[-1])
    assert line["event"] == "group_leave_failed" and line["member_id"] == "m-2" and line["group"] == "g"


def _run(owner: str, rid: str) -> str:
    return RUN + json.dumps({"owner": owner, "id": rid, "topic": "t", "partition": 0, "offset": 7})


@pytest.mark.parametrize("lines, running", [
    ([], []),
    ([_run("a#1", "r1")], ["r1"]),                                          # died running it
    ([_run("a#1", "r1"), END + "a#1"], []),                                 # it left the engine first
    ([_run("a#1", "r1"), _run("a#2", "r2"), END + "a#1"], ["r2"]),
    ([_run("a#1", "r1"), RESET, _run("a#2", "r2")], ["r2"]),                # a dropped backlog starts over
    ([_run("a#1", "r1"), 'run {"owner": "a#2", "id"', _run("a#3", "r3")], ["r1", "r3"]),  # a cut line is skipped
    ([_run("a#1", "r1"), "", STAND_DOWN], []),                              # a clean stop names nothing
    ([END + "a#9"], []),                                                    # an end of a run it never heard of
])
def test_guard_state_knows_what_ran_when_the_pipe_closed(lines, running):
    state = GuardState()
    for line in lines:
        state.feed(line)
    assert [run["id"] for run in state.running()] == running


def test_a_guard_whose_worker_died_names_the_requests_it_was_running():
    rc, err, _ = _guard([MEMBER + "m-1", _run("a#1", "r1"), _run("a#2", "r2"), END + "a#1"])
    assert rc == 0
    lines = [json.loads(line) for line in err.strip().splitlines() if line.startswith("{")]  # the guard's own
    assert [line["event"] for line in lines] == ["group_leave_failed", "worker_died_running"]
    assert lines[1]["requests"] == 1 and lines[1]["running"] == [
        {"owner": "a#2", "id": "r2", "topic": "t", "partition": 0, "offset": 7}]


def test_the_worker_never_waits_for_a_guard_that_does_not_read(tmp_path):
    """A paused guard: the worker's reports of requests entering and leaving the engine are kept
    (up to a bound) or dropped, never waited for; once the guard reads again it is told `reset` and
    what runs then, so a death after that names exactly those requests."""
    from worker.group_guard import MAX_PENDING_BYTES, GroupGuard

    log = open(tmp_path / "guard.log", "w+")
    guard = GroupGuard()
    guard.start(KafkaSettings(bootstrap="127.0.0.1:9", request_timeout_ms=1000), "g", timeout_s=1.0, stderr=log)
    guard.joined("m-1")
    time.sleep(1)  # the guard has read its settings
    os.kill(guard.pid, signal.SIGSTOP)
    try:
        slowest, runs = 0.0, 20_000  # about 3 MB of lines: far past the pipe and the bound
        for i in range(runs):
            started = time.monotonic()
            guard.running(f"w#{i}", {"id": f"r{i}", "topic": "sluice.requests.standard", "partition": i % 3,
                                     "offset": i, "tenant": "default", "cls": "standard"})
            if i % 3:
                guard.ended(f"w#{i}")
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < 0.5, slowest  # a blocking write would have waited here until SIGCONT
        assert len(guard._pending) <= MAX_PENDING_BYTES + 200 * (runs // 3 + 2)
    finally:
        os.kill(guard.pid, signal.SIGCONT)
    for i in range(0, runs, 3):
        if i >= 9:
            guard.ended(f"w#{i}")
    end = time.monotonic() + 10
    while guard._pending and time.monotonic() < end:  # no event loop here: flush by hand
        guard._flush()
        time.sleep(0.01)
    assert not guard._pending
    pid = guard.pid
    os.close(guard._proc.stdin.fileno())  # as when the worker dies: no stand-down
    end = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and guard._proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    log.seek(0)
    died = [json.loads(line) for line in log.read().splitlines() if '"worker_died_running"' in line]
    assert len(died) == 1 and sorted(run["id"] for run in died[0]["running"]) == ["r0", "r3", "r6"], died


def test_a_clean_close_stands_down_even_a_guard_that_does_not_read(tmp_path):
    """`close` waits at most about 2 s for a paused guard, then kills it: the worker's consumer has
    left the group itself, and a stop must not hang on its guard."""
    from worker.group_guard import GroupGuard

    log = open(tmp_path / "guard.log", "w+")
    guard = GroupGuard()
    guard.start(KafkaSettings(bootstrap="127.0.0.1:9", request_timeout_ms=1000), "g", timeout_s=1.0, stderr=log)
    guard.joined("m-1")
    time.sleep(1)
    proc = guard._proc
    os.kill(proc.pid, signal.SIGSTOP)
    for i in range(2_000):  # fills the pipe
        guard.running(f"w#{i}", {"id": f"r{i}", "pad": "x" * 100})
    started = time.monotonic()
    guard.close()
    assert time.monotonic() - started < 5
    assert proc.poll() is not None
    log.seek(0)
    said = log.read()
    assert "worker_died_running" not in said and "group_leave" not in said, said


def test_a_handoff_that_cannot_reach_redis_is_logged_and_the_leave_still_sent():
    """Both after-death steps run at once and each fails alone: Redis unreachable (nothing listens on
    port 9) is `handoff_failed`, and the leave is still tried; the requests are still named."""
    from worker.settings import RedisSettings

    rc, err, took = _guard([MEMBER + "m-1", _run("a#1", "r1")],
                           handoff={"redis": RedisSettings(url="redis://127.0.0.1:9"), "key": "p:handoff:{g}"})
    assert rc == 0
    events = {json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")}
    assert events == {"group_leave_failed", "handoff_failed", "worker_died_running"}, err
