"""The benchmark's like-with-like checks: CPU binding read from each arm's log, engine flags."""

import pytest

from bench import common

ENGINE_LOG = """(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=2
(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]
(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \treserved_cpus=[]
"""


def test_the_binding_is_read_from_the_engine_log():
    assert common.binding(ENGINE_LOG) == "reserve_cpu_num=2, core ids=[0, 1], reserved_cpus=[]"
    assert common.binding("no binding here") is None


def test_arms_on_different_cores_stop_the_comparison():
    one_core = ENGINE_LOG.replace("core ids=[0, 1]", "core ids=[1]").replace("reserved_cpus=[]", "reserved_cpus=[0]")
    assert common.same_binding({"a": ENGINE_LOG, "b": ENGINE_LOG})["a"]
    with pytest.raises(SystemExit, match="different cores"):
        common.same_binding({"offline": one_core, "sluice": ENGINE_LOG})
    with pytest.raises(SystemExit):
        common.same_binding({"offline": "nothing logged", "sluice": ENGINE_LOG})


def test_engine_arguments_become_the_same_server_flags():
    flags = common.vllm_cli_flags({"model": "m", "max_num_seqs": 64, "enable_prefix_caching": False,
                                   "disable_log_stats": True, "quantization": None})
    assert flags == ["--model", "m", "--max-num-seqs", "64", "--no-enable-prefix-caching", "--disable-log-stats"]


def test_stage_means_cover_only_the_requests_between_two_readings():
    before = {"engine": (10, 5.0), "reply": (10, 0.1)}
    after = {"engine": (14, 7.0), "reply": (14, 0.14), "fetch": (4, 0.02)}
    assert common.stage_means_ms(before, after) == pytest.approx({"engine": 500.0, "reply": 10.0, "fetch": 5.0})
    assert common.stage_means_ms(after, after) == {}  # nothing answered in between: no mean at all


async def test_a_metric_is_summed_over_the_samples_whose_labels_match():
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    registry = CollectorRegistry()
    failures = Counter("sluice_kv_save_failures_total", "pages not saved", ["reason"], registry=registry)
    failures.labels("over_budget").inc(3)
    failures.labels("dropped").inc(2)
    port = common.free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        assert await common.scrape_metric(port, "sluice_kv_save_failures_total", reason="over_budget") == 3
        assert await common.scrape_metric(port, "sluice_kv_save_failures_total") == 5  # not the _created samples
        assert await common.scrape_metric(port, "sluice_kv_pages_total") == 0
    finally:
        server.shutdown()
        thread.join()
