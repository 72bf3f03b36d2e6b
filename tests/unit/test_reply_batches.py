"""Reply records batched per partition (worker/reply_batches.py).

The producer under the batching layer is aiokafka's own, never started: its record size check,
partitioner and batch builder are the real ones, and every submitted batch is decoded from the
bytes aiokafka would put on the wire. Only the hand-over to the broker (`send_batch`) and the
topic metadata are stood in for. The same layer on the real broker: tests/integration/test_reply_batches.py.
"""

import asyncio

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.record.default_records import DefaultRecordBatch

from worker.reply_batches import BatchingProducer

PARTITIONS = {"replies": {0, 1, 2}, "audit": {0, 1, 2, 3, 4}}


class Handover:
    """Stands in for aiokafka's `send_batch`: records each batch, and lets a test decide when (and
    whether) a partition's batches are delivered."""

    def __init__(self, producer: AIOKafkaProducer):
        self.batches: list[tuple[str, int, list[tuple[bytes, bytes, list]]]] = []
        self.deliveries: list[asyncio.Future] = []
        self.held: dict[tuple[str, int], asyncio.Event] = {}
        self.refuse: dict[tuple[str, int], Exception] = {}

        async def wait_on_metadata(topic):
            if topic not in PARTITIONS:
                raise KafkaTimeoutError(f"no metadata for {topic}")
            return PARTITIONS[topic]

        producer.client._wait_on_metadata = wait_on_metadata
        producer._metadata.partitions_for_topic = lambda topic: PARTITIONS.get(topic)
        producer._metadata.available_partitions_for_topic = lambda topic: PARTITIONS.get(topic)
        producer.send_batch = self.send_batch

    async def send_batch(self, batch, topic, *, partition):
        if (topic, partition) in self.held:
            await self.held[(topic, partition)].wait()
        if (topic, partition) in self.refuse:
            raise self.refuse[(topic, partition)]
        records = [(r.key, r.value, list(r.headers)) for r in DefaultRecordBatch(bytes(batch._build()))]
        self.batches.append((topic, partition, records))
        delivered = asyncio.get_running_loop().create_future()
        self.deliveries.append(delivered)
        return delivered

    def deliver_all(self, exc: Exception | None = None) -> None:
        for d in self.deliveries:
            if not d.done():
                d.set_exception(exc) if exc else d.set_result(None)


@pytest.fixture
async def batching():
    inner = AIOKafkaProducer(bootstrap_servers="localhost:1", max_request_size=10_000, max_batch_size=4_096)
    handover = Handover(inner)
    yield BatchingProducer(inner), handover, inner
    await inner.stop()


def expected_partition(topic: str, key: bytes) -> int:
    parts = list(PARTITIONS[topic])
    return DefaultPartitioner()(key, parts, parts)


async def test_records_of_one_turn_go_in_one_batch_per_partition_in_send_order(batching):
    producer, handover, _ = batching
    futures = [await producer.send("replies", f"v{i}".encode(), key=f"req-{i % 7}".encode(),
                                   headers=[("x-request-id", f"req-{i % 7}".encode())]) for i in range(70)]
    await asyncio.sleep(0)  # the partitions' draining tasks run
    await asyncio.sleep(0)
    by_partition = {p: recs for _, p, recs in handover.batches}
    assert len(handover.batches) == len(by_partition)  # one batch per partition
    sent = [(k, v) for recs in by_partition.values() for k, v, _ in recs]
    assert sorted(sent) == sorted((f"req-{i % 7}".encode(), f"v{i}".encode()) for i in range(70))
    for p, recs in by_partition.items():
        assert all(expected_partition("replies", k) == p for k, _, _ in recs)  # aiokafka's partitioner
        values = [int(v[1:]) for _, v, _ in recs]
        assert values == sorted(values)  # send order within the partition
        assert all(h == [("x-request-id", k)] for k, _, h in recs)
    assert not any(f.done() for f in futures)  # nothing is done before the broker acknowledged it
    handover.deliver_all()
    await asyncio.sleep(0)
    assert all(f.done() and f.result() is None for f in futures)


async def test_a_full_batch_continues_in_the_next_in_order(batching):
    producer, handover, _ = batching
    value = b"x" * 1_000  # about four to a 4 KiB batch
    futures = [await producer.send("replies", value + str(i).encode(), key=b"one-key") for i in range(10)]
    handover.deliver_all()
    while not all(f.done() for f in futures):
        await asyncio.sleep(0)
        handover.deliver_all()
    assert len(handover.batches) >= 3
    assert {p for _, p, _ in handover.batches} == {expected_partition("replies", b"one-key")}
    values = [v for _, _, recs in handover.batches for _, v, _ in recs]
    assert values == [value + str(i).encode() for i in range(10)]


async def test_a_failed_batch_fails_exactly_its_own_records(batching):
    producer, handover, _ = batching
    keys = [b"a", b"b", b"c", b"d", b"e", b"f"]
    futures = {k: await producer.send("replies", b"v", key=k) for k in keys}
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    failing = handover.batches[0][1]
    for (_, p, _), d in zip(handover.batches, handover.deliveries):
        d.set_exception(KafkaConnectionError()) if p == failing else d.set_result(None)
    await asyncio.sleep(0)
    for k, f in futures.items():
        if expected_partition("replies", k) == failing:
            assert isinstance(f.exception(), KafkaConnectionError)
        else:
            assert f.result() is None
    assert len({expected_partition("replies", k) for k in keys}) > 1  # the keys span partitions


async def test_a_refused_handover_fails_its_records_and_the_partition_goes_on(batching):
    producer, handover, _ = batching
    p = expected_partition("replies", b"k")
    handover.refuse[("replies", p)] = KafkaTimeoutError()  # aiokafka's buffer stayed full
    first = await producer.send("replies", b"1", key=b"k")
    with pytest.raises(KafkaTimeoutError):
        await first
    del handover.refuse[("replies", p)]
    second = await producer.send("replies", b"2", key=b"k")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    handover.deliver_all()
    assert await second is None
    assert [v for _, _, recs in handover.batches for _, v, _ in recs] == [b"2"]


async def test_a_partition_whose_leader_is_away_holds_only_its_own_records(batching):
    producer, handover, _ = batching
    stuck = expected_partition("replies", b"a")
    other_key = next(k for k in (b"b", b"c", b"d", b"e") if expected_partition("replies", k) != stuck)
    handover.held[("replies", stuck)] = asyncio.Event()
    held = await producer.send("replies", b"1", key=b"a")
    moving = await producer.send("replies", b"2", key=other_key)
    for _ in range(5):
        await asyncio.sleep(0)
    handover.deliver_all()
    await asyncio.sleep(0)
    assert moving.done() and not held.done()
    later = await producer.send("replies", b"3", key=b"a")  # queued behind the held batch
    handover.held[("replies", stuck)].set()
    while not (held.done() and later.done()):
        await asyncio.sleep(0)
        handover.deliver_all()
    assert [v for _, p, recs in handover.batches if p == stuck for _, v, _ in recs] == [b"1", b"3"]


async def test_a_cancelled_waiter_leaves_the_other_records_of_its_batch_alone(batching):
    producer, handover, _ = batching
    waiter = asyncio.ensure_future(producer.send_and_wait("replies", b"1", key=b"k"))
    await asyncio.sleep(0)  # "1" is queued
    other = await producer.send("replies", b"2", key=b"k")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    handover.deliver_all()
    await asyncio.sleep(0)
    assert waiter.cancelled() and other.result() is None
    assert [v for _, _, recs in handover.batches for _, v, _ in recs] == [b"1", b"2"]  # both were sent


async def test_checks_before_queueing_raise_as_aiokafka_send_does(batching):
    producer, handover, _ = batching
    with pytest.raises(MessageSizeTooLargeError):
        await producer.send("replies", b"x" * 20_000, key=b"k")  # over max_request_size
    with pytest.raises(KafkaTimeoutError):
        await producer.send("no-such-topic", b"x", key=b"k")
    await asyncio.sleep(0)
    assert handover.batches == []


async def test_the_partition_is_aiokafkas_for_every_key_and_topic(batching):
    producer, _, inner = batching
    for topic in PARTITIONS:
        for i in range(500):
            key = f"tenant-{i}:request-{i * 7919}".encode()
            assert producer._partition(topic, key, b"v", key, b"v") == inner._partition(
                topic, None, key, b"v", key, b"v")


async def test_sending_waits_while_the_queues_are_full(batching):
    producer, handover, _ = batching
    producer.max_queued = 3
    p = expected_partition("replies", b"k")
    handover.held[("replies", p)] = asyncio.Event()
    first = [await producer.send("replies", str(i).encode(), key=b"k") for i in range(3)]
    fourth = asyncio.ensure_future(producer.send("replies", b"3", key=b"k"))
    await asyncio.sleep(0)  # the drainer takes the three: room again
    await asyncio.sleep(0)
    assert fourth.done()
    more = [await producer.send("replies", str(i).encode(), key=b"k") for i in range(4, 6)]
    blocked = asyncio.ensure_future(producer.send("replies", b"6", key=b"k"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not blocked.done()  # three queued behind the held hand-over
    handover.held[("replies", p)].set()
    every = first + [fourth.result()] + more + [await asyncio.wait_for(blocked, 5)]
    while not all(f.done() for f in every):
        await asyncio.sleep(0)
        handover.deliver_all()
    assert [v for _, _, recs in handover.batches for _, v, _ in recs] == [str(i).encode() for i in range(7)]


async def test_stop_hands_over_everything_queued_first(batching):
    producer, handover, inner = batching
    stopped = []

    async def inner_stop():
        stopped.append([v for _, _, recs in handover.batches for _, v, _ in recs])

    inner.stop = inner_stop
    for i in range(5):
        await producer.send("replies", str(i).encode(), key=b"k")
    await producer.stop()
    assert stopped == [[b"0", b"1", b"2", b"3", b"4"]]


async def test_unusable_topics_are_read_from_a_metadata_request_that_creates_none():
    """The lookup behind refusing a `reply_to`: a topic the producer knows is not asked about; the
    others are asked in one request with auto-creation off, and the broker's answer decides. A
    broker that does not answer names none (the request runs; sending finds out as before)."""
    from aiokafka.protocol.metadata import MetadataResponse_v5

    inner = AIOKafkaProducer(bootstrap_servers="localhost:1")
    asked = []

    async def send(node, request):
        asked.append((node, request))
        topic = lambda err, name, internal: (err, name, internal, [])  # noqa: E731
        return MetadataResponse_v5(0, [], "c", 1, [
            topic(3, "team.gone", False), topic(29, "team.locked", False), topic(17, "team..bad", False),
            topic(0, "__consumer_offsets", True), topic(0, "team.new", False), topic(5, "team.electing", False)])

    inner.client.cluster.partitions_for_topic = lambda t: {0} if t == "team.known" else None
    inner.client.get_random_node = lambda: 7
    inner.client.send = send
    producer = BatchingProducer(inner)
    found = await producer.unusable_topics(["team.known", "team.gone", "team.locked", "team..bad",
                                            "__consumer_offsets", "team.new", "team.electing"], 1.0)
    assert found == {"team.gone": "does not exist", "team.locked": "is not authorized for the workers' credentials",
                     "team..bad": "is not a valid topic name",
                     "__consumer_offsets": "is one of the broker's internal topics"}
    [(node, request)] = asked
    built = request.build(_request_struct(5))
    assert node == 7 and "team.known" not in built.topics and built.allow_auto_topic_creation is False
    assert await producer.unusable_topics(["team.known"], 1.0) == {} and len(asked) == 1
    # the worker's own topics are asked about every time: a deleted one stays in the client's metadata
    await producer.unusable_topics(["team.known"], 1.0, cached=False)
    assert len(asked) == 2 and list(asked[1][1].build(_request_struct(5)).topics) == ["team.known"]

    async def silent(node, request):
        await asyncio.sleep(5)

    inner.client.send = silent
    assert await producer.unusable_topics(["team.gone"], 0.05) == {}


@pytest.mark.parametrize("broker,why", [
    ("silent", "no answer to a metadata request within 0.05 s"),
    ("refusing", "KafkaConnectionError('Connection at localhost:1 closed')"),
    ("none known", "no broker known to the Kafka client"),
])
async def test_a_strict_lookup_says_why_no_broker_answered(broker, why):
    """The worker's own topic watch asks strictly: no answer is not "every topic fine" but an outage,
    which the health monitor bounds (SLUICE_BROKER_OUTAGE_S)."""
    from aiokafka.errors import KafkaConnectionError

    from worker.reply_batches import BrokerUnanswered

    inner = AIOKafkaProducer(bootstrap_servers="localhost:1")

    async def send(node, request):
        if broker == "refusing":
            raise KafkaConnectionError("Connection at localhost:1 closed")
        await asyncio.sleep(5)

    inner.client.get_random_node = lambda: None if broker == "none known" else 7
    inner.client.send = send
    producer = BatchingProducer(inner)
    with pytest.raises(BrokerUnanswered) as raised:
        await producer.unusable_topics(["team.a"], 0.05, cached=False, strict=True)
    assert str(raised.value) == why
    assert await producer.unusable_topics(["team.a"], 0.05, cached=False) == {}  # not strict: names none


def _request_struct(version: int):
    from aiokafka.protocol import metadata

    return getattr(metadata, f"MetadataRequest_v{version}")
