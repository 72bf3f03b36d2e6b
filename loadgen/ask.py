"""`sluice ask`: one request through the running workers, its reply shown as it comes.

For a person at a terminal: is the realtime class answering, and what does the model say to
this? It publishes one request to its class's topic, as any producer would, and reads only the
reply partition the request id hashes to (workers key replies by request id with the Kafka
default partitioner), so it reads little even from a busy reply topic. Exit status: 0 for a
`done`, 1 for an `error` reply, 2 when no final reply came within the timeout, 3 when the broker
could not be reached or refused the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import murmur2

from loadgen.burst import produce, topic_partitions
from schemas import DoneReply, ErrorReply, ReplyCodec, TokenReply
from worker.consumer_stop import stop_consumer

DONE, ERROR, NO_REPLY, NO_BROKER = 0, 1, 2, 3


@dataclass
class Answer:
    final: DoneReply | ErrorReply | None = None
    tokens: dict[int, str] = field(default_factory=dict)
    first_token_s: float | None = None
    final_s: float | None = None
    skipped: int = 0  # records on the partition that are not sluice replies

    @property
    def status(self) -> int:
        if isinstance(self.final, DoneReply):
            return DONE
        return ERROR if isinstance(self.final, ErrorReply) else NO_REPLY


def reply_partition(request_id: str, partitions: set[int]) -> int:
    """Where the workers' producer puts the replies of `request_id` (murmur2 of the key, as Kafka's
    Java client and aiokafka partition a keyed record)."""
    ordered = sorted(partitions)
    return ordered[(murmur2(request_id.encode()) & 0x7FFFFFFF) % len(ordered)]


async def _reply_reader(kafka_opts: dict, topic: str, request_id: str) -> tuple[AIOKafkaConsumer, TopicPartition]:
    consumer = AIOKafkaConsumer(**kafka_opts, enable_auto_commit=False, auto_offset_reset="latest",
                                fetch_max_wait_ms=50)
    try:
        await consumer.start()
        partitions = await topic_partitions(consumer, topic)
        if not partitions:
            raise LookupError(f"reply topic {topic} does not exist")
        tp = TopicPartition(topic, reply_partition(request_id, partitions))
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)  # resolved before the request is sent: no reply is missed
    except BaseException:
        await stop_consumer(consumer)
        raise
    return consumer, tp


async def ask(kafka_opts: dict, request_topic: str, reply_topic: str, body: dict, timeout_s: float,
              headers=None, on_token=None) -> Answer:
    """Publish `body` (a request with its `id`) to `request_topic`; read its replies until the final
    one or `timeout_s`. `on_token(reply)` sees each new token record, in seq order as they come."""
    request_id = body["id"]
    consumer, tp = await _reply_reader(kafka_opts, reply_topic, request_id)
    codec, answer = ReplyCodec(), Answer()
    try:
        value = msgspec.json.encode(body)
        started = time.monotonic()
        await produce(kafka_opts, [(request_topic, request_id.encode(), value, headers(request_id.encode(), value)
                                    if headers else [])])
        deadline = started + timeout_s
        while answer.final is None and time.monotonic() < deadline:
            batches = await consumer.getmany(tp, timeout_ms=max(1, int(min(0.2, deadline - time.monotonic()) * 1000)))
            for record in batches.get(tp, ()):
                if record.key != request_id.encode():
                    continue
                try:
                    reply = codec.decode(record.value or b"")
                except msgspec.DecodeError:
                    answer.skipped += 1
                    continue
                if reply.id != request_id:
                    continue
                now = time.monotonic() - started
                if isinstance(reply, TokenReply):
                    if reply.seq not in answer.tokens:  # a re-sent record (a failover) repeats its seq
                        answer.tokens[reply.seq] = reply.text
                        answer.first_token_s = answer.first_token_s or now
                        if on_token is not None:
                            on_token(reply)
                else:
                    answer.final, answer.final_s = reply, now
                    break
    finally:
        await stop_consumer(consumer)
    return answer


def summary(answer: Answer, request_topic: str, timeout_s: float) -> str:
    """One line for the person who asked."""
    final = answer.final
    if isinstance(final, DoneReply):
        first = f", first token {answer.first_token_s:.2f} s" if answer.first_token_s is not None else ""
        scores = ("; scores " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(final.scores.items(), key=lambda kv: -kv[1]))
                  if final.scores else "")
        marks = "".join(f"; {m}" for m, on in (("resumed", final.resumed), ("unchecked", final.unchecked)) if on)
        return (f"done in {answer.final_s:.2f} s{first}: finish {final.finish_reason}, {final.usage.prompt_tokens} "
                f"prompt + {final.usage.completion_tokens} completion tokens{scores}{marks}")
    if isinstance(final, ErrorReply):
        retry = f" (retry after {final.retry_after_ms} ms)" if final.retry_after_ms is not None else ""
        return f"error {final.code.value} after {answer.final_s:.2f} s: {final.message}{retry}"
    return (f"no reply within {timeout_s:g} s: is a worker reading {request_topic}? "
            f"({len(answer.tokens)} token records came)")
