from __future__ import annotations

import asyncio
import contextlib

import msgspec

from worker.worker import Worker


@contextlib.asynccontextmanager
async def running_worker(settings, catalog, engine, **overrides):
    s = msgspec.structs.replace(settings, **overrides)
    w = Worker(s, catalog, engine)
    await w.start()
    for _ in range(300):  # joined the group and owns partitions
        if w.consumer.assignment():
            break
        await asyncio.sleep(0.1)
    try:
        yield w
    finally:
        await w.stop()


async def committed_offsets(settings, group_id, topic_names):
    """{(topic, partition): committed offset} of a consumer group (OffsetFetch, without joining)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(**settings.kafka_common(), group_id=group_id, enable_auto_commit=False)
    await consumer.start()
    try:
        out = {}
        for topic in topic_names:
            await consumer._client.force_metadata_update()
            for p in sorted(consumer._client.cluster.partitions_for_topic(topic) or ()):
                off = await consumer.committed(TopicPartition(topic, p))
                if off is not None:
                    out[(topic, p)] = off
        return out
    finally:
        await consumer.stop()
