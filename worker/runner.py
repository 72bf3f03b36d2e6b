"""One request through the engine: limits, generation, streamed tokens, the final reply."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from schemas import DoneReply, ErrorCode, ErrorReply, Limits, Request, TokenReply, Usage
from worker import metrics
from worker.answers import AnswerStore
from worker.emitter import Emitter
from worker.engine import Engine, EngineDead, GenParams


@dataclass
class Job:
    request: Request
    latency_class: str
    priority: int
    reply_to: str
    tp: object
    offset: int
    timestamp_ms: int  # record timestamp: when the producer published it
    picked_at: float = field(default_factory=time.time)


class Rejected(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _now_ms() -> int:
    return int(time.time() * 1000)


class Runner:
    def __init__(self, engine: Engine, emitter: Emitter, answers: AnswerStore, limits: Limits, running):
        self.engine, self.emitter, self.answers, self.limits = engine, emitter, answers, limits
        self.running = running  # callable: keep retrying produces while true

    def params(self, request: Request, prompt_len: int) -> GenParams:
        max_tokens = request.max_tokens or self.limits.default_max_tokens
        max_prompt = self.limits.max_prompt_tokens or (self.engine.max_model_len - 1)
        if prompt_len > max_prompt:
            raise Rejected(ErrorCode.PAYLOAD_TOO_LARGE, f"prompt is {prompt_len} tokens; the limit is {max_prompt}")
        if prompt_len + max_tokens > self.engine.max_model_len:
            raise Rejected(ErrorCode.INVALID_REQUEST,
                           f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model context "
                           f"of {self.engine.max_model_len}")
        return GenParams(max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
                         seed=request.seed, stop=tuple(request.stop or ()))

    async def serve(self, job: Job) -> None:
        req = job.request
        log = structlog.get_logger("sluice.runner").bind(
            request_id=req.id, cls=job.latency_class, partition=getattr(job.tp, "partition", None), offset=job.offset)
        cls = job.latency_class
        try:
            stored = await self.answers.get(req.id)
            if stored is not None:
                # Answered before (a repeat of the id): re-send the same final reply, run nothing.
                metrics.duplicates.labels(cls).inc()
                reply = self.emitter.codec.decode(stored)
                await self.emitter.final(job.reply_to, reply, self.running)
                log.info("duplicate_answered_from_store")
                return
            if req.deadline_ms is not None and _now_ms() >= req.deadline_ms:
                raise Rejected(ErrorCode.DEADLINE_EXCEEDED, f"deadline {req.deadline_ms} passed before the request ran")
            prompt_ids = self.engine.prompt_ids(req)
            params = self.params(req, len(prompt_ids))
            final = await self._generate(job, prompt_ids, params, log)
        except Rejected as exc:
            final = ErrorReply(req.id, exc.code, exc.message)
        except EngineDead:
            raise
        except Exception as exc:  # one request's failure never stops the worker
            log.exception("request_failed")
            final = ErrorReply(req.id, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
        payload = await self.emitter.final(job.reply_to, final, self.running)
        outcome = final.code.value if isinstance(final, ErrorReply) else final.finish_reason
        metrics.requests_completed.labels(cls, outcome).inc()
        metrics.end_to_end.labels(cls).observe(max(0.0, time.time() - job.timestamp_ms / 1000))
        await self.answers.put(req.id, payload)
        log.info("request_answered", outcome=outcome)

    async def _generate(self, job: Job, prompt_ids: list[int], params: GenParams, log) -> DoneReply:
        req, cls = job.request, job.latency_class
        engine_id = f"{req.id}@{getattr(job.tp, 'partition', 0)}:{job.offset}"
        seq, texts, n_tokens, finish = 0, [], 0, "stop"
        first = True
        async for delta in self.engine.generate(engine_id, prompt_ids, params, job.priority):
            if delta.token_ids:
                if first:
                    metrics.time_to_first_token.labels(cls).observe(max(0.0, time.time() - job.timestamp_ms / 1000))
                    first = False
                n_tokens += len(delta.token_ids)
                texts.append(delta.text)
                if req.stream:
                    await self.emitter.token(job.reply_to, TokenReply(req.id, seq, delta.text, delta.token_ids))
                    seq += 1
            if delta.finish_reason is not None:
                finish = delta.finish_reason
            if req.deadline_ms is not None and _now_ms() >= req.deadline_ms and delta.finish_reason is None:
                await self.engine.abort(engine_id)
                finish = "deadline"
                break
        metrics.tokens_generated.labels(cls).inc(n_tokens)
        metrics.prompt_tokens.labels(cls).inc(len(prompt_ids))
        return DoneReply(req.id, seq, "".join(texts), finish, Usage(len(prompt_ids), n_tokens))
