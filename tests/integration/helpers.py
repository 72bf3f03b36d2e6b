from __future__ import annotations

import asyncio
import contextlib

from worker.worker import Worker


@contextlib.asynccontextmanager
async def running_worker(settings, catalog, engine, **overrides):
    s = settings.override(**overrides)
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

    consumer = AIOKafkaConsumer(**settings.kafka.options(), group_id=group_id, enable_auto_commit=False)
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str) -> tuple[int | None, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None, ""


async def first_503_until_exit(proc, port: int, since: float, limit_s: float, step_s: float = 0.1):
    """Poll a worker process's /readyz until it exits or `limit_s` after `since` has passed: the first
    503 as (seconds after `since`, body), or None if none was seen."""
    import asyncio
    import time

    first = None
    while proc.poll() is None and time.monotonic() - since < limit_s:
        status, body = http_get(port, "/readyz")
        if status == 503 and first is None:
            first = (time.monotonic() - since, body)
        await asyncio.sleep(step_s)
    return first


@contextlib.contextmanager
def broker_stopped():
    """The embedded broker SIGSTOPped for the block, and resumed however the block ends; yields when
    it was stopped (time.monotonic())."""
    import os
    import signal
    import time

    from worker import devstack

    broker = int(devstack.BROKER.pidfile(devstack.DEFAULT_DIR.resolve()).read_text())
    os.kill(broker, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(broker, signal.SIGCONT)


async def fails_closed_while_broker_stopped(proc, port: int, *reasons: str, within_s: float) -> float:
    """With the broker stopped: /readyz 503 naming every one of `reasons` within `within_s`, then exit 1
    before it is resumed. Returns the seconds to the first 503."""
    with broker_stopped() as stopped:
        first_503 = await first_503_until_exit(proc, port, stopped, limit_s=40)
        assert first_503 is not None, "never saw /readyz 503"
        assert all(reason in first_503[1] for reason in reasons), first_503
        assert first_503[0] < within_s, first_503
        assert proc.poll() == 1, "the worker did not exit 1 while the broker was away"
    return first_503[0]


async def abandon_join(consumer, joining) -> None:
    """A test's own group member whose `start()` (the join) may still be waiting: cancelled, then stopped."""
    joining.cancel()
    with contextlib.suppress(BaseException):
        await joining
    with contextlib.suppress(Exception):
        await asyncio.wait_for(consumer.stop(), 10)


def prefixed_topics_file(catalog, path):
    """The default topics renamed with this test's prefix, for worker processes."""
    import topics

    return topics.write_renamed(catalog.replies.name[: -len("sluice.replies")], path)


def metric(exposition: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    import re

    total = 0.0
    for line in exposition.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if not m:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def read_topic(kafka_opts: dict, topic: str, at_least: int, timeout_s: float = 60, until=None) -> list:
    """Every record of `topic` from the beginning, once there are `at_least` and `until(records)`
    holds, if given (or the time is up)."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, **kafka_opts, group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    out: list = []
    try:
        end = asyncio.get_running_loop().time() + timeout_s
        while ((len(out) < at_least or (until is not None and not until(out)))
               and asyncio.get_running_loop().time() < end):
            got = await consumer.getmany(timeout_ms=500)
            for records in got.values():
                out.extend(records)
        return out
    finally:
        await consumer.stop()


def delete_pages(settings) -> int:
    """Remove every KV page under the settings' key prefix (a reference run that must recompute)."""
    from redis.cluster import RedisCluster

    from worker import kv_pages

    client = RedisCluster.from_url(settings.redis.url)
    try:
        keys = list(client.scan_iter(match=kv_pages.key_pattern(settings.redis.key_prefix), count=1000,
                                     target_nodes=RedisCluster.PRIMARIES))
        for key in keys:
            client.delete(key)
        return len(keys)
    finally:
        client.close()


def cmdline(pid: int) -> bytes:
    """A process's command line as /proc holds it (NUL-separated), or b"" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
