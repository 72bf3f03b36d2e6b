"""The OpenMP environment vLLM gives its CPU model runner, worked out before vLLM is imported.

vLLM on CPU runs its model in a spawned interpreter because two things are read only when a
process starts: the loader's `LD_PRELOAD` (torch's libgomp, tcmalloc) and libgomp's thread
binding (`GOMP_CPU_AFFINITY` and `OMP_NUM_THREADS`, or Intel OpenMP's `KMP_AFFINITY`, or
`OMP_PLACES`). That interpreter imports torch and vLLM again: about 8 s on 2 cores. A forkserver
started with those values already in its environment hands them to every process forked from
it, so the engine core forked there can run the model itself (vLLM's one-process executor).

`predict` works the values out as vLLM does for one local model runner (`vllm/platforms/cpu.py`
and `vllm/utils/ompmultiprocessing.py`), from the machine and the environment alone. `expected`
asks vLLM's own code once the engine is configured. The engine runs the model in its engine
core only when the two agree (worker/engine.py); otherwise it starts the runner vLLM's way.
Only `expected` imports vLLM.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# every variable vLLM may set for its model runner's OpenMP (`OMPProcessManager.configure_omp_envs`)
OMP_KEYS = ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "KMP_AFFINITY", "KMP_BLOCKTIME", "KMP_TPAUSE",
            "OMP_PLACES", "OMP_PROC_BIND")
_OMP_LIBS = ("libomp", "libgomp", "libiomp")
# set by vLLM's CPU platform for its model runner, and read by torch._inductor when it is imported,
# which in a forkserver is before vLLM sets them
INDUCTOR_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1"}


@dataclass(frozen=True)
class LogicalCpu:
    id: int
    core: int
    node: int


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def ld_preload(current: str, torch_dir: Path | None, vllm_dir: Path | None, arch: str) -> str:
    """`LD_PRELOAD` as vLLM's CPU platform extends it: torch's libgomp when no OpenMP library is
    preloaded, then its bundled tcmalloc in front (the same globs, the first match of each)."""
    value = current
    if arch in ("x86_64", "aarch64") and torch_dir is not None and not any(lib in value for lib in _OMP_LIBS):
        found = []
        for libs in (torch_dir.parent / "torch.libs", torch_dir / "lib"):
            found.extend(glob.glob(os.path.join(libs, "libgomp*.so*")))
        if found:
            value = f"{value}:{found[0]}" if value else found[0]
    if arch in ("x86_64", "aarch64") and vllm_dir is not None and "libtcmalloc" not in value:
        for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*"):
            found = glob.glob(os.path.join(vllm_dir / "libs", pattern))
            if found:
                value = f"{found[0]}:{value}" if value else found[0]
                break
    return value


def parse_ids(text: str) -> list[int]:
    """'0-2,4' -> [0, 1, 2, 4], as vLLM parses CPU and memory-node lists."""
    ids: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return sorted(ids)


def auto_cores(cpus: list[LogicalCpu], allowed: set[int], nodes: list[int], reserve: int, arch: str) -> list[int]:
    """vLLM's automatic binding for one local runner: the allowed CPUs of the first visible memory
    node, one logical CPU per physical core on x86 (the highest id), all of them on Arm; the last
    `reserve` set aside for vLLM's other processes unless that would leave none."""
    if not nodes:
        return []
    per_core: dict[int, list[LogicalCpu]] = {}
    for cpu in cpus:
        if cpu.id in allowed and cpu.node == nodes[0]:
            per_core.setdefault(cpu.core, []).append(cpu)
    chosen = []
    for siblings in per_core.values():
        siblings = sorted(siblings, key=lambda c: c.id)
        chosen.extend(siblings[-1:] if arch == "x86_64" else siblings)
    ids = sorted(c.id for c in chosen)
    return ids[:-reserve] if 0 < reserve < len(ids) else ids


def omp_env(cores: list[int], preload: str) -> dict[str, str]:
    """The OpenMP variables vLLM sets for a runner bound to `cores`, by the OpenMP library preloaded."""
    env = {"OMP_NUM_THREADS": str(len(cores))}
    if "libiomp" in preload or "libomp" in preload:
        env.update(KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{','.join(map(str, cores))}]",
                   KMP_BLOCKTIME="5", KMP_TPAUSE="0")
    elif "libgomp" in preload:
        env["GOMP_CPU_AFFINITY"] = " ".join(map(str, cores))
    else:
        env.update(OMP_PLACES="{" + ",".join(map(str, cores)) + "}", OMP_PROC_BIND="true")
    return env


def machine_cpus() -> list[LogicalCpu]:
    """The online logical CPUs with their physical core and memory node, as vLLM reads them (lscpu)."""
    out = subprocess.run(["lscpu", "--json", "--extended=CPU,CORE,NODE", "--online"], capture_output=True,
                         text=True, timeout=10, check=True).stdout
    rows = json.loads(out.replace('"node": -', '"node": 0').replace('"node":-', '"node":0'))["cpus"]
    return [LogicalCpu(int(r["cpu"]), int(r["core"]), int(r.get("node") or 0)) for r in rows]


def memory_nodes(env: dict[str, str]) -> list[int]:
    with open("/proc/self/status") as f:
        allowed = next((parse_ids(line.split(":", 1)[1].strip()) for line in f
                        if line.startswith("Mems_allowed_list:")), [])
    visible = env.get("CPU_VISIBLE_MEMORY_NODES", "")
    return [n for n in parse_ids(visible) if n in allowed] if visible else allowed


def predict(env: dict[str, str], kv_connector: bool, cpus: list[LogicalCpu] | None = None,
            allowed: set[int] | None = None, nodes: list[int] | None = None) -> dict[str, str] | None:
    """`LD_PRELOAD` and the OpenMP variables vLLM will give its model runner, or None where this
    does not follow vLLM (not Linux on x86 or Arm, a simulated NUMA layout, no OpenMP library).

    For one runner (tensor and pipeline parallel size 1; the caller checks). vLLM reserves one core
    for its scheduler and one more with a KV connector (`VLLM_CPU_NUM_OF_RESERVED_CPU` overrides)."""
    arch = platform.machine()
    if sys.platform != "linux" or arch not in ("x86_64", "aarch64") or env.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0":
        return None
    preload = ld_preload(env.get("LD_PRELOAD", ""), _package_dir("torch"), _package_dir("vllm"), arch)
    if not any(lib in preload for lib in _OMP_LIBS):
        return None
    result = {"LD_PRELOAD": preload, **INDUCTOR_ENV}
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind == "nobind":
        return result
    if bind == "auto":
        reserve = 1 + (1 if kv_connector else 0)
        if env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") is not None:
            reserve = int(env["VLLM_CPU_NUM_OF_RESERVED_CPU"] or 0)
        if cpus is None:
            try:
                cpus = machine_cpus()
            except (OSError, ValueError, KeyError, subprocess.SubprocessError):
                return None  # no lscpu, or output this does not read: vLLM's runner is spawned its own way
        cores = auto_cores(cpus, os.sched_getaffinity(0) if allowed is None else allowed,
                           memory_nodes(env) if nodes is None else nodes, reserve, arch)
    else:
        if "|" in bind:
            return None
        cores = parse_ids(bind)
    if not cores:
        return None
    return {**result, **omp_env(cores, preload)}


def expected(vllm_config) -> dict[str, str]:
    """What vLLM's own code gives its model runner for this configuration (rank 0), from the
    worker process once vLLM has configured the engine (which set `LD_PRELOAD` there). Logs
    vLLM's "OpenMP thread binding info", as its executor would."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    with manager.configure_omp_envs(0, 0):
        env = {k: os.environ[k] for k in OMP_KEYS if k in os.environ}
    return {"LD_PRELOAD": os.environ.get("LD_PRELOAD", ""), **{k: os.environ.get(k, "") for k in INDUCTOR_ENV}, **env}
