"""The real engine's start on CPU: its engine core forked from sluice's forkserver (worker/engine_fork.py),
running the model itself with the OpenMP binding vLLM would give a model runner (worker/omp_binding.py)."""

from __future__ import annotations

import os

import pytest

from tests.integration.helpers import cmdline
from worker import engine_guard, omp_binding
from worker.engine import ONEDNN_CACHE_ENV, GenParams

pytestmark = pytest.mark.integration


async def test_engine_core_is_forked_from_the_forkserver_and_runs_the_model_itself(engine):
    if engine.device != "cpu" or engine.config.engine_start != "inprocess":
        pytest.fail(f"this test needs the CPU engine with SLUICE_ENGINE_START=inprocess (the default), not "
                    f"{engine.device}/{engine.config.engine_start}")
    assert engine.resolved["executor"] == "UniProcExecutor"
    parent_of = engine_guard.parents()
    servers = [p for p, pp in parent_of.items() if pp == os.getpid() and b"multiprocessing.forkserver" in cmdline(p)]
    assert len(servers) == 1, "no forkserver under this process"
    cores = [p for p, pp in parent_of.items() if pp == servers[0]]
    assert len(cores) == 1, f"expected one engine core forked by the forkserver, found {cores}"
    assert not [p for p, pp in parent_of.items() if pp == cores[0]], "the engine core started a model runner"
    # the forkserver, and so the engine core forked from it, started with the binding vLLM chose
    started_with = engine_guard.started_environ(servers[0])
    wanted = omp_binding.expected(engine._llm.vllm_config)
    assert {k: started_with.get(k, "") for k in wanted} == wanted
    assert "libgomp" in started_with["LD_PRELOAD"]
    # and with the bound on oneDNN's primitive cache, which the library reads as it loads there
    assert started_with.get(ONEDNN_CACHE_ENV) == str(engine.config.onednn_cache_capacity)
    # libgomp bound the engine core's threads to the first of those cores, as in vLLM's own runner
    first = int(wanted["GOMP_CPU_AFFINITY"].split()[0])
    assert os.sched_getaffinity(cores[0]) == {first}
    text = []
    async for d in engine.generate("fork-1", engine._tokenizer.encode("The capital of France is"), GenParams(8), 0):
        text.append(d.text)
    assert "".join(text).strip(), "the engine core generated nothing"
