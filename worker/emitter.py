"""Reply records: `token` / `done` / `error` keyed by request id, and dead letters.

Keying by request id keeps one request's records in one partition, in order.
Token records are sent without waiting for delivery; the final record is
awaited, and because a partition's records are delivered in order, its
acknowledgement covers every token before it.
"""

from __future__ import annotations

import asyncio

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import ErrorReply, ReplyCodec, TokenReply, dlq
from schemas.codec import CONTENT_TYPE, JSON
from worker import metrics

log = structlog.get_logger("sluice.emitter")


class Emitter:
    def __init__(self, kafka_opts: dict, idempotence: bool, dlq_topic: str, client_id: str = "sluice",
                 default_reply_topic: str | None = None, reply_attempts: int = 5):
        self._producer = AIOKafkaProducer(
            **kafka_opts,
            client_id=f"{client_id}-producer",
            acks="all",
            enable_idempotence=idempotence,
            linger_ms=2,
            max_request_size=8 << 20,
        )
        self.codec = ReplyCodec()
        self.dlq_topic = dlq_topic
        self.default_reply_topic = default_reply_topic
        self.reply_attempts = reply_attempts

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    @staticmethod
    def _headers(request_id: str) -> list[tuple[str, bytes]]:
        return [("x-request-id", request_id.encode()), (CONTENT_TYPE, JSON.encode())]

    async def token(self, topic: str, reply: TokenReply) -> None:
        fut = await self._producer.send(topic, self.codec.encode(reply), key=reply.id.encode(),
                                        headers=self._headers(reply.id))
        fut.add_done_callback(_log_failure)
        metrics.reply_records.labels("token").inc()

    async def final(self, topic: str, reply, retry_until=None) -> bytes:
        """Send `done`/`error` and wait for the broker; retried while `retry_until()` is true.

        A requester's own `reply_to` topic that cannot be written (missing, not
        authorized, ...) must not hold the partition forever: after a non-retriable
        error or `reply_attempts` failures the reply goes to the default reply topic.
        """
        payload = self.codec.encode(reply)
        key, headers = reply.id.encode(), self._headers(reply.id)
        own_topic = self.default_reply_topic is not None and topic != self.default_reply_topic
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
            await self._send_durably(self.default_reply_topic, payload, key, headers, retry_until)
        metrics.reply_records.labels("error" if isinstance(reply, ErrorReply) else "done").inc()
        return payload

    async def dead_letter(self, record, code: str, message: str, retry_until=None) -> None:
        headers = list(record.headers or ()) + dlq.headers(code, message, record.topic, record.partition, record.offset)
        await self._send_durably(self.dlq_topic, record.value, record.key, headers, retry_until)
        metrics.reply_records.labels("dlq").inc()

    async def _send_durably(self, topic, value, key, headers, retry_until, attempts=None) -> None:
        """Retriable errors are retried while `retry_until()` holds (at most `attempts` times)."""
        delay = 0.2
        tries = 0
        while True:
            tries += 1
            try:
                await self._producer.send_and_wait(topic, value, key=key, headers=headers)
                return
            except KafkaError as exc:
                if not exc.retriable or retry_until is None or not retry_until():
                    raise
                if attempts is not None and tries >= attempts:
                    raise
                log.warning("produce_failed_retrying", topic=topic, error=repr(exc), retriable=exc.retriable)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


def _log_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("token_produce_failed", error=repr(fut.exception()))
