"""Malformed records get an error reply or a dead letter; valid ones around them complete."""

import asyncio

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from loadgen.burst import ReplyReader, produce
from schemas import DoneReply, ErrorReply, dlq
from tests.integration.helpers import committed_offsets, running_worker

pytestmark = pytest.mark.integration
J = msgspec.json.encode

# (key, value, headers, expected: ("reply", code) or ("dlq", code))
BAD = [
    (b"b01", b"{not json", [], ("reply", "invalid_request")),         # id from the key
    (None, b"\x00\xff garbage", [], ("dlq", "invalid_request")),       # nothing readable
    (None, J({"prompt": "no id"}), [], ("dlq", "invalid_request")),
    (None, J({"id": "b04", "prompt": 5}), [], ("reply", "invalid_request")),
    (None, J({"id": "b05", "kind": "translate", "prompt": "x"}), [], ("reply", "invalid_request")),
    (None, J({"id": "b06"}), [], ("reply", "invalid_request")),
    (None, J({"id": "b07", "prompt": "x", "max_tokens": 100000}), [], ("reply", "invalid_request")),
    (None, J({"id": "b08", "prompt": "x", "stop": ["a"] * 50}), [], ("reply", "invalid_request")),
    (None, J({"id": "b09", "prompt": "x" * (1100 * 1024)}), [], ("reply", "payload_too_large")),
    (None, J({"id": "b10", "prompt": "x", "reply_to": "bad topic!"}), [], ("dlq", "invalid_request")),
    (None, J({"id": "b11", "prompt": "x"}), [("content-type", b"text/xml")], ("reply", "invalid_request")),
    (None, b"\xc1", [("content-type", b"application/msgpack")], ("dlq", "invalid_request")),
    (None, J({"id": "b13", "prompt": "x", "deadline_ms": 1}), [], ("reply", "deadline_exceeded")),
    (None, J({"id": "b14", "prompt": "word " * 3000}), [], ("reply", "payload_too_large")),  # > model context
    (b"b15", None, [], ("reply", "invalid_request")),                  # tombstone
]


async def _read_dlq(bootstrap, topic, n, timeout=60):
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    consumer.assign([TopicPartition(topic, 0)])
    await consumer.seek_to_beginning()
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
    topic = catalog.request_topic("standard").name
    items = []
    for i, (key, value, headers, _) in enumerate(BAD):
        items.append((topic, key, value, headers))
        good = {"id": f"good-{i}", "prompt": f"Count to {i}:", "max_tokens": 4}
        if i % 2:  # every other valid request is msgpack
            items.append((topic, f"good-{i}".encode(), msgspec.msgpack.encode(good),
                          [("content-type", b"application/msgpack")]))
        else:
            items.append((topic, f"good-{i}".encode(), J(good), []))
    reader = ReplyReader(settings.kafka_bootstrap, catalog.replies.name)
    await reader.start()
    finals = {}
    try:
        async with running_worker(settings, catalog, engine, group_id=group_id):
            await produce(settings.kafka_bootstrap, items)
            expected_replies = len(BAD) + sum(1 for b in BAD if b[3][0] == "reply")
            end = asyncio.get_running_loop().time() + 180
            while len(finals) < expected_replies and asyncio.get_running_loop().time() < end:
                async for r in reader.records():
                    if not isinstance(r, (DoneReply, ErrorReply)):
                        continue
                    assert r.id not in finals, f"second final for {r.id}"
                    finals[r.id] = r
            await asyncio.sleep(1.5)  # a commit interval
        dead = await _read_dlq(settings.kafka_bootstrap, catalog.dlq.name, sum(b[3][0] == "dlq" for b in BAD))
        committed = await committed_offsets(settings, group_id, {topic})
    finally:
        await reader.stop()

    for i in range(len(BAD)):
        assert isinstance(finals.get(f"good-{i}"), DoneReply), f"good-{i}: {finals.get(f'good-{i}')}"
    for i, (key, value, headers, (route, code)) in enumerate(BAD):
        if route == "reply":
            rid = key.decode() if key else msgspec.json.decode(value)["id"]
            reply = finals.get(rid)
            assert isinstance(reply, ErrorReply), (i, rid, reply)
            assert reply.code.value == code, (rid, reply)
            assert reply.message
    dlq_codes = sorted(dlq.parse(r.headers)[dlq.ERROR_CODE] for r in dead)
    assert dlq_codes == sorted(code for *_, (route, code) in BAD if route == "dlq")
    originals = {bytes(value) for _, value, _, (route, _) in BAD if route == "dlq"}
    assert {bytes(r.value) for r in dead} == originals  # original bytes preserved
    for r in dead:
        h = dlq.parse(r.headers)
        assert h[dlq.SOURCE_TOPIC] == topic and int(h[dlq.SOURCE_OFFSET]) >= 0
    # Everything was answered, so the whole partition range is committed.
    assert sum(committed.values()) == len(items)
