"""Partitions whose fetches go unanswered while the broker answers everything else.

A broker that answers metadata but not a worker's fetches (the leader of its partitions cut off from
that worker while another broker still answers; a broker whose fetch handling hangs) left every poll
returning empty: the Kafka client logged each fetch's timeout and retried for ever, the topic watch
was answered, and the worker stayed ready with its partitions unread. Seen by hand before the fetch
watch, with this file's proxy in front of a broker: 3 minutes at 200, a request unanswered, until the
fetches were let through. The group, seeing a live member, gave the partitions to no other worker.

The engine is the fake one: what is under test is the worker's view of the real broker.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

import topics
from loadgen.burst import ReplyReader, produce
from schemas import DoneReply
from tests.integration.helpers import first_503_until_exit, http_get
from tests.integration.kafka_proxy import HOST, FetchHoldingProxy, start_broker_behind
from tests.integration.test_worker_process import spawn_worker
from topics.admin import apply
from worker.fetch_watch import answer_marks

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BROKER_PORT, PROXY_PORT = 19392, 19393


async def test_answer_marks_follow_the_kafka_clients_fetch_answers(settings, catalog):
    """The fetch watch reads the Kafka client's own state: every fetch answer moves a partition's
    mark, even an empty one; a paused partition, or one holding fetched records not yet taken, is
    not waiting for a fetch and is left out (the client sends none for it)."""
    topic = catalog.request_topic("batch").name
    a, b = TopicPartition(topic, 0), TopicPartition(topic, 1)
    consumer = AIOKafkaConsumer(**settings.kafka.options(), enable_auto_commit=False,
                                auto_offset_reset="earliest", fetch_max_wait_ms=50)
    await consumer.start()
    try:
        consumer.assign([a, b])
        assert await consumer.getmany(timeout_ms=500) == {}
        first = answer_marks(consumer)
        await asyncio.sleep(1)
        later = answer_marks(consumer)
        assert set(later) == {a, b}
        assert later[a] != first.get(a) and later[b] != first.get(b), (first, later)  # empty answers count

        consumer.pause(a)
        await asyncio.sleep(0.3)
        assert set(answer_marks(consumer)) == {b}

        producer = AIOKafkaProducer(**settings.kafka.options())
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"x", partition=1)
        finally:
            await producer.stop()
        end = time.monotonic() + 10
        while b in answer_marks(consumer):  # fetched, not yet taken by a poll
            assert time.monotonic() < end, "the record never sat in the client's buffer"
            await asyncio.sleep(0.05)
        got = await consumer.getmany(b, timeout_ms=1000)
        assert [r.value for r in got[b]] == [b"x"]
        await asyncio.sleep(0.3)
        assert set(answer_marks(consumer)) == {b}

        consumer.resume(a)
        await asyncio.sleep(0.3)
        assert set(answer_marks(consumer)) == {a, b}
    finally:
        await consumer.stop()


@pytest.fixture
async def proxy():
    broker = await start_broker_behind(BROKER_PORT, PROXY_PORT)
    proxy = await FetchHoldingProxy(PROXY_PORT, BROKER_PORT).start()
    yield proxy
    await proxy.stop()
    broker.terminate()
    broker.wait(10)


async def _ready(*workers, within_s: float = 300) -> None:
    end = time.monotonic() + within_s
    for proc, port, log in workers:
        while http_get(port, "/readyz")[0] != 200:
            assert proc.poll() is None and time.monotonic() < end, "never ready: " + log.read_text()[-2000:]
            await asyncio.sleep(0.5)


def _failure(log) -> str:
    """The reason in a worker's `worker_failed` log line."""
    for line in log.read_text().splitlines():
        if '"worker_failed"' in line:
            return json.loads(line)["reason"]
    return ""


async def _collect(reader, arrived: dict) -> None:
    """Each done reply's id -> when it was read, for as long as the task runs."""
    while True:
        async for r in reader.records():
            if isinstance(r, DoneReply):
                arrived.setdefault(r.id, time.monotonic())


async def _all_answered(ids: set, arrived: dict, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while not ids <= arrived.keys() and time.monotonic() < end:
        await asyncio.sleep(0.2)
    return ids <= arrived.keys()


async def test_a_worker_whose_fetches_go_unanswered_fails_and_another_answers_its_partitions(
        settings, model_dir, proxy, tmp_path):
    """Two workers in one group; one's fetches stop being answered (its other connections and the
    other worker are served). It fails naming them after SLUICE_FETCH_OUTAGE_S (503, or its log where
    it exits between two looks: idle, it has nothing to drain) and exits 1; the group gives its
    partitions to the other worker, which answers every request sent meanwhile."""
    opts = settings.override(kafka_bootstrap=f"{HOST}:{PROXY_PORT}").kafka.options()
    catalog = topics.load().renamed(f"f{uuid.uuid4().hex[:6]}.")
    await apply(opts, catalog)
    env = {"SLUICE_ENGINE_KIND": "fake", "SLUICE_KAFKA_BOOTSTRAP": f"{HOST}:{PROXY_PORT}",
           "SLUICE_FETCH_OUTAGE_S": "6", "SLUICE_DRAIN_GRACE_S": "2", "SLUICE_STOP_MARGIN_S": "6"}
    group = f"g-{uuid.uuid4().hex[:6]}"
    held, h_port, _ = spawn_worker(catalog, model_dir, tmp_path, group, "held.log", SLUICE_KAFKA_CLIENT_ID="held",
                                   **env)
    other, o_port, _ = spawn_worker(catalog, model_dir, tmp_path, group, "other.log", **env)
    reader = ReplyReader(opts, catalog.replies.name)
    collecting = None
    try:
        await _ready((held, h_port, tmp_path / "held.log"), (other, o_port, tmp_path / "other.log"))
        await reader.start()
        arrived: dict = {}
        collecting = asyncio.create_task(_collect(reader, arrived))
        topic = catalog.request_topic("realtime").name

        def requests(prefix):
            return [(topic, f"{prefix}-{i}".encode(),
                     msgspec.json.encode({"id": f"{prefix}-{i}", "prompt": "x", "max_tokens": 2}), [])
                    for i in range(12)]

        # both members serve every partition before the fault
        await produce(opts, requests("before"))
        assert await _all_answered({f"before-{i}" for i in range(12)}, arrived, 60), sorted(arrived)
        status, body = http_get(h_port, "/readyz")
        assert status == 200 and json.loads(body)["fetch_wait_s"] < 2, body

        proxy.hold_fetches_of = "held-consumer"
        since = time.monotonic()
        while not proxy.held:  # a fetch in flight before the hold may still be answered: wait for the next
            assert time.monotonic() - since < 5, "the held worker sent no fetch"
            await asyncio.sleep(0.02)
        await produce(opts, requests("during"))
        first_503 = await first_503_until_exit(held, h_port, since, limit_s=40)
        failed_at = time.monotonic()  # idle, it exits as it fails: a look may miss the 503 between
        assert held.wait(10) == 1
        assert 5 <= failed_at - since < 15, failed_at - since  # counted from its last fetch answer
        says = first_503[1] if first_503 is not None else _failure(tmp_path / "held.log")
        assert "fetches unanswered for" in says and "SLUICE_FETCH_OUTAGE_S=6" in says, says

        during = {f"during-{i}" for i in range(12)}
        assert await _all_answered(during, arrived, 90), sorted(during - arrived.keys())
        # the held worker's share was answered only once it had failed (6 s after its last fetch answer,
        # at the earliest) and the group had moved its partitions; the other worker's within a second
        assert any(arrived[i] - since >= 5 for i in during), {i: round(arrived[i] - since, 1) for i in during}
        assert other.poll() is None and http_get(o_port, "/readyz")[0] == 200
    finally:
        if collecting is not None:
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
        await reader.stop()
        for proc in (held, other):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
