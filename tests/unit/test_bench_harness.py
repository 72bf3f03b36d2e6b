"""The like-with-like checks every comparison runs before it prints a ratio (bench/harness.py)."""

import json

import pytest

from bench import harness

CONFIG = {"dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
          "chunked_prefill": True, "scheduling_policy": "priority", "prefix_caching": True, "block_size": 128,
          "kv_cache_dtype": "auto", "enforce_eager": False, "executor": "mp", "kv_connector": None,
          "onednn_cache": "64"}
BINDING = """(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=0
(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]
(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \treserved_cpus=[]
(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 116,480 tokens, Maximum concurrency ...
"""


def bench_log(**changes) -> str:
    return harness.ARM_ENGINE + json.dumps({**CONFIG, **changes}) + "\n" + BINDING


def worker_log(**changes) -> str:
    line = {"event": "engine_ready", "level": "info", "timestamp": "t", **CONFIG, **changes}
    return BINDING + json.dumps(line) + "\n"


def test_a_report_holds_the_resolved_configuration_the_kv_cache_and_the_cores():
    r = harness.arm_report(bench_log())
    assert r["max_num_seqs"] == 64 and r["kv_cache_tokens"] == 116480 and r["core_ids"] == "[0, 1]"
    assert harness.arm_report(worker_log(kv_connector="SluiceKVConnector"))["kv_connector"] == "SluiceKVConnector"


def test_arms_configured_alike_pass_even_when_only_one_saves_pages():
    harness.check_alike({"offline": harness.arm_report(bench_log()),
                         "sluice+kv": harness.arm_report(worker_log(kv_connector="SluiceKVConnector"))})


@pytest.mark.parametrize("key, value", [
    ("max_num_batched_tokens", 4096),  # the LLM class's own CPU default
    ("scheduling_policy", "fcfs"),
    ("dtype", "float32"),
    ("prefix_caching", False),
    ("max_num_seqs", 256),
    ("executor", "UniProcExecutor"),  # sluice's default on CPU: the engine core runs the model itself
    ("onednn_cache", "default"),       # an arm whose oneDNN keeps 1024 compiled kernels, not the worker's 64
])
def test_one_setting_apart_stops_the_comparison_naming_it(key, value):
    with pytest.raises(SystemExit, match=key):
        harness.check_alike({"offline": harness.arm_report(bench_log(**{key: value})),
                             "sluice": harness.arm_report(worker_log())})


def test_other_cores_or_a_smaller_kv_cache_or_nothing_reported_stop_it_too():
    one_core = bench_log().replace("core ids=[0, 1]", "core ids=[1]")
    with pytest.raises(SystemExit, match="core_ids"):
        harness.check_alike({"a": harness.arm_report(one_core), "b": harness.arm_report(bench_log())})
    small = bench_log().replace("116,480", "58,240")
    with pytest.raises(SystemExit, match="kv_cache_tokens"):
        harness.check_alike({"a": harness.arm_report(small), "b": harness.arm_report(bench_log())})
    with pytest.raises(SystemExit, match="max_num_seqs"):
        harness.check_alike({"a": harness.arm_report(BINDING), "b": harness.arm_report(bench_log())})


def test_outputs_must_be_the_same_tokens_for_the_same_requests():
    same = {"0-0": [1, 2, 3], "0-1": [4, 5]}
    assert harness.check_outputs({"offline": same, "sluice": dict(same)}) == 2
    with pytest.raises(SystemExit, match=r"1 of 2 requests differ.*'0-1' at token 1"):
        harness.check_outputs({"offline": same, "sluice": {"0-0": [1, 2, 3], "0-1": [4, 6]}})
    with pytest.raises(SystemExit, match="at token 2"):
        harness.check_outputs({"offline": same, "sluice": {"0-0": [1, 2], "0-1": [4, 5]}})
    with pytest.raises(SystemExit, match="in one arm only"):
        harness.check_outputs({"offline": same, "server": {"0-0": [1, 2, 3]}})


def test_each_arm_runs_first_in_turn():
    assert harness.orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert harness.orders(["a", "b"], 3)[2] == ["a", "b"]
    assert harness.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}


@pytest.mark.parametrize("name,events,expected", [
    ("one request, steps of 100 ms", [(0.0, False, 1, "a"), (0.1, False, 1, "a"), (0.2, False, 1, "a")], 100.0),
    ("two requests interleaved: the median gap", [(0.0, False, 1, "a"), (0.05, True, 1, "b"), (0.1, False, 1, "a"),
                                                  (0.2, False, 1, "a"), (0.35, True, 1, "b")], 100.0),
    ("multi-token outputs are not steps", [(0.0, False, 1, "a"), (0.5, False, 4, "a")], None),
    ("outside the window ignored", [(0.0, False, 1, "a"), (0.1, False, 1, "a"), (9.0, False, 1, "a")], 100.0),
    ("no request with two outputs", [(0.0, False, 1, "a"), (0.1, False, 1, "b")], None),
])
def test_step_ms(name, events, expected):
    from bench.isolation import step_ms

    got = step_ms(events, 0.0, 1.0)
    assert got == (pytest.approx(expected) if expected is not None else None)

