"""Send a burst of requests, follow their replies, report per-class latency.

Used by `sluice demo` and the integration tests; it checks the contract on every
reply it reads (gapless seqs, text joins to `done.text`, one final per request).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import DoneReply, ErrorReply, ReplyCodec, TokenReply
from worker.consumer_stop import stop_consumer

MERCHANTS = ["grocery", "electronics", "travel", "fuel", "restaurant", "gaming", "pharmacy"]
COUNTRIES = ["US", "GB", "DE", "BR", "IN", "NG", "JP"]


def make_requests(n: int, seed: int = 7, prefix: str = "demo", max_tokens: int = 24) -> list[tuple[str, dict]]:
    """(latency class, request body) pairs: transaction questions and chat prompts, mixed classes."""
    rng = random.Random(seed)
    classes = ["realtime", "standard", "batch"]
    out = []
    for i in range(n):
        cls = classes[i % 3]
        amount = round(rng.lognormvariate(3.5, 1.2), 2)
        tx = (f"card-present={rng.random() < 0.5} amount={amount} USD merchant={rng.choice(MERCHANTS)} "
              f"country={rng.choice(COUNTRIES)} tx_last_24h={rng.randint(0, 30)}")
        body: dict = {"id": f"{prefix}-{i:04d}", "max_tokens": max_tokens}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"Is this card transaction suspicious? {tx}"}]
        else:
            body["prompt"] = f"Transaction: {tx}\nRisk assessment:"
        out.append((cls, body))
    return out


@dataclass
class Outcome:
    latency_class: str
    sent_at: float
    first_token_at: float | None = None
    done_at: float | None = None
    tokens: dict[int, str] = field(default_factory=dict)
    final: object = None
    problems: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.tokens[s] for s in sorted(self.tokens))


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str, wait_s: float = 5.0) -> set[int] | None:
    """The partitions of `topic`, asking the broker again for up to `wait_s` (it may be brand new);
    None when it has none by then."""
    for _ in range(max(1, int(wait_s / 0.1))):
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return parts
        await consumer._client.force_metadata_update()
        await asyncio.sleep(0.1)
    return None


class ReplyReader:
    """Reads every partition of a reply topic from its current end (no consumer group).

    After seeking to the end it also reads and drops whatever is still there: the
    embedded broker reports a partition's end as one past the *first* offset of
    its last batch, so "seek to end" alone can replay the tail of that batch.
    """

    def __init__(self, kafka_opts: dict, topic: str, decode: bool = True):
        self.topic, self.decode = topic, decode  # decode=False: the records themselves (a DLQ's)
        self.consumer = AIOKafkaConsumer(**kafka_opts, enable_auto_commit=False,
                                         auto_offset_reset="earliest", fetch_max_wait_ms=50)
        self.codec = ReplyCodec()
        self.unreadable = 0  # records that are not sluice replies (another writer's, a newer version's): skipped

    async def start(self, from_beginning: bool = False) -> None:
        await self.consumer.start()
        parts = await topic_partitions(self.consumer, self.topic)
        tps = [TopicPartition(self.topic, p) for p in sorted(parts or [])]
        self.consumer.assign(tps)
        if from_beginning:
            await self.consumer.seek_to_beginning(*tps)
        else:
            await self.consumer.seek_to_end(*tps)
            for tp in tps:
                await self.consumer.position(tp)  # resolve the end now, before anything is sent
            while await self.consumer.getmany(timeout_ms=150):
                pass  # the tail the broker's end offset left behind

    async def records(self, timeout_ms: int = 200):
        batches = await self.consumer.getmany(timeout_ms=timeout_ms)
        for recs in batches.values():
            for rec in recs:
                if not self.decode:
                    yield rec
                    continue
                try:
                    reply = self.codec.decode(rec.value or b"")
                except msgspec.DecodeError:  # a ValidationError (unknown type, missing field) is one too
                    self.unreadable += 1  # one foreign record must not stop every reader of the topic
                    continue
                yield reply

    async def stop(self) -> None:
        await stop_consumer(self.consumer)


async def produce(kafka_opts: dict, items: list[tuple[str, bytes | None, bytes, list]]) -> None:
    """items: (topic, key, value, headers). `kafka_opts`: the connection, `KafkaSettings.options()`."""
    producer = AIOKafkaProducer(**kafka_opts, acks="all", linger_ms=5, max_request_size=16 << 20)
    await producer.start()
    try:
        futs = [await producer.send(t, v, key=k, headers=h) for t, k, v, h in items]
        await asyncio.gather(*futs)
    finally:
        await producer.stop()


async def run_burst(kafka_opts: dict, catalog, requests: list[tuple[str, dict]], timeout_s: float = 600,
                    on_token=None, progress=None, sign=None) -> dict[str, Outcome]:
    """Publish `requests`, read replies until each has its final; returns outcomes by id.
    `sign(key, value)` gives each record's headers (tenancy_mode signed: `schemas.signing.signed_headers`)."""
    reader = ReplyReader(kafka_opts, catalog.replies.name)
    await reader.start()
    outcomes: dict[str, Outcome] = {}
    try:
        now = time.monotonic()
        items = []
        for cls, body in requests:
            outcomes[body["id"]] = Outcome(cls, now)
            key, value = body["id"].encode(), msgspec.json.encode(body)
            items.append((catalog.request_topic(cls).name, key, value, sign(key, value) if sign else []))
        await produce(kafka_opts, items)
        remaining = set(outcomes)
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            async for reply in reader.records():
                o = outcomes.get(reply.id)
                if o is None:
                    continue
                t = time.monotonic()
                if isinstance(reply, TokenReply):
                    if reply.seq in o.tokens and o.tokens[reply.seq] != reply.text:
                        o.problems.append(f"seq {reply.seq} repeated with other text")
                    o.tokens[reply.seq] = reply.text
                    o.first_token_at = o.first_token_at or t
                    if on_token:
                        on_token(reply)
                else:
                    if o.final is not None:
                        o.problems.append("second final reply")
                        continue
                    o.final, o.done_at = reply, t
                    o.first_token_at = o.first_token_at or t
                    remaining.discard(reply.id)
                    if progress:
                        progress(1)
        for o in outcomes.values():
            check(o)
        return outcomes
    finally:
        await reader.stop()


async def read_topic(kafka_opts: dict, topic: str, quiet_ms: int = 1500) -> list:
    """Every record of every partition of `topic`, read until nothing arrives for `quiet_ms`."""
    consumer = AIOKafkaConsumer(**kafka_opts, enable_auto_commit=False, fetch_max_wait_ms=50)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            return []
        consumer.assign([TopicPartition(topic, p) for p in parts])
        await consumer.seek_to_beginning()
        out, idle_since = [], time.monotonic()
        while time.monotonic() - idle_since < quiet_ms / 1000:
            batch = await consumer.getmany(timeout_ms=200)
            if batch:
                idle_since = time.monotonic()
            for recs in batch.values():
                out.extend(recs)
        return out
    finally:
        await stop_consumer(consumer)


def check(o: Outcome) -> None:
    """Contract checks on one request's replies."""
    if o.final is None:
        o.problems.append("no final reply")
        return
    if isinstance(o.final, DoneReply):
        if sorted(o.tokens) != list(range(len(o.tokens))):
            o.problems.append(f"token seqs not gapless: {sorted(o.tokens)[:10]}")
        if o.tokens and o.final.seq != len(o.tokens):
            o.problems.append(f"done.seq {o.final.seq} != {len(o.tokens)} tokens")
        if o.tokens and o.text != o.final.text:
            o.problems.append("joined token text differs from done.text")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def report(outcomes: dict[str, Outcome]) -> str:
    rows = ["class      n  errors  ttft p50  e2e p50  e2e p90  e2e p99   req/s  tok/s"]
    start = min((o.sent_at for o in outcomes.values()), default=0)
    for cls in ("realtime", "standard", "batch", "all"):
        group = [o for o in outcomes.values() if (cls == "all" or o.latency_class == cls) and o.done_at]
        if not group:
            continue
        e2e = [o.done_at - o.sent_at for o in group]
        ttft = [o.first_token_at - o.sent_at for o in group]
        errors = sum(isinstance(o.final, ErrorReply) for o in group)
        span = max(o.done_at for o in group) - start
        toks = sum(o.final.usage.completion_tokens for o in group if isinstance(o.final, DoneReply))
        rows.append(f"{cls:9s} {len(group):3d} {errors:7d} {percentile(ttft, 50):8.2f}s {percentile(e2e, 50):7.2f}s "
                    f"{percentile(e2e, 90):7.2f}s {percentile(e2e, 99):7.2f}s {len(group) / span:7.1f} {toks / span:6.0f}")
    return "\n".join(rows)
