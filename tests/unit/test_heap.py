"""A worker's own process: what start-up loaded is kept out of the garbage collector's walks (and given back at
stop), and a stalled event loop shows in `sluice_event_loop_lag_seconds`."""

import asyncio
import gc
import time

from tests.unit.harness import J, Memory, running, until
from worker.metrics import REGISTRY


async def test_start_freezes_the_loaded_heap_and_stop_thaws_it():
    gc.unfreeze()
    loaded = len(gc.get_objects())  # what a full collection walks now
    mem = Memory()
    async with running(mem) as w:
        assert gc.get_freeze_count() >= loaded * 0.9
        assert len(gc.get_objects()) < loaded * 0.1  # a full collection walks only what came later
        mem.send("standard", J({"id": "r1", "prompt": "hi", "max_tokens": 3}))
        assert await until(lambda: "r1" in mem.finals())  # and requests are served as before
        assert w.supervisor.failure is None
    assert gc.get_freeze_count() == 0


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
