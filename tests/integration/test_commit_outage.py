"""A `sluice worker` whose commits never return (the real broker SIGSTOPped under a backlog) fails
closed past `SLUICE_COMMIT_OUTAGE_S`: /readyz 503 naming it, then exit 1 while the broker is still away.

The Kafka client retries a commit until the broker answers, so before the bound such a worker went on
behind a green /readyz. The engine is the fake one: what is under test is the Kafka client's commit."""

import asyncio
import os
import signal
import time

import msgspec
import pytest

from loadgen.burst import produce
from tests.integration.helpers import committed_offsets, first_503_until_exit
from tests.integration.test_worker_process import start_worker
from worker import devstack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_commits_that_never_return_fail_the_worker(settings, catalog, model_dir, tmp_path):
    proc, port, group = await start_worker(
        catalog, model_dir, tmp_path, SLUICE_ENGINE_KIND="fake", SLUICE_FAKE_TOKEN_MS="2",
        SLUICE_COMMIT_OUTAGE_S="4", SLUICE_REPLY_OUTAGE_S="120", SLUICE_DRAIN_GRACE_S="2", SLUICE_STOP_MARGIN_S="6")
    broker = int(devstack.BROKER.pidfile(devstack.DEFAULT_DIR.resolve()).read_text())
    topic = catalog.request_topic("standard").name
    stopped = None
    try:
        # a backlog, so that answered offsets always wait for the next commit when the broker stops
        await produce(settings.kafka.options(), [
            (topic, f"co-{i}".encode(), msgspec.json.encode({"id": f"co-{i}", "prompt": "x", "max_tokens": 4}), [])
            for i in range(3000)])
        end = time.monotonic() + 60
        while not any((await committed_offsets(settings, group, [topic])).values()):
            assert time.monotonic() < end, "the worker never committed"
            await asyncio.sleep(0.05)
        os.kill(broker, signal.SIGSTOP)
        stopped = time.monotonic()
        first_503 = await first_503_until_exit(proc, port, stopped, limit_s=40)
        assert first_503 is not None, "never saw /readyz 503"
        assert "offsets could not be committed" in first_503[1] and "SLUICE_COMMIT_OUTAGE_S=4" in first_503[1], first_503
        assert 4 <= first_503[0] < 15, first_503
        assert proc.poll() == 1, "the worker did not exit 1 while the broker was away"
    finally:
        if stopped is not None:
            os.kill(broker, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
