"""The connector's counts, carried by a finished request, land in the metrics they name: pages and
bytes by op, misses and failed saves by reason, the time spent moving pages by op and part, and how
long stored pages waited to be in Redis (all times counted in whole microseconds, exported in
seconds). A time count for a part that is not known is dropped rather than made a new label value."""

import pytest

from worker import metrics


def sample(name: str, **labels) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


CASES = [
    # (counts carried, metric, its labels, expected increase)
    ({"us_loaded_redis": 2500}, "sluice_kv_seconds_total", {"op": "loaded", "part": "redis"}, 0.0025),
    ({"us_loaded_decode": 1_000_000}, "sluice_kv_seconds_total", {"op": "loaded", "part": "decode"}, 1.0),
    ({"us_loaded_copy": 7}, "sluice_kv_seconds_total", {"op": "loaded", "part": "copy"}, 7e-6),
    ({"us_stored_encode": 40_000}, "sluice_kv_seconds_total", {"op": "stored", "part": "encode"}, 0.04),
    ({"us_stored_redis": 120_000}, "sluice_kv_seconds_total", {"op": "stored", "part": "redis"}, 0.12),
    # a part the connector does not report under that op: nothing counted anywhere
    ({"us_stored_decode": 5}, "sluice_kv_seconds_total", {"op": "stored", "part": "decode"}, 0.0),
    ({"us_evicted_redis": 5}, "sluice_kv_seconds_total", {"op": "evicted", "part": "redis"}, 0.0),
    # summed over stored pages: how long each was computed but not yet in Redis
    ({"page_lag_us": 350_000}, "sluice_kv_page_lag_seconds_total", {}, 0.35),
    ({"stored_pages": 3}, "sluice_kv_pages_total", {"op": "stored"}, 3.0),
    ({"loaded_bytes": 4096}, "sluice_kv_bytes_total", {"op": "loaded"}, 4096.0),
    ({"load_miss_checksum": 1}, "sluice_kv_load_misses_total", {"reason": "checksum"}, 1.0),
    ({"save_failed": 2}, "sluice_kv_save_failures_total", {"reason": "failed"}, 2.0),
]


@pytest.mark.parametrize("counts, name, labels, increase", CASES)
def test_a_finished_requests_connector_counts_land_in_their_metric(counts, name, labels, increase):
    before = sample(name, **labels)
    metrics.record_kv("standard", 0, 0, {"loaded_tokens": 0, "counts": counts})
    assert sample(name, **labels) - before == pytest.approx(increase)


def test_time_counts_leave_the_page_and_failure_counters_alone():
    watched = [("sluice_kv_pages_total", {"op": "stored"}), ("sluice_kv_save_failures_total", {"reason": "failed"}),
               ("sluice_kv_load_misses_total", {"reason": "missing"})]
    before = [sample(n, **labels) for n, labels in watched]
    metrics.record_kv("standard", 0, 0, {"counts": {"us_stored_encode": 10, "us_stored_redis": 10,
                                                    "us_loaded_redis": 10, "page_lag_us": 10}})
    assert [sample(n, **labels) for n, labels in watched] == before
