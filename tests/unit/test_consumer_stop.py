"""stop_consumer: a consumer whose fetch routine swallows the stop's cancel still stops."""

import asyncio
import contextlib

from worker.consumer_stop import stop_consumer


class _Fetcher:
    """The pattern of aiokafka 0.14's fetch routine: after an assignment change it awaits the fetch
    tasks it cancelled with CancelledError suppressed, so a cancel landing there is lost."""

    def __init__(self):
        self.cleanup = asyncio.get_running_loop().create_future()  # a cancelled fetch still winding down
        self._fetch_task = asyncio.ensure_future(self._routine())

    async def _routine(self):
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await self.cleanup
            await asyncio.get_running_loop().create_future()  # waits for fetches never started
        except asyncio.CancelledError:
            pass


class _Consumer:
    def __init__(self):
        self._fetcher = _Fetcher()
        self.stopped = False

    async def stop(self):
        self._fetcher._fetch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._fetcher._fetch_task
        self.stopped = True


async def test_a_plain_stop_of_such_a_consumer_never_returns():
    consumer = _Consumer()
    await asyncio.sleep(0)  # the routine is at its suppressed await
    stopping = asyncio.ensure_future(consumer.stop())
    await asyncio.sleep(0.3)
    assert not stopping.done()  # the stand-in shows the hang
    stopping.cancel()


async def test_stop_consumer_cancels_the_routine_again_and_returns():
    consumer = _Consumer()
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_consumer(consumer, nudge_s=0.05), 2)
    assert consumer.stopped and consumer._fetcher._fetch_task.done()


async def test_a_consumer_that_stops_at_once_is_not_touched():
    class Quick:
        _fetcher = None
        calls = 0

        async def stop(self):
            Quick.calls += 1

    await stop_consumer(Quick())
    assert Quick.calls == 1
