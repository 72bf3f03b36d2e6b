"""A worker's own process: what start-up loaded is kept out of the garbage collector's walks (and given back at
stop), and a stalled event loop shows in `sluice_event_loop_lag_seconds`."""

import asyncio
import gc
import time

import pytest

from tests.unit.harness import J, Memory, running, until
from worker.metrics import REGISTRY


async def test_start_freezes_the_loaded_heap_and_stop_thaws_it():
    gc.unfreeze()
    before = gc.get_threshold()
    loaded = len(gc.get_objects())  # what a full collection walks now
    mem = Memory(gc_young_threshold=12_345)
    async with running(mem) as w:
        assert gc.get_freeze_count() >= loaded * 0.9
        assert len(gc.get_objects()) < loaded * 0.1  # a full collection walks only what came later
        assert gc.get_threshold() == (12_345, *before[1:])  # young collections less often, the rest as before
        mem.send("standard", J({"id": "r1", "prompt": "hi", "max_tokens": 3}))
        assert await until(lambda: "r1" in mem.finals())  # and requests are served as before
        assert w.supervisor.failure is None
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before  # the process's collector as it was (tests start many workers)


def test_the_young_threshold_is_a_validated_setting():
    from worker.settings import SettingsError, load

    assert load(environ={}).ops.gc_young_threshold == 10_000
    assert load(environ={"SLUICE_GC_YOUNG_THRESHOLD": "2000"}).ops.gc_young_threshold == 2000
    with pytest.raises(SettingsError, match="GC_YOUNG_THRESHOLD"):
        load(environ={"SLUICE_GC_YOUNG_THRESHOLD": "0"})  # 0 would turn the collector off


def _lag_samples() -> tuple[float, float]:
    """(observations, observations above 0.1 s) of the event loop's lag so far."""
    count = REGISTRY.get_sample_value("sluice_event_loop_lag_seconds_count") or 0.0
    quick = REGISTRY.get_sample_value("sluice_event_loop_lag_seconds_bucket", {"le": "0.1"}) or 0.0
    return count, count - quick


async def test_a_blocked_event_loop_shows_in_the_lag_histogram():
    async with running(Memory()):
        await asyncio.sleep(1.2)  # the monitor's ticks on a free loop
        count, late = _lag_samples()
        assert count >= 1
        time.sleep(0.8)  # blocking work in the worker's process: the tick due meanwhile is late
        await asyncio.sleep(0.7)
        count_after, late_after = _lag_samples()
        assert count_after > count
        assert late_after > late
