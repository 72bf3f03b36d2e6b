"""Reply records produced a batch per partition instead of one `send()` each.

aiokafka's `send()` costs about 12 µs of Python per record (partitioning, the accumulator, a
future, a coroutine), and a streamed request sends three or four records: a large share of a
worker's CPU at thousands of requests a second (bench/overhead.py). `BatchingProducer` has the
same `send` / `send_and_wait` as aiokafka's producer, and the same checks before a record is
accepted (the topic's metadata, the record size limit, the partition from the key), but it
only queues the record; one task per partition fills a `BatchBuilder` with everything queued
for it and hands the batch to aiokafka (`send_batch`), which sends it as it would its own.

Order: a partition's records reach aiokafka in the order `send` was called for them (one queue
and one draining task per partition, one batch submitted at a time), and aiokafka keeps the
order of a partition's batches. A record's future says whether its batch was delivered; each
record has its own future, so a caller that is cancelled while waiting affects no other record.
A partition whose leader is away holds only its own records, until `max_queued` records
wait in all: then every `send` waits, as with aiokafka's own full buffer.
"""

from __future__ import annotations

import asyncio

from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner, murmur2
from aiokafka.structs import TopicPartition

from worker import topic_metadata

_HASHES_KEPT = 16_384


class BrokerUnanswered(Exception):
    """No broker answered the client: none known, the connection refused, or no answer in time."""


class BatchingProducer:
    def __init__(self, producer, max_queued: int = 50_000):
        self._inner = producer
        self._queues: dict[TopicPartition, list] = {}
        self._drainers: dict[TopicPartition, asyncio.Task] = {}
        self._queued = 0
        # sending waits while this many records are queued (a broker that cannot keep up slows the
        # requests down, as aiokafka's full buffer does, rather than growing the queues without bound)
        self.max_queued = max_queued
        self._room = asyncio.Event()
        # a request's records share its key: its murmur2 hash (pure Python in aiokafka) is worked out once
        self._hashes: dict[bytes, int] = {}
        self._partition_lists: dict[str, tuple[object, list[int]]] = {}

    @property
    def _sender(self):  # the supervisor watches aiokafka's sender task through the emitter
        return self._inner._sender

    async def start(self) -> None:
        await self._inner.start()

    async def stop(self) -> None:
        """Hands over everything queued, then stops aiokafka's producer (which delivers what it holds)."""
        while self._drainers:
            await asyncio.wait(list(self._drainers.values()))
        await self._inner.stop()

    async def unusable_topics(self, topics, timeout_s: float, cached: bool = True,
                              strict: bool = False) -> dict[str, str]:
        """Of `topics`, those the broker says do not exist, or that this client may not write, with why.
        `cached`: topics this client knows partitions of are taken as fine without asking.

        Asked in one metadata request that does not create topics: aiokafka's `send` would ask for
        the topic's metadata with auto-creation on, and where the broker does not create topics it
        retries for the whole request timeout (40 s) before every record to a missing topic. A broker
        that cannot be asked within `timeout_s` names none (sending then finds out as it always did),
        or, if `strict`, raises `BrokerUnanswered` saying why.
        """
        client = self._inner.client
        ask = [t for t in topics if not cached or client.cluster.partitions_for_topic(t) is None]
        if not ask:
            return {}
        try:
            response = await self._ask_metadata(ask, timeout_s)
        except BrokerUnanswered:
            if strict:
                raise
            return {}
        return topic_metadata.problems(response)

    async def _ask_metadata(self, topics, timeout_s: float):
        client = self._inner.client
        node = client.get_random_node()
        if node is None:
            raise BrokerUnanswered("no broker known to the Kafka client")
        try:
            return await asyncio.wait_for(client.send(node, topic_metadata.request(topics)), timeout_s)
        except asyncio.TimeoutError:
            raise BrokerUnanswered(f"no answer to a metadata request within {timeout_s:g} s") from None
        except (KafkaError, OSError) as exc:
            raise BrokerUnanswered(repr(exc)[:200]) from None

    async def send(self, topic, value=None, key=None, headers=None) -> asyncio.Future:
        """Queue one record; the future is done when its batch was delivered (or failed).

        Raises as aiokafka's `send` does before a record is accepted: no metadata for the topic
        in time, a record over the request size limit."""
        inner = self._inner
        await inner.client._wait_on_metadata(topic)
        headers = headers or []
        key_bytes, value_bytes = inner._serialize(key, value, headers)
        tp = TopicPartition(topic, self._partition(topic, key, value, key_bytes, value_bytes))
        while self._queued >= self.max_queued:
            self._room.clear()
            await self._room.wait()
        fut = asyncio.get_running_loop().create_future()
        queue = self._queues.get(tp)
        if queue is None:
            queue = self._queues[tp] = []
        queue.append((key_bytes, value_bytes, headers, fut))
        self._queued += 1
        if tp not in self._drainers:
            self._drainers[tp] = asyncio.ensure_future(self._drain(tp))
        return fut

    def _partition(self, topic, key, value, key_bytes, value_bytes) -> int:
        """The partition aiokafka's default partitioner picks (murmur2 of the key over all partitions)."""
        inner = self._inner
        if key_bytes is None or type(inner._partitioner) is not DefaultPartitioner:
            return inner._partition(topic, None, key, value, key_bytes, value_bytes)
        partitions = inner._metadata.partitions_for_topic(topic)
        known = self._partition_lists.get(topic)
        if known is None or known[0] is not partitions:
            known = self._partition_lists[topic] = (partitions, list(partitions))  # as aiokafka lists them
        h = self._hashes.get(key_bytes)
        if h is None:
            if len(self._hashes) >= _HASHES_KEPT:
                self._hashes.clear()
            h = self._hashes[key_bytes] = murmur2(key_bytes) & 0x7FFFFFFF
        return known[1][h % len(known[1])]

    async def send_and_wait(self, topic, value=None, key=None, headers=None):
        return await (await self.send(topic, value, key, headers))

    async def _drain(self, tp: TopicPartition) -> None:
        """Submit the partition's queued records, a batch at a time, until its queue is empty."""
        queue, at = [], 0
        try:
            while queue := self._queues.pop(tp, None):
                self._queued -= len(queue)
                self._room.set()
                at = 0
                while at < len(queue):
                    batch, start = self._inner.create_batch(), at
                    while at < len(queue):
                        key, value, headers, fut = queue[at]
                        if batch.append(timestamp=None, key=key, value=value, headers=headers) is not None:
                            at += 1
                        elif at == start:  # refused by an empty batch (aiokafka's builder takes any record)
                            fut.set_exception(MessageSizeTooLargeError(f"{len(value or b'')} bytes"))
                            at = start = at + 1
                        else:
                            break  # full
                    futures = [f for *_, f in queue[start:at]]
                    if not futures:
                        continue
                    batch.close()
                    try:
                        delivered = await self._inner.send_batch(batch, tp.topic, partition=tp.partition)
                    except KafkaError as exc:  # no room before the request timeout, producer closed
                        _fail(futures, exc)
                        continue
                    delivered.add_done_callback(lambda d, futures=futures: _settle(futures, d))
        except BaseException as exc:  # cancelled (the loop is closing), or a bug: no record waits forever
            failure = exc if isinstance(exc, Exception) else KafkaError("the worker is stopping")
            _fail([f for *_, f in (queue or [])[at:]], failure)
            _fail([f for *_, f in self._queues.pop(tp, ())], failure)
            raise
        finally:
            del self._drainers[tp]


def _fail(futures, exc: BaseException) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_exception(exc)


def _settle(futures, delivered: asyncio.Future) -> None:
    if delivered.cancelled():
        _fail(futures, KafkaError("the batch was cancelled"))
    elif (exc := delivered.exception()) is not None:
        _fail(futures, exc)
    else:
        for fut in futures:
            if not fut.done():
                fut.set_result(None)
