"""A burst's offsets are committed as soon as the worker has finished every record it read, on the
real broker, not at the next tick of the commit timer (`SLUICE_GROUP_COMMIT_INTERVAL_MS`).

The timer is set to ten minutes here, so only the commit made when the worker goes idle can cover
the burst within the wait below. Before, a burst's offsets (and the lag KEDA scales on) waited for
the timer, and a worker killed in that window left the burst to be read and answered again."""

import asyncio
import time

import msgspec
import pytest

from loadgen.burst import ReplyReader, produce
from schemas import DoneReply
from tests.integration.helpers import committed_offsets
from tests.integration.test_worker_process import start_worker

pytestmark = [pytest.mark.integration]

BURST = 60


async def test_a_burst_is_committed_once_the_worker_is_idle(settings, catalog, model_dir, tmp_path):
    proc, port, group = await start_worker(catalog, model_dir, tmp_path, SLUICE_ENGINE_KIND="fake",
                                           SLUICE_FAKE_TOKEN_MS="2", SLUICE_GROUP_COMMIT_INTERVAL_MS="600000")
    topic = catalog.request_topic("standard").name
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    try:
        await produce(settings.kafka.options(), [
            (topic, f"ic-{i}".encode(), msgspec.json.encode({"id": f"ic-{i}", "prompt": "x", "max_tokens": 4,
                                                               "stream": i % 2 == 0}), [])
            for i in range(BURST)])
        done: set[str] = set()
        end = time.monotonic() + 60
        while len(done) < BURST:
            assert time.monotonic() < end, f"{len(done)} of {BURST} answered"
            done.update(r.id for r in [r async for r in reader.records()] if isinstance(r, DoneReply))
        end = time.monotonic() + 15  # far inside the ten-minute timer
        committed = {}
        while sum(committed.values()) < BURST:
            assert time.monotonic() < end, f"committed {committed} of {BURST} records after the burst was answered"
            await asyncio.sleep(0.2)
            committed = await committed_offsets(settings, group, [topic])
        assert sum(committed.values()) == BURST and proc.poll() is None
    finally:
        await reader.stop()
        proc.terminate()
        proc.wait(60)
