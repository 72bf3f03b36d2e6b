"""Engine sizing settings reach vLLM's engine arguments, validated at start-up."""

import dataclasses

import pytest

from worker.engine import ONEDNN_CACHE_ENV, engine_args, engine_env, model_fingerprint
from worker.settings import ONEDNN_CACHE_DEFAULT, SettingsError, load


def args(**env):
    s = load(environ={f"SLUICE_{k.upper()}": str(v) for k, v in env.items()})
    return engine_args(s.engine, "bfloat16")


def test_defaults_leave_vllm_to_choose_what_it_knows_best():
    a = args()
    assert a["tensor_parallel_size"] == 1 and a["pipeline_parallel_size"] == 1 and a["kv_cache_dtype"] == "auto"
    assert "quantization" not in a and "max_num_batched_tokens" not in a
    assert a["scheduling_policy"] == "priority" and a["dtype"] == "bfloat16"


@pytest.mark.parametrize("env, key, value", [
    ({"tensor_parallel_size": 8}, "tensor_parallel_size", 8),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size", 2),
    ({"quantization": "awq"}, "quantization", "awq"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype", "fp8"),
    ({"max_num_batched_tokens": 8192}, "max_num_batched_tokens", 8192),
    ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization", 0.9),
    ({"enable_prefix_caching": "false"}, "enable_prefix_caching", False),
])
def test_each_sizing_setting_is_passed_on(env, key, value):
    assert args(**env)[key] == value


@pytest.mark.parametrize("env, variable", [
    ({"tensor_parallel_size": 0}, "SLUICE_TENSOR_PARALLEL_SIZE"),
    ({"kv_cache_dtype": "int4"}, "SLUICE_KV_CACHE_DTYPE"),
    ({"quantization": "AWQ; rm"}, "SLUICE_QUANTIZATION"),
    ({"max_num_batched_tokens": -1}, "SLUICE_MAX_NUM_BATCHED_TOKENS"),
])
def test_a_bad_sizing_setting_stops_start_up_naming_its_variable(env, variable):
    with pytest.raises(SettingsError, match=variable):
        args(**env)


def test_pages_of_another_kv_cache_dtype_never_match(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert model_fingerprint(str(tmp_path), "bfloat16") != model_fingerprint(str(tmp_path), "bfloat16", "fp8")
    assert model_fingerprint(str(tmp_path), "bfloat16") == model_fingerprint(str(tmp_path), "bfloat16", "auto")


def test_every_argument_is_one_vllm_knows():
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    known = {f.name for f in dataclasses.fields(arg_utils.AsyncEngineArgs)}
    a = args(quantization="awq", max_num_batched_tokens=4096)
    assert set(a) <= known, set(a) - known


@pytest.mark.parametrize("use_mla, dtype, amx, reference", [
    (True, "torch.float32", True, True),  # AMX MLA would refuse the float32 weights
    (True, "torch.bfloat16", True, False),  # AMX MLA takes them
    (True, "torch.float32", False, False),  # no AMX: vLLM picks the reference backend itself
    (False, "torch.float32", True, False),  # not an MLA model
])
def test_a_float32_mla_model_on_an_amx_cpu_runs_on_the_reference_mla_backend(use_mla, dtype, amx, reference):
    from types import SimpleNamespace

    from worker.engine import amx_mla_cannot_take

    assert amx_mla_cannot_take(SimpleNamespace(use_mla=use_mla, dtype=dtype), amx=amx) is reference


def test_pages_of_another_fine_tune_with_the_same_config_never_match(tmp_path):
    """A fine-tune keeps its base model's config.json: the fingerprint reads the weights too (sampled),
    so a worker rolled to new weights never continues from the old weights' KV pages."""
    import random

    rng = random.Random(5)
    base, tuned, same = tmp_path / "base", tmp_path / "tuned", tmp_path / "same"
    weights = bytearray(rng.randbytes(3 << 20))  # 3 MiB: larger than the blocks read
    for d in (base, tuned, same):
        d.mkdir()
        (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        (d / "model.safetensors").write_bytes(weights)
    tuned_weights = bytearray(weights)
    for at in range(0, len(tuned_weights), 4096):  # every weight moved a little, as fine-tuning does
        tuned_weights[at] ^= 1
    (tuned / "model.safetensors").write_bytes(tuned_weights)
    fp = {d.name: model_fingerprint(str(d), "bfloat16") for d in (base, tuned, same)}
    assert fp["base"] == fp["same"] and fp["tuned"] != fp["base"]
    (same / "model-00002-of-00002.safetensors").write_bytes(b"another shard")
    model_fingerprint.cache_clear()
    assert model_fingerprint(str(same), "bfloat16") != fp["base"]


@pytest.mark.parametrize("env, capacity", [
    ({}, str(ONEDNN_CACHE_DEFAULT)),                 # sluice's bound, not oneDNN's 1024
    ({"onednn_cache_capacity": 256}, "256"),
    ({"onednn_cache_capacity": 0}, "0"),            # no cache: every shape compiled again
    ({"onednn_cache_capacity": ""}, None),          # unset: oneDNN's own default
])
def test_onednn_cache_capacity_reaches_the_engine_environment(env, capacity):
    s = load(environ={f"SLUICE_{k.upper()}": str(v) for k, v in env.items()})
    assert engine_env(s.engine).get(ONEDNN_CACHE_ENV) == capacity


def test_onednn_cache_capacity_is_validated():
    with pytest.raises(SettingsError, match="SLUICE_ONEDNN_CACHE_CAPACITY"):
        load(environ={"SLUICE_ONEDNN_CACHE_CAPACITY": "-1"})
