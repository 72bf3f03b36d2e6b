"""worker/engine_fork.py: the engine core forked from a forkserver, in the launcher's environment.

Each case runs in a fresh interpreter: a forkserver is one per process, and the test session's own
engine must find none started with another preload list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, os, sys
    from worker import engine_fork

    def report(path):
        with open("/proc/self/environ", "rb") as f:
            started_with = f.read().split(b"\\0")
        with open(path, "w") as f:
            json.dump({"late": os.environ.get("SLUICE_TEST_LATE"), "ppid": os.getppid(),
                       "method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
                       "preloaded": "colorsys" in sys.modules, "core_env": os.environ.get("SLUICE_TEST_CORE"),
                       "forkserver_env": b"SLUICE_TEST_FORKSERVER=at its start" in started_with,
                       "affinity": sorted(os.sched_getaffinity(0))}, f)

    if __name__ == "__main__":
        engine_fork.start_forkserver(preload=["colorsys"], env={"SLUICE_TEST_FORKSERVER": "at its start"})
        assert "SLUICE_TEST_FORKSERVER" not in os.environ  # the forkserver's alone
        if sys.argv[1] == "env":
            engine_fork.ENGINE_CORE_ENV["SLUICE_TEST_CORE"] = "added for the engine core"
            engine_fork.ENGINE_CORE_AFFINITY.add(min(os.sched_getaffinity(0)))
        os.environ["SLUICE_TEST_LATE"] = "set after the forkserver started"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "forkserver"  # what the launcher was told later
        context = engine_fork.EnvContext() if sys.argv[1] == "env" else engine_fork._FORKSERVER
        proc = context.Process(target=report, args=(sys.argv[2],))
        proc.start()
        proc.join(60)
        print(json.dumps({"exitcode": proc.exitcode, "launcher": os.getpid()}))
""")


def _run(tmp_path, mode: str) -> tuple[dict, dict]:
    script = tmp_path / "launch.py"
    script.write_text(CHILD)
    out = tmp_path / f"{mode}.json"
    done = subprocess.run([sys.executable, str(script), mode, str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


def test_engine_core_is_forked_from_the_preloaded_forkserver_in_the_launchers_environment(tmp_path):
    launched, seen = _run(tmp_path, "env")
    assert launched["exitcode"] == 0
    assert seen["ppid"] != launched["launcher"]  # forked by the forkserver, not spawned by the launcher
    assert seen["preloaded"]  # the module the forkserver imported came with the fork
    assert seen["late"] == "set after the forkserver started"
    assert seen["method"] == "forkserver"  # the launcher's environment as of start()
    assert seen["forkserver_env"]  # what the forkserver started with (the loader and libgomp read it)
    assert seen["core_env"] == "added for the engine core"
    assert seen["affinity"] == [min(os.sched_getaffinity(0))]


def test_a_plain_forkserver_process_would_miss_what_was_set_later(tmp_path):
    """Why the environment is carried: without it the engine core would lack what vLLM set meanwhile."""
    _, seen = _run(tmp_path, "plain")
    assert seen["late"] is None and seen["method"] == "spawn"
    assert seen["forkserver_env"] and seen["core_env"] is None
