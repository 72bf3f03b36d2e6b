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
    def __init__(self, engine: Engine, emitter: Emitter, answers: AnswerStore, limits: Limits, running,
                 chunk_tokens: int = 1, chunk_ms: int = 0):
        self.engine, self.emitter, self.answers, self.limits = engine, emitter, answers, limits
        self.running = running  # callable: keep retrying produces while true
        self.chunk_tokens, self.chunk_s = chunk_tokens, chunk_ms / 1000

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
        chunk = _Chunk(self, job) if req.stream else None
        texts, n_tokens, finish = [], 0, "stop"
        async for delta in self.engine.generate(engine_id, prompt_ids, params, job.priority):
            if delta.token_ids:
                if n_tokens == 0:
                    metrics.time_to_first_token.labels(cls).observe(max(0.0, time.time() - job.timestamp_ms / 1000))
                n_tokens += len(delta.token_ids)
                texts.append(delta.text)
                if chunk is not None:
                    await chunk.add(delta.text, delta.token_ids)
            if delta.finish_reason is not None:
                finish = delta.finish_reason
            elif req.deadline_ms is not None and _now_ms() >= req.deadline_ms:
                await self.engine.abort(engine_id)
                finish = "deadline"
                break
        seq = await chunk.flush() if chunk is not None else 0
        metrics.tokens_generated.labels(cls).inc(n_tokens)
        metrics.prompt_tokens.labels(cls).inc(len(prompt_ids))
        return DoneReply(req.id, seq, "".join(texts), finish, Usage(len(prompt_ids), n_tokens))


class _Chunk:
    """Coalesces deltas into token records: the first at once, then by count or age."""

    def __init__(self, runner: Runner, job: Job):
        self.runner, self.job = runner, job
        self.seq = 0
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.since = 0.0

    async def add(self, text: str, ids: list[int]) -> None:
        if not self.ids:
            self.since = time.monotonic()
        self.texts.append(text)
        self.ids.extend(ids)
        if (self.seq == 0 or len(self.ids) >= self.runner.chunk_tokens
                or time.monotonic() - self.since >= self.runner.chunk_s):
            await self.flush()

    async def flush(self) -> int:
        """Send what is buffered; returns the next seq (the done record's seq)."""
        if self.ids:
            reply = TokenReply(self.job.request.id, self.seq, "".join(self.texts), self.ids)
            await self.runner.emitter.token(self.job.reply_to, reply)
            self.seq += 1
            self.texts, self.ids = [], []
        return self.seq
