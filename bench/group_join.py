"""How long a plain aiokafka consumer takes to join a new group of one and hold its partitions,
by session timeout: the broker's share of a worker's start to ready.

    python bench/group_join.py [--timeouts 10000,6000,3000] [--tries 3]

Needs the dev stack (`sluice dev up`); creates one 6-partition topic. Prints each join's seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from worker.settings import load

TOPIC = "bench.group-join"


async def main(args) -> None:
    kafka = load().kafka.options()  # the dev stack by default; SLUICE_KAFKA_* as for a worker
    admin = AIOKafkaAdminClient(**kafka)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, 6, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        await admin.close()
    for timeout in args.timeouts:
        times = []
        for _ in range(args.tries):
            consumer = AIOKafkaConsumer(TOPIC, **kafka, group_id=f"join-{uuid.uuid4().hex[:6]}",
                                        session_timeout_ms=timeout, heartbeat_interval_ms=max(100, timeout // 3))
            t0 = time.monotonic()
            await consumer.start()  # returns once the group has assigned the partitions
            times.append(time.monotonic() - t0)
            assert len(consumer.assignment()) == 6
            await consumer.stop()
        print(f"session timeout {timeout} ms: join " + ", ".join(f"{t:.2f}" for t in times) + " s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeouts", type=lambda v: [int(x) for x in v.split(",")], default=[10000, 6000, 3000])
    p.add_argument("--tries", type=int, default=3)
    asyncio.run(main(p.parse_args()))
