"""vLLM's OpenAI-compatible server as a benchmark arm: the unchanged server, which also writes the
engine configuration it resolved into its log (`bench.harness.ARM_ENGINE`), like every other arm.

    python bench/serve_arm.py --port 8000 --model ... (vLLM's server flags)
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vllm.v1.engine import async_llm  # noqa: E402

from bench import common  # noqa: E402
from bench.harness import ARM_ENGINE  # noqa: E402
from worker.engine import describe_config  # noqa: E402

_init = async_llm.AsyncLLM.__init__
_inprocess = common.inprocess_vllm_arm()  # `--engine-start inprocess`: before vLLM spawns its engine core


def _reporting_init(self, vllm_config, *args, **kwargs):
    if _inprocess is not None:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        vllm_config.parallel_config.distributed_executor_backend = UniProcExecutor
        kwargs["executor_class"] = UniProcExecutor
        common.check_inprocess_vllm_arm(vllm_config, _inprocess)
    print(ARM_ENGINE + json.dumps(describe_config(vllm_config)), flush=True)
    _init(self, vllm_config, *args, **kwargs)


async_llm.AsyncLLM.__init__ = _reporting_init

if __name__ == "__main__":
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
