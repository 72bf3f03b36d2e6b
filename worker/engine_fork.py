"""Start vLLM's engine-core process from a forkserver that imported vLLM while the worker configured it.

On CPU, vLLM starts its engine core with `spawn`: a fresh interpreter that imports torch and vLLM
again (about 8 s on 2 cores), after the worker's own import and configuration. With
`SLUICE_ENGINE_START=forkserver` (the default on CPU) a forkserver process starts first and
imports the engine core's modules while the worker imports and configures vLLM; the engine core
is then forked from it with those modules loaded. Only that launch changes: the engine core
still starts its model runner with `spawn`, so OpenMP is set up in a fresh process as vLLM
requires on CPU.

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

_FORKSERVER = multiprocessing.get_context("forkserver")


def _with_env(env: dict[str, str], target, *args, **kwargs):
    os.environ.clear()
    os.environ.update(env)
    return target(*args, **kwargs)


class EnvProcess(_FORKSERVER.Process):
    """A forkserver process whose target runs in the launcher's environment as of `start()`."""

    def start(self) -> None:
        self._target = functools.partial(_with_env, dict(os.environ), self._target)
        super().start()


class EnvContext(type(_FORKSERVER)):
    Process = EnvProcess


def start_forkserver(preload=PRELOAD) -> None:
    """Launch the forkserver; it imports `preload` in the background while this returns at once."""
    # its children start the model runner vLLM's way on CPU (spawn), whatever this process is told later
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    multiprocessing.set_forkserver_preload(list(preload))
    from multiprocessing import forkserver

    forkserver.ensure_running()


def use_forkserver_for_engine_core() -> None:
    """vLLM launches its engine core, and nothing else, through the forkserver."""
    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = EnvContext
