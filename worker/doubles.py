"""In-memory doubles of the worker's clients: a broker with consumer and producer, and an answer store.

The same stage code runs over these (millisecond unit tests with the fake engine)
and over aiokafka + Redis Cluster (integration tests). They implement only what
the worker calls, with the same shapes: `ConsumerRecord`, `TopicPartition`,
futures from `send`, `KafkaError`s with `retriable`.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import defaultdict
from types import SimpleNamespace

from aiokafka.errors import (MessageSizeTooLargeError, NoOffsetForPartitionError, OffsetOutOfRangeError,
                            UnknownTopicOrPartitionError)
from aiokafka.structs import ConsumerRecord, TopicPartition

from worker.answers import Progress
from worker.reply_batches import BrokerUnanswered


class MemoryBroker:
    def __init__(self, partitions: int = 1, max_record_bytes: int = 1_048_576):
        self.partitions = partitions
        self.max_record_bytes = max_record_bytes
        self.logs: dict[TopicPartition, list[ConsumerRecord]] = defaultdict(list)
        self.committed: dict[TopicPartition, int] = {}
        self.log_start: dict[TopicPartition, int] = defaultdict(int)  # below it, records are deleted
        self.appended = asyncio.Event()
        # False: like a broker that does not create topics, only topics `create`d or appended to exist
        self.auto_create = True
        self.created: set[str] = set()
        self.deleted: set[str] = set()  # what metadata says no longer exists (records kept: reads go on)
        self.unreachable = False  # True: metadata requests get no answer (a broker killed or cut off)
        self.fetches_held = False  # True: fetches get no answer while metadata does (a leader cut off)

    def create(self, *topics: str) -> None:
        self.created.update(topics)
        self.deleted.difference_update(topics)

    def delete(self, *topics: str) -> None:
        self.deleted.update(topics)

    def exists(self, topic: str) -> bool:
        if topic in self.deleted:
            return False
        return self.auto_create or topic in self.created or any(tp.topic == topic for tp in self.logs)

    def append(self, topic: str, value, key=None, headers=(), partition: int | None = None,
               timestamp_ms: int | None = None) -> ConsumerRecord:
        if partition is None:
            partition = (zlib.crc32(key) % self.partitions) if key else 0
        tp = TopicPartition(topic, partition)
        log = self.logs[tp]
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        rec = ConsumerRecord(topic, partition, len(log), stamp, 0, key, value, None,
                             len(key or b""), len(value or b""), tuple(headers or ()))
        log.append(rec)
        self.appended.set()
        return rec

    def delete_records(self, tp: TopicPartition, before: int) -> None:
        """What retention or DeleteRecords does: the records below `before` are gone."""
        self.log_start[tp] = max(self.log_start[tp], min(before, len(self.logs[tp])))

    def records(self, topic: str) -> list[ConsumerRecord]:
        return [r for tp, log in sorted(self.logs.items()) if tp.topic == topic for r in log]


class MemoryConsumer:
    """One group member that owns every partition of its topics, reading as aiokafka's consumer does with
    `auto_offset_reset="none"`: a partition the group has no offset for, or whose offset is below the
    broker's log start, raises on `getmany` until it is sought.

    `fail_next` makes the next `getmany` raise (a client fault), `failing` every one while it is set
    (a broker that keeps refusing); `unreadable` holds
    (tp, offset) pairs that raise on read, like a record aiokafka cannot parse. `join_held`, while
    not set, holds `start` as a coordinator that never completes the join does (aiokafka's `start`
    returns once the group has assigned partitions); `rejoin_held` is a rebalance whose rejoin it holds.
    """

    def __init__(self, broker: MemoryBroker):
        self.broker = broker
        self.topics: list[str] = []
        self.listener = None
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._position: dict[TopicPartition, int] = {}
        self.unreadable: set[tuple[TopicPartition, int]] = set()
        self.fail_next: Exception | None = None
        self.failing: Exception | None = None
        self.commit_error: Exception | None = None
        self.join_held: asyncio.Event | None = None
        self.polls = 0
        self._answers: dict[TopicPartition, int] = {}  # fetch answers per partition (worker/fetch_watch.py)

    def subscribe(self, topics, listener=None) -> None:
        self.topics, self.listener = list(topics), listener

    async def start(self) -> None:
        if self.join_held is not None:
            await self.join_held.wait()
        await self.assign({TopicPartition(t, p) for t in self.topics for p in range(self.broker.partitions)})

    async def assign(self, tps: set) -> None:
        """A rebalance: revoke what is no longer ours, then assign, as the group protocol does."""
        if self.listener is not None and self._assigned:
            await self.listener.on_partitions_revoked(set(self._assigned))
        self._assigned = set(tps)
        for tp in tps:
            self._position[tp] = self.broker.committed.get(tp)
        if self.listener is not None:
            await self.listener.on_partitions_assigned(set(tps))

    async def rejoin_held(self) -> None:
        """A rebalance whose rejoin the coordinator holds: this member's partitions are revoked, and
        nothing is assigned again."""
        if self.listener is not None:
            await self.listener.on_partitions_revoked(set(self._assigned))
        self._assigned = set()

    async def stop(self) -> None:
        return None

    def assignment(self) -> set:
        return set(self._assigned)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return set(range(self.broker.partitions)) if topic in self.topics else None

    def answer_marks(self) -> dict:
        """Each assigned, unpaused partition -> how many fetches for it were answered."""
        return {tp: self._answers.get(tp, 0) for tp in self._assigned if tp not in self._paused}

    def pause(self, *tps) -> None:
        self._paused.update(tps)

    def resume(self, *tps) -> None:
        self._paused.difference_update(tps)

    async def position(self, tp) -> int:
        return self._position[tp]

    def highwater(self, tp) -> int | None:
        return len(self.broker.logs.get(tp, ())) if tp in self._assigned else None

    def seek(self, tp, offset: int) -> None:
        self._position[tp] = offset

    async def seek_to_beginning(self, *tps) -> None:
        for tp in tps:
            self._position[tp] = self.broker.log_start[tp]

    async def beginning_offsets(self, tps) -> dict:
        return {tp: self.broker.log_start[tp] for tp in tps}

    async def end_offsets(self, tps) -> dict:
        return {tp: len(self.broker.logs.get(tp, ())) for tp in tps}

    async def committed(self, tp) -> int | None:
        return self.broker.committed.get(tp)

    async def getmany(self, *tps, timeout_ms: int = 0, max_records: int | None = None) -> dict:
        self.polls += 1
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        if self.failing is not None:
            raise self.failing
        end = time.monotonic() + timeout_ms / 1000
        if self.broker.fetches_held:  # the wait passes with nothing, as a fetch the client gave up on
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        for tp in tps or self._assigned:
            self._answers[tp] = self._answers.get(tp, 0) + 1
        while True:
            got, budget = {}, max_records or 1 << 30
            for tp in tps or sorted(self._assigned):
                if tp not in self._assigned or tp in self._paused:
                    continue
                log, pos = self.broker.logs.get(tp, []), self._position[tp]
                if pos is None or pos < self.broker.log_start[tp] or pos > len(log):
                    if got:  # as aiokafka: what was read is returned, the error raised on the next call
                        return got
                    raise NoOffsetForPartitionError(tp) if pos is None else OffsetOutOfRangeError({tp: pos})
                take = []
                for rec in log[pos: pos + budget]:
                    if (tp, rec.offset) in self.unreadable:
                        # As aiokafka does: the fetch raises, and what it read before the bad record
                        # (of this partition and of those before it) is dropped, positions moved past it.
                        for done_tp, recs in got.items():
                            self._position[done_tp] = recs[-1].offset + 1
                        self._position[tp] = rec.offset
                        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
                    take.append(rec)
                if take:
                    got[tp] = take
                    self._position[tp] = take[-1].offset + 1
                    budget -= len(take)
                if budget <= 0:
                    break
            if got or time.monotonic() >= end:
                return got
            self.broker.appended.clear()
            # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation
            waiter = asyncio.ensure_future(self.broker.appended.wait())
            try:
                await asyncio.wait({waiter}, timeout=max(0.001, end - time.monotonic()))
            finally:
                waiter.cancel()

    async def commit(self, offsets: dict) -> None:
        if self.commit_error is not None:
            raise self.commit_error
        self.broker.committed.update(offsets)


class MemoryProducer:
    """Appends to the broker. `fail(topic, value)` may return an exception to raise instead."""

    def __init__(self, broker: MemoryBroker, fail=None):
        self.broker = broker
        self.fail = fail or (lambda topic, value: None)
        self._sender = None
        self._crash = asyncio.Event()
        self.crash_with: BaseException | None = None

    async def start(self) -> None:
        # Like aiokafka's producer, a background sender task that the worker's supervisor watches.
        self._sender = SimpleNamespace(sender_task=asyncio.create_task(self._sender_routine()))

    async def _sender_routine(self) -> None:
        await self._crash.wait()
        raise self.crash_with or RuntimeError("sender crashed")

    def crash(self, exc: BaseException) -> None:
        self.crash_with = exc
        self._crash.set()

    async def stop(self) -> None:
        if self._sender is not None and not self._sender.sender_task.done():
            self._sender.sender_task.cancel()
            await asyncio.gather(self._sender.sender_task, return_exceptions=True)

    def _append(self, topic, value, key, headers):
        assert key is not None or value is not None, "Need at least one: key or value"  # as aiokafka
        exc = self.fail(topic, value)
        if exc is not None:
            raise exc
        if not self.broker.exists(topic):  # what aiokafka raises once its metadata wait runs out
            raise UnknownTopicOrPartitionError(topic)
        size = len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in headers or ())
        if size > self.broker.max_record_bytes:
            raise MessageSizeTooLargeError(f"{size} bytes")
        return self.broker.append(topic, value, key, headers, partition=0)

    async def unusable_topics(self, topics, timeout_s: float, cached: bool = True,
                              strict: bool = False) -> dict[str, str]:
        if self.broker.unreachable:
            if strict:
                raise BrokerUnanswered("KafkaConnectionError('connection refused (in-memory broker)')")
            return {}
        return {t: "does not exist" for t in topics if not self.broker.exists(t)}

    async def send(self, topic, value=None, key=None, headers=None):
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(self._append(topic, value, key, headers))
        except Exception as exc:  # noqa: BLE001 - delivered through the future, as aiokafka does
            fut.set_exception(exc)
        return fut

    async def send_and_wait(self, topic, value=None, key=None, headers=None):
        return self._append(topic, value, key, headers)


class MemoryAnswers:
    """The AnswerStore's interface over dicts; `available` False behaves as degraded Redis."""

    def __init__(self):
        self.answers: dict[str, bytes] = {}
        self.progress: dict[str, dict] = {}
        self.tokenizers: dict[str, str] = {}  # request id -> its progress's `tok`
        self.owners: dict[str, str] = {}  # request id -> the attempt that claimed it
        self._available = True
        self.unavailable_since: float | None = None  # monotonic, as the AnswerStore keeps it
        self.fail_writer: Exception | None = None
        self.hold: asyncio.Event | None = None
        self._writer: asyncio.Task | None = None
        self._wanted = asyncio.Event()

    @property
    def available(self) -> bool:
        return self._available

    @available.setter
    def available(self, ok: bool) -> None:
        if not ok and self.unavailable_since is None:
            self.unavailable_since = time.monotonic()
        elif ok:
            self.unavailable_since = None
        self._available = ok

    async def start(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name="sluice-answers-writer")

    async def _write_loop(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            if self.fail_writer is not None:
                raise self.fail_writer

    @property
    def writer(self) -> asyncio.Task | None:
        return self._writer

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)

    async def lookup_many(self, request_ids, streamed, owners=None):
        if not self.available:
            return [(None, None)] * len(request_ids)
        out = []
        for i, (rid, stream) in enumerate(zip(request_ids, streamed)):
            chunks = self.progress.get(rid) if stream else None
            out.append((self.answers.get(rid),
                        Progress([c for _, c in sorted(chunks.items())], None, self.tokenizers.get(rid))
                        if chunks else None))
            if owners is not None and self.answers.get(rid) is None:
                self.owners[rid] = owners[i]
        return out

    async def adopt(self, request_id, streamed, dead_owner, owner):
        """As AnswerStore.adopt: claimed only from the dead run."""
        from worker.answers import ADOPTED, ANSWERED, TAKEN

        if not self.available:
            return None, None
        if request_id in self.answers:
            return ANSWERED, None
        if self.owners.get(request_id) != dead_owner:
            return TAKEN, None
        self.owners[request_id] = owner
        chunks = self.progress.get(request_id) if streamed else None
        return ADOPTED, (Progress([c for _, c in sorted(chunks.items())], None, self.tokenizers.get(request_id))
                         if chunks else None)

    def _fenced(self, request_id: str, owner: str) -> bool:
        """Another attempt holds the claim, or the claim is gone because an answer was stored."""
        holder = self.owners.get(request_id)
        return holder != owner and (holder is not None or request_id in self.answers)

    def put_later(self, request_id: str, final_reply: bytes, owner: str = "") -> asyncio.Future:
        """Stored once `hold` (an Event, if set by a test) allows; resolves as AnswerStore's does:
        True stored, False fenced (another run owns the id), None Redis away."""
        done = asyncio.get_running_loop().create_future()

        async def write():
            if self.hold is not None:
                await self.hold.wait()
            if not self.available:
                done.set_result(None)
            elif owner and self._fenced(request_id, owner):
                done.set_result(False)
            else:
                self.answers[request_id] = final_reply
                self.progress.pop(request_id, None)
                self.tokenizers.pop(request_id, None)
                self.owners.pop(request_id, None)
                done.set_result(True)

        asyncio.get_running_loop().create_task(write())
        self._wanted.set()
        return done

    async def append_chunks(self, request_id, chunks, scores=None, owner=None, tokenizer=None):
        if not self.available:
            return None
        if owner and self._fenced(request_id, owner):
            return False  # another attempt owns it now, or answered it
        if owner:
            self.owners[request_id] = owner  # a claim gone with no answer is taken again, as AnswerStore's is
        for seq, token_ids, text in chunks:
            self.progress.setdefault(request_id, {})[seq] = (list(token_ids), text)
        if tokenizer is not None:
            self.tokenizers[request_id] = tokenizer
        return True
