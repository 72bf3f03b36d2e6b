"""An idle `sluice worker` whose broker stops answering (the real broker SIGSTOPped) fails closed past
`SLUICE_BROKER_OUTAGE_S`: /readyz 503 naming it, then exit 1 while the broker is still away.

An idle worker has no reply or commit to fail, and the Kafka client retries the broker for ever, so
before the bound it stayed ready for as long as the broker was away. The engine is the fake one: what
is under test is the worker's view of the broker."""

import json

import pytest

from tests.integration.helpers import fails_closed_while_broker_stopped, http_get
from tests.integration.test_worker_process import start_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_an_idle_worker_whose_broker_stops_answering_fails_closed(catalog, model_dir, tmp_path):
    proc, port, _ = await start_worker(
        catalog, model_dir, tmp_path, SLUICE_ENGINE_KIND="fake", SLUICE_BROKER_OUTAGE_S="4",
        SLUICE_TOPIC_CHECK_INTERVAL_S="1", SLUICE_DRAIN_GRACE_S="2", SLUICE_STOP_MARGIN_S="6")
    try:
        status, body = http_get(port, "/readyz")
        assert status == 200 and json.loads(body)["broker_outage_s"] == 0.0, body
        took = await fails_closed_while_broker_stopped(
            proc, port, "broker unanswered", "SLUICE_BROKER_OUTAGE_S=4", within_s=12)
        assert took >= 2  # counted from the last answer: up to one check interval (1 s) and a monitor tick early
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
