"""A worker over the in-memory doubles and the fake engine: the stages run as they do in production."""

from __future__ import annotations

import asyncio
import contextlib
import json

import msgspec

import topics
from schemas import DoneReply, ErrorReply, ReplyCodec, TokenReply, dlq
from worker.doubles import MemoryAnswers, MemoryBroker, MemoryConsumer, MemoryProducer
from worker.fake_engine import FakeEngine
from worker.settings import load
from worker.worker import Worker

CATALOG = topics.load()
REPLIES = CATALOG.replies.name
_NOT_REPLIES = {t.name for t in CATALOG.requests} | {CATALOG.dlq.name, CATALOG.audit.name}
_codec = ReplyCodec()


def settings(**overrides):
    base = {"kafka_idempotence": False, "metrics_port": 0, "group_commit_interval_ms": 10, "drain_grace_s": 2,
            "stream_chunk_tokens": 1, "contention_hold_ms": 0, "max_record_bytes": 64 * 1024,
            "max_produce_bytes": 96 * 1024, "engine_health_interval_s": 0.2,
            "redis_lookup_wait_s": 0.2}
    return load(environ={}, **{**base, **overrides})


class Memory:
    """The doubles of one worker, and what came out of it."""

    def __init__(self, partitions: int = 2, engine=None, **overrides):
        self.settings = settings(**overrides)
        self.broker = MemoryBroker(partitions, max_record_bytes=self.settings.worker.max_produce_bytes)
        self.consumer = MemoryConsumer(self.broker)
        self.producer = MemoryProducer(self.broker)
        self.answers = MemoryAnswers()
        self.engine = engine or FakeEngine()

    def clients(self) -> dict:
        return {"consumer": self.consumer, "producer": self.producer, "answers": self.answers}

    def worker(self) -> Worker:
        return Worker(self.settings, CATALOG, self.engine, **self.clients())

    def send(self, cls: str, value, key=None, headers=(), timestamp_ms: int | None = None) -> None:
        self.broker.append(CATALOG.request_topic(cls).name, value, key, headers, timestamp_ms=timestamp_ms)

    def replies(self, everywhere: bool = False) -> list:
        """Reply records on the default reply topic (or on every topic a `reply_to` named)."""
        names = {tp.topic for tp in self.broker.logs} - _NOT_REPLIES if everywhere else {REPLIES}
        return [_codec.decode(r.value) for name in sorted(names) for r in self.broker.records(name)]

    def finals(self, everywhere: bool = False) -> dict[str, list]:
        out: dict[str, list] = {}
        for r in self.replies(everywhere):
            if isinstance(r, (DoneReply, ErrorReply)):
                out.setdefault(r.id, []).append(r)
        return out

    def tokens(self) -> list[TokenReply]:
        return [r for r in self.replies() if isinstance(r, TokenReply)]

    def audit(self) -> list:
        from schemas.audit import decoder

        return [decoder.decode(r.value) for r in self.broker.records(CATALOG.audit.name)]

    def dead_letters(self) -> list:
        return self.broker.records(CATALOG.dlq.name)

    def dead_letter_sources(self) -> set[tuple[str, int, int]]:
        out = set()
        for r in self.dead_letters():
            h = dlq.parse(r.headers)
            out.add((h[dlq.SOURCE_TOPIC], int(h[dlq.SOURCE_PARTITION]), int(h[dlq.SOURCE_OFFSET])))
        return out

    def all_committed(self) -> bool:
        """Every request record's partition is committed up to its end."""
        return all(self.broker.committed.get(tp) == len(log)
                   for tp, log in self.broker.logs.items() if tp.topic.startswith("sluice.requests."))


@contextlib.asynccontextmanager
async def running(mem: Memory):
    w = mem.worker()
    await w.start()
    try:
        yield w
    finally:
        await w.stop(grace_s=1)


async def until(predicate, timeout: float = 10.0, step: float = 0.01) -> bool:
    end = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > end:
            return False
        await asyncio.sleep(step)
    return True


J = msgspec.json.encode
M = msgspec.msgpack.encode
MSGPACK = [("content-type", b"application/msgpack")]


def request_id_of(key: bytes | None, value: bytes) -> str:
    """The id a test record is answered under: its key, else the `id` in its JSON or msgpack value."""
    if key:
        return key.decode()
    try:
        return msgspec.json.decode(value)["id"]
    except msgspec.DecodeError:
        pass
    try:  # JSON that is not Unicode text (a lone surrogate escape, a Latin-1 byte)
        return json.loads(value.decode("utf-8", errors="replace"))["id"]
    except ValueError:
        return msgspec.msgpack.decode(value)["id"]
