"""Reply records batched per partition, on the real broker (worker/reply_batches.py).

Many requests' records interleaved, as a busy worker sends them: each request's records arrive
complete, in the order they were sent, in the partition aiokafka's own partitioner picks for
the request id, with their headers; a record over the size limit is refused as aiokafka refuses it.
"""

import asyncio
import random

import pytest
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner

from tests.integration.helpers import read_topic
from worker.emitter import kafka_producer


async def test_interleaved_requests_arrive_whole_in_order_and_in_aiokafkas_partition(settings, catalog):
    topic = catalog.replies.name
    producer = kafka_producer(settings.kafka.options(), False, "batch-test", 1_000_000)
    await producer.start()
    requests, per_request = 300, 8
    rng = random.Random(7)
    try:
        # each request's records in seq order, requests interleaved at random, sent from several tasks
        pending = {f"req-{r}": 0 for r in range(requests)}
        futures = []

        async def sender(names):
            for name in names:
                seq = pending[name]
                pending[name] += 1
                futures.append(await producer.send(topic, f"{name}|{seq}".encode(), key=name.encode(),
                                                   headers=[("x-request-id", name.encode())]))
                if rng.random() < 0.1:
                    await asyncio.sleep(0)

        order = [name for name in pending for _ in range(per_request)]
        rng.shuffle(order)
        # one request's records stay in one task (as in the worker: a request's task sends them in turn)
        tasks = {}
        for name in order:
            tasks.setdefault(hash(name) % 4, []).append(name)
        await asyncio.gather(*(sender(names) for names in tasks.values()))
        await asyncio.gather(*futures)
        with pytest.raises(MessageSizeTooLargeError):
            await producer.send(topic, b"x" * 1_100_000, key=b"too-big")
    finally:
        await producer.stop()

    records = await read_topic(settings.kafka.options(), topic, requests * per_request)
    assert len(records) == requests * per_request
    partitions = sorted(producer._inner._metadata.partitions_for_topic(topic))
    assert len(partitions) > 1
    seen: dict[str, list[int]] = {}
    for rec in sorted(records, key=lambda r: (r.partition, r.offset)):
        name, seq = rec.value.decode().split("|")
        assert rec.key == name.encode()
        assert list(rec.headers) == [("x-request-id", name.encode())]
        assert rec.partition == DefaultPartitioner()(rec.key, partitions, partitions)
        seen.setdefault(name, []).append(int(seq))
    assert seen == {f"req-{r}": list(range(per_request)) for r in range(requests)}
