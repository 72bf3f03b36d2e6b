"""Reply records on the wire: `token` / `done` / `error` keyed by request id, and dead letters.

Keying by request id keeps one request's records in one partition, in order.
Token records are sent without waiting for delivery; the final record is
awaited, and because a partition's records are delivered in order, its
acknowledgement covers every token before it.

The producer is passed in (aiokafka's, or the in-memory double in tests). Retriable
failures are retried with back-off; when nothing could be produced for longer than
`outage_s`, `ReplyOutage` is raised and the worker stops (it cannot answer anyone).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog
from aiokafka.errors import KafkaError, KafkaTimeoutError

from schemas import ErrorCode, ErrorReply, ReplyCodec, TokenReply, dlq
from schemas.codec import CONTENT_TYPE, JSON, cap
from worker import metrics

log = structlog.get_logger("sluice.emitter")

# A requester's reply topic is looked up once before its request runs (one metadata request, at most
# this long); one found unusable is remembered this long, so a flood naming it costs no more lookups.
TOPIC_LOOKUP_S = 2.0
UNUSABLE_KEPT_S = 10.0
_UNUSABLE_KEPT = 4096


class ReplyOutage(RuntimeError):
    """Replies could not be produced for longer than the configured bound: the worker must stop."""


def kafka_producer(kafka_opts: dict, idempotence: bool, client_id: str, max_bytes: int,
                   request_timeout_ms: int = 40000):
    from aiokafka import AIOKafkaProducer

    from worker.reply_batches import BatchingProducer

    # Batches of up to 256 KiB rather than aiokafka's 16 KiB: under load a full batch makes every
    # send wait for the sender to drain it (bench/overhead.py), and fewer produce requests cost
    # the broker less.
    return BatchingProducer(AIOKafkaProducer(
        **kafka_opts, client_id=f"{client_id}-producer", acks="all", enable_idempotence=idempotence, linger_ms=2,
        max_request_size=max_bytes, max_batch_size=min(max_bytes, 256 << 10), request_timeout_ms=request_timeout_ms))


class Emitter:
    def __init__(self, producer, dlq_topic: str, default_reply_topic: str | None = None, reply_attempts: int = 5,
                 outage_s: float = 120.0, max_record_bytes: int = 1_000_000):
        self._producer = producer
        self.codec = ReplyCodec()
        self.dlq_topic = dlq_topic
        self.default_reply_topic = default_reply_topic
        self.reply_attempts = reply_attempts
        self.outage_s = outage_s
        self.max_record_bytes = max_record_bytes
        self.failing_since: float | None = None  # monotonic time of the first failure of the current outage
        self._unusable: dict[str, tuple[float, str]] = {}  # topic -> (until, why)

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    def background_task(self):
        """The producer's own sender task (aiokafka's, or the double's), for the supervisor to watch."""
        return getattr(getattr(self._producer, "_sender", None), "sender_task", None)

    def outage_for(self) -> float:
        """Seconds since produces started failing (0 while they succeed)."""
        return 0.0 if self.failing_since is None else time.monotonic() - self.failing_since

    def discount(self, shift) -> None:
        """The outage's start through `shift` (`worker/supervisor.py: unseen`): time the worker did not run."""
        self.failing_since = shift(self.failing_since)

    async def unusable_reply_topics(self, topics: set[str]) -> dict[str, str]:
        """Of requesters' `reply_to` topics, those that cannot take replies, with why (missing, say).

        Asked before their requests run, so that a request naming a missing topic is refused at once
        rather than waiting out the producer's metadata timeout on every record it would send there.
        """
        now = time.monotonic()
        known = {}
        for topic in topics:
            until, why = self._unusable.get(topic, (0.0, ""))
            if until > now:
                known[topic] = why
        ask = [t for t in topics if t not in known]
        found = await self._producer.unusable_topics(ask, TOPIC_LOOKUP_S) if ask else {}
        if len(self._unusable) + len(found) > _UNUSABLE_KEPT:
            self._unusable.clear()
        for topic, why in found.items():
            self._unusable[topic] = (now + UNUSABLE_KEPT_S, why)
            log.warning("reply_topic_refused", topic=topic, reason=why)
        return known | found

    async def own_topics_unusable(self, topics: list[str]) -> dict[str, str]:
        """Of the worker's own topics, those the broker says cannot be used (asked afresh every time:
        a deleted topic stays in the client's metadata until its next refresh). Raises
        `BrokerUnanswered` when no broker answers."""
        return await self._producer.unusable_topics(topics, TOPIC_LOOKUP_S, cached=False, strict=True)

    @staticmethod
    def _headers(request_id: str) -> list[tuple[str, bytes]]:
        return [("x-request-id", request_id.encode()), (CONTENT_TYPE, JSON.encode())]

    async def token(self, topic: str, reply: TokenReply) -> asyncio.Future:
        """Send a token record without waiting for the broker; the future says whether it was delivered.

        The caller awaits every such future before the request's `done` (see `Replies.settle_tokens`).
        """
        try:
            fut = await self._producer.send(topic, self.codec.encode(reply), key=reply.id.encode(),
                                            headers=self._headers(reply.id))
        except KafkaError as exc:  # the producer's buffer stayed full (broker away): a failed delivery
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(exc)
        fut.add_done_callback(_log_failure)
        metrics.reply_records.labels("token").inc()
        return fut

    async def token_durably(self, topic: str, reply: TokenReply, retry_until=None) -> None:
        """Send a token record and wait for the broker (a re-send after a failed delivery)."""
        await self._send_durably(topic, self.codec.encode(reply), reply.id.encode(), self._headers(reply.id),
                                 retry_until)
        metrics.reply_records.labels("token").inc()

    def encode_final(self, reply) -> tuple[object, bytes]:
        """The final reply as it goes on the wire (error messages capped) and its bytes."""
        if isinstance(reply, ErrorReply):
            reply = msgspec.structs.replace(reply, message=cap(reply.message))
        return reply, self.codec.encode(reply)

    async def final(self, topic: str, reply, retry_until=None) -> bytes:
        """Send `done`/`error` and wait for the broker; returns the bytes sent.

        A requester's own `reply_to` topic that cannot be written (missing, not
        authorized, ...) must not hold the partition forever: after a non-retriable
        error or `reply_attempts` failures the reply goes to the default reply topic.
        A reply the broker refuses outright (too large, say) is replaced by an
        `internal` error, so no record can make every worker that reads it fail.
        """
        reply, payload = self.encode_final(reply)
        key, headers = reply.id.encode(), self._headers(reply.id)
        own_topic = self.default_reply_topic is not None and topic != self.default_reply_topic
        try:
            try:
                await self._send_durably(topic, payload, key, headers, retry_until,
                                         self.reply_attempts if own_topic else None)
            except KafkaError as exc:
                if not own_topic:
                    raise
                log.warning("reply_topic_unusable", topic=topic, request_id=reply.id, error=repr(exc),
                            fallback=self.default_reply_topic)
                metrics.reply_fallbacks.inc()
                headers.append(("x-sluice-reply-to-failed", topic.encode()))
                topic = self.default_reply_topic
                await self._send_durably(topic, payload, key, headers, retry_until)
        except KafkaError as exc:
            if isinstance(reply, ErrorReply) and reply.code == ErrorCode.INTERNAL:
                raise
            log.error("reply_refused", topic=topic, request_id=reply.id, error=repr(exc))
            reply = ErrorReply(reply.id, ErrorCode.INTERNAL, cap(f"the reply could not be produced: {exc!r}"))
            payload = self.codec.encode(reply)
            await self._send_durably(topic, payload, key, headers, retry_until)
        metrics.reply_records.labels("error" if isinstance(reply, ErrorReply) else "done").inc()
        return payload

    async def audit(self, topic: str, key: bytes | None, value: bytes, retry_until=None,
                    queued: asyncio.Future | None = None) -> None:
        """An audit record, waited for like a final reply (its request's offset is committed after it).

        `queued`: the delivery of the same record queued earlier (`queue_audit`), waited for as the
        first attempt."""
        await self._send_durably(topic, value, key, _audit_headers(), retry_until, queued=queued)
        metrics.reply_records.labels("audit").inc()

    async def queue_audit(self, topic: str, key: bytes | None, value: bytes) -> asyncio.Future | None:
        """Queue an audit record without waiting (`audit(..., queued=)` waits for it later); None when
        it could not be queued (then `audit` sends it anew).

        A request's `done` and its audit record then leave in the same turn of the producer, without a
        task of their own. A failure nobody waits for (the `done` failed first) is retrieved here."""
        try:
            fut = await self._producer.send(topic, value, key=key, headers=_audit_headers())
        except KafkaError:
            return None
        fut.add_done_callback(_retrieve)
        return fut

    async def dead_letter(self, record, code: str, message: str, retry_until=None) -> None:
        """The record's original bytes to the DLQ, cut to fit the broker's record limit if needed."""
        extra = dlq.headers(code, cap(message), record.topic, record.partition, record.offset)
        key, value, headers = dlq.fit(record.key, record.value, record.headers, extra, self.max_record_bytes)
        await self._send_durably(self.dlq_topic, value, key, headers, retry_until)
        metrics.reply_records.labels("dlq").inc()

    async def _send_durably(self, topic, value, key, headers, retry_until, attempts=None, queued=None) -> None:
        """Retriable errors are retried while `retry_until()` holds (at most `attempts` times), within the outage bound.

        On our own topics (`attempts` None) a delivery timeout counts as retriable: it is what a
        broker outage longer than the producer's request timeout looks like, and it must not end
        the worker before `outage_s`. On a requester's `reply_to` it means "go to the default topic".
        """
        delay = 0.2
        tries = 0
        while True:
            tries += 1
            try:
                if queued is not None:  # the first attempt, queued already
                    queued, first = None, queued
                    await first
                else:
                    await self._producer.send_and_wait(topic, value, key=key, headers=headers)
                self.failing_since = None
                return
            except KafkaError as exc:
                retriable = exc.retriable or (attempts is None and isinstance(exc, KafkaTimeoutError))
                if not retriable or retry_until is None or not retry_until():
                    raise
                if attempts is not None:  # a requester's topic: its failures are no outage of the worker's
                    if tries >= attempts:
                        raise
                else:
                    if self.failing_since is None:
                        self.failing_since = time.monotonic()
                    if self.outage_for() > self.outage_s:
                        raise ReplyOutage(f"no reply could be produced for {self.outage_for():.0f} s "
                                          f"(SLUICE_REPLY_OUTAGE_S={self.outage_s:g}): {exc!r}") from exc
                log.warning("produce_failed_retrying", topic=topic, error=repr(exc), retriable=exc.retriable)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


def _audit_headers() -> list[tuple[str, bytes]]:
    return [(CONTENT_TYPE, JSON.encode())]


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _log_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("token_produce_failed", error=repr(fut.exception()))
