"""One request through the engine: limits, generation, streamed tokens, the final reply.

A running request can be suspended (a higher class needs its engine slot): the
engine request is aborted, what was generated stays on the `Job`, and when the
job is admitted again it continues with prompt + generated tokens as its prefix
(vLLM's prefix cache holds most of that KV), the remaining `max_tokens`, and
the next reply seq, so readers see one gapless stream.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import msgspec
import structlog

from schemas import DoneReply, ErrorCode, ErrorReply, Limits, Request, TokenReply, Usage
from schemas.templates import TemplateError, Templates
from worker import metrics
from worker.answers import MIXED, AnswerStore
from worker.emitter import Emitter
from worker.engine import Engine, EngineDead, GenParams
from worker.prompt_tokens import LONG_TEXT_CHARS, ChatRefused
from worker.replies import Fenced, Replies

_log = structlog.get_logger("sluice.runner")  # one proxy: a new one per request built a logger each time


@dataclass
class Job:
    request: Request
    latency_class: str
    priority: int
    reply_to: str
    tp: object
    offset: int
    timestamp_ms: int  # record timestamp: when the producer says it published it (the audit keeps it)
    # progress, kept across suspensions
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)  # what the engine continues after (prompt + these)
    # emitted tokens beyond len(generated): an earlier owner's ids written again by another tokenizer
    # number differently, and max_tokens and usage count what was generated, not how it is re-read
    generated_credit: int = 0
    texts: list[str] = field(default_factory=list)
    seq: int = 0
    segments: int = 0
    # score requests: the label set, each label's first token, and the scores once known
    labels: list[str] | None = None
    label_ids: tuple[int, ...] = ()
    scores: dict[str, float] | None = None
    progress: object = None  # answers.Progress left by an earlier owner that died
    # what this run's token ids mean, stored with its next chunk of progress (then None): the
    # engine's tokenizer for a run from seq 0, MIXED for a run that went on from another tokenizer's
    tokenizer_mark: str | None = None
    # token records sent in this process and their delivery futures (awaited before `done`)
    sent_tokens: list = field(default_factory=list)
    token_futures: list = field(default_factory=list)
    # token records held back because their progress could not be stored yet (Redis degraded)
    unstored: list = field(default_factory=list)
    tenant: str = "default"  # the authenticated tenant (worker/tenancy.py), never the record's say-so
    owner: str = ""  # the attempt token this job claimed in Redis ("" when the claim could not be made)
    checked: bool = True  # False: run without the stored answer and progress (Redis unavailable at intake)
    # handed over from a dead worker (worker/handoff.py) before its partition came here: no offset of
    # this worker's is its, until the record is read here and the job lands (`Dispatcher.land`)
    handed_over: bool = False
    resumed: bool = False
    suspend: asyncio.Event = field(default_factory=asyncio.Event)
    slot_released: bool = True  # set False while the job holds an engine slot
    # wall-clock seconds (as record timestamps are) of its stages: read by intake, in the engine, out of it
    read_at: float = field(default_factory=time.time)
    engine_at: float | None = None
    engine_done_at: float | None = None
    # when the request arrived, for its place in its class's queue and its latency: the record timestamp
    # unless that cannot be true (worker/intake.py: arrival_ms)
    arrived_ms: int | None = None

    @property
    def emitted(self) -> int:
        """Tokens generated for the request so far, by every owner, as each counted them."""
        return len(self.generated) + self.generated_credit

    def __post_init__(self):
        if self.arrived_ms is None:
            self.arrived_ms = self.timestamp_ms

    def observe_stages(self, now: float) -> None:
        """Where this request's end-to-end time went (`sluice_stage_seconds`); only for requests that ran."""
        if self.engine_at is None or self.engine_done_at is None:
            return
        marks = (self.arrived_ms / 1000, self.read_at, self.engine_at, self.engine_done_at, now)
        for stage, start, end in zip(metrics.STAGES, marks, marks[1:]):
            metrics.stage_seconds.labels(self.latency_class, stage).observe(max(0.0, end - start))

    @property
    def state_id(self) -> str:
        """The request's name in Redis: its id within its tenant, so tenants never share answers or progress."""
        return f"{self.tenant}:{self.request.id}"


class Rejected(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Suspended(Exception):
    """The job left the engine for a higher class; it waits to be admitted again."""

    def __init__(self, job: Job):
        super().__init__(job.request.id)
        self.job = job


def job_log(job: Job):
    """The request's logger, bound only when a line is written: binding one per request cost about
    3 µs, and most requests write no line here."""
    return _log.bind(request_id=job.request.id, cls=job.latency_class, partition=getattr(job.tp, "partition", None),
                     offset=job.offset)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _passed(request: Request) -> bool:
    return request.deadline_ms is not None and _now_ms() >= request.deadline_ms


class Runner:
    def __init__(self, engine: Engine, emitter: Emitter, answers: AnswerStore, limits: Limits, running,
                 chunk_tokens: int = 1, chunk_ms: int = 0, release_slot=lambda job: None,
                 templates: Templates | None = None, replies: Replies | None = None,
                 on_progress=lambda tokens, prompt_tokens: None,
                 save_min_tokens: int = 0):
        self.engine, self.emitter, self.answers, self.limits = engine, emitter, answers, limits
        self.save_min_tokens = save_min_tokens
        self.templates = templates or Templates()
        self.release_slot = release_slot  # the engine slot is free once generation ends
        self.replies = replies or Replies(emitter, answers, None, running)
        # called with the tokens of every engine output: the stall detector's clock, and the step clock
        # of admission "step" (a segment's first output also carries its prompt, prefilled)
        self.on_progress = on_progress
        self.chunk_tokens, self.chunk_s = chunk_tokens, chunk_ms / 1000

    def params(self, request: Request, prompt_len: int, label_ids: tuple[int, ...] = ()) -> GenParams:
        if request.kind == "score":
            # Scores come from the first position; scores-only still runs that one step.
            max_tokens = max(1, request.max_tokens or 0)
        else:
            max_tokens = request.max_tokens or self.limits.default_max_tokens
        max_prompt = self.limits.max_prompt_tokens or (self.engine.max_model_len - 1)
        if prompt_len > max_prompt:
            raise Rejected(ErrorCode.PAYLOAD_TOO_LARGE, f"prompt is {prompt_len} tokens; the limit is {max_prompt}")
        if prompt_len + max_tokens > self.engine.max_model_len:
            raise Rejected(ErrorCode.INVALID_REQUEST,
                           f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model context "
                           f"of {self.engine.max_model_len}")
        return GenParams(max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
                         seed=request.seed, stop=tuple(request.stop or ()), logprob_token_ids=label_ids)

    def unusable_templates(self) -> dict[str, str]:
        """At start: {template name: why requests naming it will be refused} for each template file that
        is invalid or whose turns this model's chat template refuses. Logged, not fatal: the other
        templates, and every other kind of request, still work."""
        out = {}
        for name in self.templates.names():
            try:
                template = self.templates.get(name)
                self.engine.render_ids("x", template.chat, template.system)
            except (TemplateError, ChatRefused) as exc:
                out[name] = str(exc)[:300]
        return out

    async def prepare_score(self, job: Job) -> None:
        """Render the event through its template; find the token that stands for each label."""
        req = job.request
        try:
            template = self.templates.get(req.template or "")
            text = template.render(req.event or {})
        except TemplateError as exc:
            raise Rejected(ErrorCode.INVALID_REQUEST, str(exc)) from None
        job.labels = list(req.labels or template.labels)
        job.prompt_ids = await tokenized(lambda: self.engine.render_ids(text, template.chat, template.system),
                                         len(text))
        firsts: dict[int, str] = {}
        for label, ids in zip(job.labels, self.engine.label_ids(job.labels, template.chat)):
            if not ids:
                raise Rejected(ErrorCode.INVALID_REQUEST, f"label `{label}` encodes to no tokens")
            if ids[0] in firsts:
                raise Rejected(ErrorCode.INVALID_REQUEST,
                               f"labels `{firsts[ids[0]]}` and `{label}` begin with the same token; "
                               f"scores need labels whose first tokens differ")
            firsts[ids[0]] = label
        job.label_ids = tuple(firsts)

    def _observe_scores(self, template: str | None, scores: dict[str, float]) -> None:
        """Only the template's own labels are series: a request may name any labels, and each new
        one would be a histogram kept for the life of the process and exported at every scrape."""
        own = self.templates.get(template or "").labels
        for label, p in scores.items():
            if label in own:
                metrics.scores.labels(template or "-", label).observe(p)

    async def serve(self, job: Job) -> None:
        try:
            await self._serve(job)
        except Fenced:
            # its record is finished: the later attempt answers the id; the trail says so
            await self.replies.superseded(job)
            raise

    async def _serve(self, job: Job) -> None:
        req = job.request
        if job.engine_at is None:
            job.engine_at = time.time()
        try:
            if job.segments == 0:
                if job.progress is None and _passed(req):
                    raise Rejected(ErrorCode.DEADLINE_EXCEEDED,
                                   f"deadline {req.deadline_ms} passed before the request ran")
                try:
                    if req.kind == "score":
                        await self.prepare_score(job)
                    else:
                        job.prompt_ids = await tokenized(lambda: self.engine.prompt_ids(req), prompt_chars(req))
                except ChatRefused as exc:  # the producer's messages, or the template's turns, are not this model's
                    what = f"template `{req.template}`" if req.kind == "score" else "these messages"
                    raise Rejected(ErrorCode.INVALID_REQUEST,
                                   f"the model's chat template refused {what}: {exc}") from None
                if job.progress is not None:
                    await self._resume(job)
                else:
                    job.tokenizer_mark = self.engine.tokenizer_id
            if job.generated and _passed(req):  # it generated (here, or for an earlier owner), then waited past it
                final = self._done(job, "deadline")
            else:
                final = await self._generate(job, self.params(req, len(job.prompt_ids), job.label_ids))
            job.engine_done_at = time.time()
        except Rejected as exc:
            final = ErrorReply(req.id, exc.code, exc.message)
        except (EngineDead, Suspended, Fenced, asyncio.CancelledError):
            raise
        except Exception as exc:  # one request's failure never stops the worker
            job_log(job).exception("request_failed")
            final = ErrorReply(req.id, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
        self.release_slot(job)
        if job.unstored:  # Redis stayed away: what was held back goes out now, just before the done
            await self._send_stored(job, force=True)
        await self.replies.settle_tokens(job)
        await self.replies.finish(job, final)

    async def expire(self, job: Job) -> None:
        """A waiting job whose deadline passed (admission found it). One that never generated is
        answered `deadline_exceeded`. One that did (suspended for a higher class, or continued from an
        earlier owner) has readers holding its tokens: it ends as a deadline passing while generating
        does, with the token records it owes and then a `done`, finish "deadline"."""
        if job.generated or job.progress is not None:
            await self.serve(job)
        else:
            await self.replies.expire(job)

    async def _resume(self, job: Job) -> None:
        """Continue after the tokens an earlier owner emitted: re-send them unchanged, then generate the rest."""
        progress, job.progress = job.progress, None
        job.resumed = True
        job.scores = progress.scores if job.label_ids else None
        for ids, text in progress.chunks:
            job.generated.extend(ids)
            job.texts.append(text)
            # a repeat of what readers may already have: same seq, same text (stored already)
            await self._send_token(job, TokenReply(job.request.id, job.seq, text, ids, unchecked=not job.checked))
            job.seq += 1
        # Ids from another tokenizer (a rolling upgrade to another model) are other tokens in this
        # one's vocabulary: go on from the emitted text as this tokenizer writes it. Readers already
        # have that text, so the records above go out unchanged.
        retokenized = progress.tokenizer not in (None, self.engine.tokenizer_id)
        if retokenized:
            emitted = len(job.generated)
            job.generated = self.engine.text_ids("".join(job.texts))
            job.generated_credit = emitted - len(job.generated)
            job.tokenizer_mark = MIXED
        metrics.resumed.labels(job.latency_class).inc()
        job_log(job).info("request_resumed", emitted_tokens=job.emitted, next_seq=job.seq,
                          retokenized=retokenized)

    async def _generate(self, job: Job, params: GenParams) -> DoneReply:
        req = job.request
        job.segments += 1
        job.suspend.clear()
        engine_id = f"{req.id}@{getattr(job.tp, 'partition', 0)}:{job.offset}#{job.segments}"
        prefix_len = len(job.prompt_ids) + len(job.generated)  # this segment's prompt, as the engine sees it
        # (a prefix written again by another tokenizer may be longer than the one its tokens were counted in)
        remaining = min(params.max_tokens - job.emitted, self.engine.max_model_len - prefix_len)
        if remaining <= 0:  # resumed after every token was already emitted
            return self._done(job, "length")
        want_scores = bool(job.label_ids) and job.scores is None
        scores_only = req.kind == "score" and not req.max_tokens
        # pages are the insurance of long requests: a short one is recomputed on resume (`save_min_tokens`)
        long_enough = prefix_len + remaining >= self.save_min_tokens
        params = GenParams(remaining, params.temperature, params.top_p, params.seed, params.stop,
                           job.label_ids if want_scores else (), tenant=job.tenant,
                           save_pages=long_enough and not scores_only)
        chunk = _Chunk(self, job) if req.stream and not scores_only else None
        try:
            return await self._stream(job, params, engine_id, chunk, want_scores, scores_only, prefix_len)
        except Fenced:
            await self.engine.abort(engine_id)
            raise

    async def _stream(self, job: Job, params: GenParams, engine_id: str, chunk, want_scores: bool, scores_only: bool,
                      prefix_len: int) -> DoneReply:
        """The engine's deltas for this segment: scores, token records, the finish (or a suspension)."""
        req, cls = job.request, job.latency_class
        finish = "stop"
        new_tokens = 0
        last_tokens_at = None
        prefill = prefix_len
        async for delta in self.engine.generate(engine_id, job.prompt_ids + job.generated, params, job.priority):
            self.on_progress(len(delta.token_ids), prefill)
            prefill = 0
            if want_scores and job.scores is None:
                job.scores = self._scores(job, delta.logprobs)
                self._observe_scores(req.template, job.scores)
            if scores_only:
                finish = "scored"
                metrics.record_kv(cls, prefix_len, delta.cached_tokens, delta.kv)
                if delta.finish_reason is None:
                    await self.engine.abort(engine_id)
                break
            if delta.token_ids:
                now = time.monotonic()
                if not job.generated:
                    metrics.time_to_first_token.labels(cls).observe(max(0.0, time.time() - job.arrived_ms / 1000))
                elif last_tokens_at is not None:
                    metrics.inter_token.labels(cls).observe((now - last_tokens_at) / len(delta.token_ids))
                last_tokens_at = now
                job.generated.extend(delta.token_ids)
                job.texts.append(delta.text)
                new_tokens += len(delta.token_ids)
                if chunk is not None:
                    await chunk.add(delta.text, delta.token_ids)
            if delta.finish_reason is not None:
                finish = delta.finish_reason
                metrics.record_kv(cls, prefix_len, delta.cached_tokens, delta.kv)
            elif _passed(req):
                await self.engine.abort(engine_id)
                finish = "deadline"
                break
            elif job.suspend.is_set():
                await self.engine.abort(engine_id)
                if chunk is not None:
                    await chunk.flush()
                metrics.tokens_generated.labels(cls).inc(new_tokens)
                metrics.suspended.labels(cls).inc()
                job_log(job).debug("suspended", generated=len(job.generated))
                raise Suspended(job)
        if chunk is not None:
            await chunk.flush()
        metrics.tokens_generated.labels(cls).inc(new_tokens)
        metrics.prompt_tokens.labels(cls).inc(len(job.prompt_ids))
        return self._done(job, finish)

    @staticmethod
    def _done(job: Job, finish: str) -> DoneReply:
        """The `done` of what the job generated so far (every segment, every owner)."""
        return DoneReply(job.request.id, job.seq, "".join(job.texts), finish,
                         Usage(len(job.prompt_ids), job.emitted), scores=job.scores, resumed=job.resumed,
                         unchecked=not job.checked)

    async def _send_token(self, job: Job, reply: TokenReply) -> None:
        job.token_futures.append(await self.emitter.token(job.reply_to, reply))
        job.sent_tokens.append(reply)

    async def _send_stored(self, job: Job, force: bool = False) -> None:
        """Store the progress of every held-back token record, then send them, in seq order.

        Write-ahead: a record goes out only once its chunk is stored, so whoever resumes this
        request re-sends exactly what readers may have. While Redis is degraded the records
        wait on the job (the stream pauses); `force` sends them anyway, just before the done.
        """
        first = job.unstored[0]
        stored = await self.answers.append_chunks(job.state_id, [(r.seq, r.token_ids, r.text) for r in job.unstored],
                                                  job.scores if first.seq == 0 else None, owner=job.owner,
                                                  tokenizer=job.tokenizer_mark)
        if stored is False:
            raise Fenced(job)
        if stored:
            job.tokenizer_mark = None
        if not stored and not force:
            metrics.tokens_held.inc()
            return
        held, job.unstored = job.unstored, []
        if not stored:  # sent without stored progress: a later attempt cannot repeat them, so say so
            held = [msgspec.structs.replace(r, unchecked=True) for r in held]
        for reply in held:
            await self._send_token(job, reply)

    @staticmethod
    def _scores(job: Job, logprobs: dict[int, float] | None) -> dict[str, float]:
        """Label probabilities: the model's distribution restricted to the labels, renormalised."""
        if not logprobs or any(t not in logprobs for t in job.label_ids):
            raise RuntimeError("the engine returned no log-probabilities for the labels")
        top = max(logprobs[t] for t in job.label_ids)
        weights = [math.exp(logprobs[t] - top) for t in job.label_ids]
        total = sum(weights)
        return {label: w / total for label, w in zip(job.labels or (), weights)}


def prompt_chars(request: Request) -> int:
    if request.messages is not None:
        return sum(len(m.content) for m in request.messages)
    return len(request.prompt or "")


async def tokenized(encode, chars: int) -> list[int]:
    """`encode()`, in a thread when the text is long: the loop keeps every other stream moving."""
    if chars > LONG_TEXT_CHARS:
        return await asyncio.to_thread(encode)
    return encode()


def flush_due(seq: int, held_tokens: int, since_sent_s: float, chunk_tokens: int, chunk_s: float) -> bool:
    """Whether the tokens held for a request go out now, as each engine output arrives: the first
    record at once, then when `chunk_tokens` are held or `chunk_s` has passed since the last record.

    Measured from the last record sent, not from the oldest held token: an engine whose steps take
    longer than `chunk_s` sends each step's tokens as they come, instead of holding them a whole
    step for company (tests/unit/test_stages.py)."""
    return held_tokens > 0 and (seq == 0 or held_tokens >= chunk_tokens or since_sent_s >= chunk_s)


class _Chunk:
    """Coalesces deltas into token records (`flush_due`)."""

    def __init__(self, runner: Runner, job: Job):
        self.runner, self.job = runner, job
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.sent_at = -math.inf  # a resumed segment sends its first tokens at once

    async def add(self, text: str, ids: list[int]) -> None:
        self.texts.append(text)
        self.ids.extend(ids)
        now = time.monotonic()
        if flush_due(self.job.seq, len(self.ids), now - self.sent_at, self.runner.chunk_tokens, self.runner.chunk_s):
            self.sent_at = now
            await self.flush()

    async def flush(self) -> None:
        if self.ids:
            job = self.job
            job.unstored.append(TokenReply(job.request.id, job.seq, "".join(self.texts), self.ids,
                                           unchecked=not job.checked))
            job.seq += 1
            self.texts, self.ids = [], []
            await self.runner._send_stored(job)
