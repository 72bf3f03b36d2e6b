"""Start vLLM's engine-core process from a forkserver that imported vLLM while the worker configured it.

On CPU, vLLM starts its engine core with `spawn`: a fresh interpreter that imports torch and vLLM
again (about 8 s on 2 cores), after the worker's own import and configuration; the engine core
then spawns its model runner, a second fresh interpreter. With `SLUICE_ENGINE_START=forkserver`
a forkserver process starts first and imports the engine core's modules while the worker imports
and configures vLLM; the engine core is then forked from it with those modules loaded, and still
spawns its model runner, so OpenMP is set up in a fresh process as vLLM requires on CPU. With
`inprocess` (the default on CPU) the forkserver starts with the OpenMP binding and preloads vLLM
would give that runner (worker/omp_binding.py), and the engine core runs the model itself.

A forked process keeps the forkserver's environment, and the worker and vLLM's configuration set
variables after the forkserver started, so each process started here runs in the launching
process's environment as it was at `start()`.
"""

from __future__ import annotations

import functools
import multiprocessing
import os

# what the engine core imports before it runs: loaded once, in the forkserver
PRELOAD = ("torch", "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "worker.kv_connector")
# and what an engine core that runs the model itself imports
PRELOAD_INPROCESS = PRELOAD + ("vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker")

_FORKSERVER = multiprocessing.get_context("forkserver")


# added to the launcher's environment in the engine core: the OpenMP variables the forkserver
# started with, which the engine core keeps when it runs the model itself (what a runner sees)
ENGINE_CORE_ENV: dict[str, str] = {}
# when set, the CPUs the engine core runs on: libgomp pins a process's first thread at start when
# the forkserver had a binding, and an engine core that spawns its runner must not keep it
ENGINE_CORE_AFFINITY: set[int] = set()


def _with_env(env: dict[str, str], affinity: set[int], target, *args, **kwargs):
    os.environ.clear()
    os.environ.update(env)
    if affinity:
        os.sched_setaffinity(0, affinity)
    return target(*args, **kwargs)


class EnvProcess(_FORKSERVER.Process):
    """A forkserver process whose target runs in the launcher's environment as of `start()`."""

    def start(self) -> None:
        self._target = functools.partial(_with_env, {**os.environ, **ENGINE_CORE_ENV}, set(ENGINE_CORE_AFFINITY),
                                         self._target)
        super().start()


class EnvContext(type(_FORKSERVER)):
    Process = EnvProcess


def start_forkserver(preload=PRELOAD, env: dict[str, str] | None = None) -> None:
    """Launch the forkserver; it imports `preload` in the background while this returns at once.
    `env` is added to its environment only (the loader and libgomp read it when it starts)."""
    # its children start the model runner vLLM's way on CPU (spawn), whatever this process is told later
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    multiprocessing.set_forkserver_preload(list(preload))
    from multiprocessing import forkserver

    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def use_forkserver_for_engine_core() -> None:
    """vLLM launches its engine core, and nothing else, through the forkserver."""
    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = EnvContext
