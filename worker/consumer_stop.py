"""Stopping an aiokafka consumer so that the stop returns.

aiokafka 0.14's fetch routine, when its assignment changes, cancels its in-flight fetch tasks and
awaits them with CancelledError suppressed. A stop() that cancels the routine at that moment is
swallowed there: the routine goes on waiting for fetches that will never be started, and stop()
never returns (seen with the backfill's probe consumer stopped just after it was reassigned). The
cancel is delivered again until the routine ends.
"""

from __future__ import annotations

import asyncio

NUDGE_S = 1.0  # how long a stop may take before the fetch routine is cancelled again


async def stop_consumer(consumer, nudge_s: float = NUDGE_S) -> None:
    """`consumer.stop()`, cancelling its fetch routine again while the stop waits on it."""
    stopping = asyncio.ensure_future(consumer.stop())
    try:
        while not (await asyncio.wait({stopping}, timeout=nudge_s))[0]:
            task = getattr(getattr(consumer, "_fetcher", None), "_fetch_task", None)
            if task is not None and not task.done():
                task.cancel()
    except asyncio.CancelledError:
        stopping.cancel()
        raise
    stopping.result()
