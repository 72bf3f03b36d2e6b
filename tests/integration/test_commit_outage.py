"""A `sluice worker` whose commits never return (the real broker SIGSTOPped under a backlog) fails
closed past `SLUICE_COMMIT_OUTAGE_S`: /readyz 503 naming it, then exit 1 while the broker is still away.

The Kafka client retries a commit until the broker answers, so before the bound such a worker went on
behind a green /readyz. The engine is the fake one: what is under test is the Kafka client's commit."""

import asyncio
import time

import msgspec
import pytest

from loadgen.burst import produce
from tests.integration.helpers import committed_offsets, fails_closed_while_broker_stopped
from tests.integration.test_worker_process import start_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_commits_that_never_return_fail_the_worker(settings, catalog, model_dir, tmp_path):
    proc, port, group = await start_worker(
        catalog, model_dir, tmp_path, SLUICE_ENGINE_KIND="fake", SLUICE_FAKE_TOKEN_MS="50",
        SLUICE_GROUP_COMMIT_INTERVAL_MS="2000",
        SLUICE_COMMIT_OUTAGE_S="4", SLUICE_REPLY_OUTAGE_S="120", SLUICE_DRAIN_GRACE_S="2", SLUICE_STOP_MARGIN_S="6")
    topic = catalog.request_topic("standard").name
    try:
        # a backlog that lasts (3000 requests of 8 tokens at 50 ms a token), so that records are answered
        # between any two commits; the broker stops halfway between two commits, when answered offsets wait
        # for the next one. At 2 ms a token the worker finished the whole backlog before the broker stopped
        # at times, and with nothing left to commit no commit outage could start.
        await produce(settings.kafka.options(), [
            (topic, f"co-{i}".encode(), msgspec.json.encode({"id": f"co-{i}", "prompt": "x", "max_tokens": 8}), [])
            for i in range(3000)])
        end = time.monotonic() + 60
        first = None
        while True:
            seen = await committed_offsets(settings, group, [topic])
            if first is None and any(seen.values()):
                first = seen
            elif first is not None and seen != first:
                break  # a second commit: the next one is due in about 2 s
            assert time.monotonic() < end, f"the worker did not commit twice: {seen}"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        took = await fails_closed_while_broker_stopped(
            proc, port, "offsets could not be committed", "SLUICE_COMMIT_OUTAGE_S=4", within_s=15)
        assert took >= 4
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
