"""The image's first process (worker/container_init.py): the command's status, signals passed on,
and what the command leaves behind waited for before it exits."""

import signal
import subprocess
import sys
import time

INIT = [sys.executable, "-m", "worker.container_init"]


def test_the_commands_exit_status_is_the_inits():
    assert subprocess.run([*INIT, "sh", "-c", "exit 3"], timeout=30).returncode == 3


def test_a_command_killed_by_a_signal_gives_128_plus_its_number():
    assert subprocess.run([*INIT, "sh", "-c", "kill -9 $$"], timeout=30).returncode == 128 + 9


def test_sigterm_is_passed_on_to_the_command():
    proc = subprocess.Popen([*INIT, "sh", "-c", "trap 'kill $!; exit 7' TERM; sleep 30 & wait"])
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 7


def test_what_the_command_leaves_running_is_waited_for(tmp_path):
    # the background job outlives the command (as a guard outlives a killed worker); the init is its
    # subreaper and exits only after it
    mark = tmp_path / "late"
    started = time.monotonic()
    rc = subprocess.run([*INIT, "sh", "-c", f"(sleep 1; echo done > {mark}) & exit 0"], timeout=30).returncode
    assert rc == 0 and mark.read_text().strip() == "done" and time.monotonic() - started >= 1
