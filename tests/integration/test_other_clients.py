"""The wire contract through other Kafka clients than the workers' own, on the real broker, Redis
Cluster and vLLM: librdkafka (confluent-kafka), which most non-Python services use, and KafkaJS, a
client written in JavaScript alone. Requests are written with every `compression.type`, null header
values, msgpack, a score and a tombstone; replies are read by a librdkafka consumer at its default
`read_committed` isolation. A JavaScript service's text cut inside an emoji is answered at its id."""

import asyncio
import json
import os
import time
from pathlib import Path

import confluent_kafka
import msgspec
import pytest

from loadgen.ask import reply_partition
from tests.integration.helpers import committed_offsets, running_worker
from tests.tools import missing, need_tool
from tests.unit.test_templates import EVENT

pytestmark = pytest.mark.integration
J = msgspec.json.encode
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
CLASSES = ("realtime", "standard", "batch")
ROOT = Path(__file__).resolve().parents[2]
NODE_HOME = ROOT / ".sluice" / "node"  # .ci/run: npm install --prefix .sluice/node kafkajs


def _requests(tag: str) -> list[tuple[str, str, bytes | None, list, str]]:
    """(class, id, value, headers, expected final) for one codec's batch; ids unique to `tag`."""
    out = []
    for i, c in enumerate(CLASSES):
        rid = f"{tag}-s{i}"
        out.append((c, rid, J({"id": rid, "prompt": "The capital of France is", "max_tokens": 4}),
                    [("x-trace", None)], "done"))
        rid = f"{tag}-n{i}"
        out.append((c, rid, J({"id": rid, "prompt": "Ünïcode ✓ prompt", "max_tokens": 3, "stream": False}),
                    [], "done"))
    out.append(("standard", f"{tag}-m", msgspec.msgpack.encode({"id": f"{tag}-m", "prompt": "Hi", "max_tokens": 2}),
                [("content-type", b"application/msgpack")], "done"))
    out.append(("realtime", f"{tag}-f", J({"id": f"{tag}-f", "kind": "score", "template": "fraud", "event": EVENT}),
                [], "done"))
    out.append(("batch", f"{tag}-t", None, [], "invalid_request"))  # a tombstone: the id comes from its key
    out.append(("standard", f"{tag}-x", J({"id": f"{tag}-x", "prompt": "x", "max_tokens": 0}), [], "invalid_request"))
    return out


def _produce(bootstrap: str, catalog, tag: str, codec: str) -> dict[str, str]:
    """Publishes one codec's requests in one batch per topic through librdkafka: {id: expected final}."""
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "compression.type": codec,
                                         "linger.ms": 50, "enable.idempotence": False})
    expected = {}
    for cls, rid, value, headers, final in _requests(f"{tag}{codec}"):
        producer.produce(catalog.request_topic(cls).name, key=rid.encode(), value=value, headers=headers)
        expected[rid] = final
    assert producer.flush(30) == 0, "librdkafka could not deliver every request"
    return expected


def _read_replies(bootstrap: str, topic: str, ids: set[str], timeout_s: float = 180) -> tuple[list, set[int]]:
    """Every reply record of `ids` as (partition, headers, reply), and the topic's partitions; read by a librdkafka consumer assigned every partition (no group
    join, which the embedded broker holds for a rebalance delay) until each id has a final reply."""
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "unused-reader",
                                         "enable.auto.commit": False})
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in partitions])
    records, finals, end = [], set(), time.monotonic() + timeout_s
    try:
        while finals < ids and time.monotonic() < end:
            m = consumer.poll(0.5)
            if m is None:
                continue
            assert m.error() is None, m.error()
            reply = msgspec.json.decode(m.value())
            if reply["id"] in ids:
                records.append((m.partition(), dict(m.headers() or []), reply))
                if reply["type"] != "token":
                    finals.add(reply["id"])
    finally:
        consumer.close()
    return records, set(partitions)


async def test_a_librdkafka_producer_and_consumer_see_the_wire_contract(settings, catalog, engine, group_id):
    """Each request written by librdkafka, under every codec, ends in exactly one final reply once
    repeats of (id, seq) are dropped: `done` for the valid ones, `invalid_request` for a tombstone
    (named by its key) and a zero `max_tokens`. A streamed request's token records come first with
    seq 0..n-1 and add up to the `done` text; a non-streamed one has only its `done`. Every reply is
    keyed and headed by its id, on the partition murmur2 of the id names, and the worker's group
    commits every request record."""
    bootstrap = settings.kafka.bootstrap
    tag = f"rd{group_id[-6:]}"
    async with running_worker(settings, catalog, engine, group_id=group_id) as w:
        expected = {}
        for codec in CODECS:
            expected |= await asyncio.to_thread(_produce, bootstrap, catalog, tag, codec)
        records, partitions = await asyncio.to_thread(_read_replies, bootstrap, catalog.replies.name, set(expected))
        await asyncio.sleep(1.5)  # a commit interval
        assert w.ready

    by_id: dict[str, dict[int, dict]] = {}
    for partition, headers, reply in records:
        assert partition == reply_partition(reply["id"], partitions), reply
        assert headers["x-request-id"] == reply["id"].encode() and headers["content-type"] == b"application/json"
        by_id.setdefault(reply["id"], {})[reply.get("seq", -1)] = reply  # repeats of (id, seq) dropped
    for rid, final in expected.items():
        replies = by_id.get(rid, {})
        finals = [r for r in replies.values() if r["type"] != "token"]
        assert len(finals) == 1, (rid, replies)
        got = finals[0]
        if final == "done":
            assert got["type"] == "done", (rid, got)
            tokens = sorted(s for s, r in replies.items() if r["type"] == "token")
            assert tokens == list(range(len(tokens))) and got["seq"] == len(tokens), (rid, replies)
            if rid.endswith(("-n0", "-n1", "-n2")):
                assert tokens == [] and got["usage"]["completion_tokens"] == 3
            elif "-s" in rid:
                assert tokens and "".join(replies[s]["text"] for s in tokens) == got["text"] != ""
            if rid.endswith("-f"):
                assert got["finish_reason"] == "scored" and set(got["scores"]) == {"legit", "fraud"}
        else:
            assert got["type"] == "error" and got["code"] == final, (rid, got)
    committed = await committed_offsets(settings, group_id, {catalog.request_topic(c).name for c in CLASSES})
    assert sum(committed.values()) == len(expected)


async def test_a_kafkajs_service_hears_back_at_its_id_even_for_a_text_cut_inside_an_emoji(settings, catalog, engine,
                                                                                        group_id):
    """KafkaJS writes three requests with JSON.stringify and no key, and reads the replies in a consumer
    group. JSON.stringify writes the first half of a cut emoji as a lone `\\ud83d` escape: that request
    is answered `invalid_request` at its id, naming the escape; the others are answered `done` (the
    streamed one with its token records first)."""
    node = need_tool("node", "nodejs")
    if not (NODE_HOME / "node_modules" / "kafkajs").is_dir():
        missing("kafkajs", f"kafkajs is not installed under {NODE_HOME} (see .ci/run)")
    tag = f"js{group_id[-6:]}"
    async with running_worker(settings, catalog, engine, group_id=group_id) as w:
        proc = await asyncio.create_subprocess_exec(
            node, str(ROOT / "tests" / "kafkajs_roundtrip.cjs"), settings.kafka.bootstrap,
            catalog.request_topic("realtime").name, catalog.replies.name, tag,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "NODE_PATH": str(NODE_HOME / "node_modules"), "KAFKAJS_NO_PARTITIONER_WARNING": "1"})
        out, err = await asyncio.wait_for(proc.communicate(), 240)
        assert w.ready
    assert proc.returncode == 0, (proc.returncode, err.decode()[-2000:], out.decode()[-2000:])
    result = json.loads(out.decode().strip().splitlines()[-1])
    assert "\\ud83d" in result["sent"][f"{tag}-cut"]  # what the JavaScript writer put on the wire
    replies = result["replies"]
    cut = [r for r in replies[f"{tag}-cut"] if r["type"] != "token"]
    assert [(r["type"], r["code"]) for r in cut] == [("error", "invalid_request")], cut
    assert "lone UTF-16 surrogate escape (\\ud83d)" in cut[0]["message"]
    ok = {r.get("seq"): r for r in replies[f"{tag}-ok"]}  # repeats of (id, seq) dropped
    done = [r for r in ok.values() if r["type"] == "done"]
    assert len(done) == 1 and done[0]["seq"] == len(ok) - 1 > 0
    assert "".join(ok[s]["text"] for s in range(done[0]["seq"])) == done[0]["text"]
    whole = replies[f"{tag}-whole"]
    assert [r["type"] for r in whole] == ["done"] and whole[0]["usage"]["completion_tokens"] == 3
