"""The real engine's start on CPU: its engine core forked from sluice's forkserver (worker/engine_fork.py)."""

from __future__ import annotations

import os

import pytest

from worker import engine_guard
from worker.engine import GenParams

pytestmark = pytest.mark.integration


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


async def test_engine_core_is_forked_from_the_forkserver_and_serves(engine):
    if engine.device != "cpu" or engine.config.engine_start != "forkserver":
        pytest.fail(f"this test needs the CPU engine with SLUICE_ENGINE_START=forkserver, not "
                    f"{engine.device}/{engine.config.engine_start}")
    parent_of = engine_guard.parents()
    servers = [p for p, pp in parent_of.items() if pp == os.getpid() and b"multiprocessing.forkserver" in _cmdline(p)]
    assert len(servers) == 1, "no forkserver under this process"
    cores = [p for p, pp in parent_of.items() if pp == servers[0]]
    assert cores, "no engine core forked by the forkserver"
    runners = [p for p, pp in parent_of.items() if pp in cores]
    assert runners, "the engine core started no model runner"
    text = []
    async for d in engine.generate("fork-1", engine._tokenizer.encode("The capital of France is"), GenParams(8), 0):
        text.append(d.text)
    assert "".join(text).strip(), "the forked engine core generated nothing"
