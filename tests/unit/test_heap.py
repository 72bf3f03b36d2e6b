"""A started worker keeps what start-up loaded out of the garbage collector's walks, and gives it back at stop."""

import gc

from tests.unit.harness import CATALOG, J, Memory, running, until


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
