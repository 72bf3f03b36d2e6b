"""Replies: every final reply (`done`, `error`, dead letter) leaves from here, with its metrics.

Four things end a record: a request that ran (or whose deadline passed), a bad record,
a record the Kafka client could not parse, and a repeated id answered from the store.
Each is one method here, so counting, logging and storing answers happen in one place.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog

from schemas import DoneReply, ErrorCode, ErrorReply
from schemas.audit import AuditRecord, AuditSource
from schemas.audit import encoder as audit_encoder
from worker import metrics

log = structlog.get_logger("sluice.replies")


class _Source:
    def __init__(self, topic: str, partition: int, offset: int):
        self.topic, self.partition, self.offset = topic, partition, offset


class Fenced(Exception):
    """Another attempt owns the request now (this worker was paused past its session timeout and
    the group gave the partition away): this attempt stops without sending anything more."""

    def __init__(self, job):
        super().__init__(job.request.id)
        self.job = job


class Replies:
    def __init__(self, emitter, answers, default_topic: str, running, *, audit_topic: str | None = None,
                 audit_content: bool = False, worker_name: str = "", model: str = ""):
        self.emitter, self.answers, self.default_topic = emitter, answers, default_topic
        self.running = running  # callable: keep retrying produces while true
        self.audit_topic, self.audit_content = audit_topic, audit_content
        self.worker_name, self.model = worker_name, model
        self.charge = lambda tenant, tokens: None  # token-rate quotas (worker/quotas.py), set by the worker

    async def _audit(self, cls: str, source, request_id: str | None, outcome: str, **fields) -> None:
        """The request's audit record, produced before its offset can be committed (no-op without an audit topic)."""
        if self.audit_topic is None:
            return
        await self.emitter.audit(self.audit_topic, request_id.encode() if request_id else None,
                                 self._audit_record(cls, source, request_id, outcome, **fields), self.running)

    def _audit_record(self, cls: str, source, request_id: str | None, outcome: str, *, job=None, final=None,
                      message: str | None = None, tenant: str | None = None) -> bytes:
        req = job.request if job is not None else None
        done = final if isinstance(final, DoneReply) else None
        content = self.audit_content and req is not None
        prompt = None
        if content:
            prompt = req.prompt if req.prompt is not None else msgspec.json.encode(
                req.messages if req.messages is not None else req.event).decode()
        record = AuditRecord(
            id=request_id, tenant=job.tenant if job is not None else tenant, latency_class=cls, outcome=outcome,
            source=AuditSource(source.topic, source.partition, source.offset), worker=self.worker_name,
            model=self.model, kind=req.kind if req is not None else None,
            finish_reason=done.finish_reason if done else None, scores=done.scores if done else None,
            prompt_tokens=done.usage.prompt_tokens if done else None,
            completion_tokens=done.usage.completion_tokens if done else None,
            produced_ms=job.timestamp_ms if job is not None else getattr(source, "timestamp", 0) or 0,
            answered_ms=int(time.time() * 1000), resumed=bool(done and done.resumed),
            message=final.message if isinstance(final, ErrorReply) else message,
            prompt=prompt, text=done.text if content and done else None)
        return audit_encoder.encode(record)

    @staticmethod
    def _source(job):
        return _Source(getattr(job.tp, "topic", ""), getattr(job.tp, "partition", -1), job.offset)

    async def finish(self, job, final) -> None:
        """The final reply of a request that was admitted (or expired).

        Its answer is stored first, and only if this run still owns the request (fencing); then
        the reply is produced. A worker that dies in between leaves the record uncommitted, and
        whoever reads it again finds the answer and re-sends the same reply.
        """
        cls = job.latency_class
        final, payload = self.emitter.encode_final(final)
        stored = self.answers.put_later(job.state_id, payload, job.owner)
        stored = await stored if stored is not None else None
        if stored is False:
            raise Fenced(job)  # another worker took the request over while this one was paused
        if stored is None:
            metrics.answers_unstored.inc()
            if isinstance(final, DoneReply) and not final.unchecked:
                # not stored: a later attempt may answer this id again, so the reader is told
                final = msgspec.structs.replace(final, unchecked=True)
        outcome = final.code.value if isinstance(final, ErrorReply) else final.finish_reason
        # the reply and its audit record leave together (the audit record queued first, so one turn of
        # the producer takes both), both acknowledged before the offset can be committed
        audit = queued = None
        if self.audit_topic is not None:
            audit = self._audit_record(cls, self._source(job), job.request.id, outcome, job=job, final=final)
            queued = await self.emitter.queue_audit(self.audit_topic, job.request.id.encode(), audit)
        await self.emitter.final(job.reply_to, final, self.running)
        if audit is not None:
            await self.emitter.audit(self.audit_topic, job.request.id.encode(), audit, self.running, queued=queued)
        if isinstance(final, DoneReply):
            self.charge(job.tenant, final.usage.prompt_tokens + final.usage.completion_tokens)
        metrics.requests_completed.labels(cls, outcome).inc()
        metrics.tenant_requests.labels(metrics.tenant_label(job.tenant), outcome).inc()
        now = time.time()
        metrics.end_to_end.labels(cls).observe(max(0.0, now - job.arrived_ms / 1000))
        job.observe_stages(now)
        log.info("request_answered", request_id=job.request.id, cls=cls, outcome=outcome, segments=job.segments)

    async def superseded(self, job) -> None:
        """A fenced attempt: another attempt (a later record with the same id, or another worker) answers it."""
        await self._audit(job.latency_class, self._source(job), job.request.id, "superseded", job=job,
                          message="another attempt claimed this request id and answers it")

    async def settle_tokens(self, job) -> None:
        """A `done` goes out only after every token record before it was acknowledged. Records whose
        delivery failed are sent again, in seq order from the first that failed, and awaited (same seq,
        same text: a reader drops the repeats); a gap never reaches a reader silently."""
        if not job.token_futures:
            return
        pending = [f for f in job.token_futures if not f.done()]
        if pending:  # most are acknowledged already: no gathering future for those
            await asyncio.wait(pending)
        futures, job.token_futures = job.token_futures, []
        first = next((i for i, f in enumerate(futures) if f.cancelled() or f.exception() is not None), None)
        if first is None:
            return
        failure = "cancelled" if futures[first].cancelled() else repr(futures[first].exception())
        again = job.sent_tokens[first:]
        metrics.token_resends.inc(len(again))
        log.warning("token_records_failed", request_id=job.request.id, first_seq=again[0].seq, resending=len(again),
                    error=failure[:200])
        for reply in again:
            await self.emitter.token_durably(job.reply_to, reply, self.running)

    async def overloaded(self, job, why: str, retry_after_ms: int) -> None:
        """Over a limit of its tenant: answered `overloaded` at once instead of queueing without bound.
        Not stored: the same id published again later runs."""
        await self.emitter.final(job.reply_to, ErrorReply(
            job.request.id, ErrorCode.OVERLOADED, f"tenant {job.tenant!r} has {why}; retry later",
            retry_after_ms=retry_after_ms), self.running)
        await self._audit(job.latency_class, self._source(job), job.request.id, ErrorCode.OVERLOADED.value, job=job,
                          message=why)
        metrics.requests_completed.labels(job.latency_class, ErrorCode.OVERLOADED.value).inc()
        metrics.tenant_requests.labels(metrics.tenant_label(job.tenant), ErrorCode.OVERLOADED.value).inc()
        log.info("request_overloaded", request_id=job.request.id, cls=job.latency_class, tenant=job.tenant)

    async def expire(self, job) -> None:
        await self.finish(job, ErrorReply(job.request.id, ErrorCode.DEADLINE_EXCEEDED,
                                          f"deadline {job.request.deadline_ms} passed before the request ran"))

    def decode_stored(self, payload: bytes):
        """A stored answer, or None when it does not decode (then the request simply runs again)."""
        try:
            reply = self.emitter.codec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as exc:
            log.warning("stored_answer_unreadable", error=repr(exc)[:200])
            metrics.intake_errors.labels("any", "stored_answer").inc()
            return None
        return reply if isinstance(reply, (DoneReply, ErrorReply)) else None

    async def resend(self, job, reply) -> None:
        """A repeat of an answered id: re-send the same final reply, run nothing."""
        metrics.duplicates.labels(job.latency_class).inc()
        await self.emitter.final(job.reply_to, reply, self.running)
        await self._audit(job.latency_class, self._source(job), job.request.id, "duplicate", job=job, final=reply)
        log.info("duplicate_answered_from_store", request_id=job.request.id, cls=job.latency_class)

    async def reject(self, cls: str, record, bad) -> None:
        """A record that cannot be served: an `error` reply when it has a readable id, else a dead letter."""
        if bad.id is not None:
            await self.emitter.final(bad.reply_to or self.default_topic, ErrorReply(bad.id, bad.code, bad.message),
                                     self.running)
            route = "reply"
        else:
            await self.emitter.dead_letter(record, bad.code.value, bad.message, self.running)
            route = "dlq"
        metrics.bad_records.labels(bad.code.value, route).inc()
        await self._audit(cls, record, bad.id, bad.code.value, message=bad.message, tenant=bad.tenant)
        log.info("bad_record", code=bad.code.value, route=route, cls=cls, topic=record.topic,
                 partition=record.partition, offset=record.offset, request_id=bad.id, reason=bad.message)

    async def unreadable(self, cls: str, record) -> None:
        """A record the Kafka client could not parse: its coordinates go to the DLQ (the bytes stay in the source)."""
        message = f"the Kafka client could not parse this record: {record.error!r}"
        await self.emitter.dead_letter(record, ErrorCode.INVALID_REQUEST.value, message, self.running)
        metrics.bad_records.labels(ErrorCode.INVALID_REQUEST.value, "dlq").inc()
        await self._audit(cls, record, None, ErrorCode.INVALID_REQUEST.value, message=message)
        log.warning("unreadable_record", cls=cls, topic=record.topic, partition=record.partition,
                    offset=record.offset, error=repr(record.error)[:300])
