"""Malformed and hostile records, interleaved with valid ones on every class, against the real broker,
Redis Cluster and vLLM: each bad one gets an error reply or a dead letter, every valid request is
answered, the whole partition range is committed, and the worker stays ready."""

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from loadgen.burst import ReplyReader, produce
from schemas import DoneReply, ErrorReply, dlq
from tests.integration.helpers import committed_offsets, read_topic, running_worker
from tests.unit.harness import request_id_of

pytestmark = pytest.mark.integration
J = msgspec.json.encode
MSGPACK = [("content-type", b"application/msgpack")]
DEEP = b"[" * 5000 + b"]" * 5000
CLASSES = ("realtime", "standard", "batch")


def bad_records(c: str) -> list:
    """(key, value, headers, expected) with ids unique to class prefix `c`; expected is
    ("reply", code), ("dlq", code) or ("done", None)."""
    return [
        (f"{c}01".encode(), b"{not json", [], ("reply", "invalid_request")),     # id from the key
        (None, b"\x00\xff garbage", [], ("dlq", "invalid_request")),              # nothing readable
        (None, J({"prompt": "no id"}), [], ("dlq", "invalid_request")),
        (None, J({"id": f"{c}04", "prompt": 5}), [], ("reply", "invalid_request")),
        (None, J({"id": f"{c}05", "kind": "translate", "prompt": "x"}), [], ("reply", "invalid_request")),
        (None, J({"id": f"{c}06"}), [], ("reply", "invalid_request")),
        (None, J({"id": f"{c}07", "prompt": "x", "max_tokens": 100000}), [], ("reply", "invalid_request")),
        (None, J({"id": f"{c}08", "prompt": "x", "stop": ["a"] * 50}), [], ("reply", "invalid_request")),
        (None, J({"id": f"{c}09", "prompt": "x" * (1100 * 1024)}), [], ("reply", "payload_too_large")),
        (None, J({"id": f"{c}10", "prompt": "x", "reply_to": "bad topic!"}), [], ("dlq", "invalid_request")),
        (None, J({"id": f"{c}11", "prompt": "x"}), [("content-type", b"text/xml")], ("reply", "invalid_request")),
        (None, b"\xc1", MSGPACK, ("dlq", "invalid_request")),
        (None, J({"id": f"{c}13", "prompt": "x", "deadline_ms": 1}), [], ("reply", "deadline_exceeded")),
        (None, J({"id": f"{c}14", "prompt": "word " * 3000}), [], ("reply", "payload_too_large")),  # > context
        (f"{c}15".encode(), None, [], ("reply", "invalid_request")),             # tombstone
        (f"{c}16".encode(), b'{"id":"x","prompt":"x","z":' + DEEP + b"}", [], ("reply", "invalid_request")),
        (None, b'{"id":"x","prompt":"x","z":' + DEEP + b"}", [], ("dlq", "invalid_request")),
        (f"{c}18".encode(), b"\x91" * 5000 + b"\x01", MSGPACK, ("reply", "invalid_request")),
        (None, J({"id": f"{c}19", "prompt": "Hi", "max_tokens": 2}), [("x-trace", None)], ("done", None)),
        (None, J({"id": f"{c}20", "prompt": "Hi", "max_tokens": 2}), [("content-type", None)], ("done", None)),
        (None, J({"id": f"{c}21", "prompt": "x"}), [("content-type", b"x" * (1 << 20))], ("reply", "invalid_request")),
        (None, b"\x00" * ((1 << 20) - 64), [("h", b"y" * 600_000)], ("dlq", "invalid_request")),  # cut to fit
        (None, J({"id": f"{c}23", "prompt": ""}), [], ("reply", "invalid_request")),
        (None, msgspec.msgpack.encode({"id": f"{c}24", "prompt": "x", "temperature": float("nan")}), MSGPACK,
         ("reply", "invalid_request")),
        (b"\xff\xfe", b"{", [], ("dlq", "invalid_request")),
        (None, b'{"id":"' + f"{c}26".encode() + b'","prompt":"cut \\ud83d"}', [], ("reply", "invalid_request")),
    ]


HOSTILE_PRODUCER = textwrap.dedent("""
    # A plain Kafka client writing a header key that is not UTF-8 (the pure-Python record builder
    # lets it through); aiokafka's own reader cannot parse such a record.
    import asyncio, sys
    from aiokafka import AIOKafkaProducer

    class NotUtf8(str):
        def encode(self, *a, **k):
            return b"\\xff\\xfe-key"

    async def main(bootstrap, topics):
        p = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await p.start()
        for t in topics.split(","):
            await p.send_and_wait(t, b'{"id":"h","prompt":"x"}', partition=0, headers=[(NotUtf8("k"), b"v")])
        await p.stop()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


async def _read_all(bootstrap, topic, n, timeout=60):
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False,
                                max_partition_fetch_bytes=8 << 20)
    await consumer.start()
    parts = consumer.partitions_for_topic(topic) or {0}
    tps = [TopicPartition(topic, p) for p in parts]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    out = []
    try:
        end = asyncio.get_running_loop().time() + timeout
        while len(out) < n and asyncio.get_running_loop().time() < end:
            for recs in (await consumer.getmany(timeout_ms=300)).values():
                out.extend(recs)
    finally:
        await consumer.stop()
    return out


async def test_malformed_records_never_block(settings, catalog, engine, group_id):
    items, bad, goods = [], [], []
    for cls in CLASSES:
        topic = catalog.request_topic(cls).name
        for i, (key, value, headers, expect) in enumerate(bad_records(cls[0])):
            items.append((topic, key, value, headers))
            bad.append((cls, key, value, expect))
            gid = f"good-{cls}-{i}"
            goods.append(gid)
            body = {"id": gid, "prompt": f"Count to {i}:", "max_tokens": 3}
            if i % 2:  # every other valid request is msgpack
                items.append((topic, gid.encode(), msgspec.msgpack.encode(body), MSGPACK))
            else:
                items.append((topic, gid.encode(), J(body), []))
    partitions = {cls: catalog.request_topic(cls).partitions for cls in CLASSES}
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    finals = {}
    try:
        async with running_worker(settings, catalog, engine, group_id=group_id, max_produce_bytes=1_000_000) as w:
            await produce(settings.kafka.options(), items)
            subprocess.run([sys.executable, "-c", HOSTILE_PRODUCER, settings.kafka.bootstrap,
                            ",".join(catalog.request_topic(c).name for c in CLASSES)],
                           env={**os.environ, "AIOKAFKA_NO_EXTENSIONS": "1"}, check=True, timeout=60)
            # valid requests after the unparseable record, on every partition of every class
            producer = AIOKafkaProducer(**settings.kafka.options())
            await producer.start()
            for cls in CLASSES:
                for p in range(partitions[cls]):
                    gid = f"after-{cls}-{p}"
                    goods.append(gid)
                    await producer.send_and_wait(catalog.request_topic(cls).name, J(
                        {"id": gid, "prompt": "Say hi", "max_tokens": 2}), key=gid.encode(), partition=p)
            await producer.stop()
            expected = len(goods) + sum(1 for b in bad if b[3][0] in ("reply", "done"))
            end = asyncio.get_running_loop().time() + 300
            while len(finals) < expected and asyncio.get_running_loop().time() < end:
                async for r in reader.records():
                    if not isinstance(r, (DoneReply, ErrorReply)):
                        continue
                    assert r.id not in finals, f"second final for {r.id}"
                    finals[r.id] = r
            await asyncio.sleep(1.5)  # a commit interval
            still_ready = w.ready and w.supervisor.failure is None
        n_dlq = sum(b[3][0] == "dlq" for b in bad) + len(CLASSES)
        dead = await _read_all(settings.kafka.bootstrap, catalog.dlq.name, n_dlq)
        committed = await committed_offsets(settings, group_id, {catalog.request_topic(c).name for c in CLASSES})
    finally:
        await reader.stop()

    assert still_ready
    for gid in goods:
        assert isinstance(finals.get(gid), DoneReply), f"{gid}: {finals.get(gid)}"
    for cls, key, value, (route, code) in bad:
        if route == "dlq":
            continue
        reply = finals.get(request_id_of(key, value))
        if route == "done":
            assert isinstance(reply, DoneReply), (cls, key, reply)
        else:
            assert isinstance(reply, ErrorReply) and reply.code.value == code, (cls, key, reply)
            assert 0 < len(reply.message) <= 512
    assert len(dead) == n_dlq
    parsed = [dlq.parse(r.headers) for r in dead]
    assert sorted(h[dlq.ERROR_CODE] for h in parsed) == ["invalid_request"] * n_dlq
    unparsed = [h for h in parsed if "could not parse" in h[dlq.ERROR_MESSAGE]]
    assert sorted(h[dlq.SOURCE_TOPIC] for h in unparsed) == sorted(catalog.request_topic(c).name for c in CLASSES)
    assert sum(dlq.TRUNCATED in h for h in parsed) == len(CLASSES)  # the near-limit record, once per class
    originals = {bytes(v) for _, _, v, (route, _) in bad if route == "dlq" and len(v) < 100_000}
    assert originals <= {bytes(r.value or b"") for r in dead}  # original bytes preserved where they fit
    # Everything was answered, so the whole partition range is committed.
    assert sum(committed.values()) == len(items) + len(CLASSES) + sum(partitions.values())


CODECS = ("gzip", "snappy", "lz4", "zstd")


async def _publish_compressed(settings, topic: str, tag: str) -> dict[str, list[int]]:
    """Three requests per codec, each codec's three in one compressed batch on partition 0, as a
    Java or librdkafka producer with `compression.type` set writes them: {codec: offsets}."""
    offsets = {}
    for codec in CODECS:
        producer = AIOKafkaProducer(**settings.kafka.options(), compression_type=codec, linger_ms=50)
        await producer.start()
        try:
            futures = [await producer.send(topic, J({"id": f"{tag}-{codec}-{i}", "prompt": "Say hi", "max_tokens": 2}),
                                           key=f"{tag}-{codec}-{i}".encode(), partition=0) for i in range(3)]
            offsets[codec] = [(await f).offset for f in futures]
        finally:
            await producer.stop()
    return offsets


async def _finals(reader, ids, timeout=120) -> dict:
    finals = {}
    end = asyncio.get_running_loop().time() + timeout
    while set(ids) - set(finals) and asyncio.get_running_loop().time() < end:
        async for r in reader.records():
            if isinstance(r, (DoneReply, ErrorReply)):
                finals[r.id] = r
    return finals


async def test_compressed_batches_are_answered_and_one_the_client_cannot_decode_is_dead_lettered(
        settings, catalog, engine, group_id, monkeypatch):
    """Every codec Kafka has (gzip, snappy, lz4, zstd) is read and answered. A batch the worker's
    Kafka client cannot decode (lz4 with its library hidden from the client) fails every fetch that
    reaches it, and before the fix stopped the whole class; now each of its records is dead-lettered
    with its coordinates, the records after it are answered, and the partition is committed."""
    import aiokafka.codec
    import topics
    from topics.admin import apply

    topic = catalog.request_topic("standard").name
    await _publish_compressed(settings, topic, "a")
    ids = [f"a-{c}-{i}" for c in CODECS for i in range(3)]
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    try:
        async with running_worker(settings, catalog, engine, group_id=group_id):
            finals = await _finals(reader, ids)
            await asyncio.sleep(1.5)  # a commit interval
    finally:
        await reader.stop()
    assert all(isinstance(finals.get(i), DoneReply) for i in ids), finals
    assert sum((await committed_offsets(settings, group_id, {topic})).values()) == 12

    hidden = topics.load().renamed(f"t{group_id}lz.")
    await apply(settings.kafka.options(), hidden)
    topic = hidden.request_topic("standard").name
    offsets = await _publish_compressed(settings, topic, "b")
    monkeypatch.setattr(aiokafka.codec, "has_lz4", lambda: False)  # the worker's client now fails on lz4
    ids = [f"b-{c}-{i}" for c in CODECS if c != "lz4" for i in range(3)]
    reader = ReplyReader(settings.kafka.options(), hidden.replies.name)
    await reader.start()
    try:
        async with running_worker(settings, hidden, engine, group_id=f"{group_id}-lz") as w:
            finals = await _finals(reader, ids)
            await asyncio.sleep(1.5)
            still_ready = w.ready and w.supervisor.failure is None
    finally:
        await reader.stop()
    dead = await _read_all(settings.kafka.bootstrap, hidden.dlq.name, 3)
    assert still_ready
    assert all(isinstance(finals.get(i), DoneReply) for i in ids), finals
    assert not any(i.startswith("b-lz4") for i in finals)
    coords = sorted((h[dlq.SOURCE_TOPIC], int(h[dlq.SOURCE_PARTITION]), int(h[dlq.SOURCE_OFFSET]))
                    for h in map(dlq.parse, (r.headers for r in dead)))
    assert coords == [(topic, 0, o) for o in offsets["lz4"]]
    assert all("lz4" in dlq.parse(r.headers)[dlq.ERROR_MESSAGE] for r in dead)
    assert sum((await committed_offsets(settings, f"{group_id}-lz", {topic})).values()) == 12


async def _timestamps_at(settings, sent: dict) -> dict:
    """{name: the timestamp the broker returns} for records known by their send metadata."""
    consumer = AIOKafkaConsumer(**settings.kafka.options(), enable_auto_commit=False)
    await consumer.start()
    out = {}
    try:
        for name, meta in sent.items():
            tp = TopicPartition(meta.topic, meta.partition)
            consumer.assign([tp])
            consumer.seek(tp, meta.offset)
            recs = (await consumer.getmany(tp, timeout_ms=5000, max_records=1)).get(tp, [])
            out[name] = recs[0].timestamp if recs else None
    finally:
        await consumer.stop()
    return out


async def test_a_record_stamped_0_or_an_hour_ahead_is_answered_and_timed_from_when_it_was_read(
        settings, catalog, engine, group_id):
    """A plain Kafka client may set any CreateTime. The broker keeps it; the worker answers the
    request, counts the timestamp as untrusted and times the request from when it read it, so the
    latency histograms do not gain 56 years (or lose an hour)."""
    from worker import metrics

    def sample(name):
        return metrics.REGISTRY.get_sample_value(name, {"class": "realtime"}) or 0.0

    topic = catalog.request_topic("realtime").name
    now_ms = int(time.time() * 1000)
    stamps = {"ts-zero": 0, "ts-ahead": now_ms + 3_600_000}
    e2e, untrusted = sample("sluice_end_to_end_seconds_sum"), sample("sluice_untrusted_timestamps_total")
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    try:
        async with running_worker(settings, catalog, engine, group_id=group_id):
            producer = AIOKafkaProducer(**settings.kafka.options())
            await producer.start()
            try:
                kept = {rid: await (await producer.send(topic, J({"id": rid, "prompt": "Say hi", "max_tokens": 2}),
                                                       key=rid.encode(), timestamp_ms=stamp))
                        for rid, stamp in stamps.items()}
            finally:
                await producer.stop()
            finals = await _finals(reader, list(stamps))
    finally:
        await reader.stop()
    assert await _timestamps_at(settings, kept) == stamps  # the broker kept what the client set
    assert all(isinstance(finals.get(rid), DoneReply) for rid in stamps), finals
    assert sample("sluice_untrusted_timestamps_total") - untrusted == 2
    assert 0 < sample("sluice_end_to_end_seconds_sum") - e2e < 120


async def _topic_exists(settings, topic: str) -> bool:
    """Asked without creating it (a plain metadata request would create it on this broker)."""
    from aiokafka.protocol.metadata import MetadataRequest

    producer = AIOKafkaProducer(**settings.kafka.options())
    await producer.start()
    try:
        client = producer.client
        response = await client.send(client.get_random_node(), MetadataRequest([topic], allow_auto_topic_creation=False))
        return response.topics[0][0] == 0
    finally:
        await producer.stop()


async def test_a_reply_to_topic_that_does_not_exist_is_refused_and_not_created(settings, catalog, engine, group_id):
    """A `reply_to` the tenant's pattern allows, naming a topic that does not exist, is refused
    `invalid_request` on the default reply topic before it runs, and the worker does not create it
    (on a broker that does not create topics, each of its records would have waited out the
    producer's metadata timeout; on this one, any request could add topics). A `reply_to` naming an
    existing topic under the same pattern is answered there."""
    import uuid

    run = uuid.uuid4().hex[:8]
    missing, existing = f"probe-{run}.gone", f"probe-{run}.replies"
    topic = catalog.request_topic("realtime").name
    producer = AIOKafkaProducer(**settings.kafka.options())
    await producer.start()
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    try:
        await producer.send_and_wait(existing, b"created by a plain producer")
        async with running_worker(settings, catalog, engine, group_id=group_id, tenancy_reply_to=r"probe-.*") as w:
            for rid, reply_to in ((f"gone-{run}", missing), (f"there-{run}", existing)):
                await producer.send_and_wait(topic, J({"id": rid, "prompt": "Say hi", "max_tokens": 2,
                                                       "reply_to": reply_to}), key=rid.encode())
            finals = await _finals(reader, [f"gone-{run}"])
            # the answer may be a token record before its done: read until the done is there
            answered = await read_topic(settings.kafka.options(), existing, at_least=2,
                                        until=lambda got: any(b'"done"' in (r.value or b"") for r in got))
            assert w.ready
    finally:
        await reader.stop()
        await producer.stop()
    refused = finals[f"gone-{run}"]
    assert isinstance(refused, ErrorReply) and refused.code == "invalid_request", refused
    assert refused.message == f"reply_to '{missing}' does not exist"
    assert not await _topic_exists(settings, missing)
    done = [r for r in answered[1:] if r.value and b'"done"' in r.value]
    assert len(done) == 1 and done[0].key == f"there-{run}".encode()
