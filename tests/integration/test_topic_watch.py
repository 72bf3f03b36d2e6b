"""A topic deleted under a running worker, on the real broker: the Kafka client retries the deleted
topic's fetches for ever and its class would go unserved behind a green `/readyz`; the topic watch
fails the worker, naming the topic."""

import asyncio
import time

import msgspec
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from loadgen.burst import produce
from tests.integration.helpers import read_topic, running_worker

pytestmark = pytest.mark.integration


async def test_a_request_topic_deleted_under_a_running_worker_fails_it_naming_the_topic(settings, catalog, engine,
                                                                                       group_id):
    gone = catalog.request_topic("realtime").name
    async with running_worker(settings, catalog, engine, group_id=group_id, topic_check_interval_s=1) as w:
        # serving before: a request is answered, and the watch has found nothing for a few checks
        await produce(settings.kafka.options(), [(catalog.request_topic("standard").name, b"before",
                                                  msgspec.json.encode({"id": "before", "prompt": "Hi",
                                                                       "max_tokens": 2}), [])])
        assert await read_topic(settings.kafka.options(), catalog.replies.name, 2, timeout_s=60)
        await asyncio.sleep(3)
        assert w.supervisor.failure is None and w.ready

        admin = AIOKafkaAdminClient(**settings.kafka.options())
        await admin.start()
        try:
            await admin.delete_topics([gone])
        finally:
            await admin.close()
        since = time.monotonic()
        while w.supervisor.failure is None:
            assert time.monotonic() - since < 30, "a deleted request topic left the worker ready"
            await asyncio.sleep(0.1)
        assert not w.ready
    assert f"{gone} does not exist" in w.supervisor.failure, w.supervisor.failure
    assert time.monotonic() - since < 30
