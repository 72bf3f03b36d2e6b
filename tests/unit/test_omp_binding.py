"""worker/omp_binding.py: the model runner's OpenMP environment, worked out as vLLM does.

The tables follow vLLM's `OMPProcessManager` and its CPU platform; the last test checks the
prediction against vLLM's own code on this machine (the engine relies on that agreement).
"""

from __future__ import annotations

import os
import platform

import pytest

from worker import omp_binding
from worker.omp_binding import LogicalCpu, auto_cores, ld_preload, omp_env, parse_ids

# two sockets' worth of a small machine: cores 0-3 on node 0 with SMT siblings 8-11, node 1 beside it
SMT = ([LogicalCpu(i, i, 0) for i in range(4)] + [LogicalCpu(8 + i, i, 0) for i in range(4)]
       + [LogicalCpu(4 + i, 4 + i, 1) for i in range(4)])
PLAIN = [LogicalCpu(0, 0, 0), LogicalCpu(1, 1, 0)]


@pytest.mark.parametrize("cpus, allowed, nodes, reserve, arch, cores", [
    (PLAIN, {0, 1}, [0], 2, "x86_64", [0, 1]),  # reserving both would leave none: vLLM reserves nothing
    (PLAIN, {0, 1}, [0], 1, "x86_64", [0]),  # the last core is set aside
    (PLAIN, {0, 1}, [0], 0, "x86_64", [0, 1]),
    (PLAIN, {1}, [0], 1, "x86_64", [1]),  # only what the process may run on
    (SMT, set(range(12)), [0], 1, "x86_64", [8, 9, 10]),  # x86: one logical CPU per core, the highest id
    (SMT, set(range(12)), [0], 1, "aarch64", [0, 1, 2, 3, 8, 9, 10]),  # Arm: every logical CPU
    (SMT, set(range(12)), [1], 2, "x86_64", [4, 5]),  # the first visible memory node only
    (SMT, set(range(12)), [], 1, "x86_64", []),
])
def test_automatic_binding_follows_vllm(cpus, allowed, nodes, reserve, arch, cores):
    assert auto_cores(cpus, allowed, nodes, reserve, arch) == cores


@pytest.mark.parametrize("preload, env", [
    ("/t/lib/libgomp.so.1", {"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "0 1"}),
    ("/x/libiomp5.so", {"OMP_NUM_THREADS": "2", "KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1]",
                        "KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"}),
    ("", {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}),
])
def test_the_variables_depend_on_the_openmp_library_preloaded(preload, env):
    assert omp_env([0, 1], preload) == env


def test_preload_adds_torchs_libgomp_then_puts_tcmalloc_first(tmp_path):
    torch_dir, vllm_dir = tmp_path / "torch", tmp_path / "vllm"
    (torch_dir / "lib").mkdir(parents=True)
    (vllm_dir / "libs").mkdir(parents=True)
    (torch_dir / "lib" / "libgomp.so.1").touch()
    assert ld_preload("", torch_dir, vllm_dir, "x86_64") == f"{torch_dir}/lib/libgomp.so.1"
    (vllm_dir / "libs" / "libtcmalloc_minimal.so.4").touch()
    assert ld_preload("/a.so", torch_dir, vllm_dir, "x86_64") == \
        f"{vllm_dir}/libs/libtcmalloc_minimal.so.4:/a.so:{torch_dir}/lib/libgomp.so.1"
    # an OpenMP library the user preloaded is kept, and none is added beside it
    assert ld_preload("/opt/libiomp5.so", torch_dir, vllm_dir, "x86_64") == \
        f"{vllm_dir}/libs/libtcmalloc_minimal.so.4:/opt/libiomp5.so"


def test_id_lists_parse_as_vllm_parses_them():
    assert parse_ids("0-2,4,7-8") == [0, 1, 2, 4, 7, 8]
    assert parse_ids("") == []


@pytest.mark.parametrize("env, kv, expected_cores", [
    ({}, True, "0 1"),  # a KV connector asks for 2 reserved cores; on 2 cores vLLM reserves none
    ({}, False, "0"),
    ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, True, "0 1"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "1"}, True, "1"),
])
def test_prediction_on_a_two_core_machine(env, kv, expected_cores):
    if platform.machine() != "x86_64" or not os.path.exists("/proc/self/status"):
        pytest.fail("these cases describe Linux on x86")
    got = omp_binding.predict(env, kv, cpus=PLAIN, allowed={0, 1}, nodes=[0])
    assert got is not None and "libgomp" in got["LD_PRELOAD"]
    assert got["GOMP_CPU_AFFINITY"] == expected_cores
    assert got["OMP_NUM_THREADS"] == str(len(expected_cores.split()))
    assert got["TORCHINDUCTOR_COMPILE_THREADS"] == "1"


@pytest.mark.parametrize("env", [{"VLLM_CPU_SIM_MULTI_NUMA": "1"}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}])
def test_no_prediction_where_vllm_would_do_something_else(env):
    assert omp_binding.predict(env, True, cpus=PLAIN, allowed={0, 1}, nodes=[0]) is None


@pytest.mark.parametrize("kv", [True, False])
def test_prediction_matches_vllms_own_code_on_this_machine(kv, monkeypatch):
    """What the engine checks at start, here for both reservations: vLLM's configuration (which sets
    LD_PRELOAD and the inductor variables in this process) and its OpenMP manager."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from worker.settings import load

    for key in ("LD_PRELOAD", *omp_binding.INDUCTOR_ENV, *omp_binding.OMP_KEYS):
        monkeypatch.delenv(key, raising=False)
    predicted = omp_binding.predict(dict(os.environ), kv_connector=kv)
    kv_config = KVTransferConfig(kv_connector="SluiceKVConnector", kv_connector_module_path="worker.kv_connector",
                                 kv_role="kv_both") if kv else None
    config = EngineArgs(model=load(environ={}).engine.model, dtype="float32", max_model_len=512,
                        kv_transfer_config=kv_config).create_engine_config()
    assert omp_binding.expected(config) == predicted


@pytest.mark.parametrize("agree", [True, False])
def test_the_engine_core_runs_the_model_only_when_the_bindings_agree(agree, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from worker import engine_fork
    from worker.engine import _run_model_in_engine_core, describe_config
    from worker.settings import load

    monkeypatch.setattr(engine_fork, "ENGINE_CORE_ENV", {})
    monkeypatch.setattr(engine_fork, "ENGINE_CORE_AFFINITY", set())
    for key in ("LD_PRELOAD", *omp_binding.INDUCTOR_ENV, *omp_binding.OMP_KEYS):
        monkeypatch.delenv(key, raising=False)
    predicted = omp_binding.predict(dict(os.environ), kv_connector=False)
    if not agree:
        predicted = {**predicted, "OMP_NUM_THREADS": "64"}
    config = EngineArgs(model=load(environ={}).engine.model, dtype="float32", max_model_len=512).create_engine_config()
    _run_model_in_engine_core(config, predicted)
    if agree:
        assert describe_config(config)["executor"] == "UniProcExecutor"
        assert engine_fork.ENGINE_CORE_ENV["OMP_NUM_THREADS"] == predicted["OMP_NUM_THREADS"]
        assert not engine_fork.ENGINE_CORE_AFFINITY
    else:  # vLLM's runner, spawned with its own binding; the engine core unpinned from the forkserver's
        assert describe_config(config)["executor"] == "mp"
        assert not engine_fork.ENGINE_CORE_ENV
        assert engine_fork.ENGINE_CORE_AFFINITY == os.sched_getaffinity(0)


def test_no_prediction_without_lscpu(monkeypatch):
    def missing():
        raise FileNotFoundError("lscpu")

    monkeypatch.setattr(omp_binding, "machine_cpus", missing)
    assert omp_binding.predict({}, True, allowed={0, 1}, nodes=[0]) is None
    # an explicit binding does not need the topology
    assert omp_binding.predict({"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, True)["GOMP_CPU_AFFINITY"] == "0 1"
