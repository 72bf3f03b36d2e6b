"""The group guard: which member it takes out of the group, and that it acts only when the pipe
closes without a stand-down (the broker side is tests/integration/test_group_guard.py)."""

import json
import subprocess
import sys
import time

import msgspec
import pytest

from worker.group_guard import MEMBER, STAND_DOWN, member_to_leave
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


def _guard(lines: list[str]) -> tuple[int, str, float]:
    """Run the guard process with these lines after its config, then close its pipe."""
    config = msgspec.json.encode({"kafka": KafkaSettings(bootstrap="127.0.0.1:9", request_timeout_ms=1000),
                                  "group": "g", "timeout_s": 1.0}).decode()
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
