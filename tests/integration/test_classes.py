"""Latency classes under load, on the real engine: priority, deadlines, backpressure, no starvation."""

import asyncio
import time

import msgspec
import pytest

from loadgen.burst import ReplyReader, produce
from schemas import DoneReply, ErrorReply, TokenReply
from worker import metrics
from tests.integration.helpers import running_worker

pytestmark = pytest.mark.integration
J = msgspec.json.encode


class RecordingEngine:
    """The real engine, recording which requests reached it."""

    def __init__(self, engine):
        self._engine = engine
        self.max_model_len = engine.max_model_len
        self.started: list[str] = []

    def __getattr__(self, name):  # everything else is the real engine's
        return getattr(self._engine, name)

    def prompt_ids(self, request):
        return self._engine.prompt_ids(request)

    def generate(self, request_id, prompt_ids, params, priority):
        self.started.append(request_id.split("@")[0])
        return self._engine.generate(request_id, prompt_ids, params, priority)

    async def abort(self, request_id):
        await self._engine.abort(request_id)


def _req(rid, max_tokens=24, **extra):
    return J({"id": rid, "prompt": f"Request {rid}: describe the weather today.", "max_tokens": max_tokens, **extra})


async def _follow(reader, ids, timeout, on_final=None, tokens=None):
    finals, done_at = {}, {}
    end = time.monotonic() + timeout
    while set(ids) - set(finals) and time.monotonic() < end:
        async for r in reader.records():
            if tokens is not None and isinstance(r, TokenReply):
                assert tokens.setdefault(r.id, {}).setdefault(r.seq, r.text) == r.text
            if isinstance(r, (DoneReply, ErrorReply)) and r.id in ids:
                finals[r.id], done_at[r.id] = r, time.monotonic()
                if on_final:
                    await on_final(r)
    return finals, done_at


async def test_realtime_overtakes_a_batch_backlog(settings, catalog, engine, group_id):
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    batch_ids = [f"bk-{i}" for i in range(48)]
    rt_ids = [f"rt-{i}" for i in range(4)]
    async with running_worker(settings, catalog, engine, group_id=group_id):
        await produce(settings.kafka.options(),
                      [(catalog.request_topic("batch").name, i.encode(), _req(i, 48), []) for i in batch_ids])
        await asyncio.sleep(1.0)  # the backlog is read and fills the engine
        suspended = metrics.suspended.labels("batch")._value.get()
        await produce(settings.kafka.options(),
                      [(catalog.request_topic("realtime").name, i.encode(), _req(i, 16), []) for i in rt_ids])
        tokens = {}
        finals, done_at = await _follow(reader, batch_ids + rt_ids, 400, tokens=tokens)
    await reader.stop()
    assert all(isinstance(finals.get(i), DoneReply) for i in batch_ids + rt_ids), len(finals)
    # Batch requests holding the engine were suspended for realtime and resumed later,
    # and their streams stayed gapless and whole.
    assert metrics.suspended.labels("batch")._value.get() > suspended
    for i in batch_ids:
        seqs = tokens.get(i, {})
        assert sorted(seqs) == list(range(finals[i].seq)), i
        assert "".join(seqs[k] for k in sorted(seqs)) == finals[i].text, i
        assert finals[i].usage.completion_tokens == 48 or finals[i].finish_reason == "stop"
    last_rt = max(done_at[i] for i in rt_ids)
    batch_after = [i for i in batch_ids if done_at[i] > last_rt]
    # Realtime published after the whole backlog finishes while most of the backlog still waits.
    assert len(batch_after) >= len(batch_ids) // 2, (len(batch_after), len(batch_ids))


async def test_expired_request_never_reaches_the_engine(settings, catalog, engine, group_id):
    rec = RecordingEngine(engine)
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    past = int(time.time() * 1000) - 1000
    future = int(time.time() * 1000) + 120_000
    items = [(catalog.request_topic("realtime").name, b"expired", _req("expired", deadline_ms=past), []),
             (catalog.request_topic("realtime").name, b"in-time", _req("in-time", deadline_ms=future), [])]
    async with running_worker(settings, catalog, rec, group_id=group_id):
        await produce(settings.kafka.options(), items)
        finals, _ = await _follow(reader, ["expired", "in-time"], 120)
    await reader.stop()
    assert isinstance(finals["expired"], ErrorReply) and finals["expired"].code.value == "deadline_exceeded"
    assert isinstance(finals["in-time"], DoneReply)
    assert "expired" not in rec.started and "in-time" in rec.started


async def test_deadline_passing_mid_generation_finishes_with_deadline(settings, catalog, engine, group_id):
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    async with running_worker(settings, catalog, engine, group_id=group_id):
        soon = int(time.time() * 1000) + 3000
        body = J({"id": "short-lived", "prompt": "Count from 1 to 1000: 1, 2, 3, 4, 5,", "max_tokens": 1000,
                  "deadline_ms": soon})
        await produce(settings.kafka.options(), [(catalog.request_topic("standard").name, b"short-lived", body, [])])
        finals, _ = await _follow(reader, ["short-lived"], 120)
    await reader.stop()
    done = finals["short-lived"]
    assert isinstance(done, DoneReply) and done.finish_reason == "deadline"
    assert 0 < done.usage.completion_tokens < 1000


async def test_a_deadline_passing_while_suspended_ends_the_stream_with_a_done(settings, catalog, engine, group_id):
    """Batch requests streaming on the real engine are suspended when realtime work arrives (batch's
    contended cap is 2), and their deadline passes while the realtime request still runs: each ends
    with a `done`, finish "deadline", after the token records it sent, not with `deadline_exceeded`."""
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    count = "Count from 1 to 1000: 1, 2, 3, 4, 5,"
    batch_ids = [f"sus-{i}" for i in range(6)]
    suspended = metrics.suspended.labels("batch")._value.get()
    tokens: dict = {}
    async with running_worker(settings, catalog, engine, group_id=group_id):
        deadline = int(time.time() * 1000) + 8000
        await produce(settings.kafka.options(), [
            (catalog.request_topic("batch").name, i.encode(),
             J({"id": i, "prompt": count, "max_tokens": 1000, "deadline_ms": deadline}), []) for i in batch_ids])
        end = time.monotonic() + 60
        while any(i not in tokens for i in batch_ids) and time.monotonic() < end:  # every one has generated
            async for r in reader.records():
                if isinstance(r, TokenReply):
                    tokens.setdefault(r.id, {}).setdefault(r.seq, r.text)
        assert all(i in tokens for i in batch_ids) and time.time() * 1000 < deadline - 2000, "too slow to test"
        await produce(settings.kafka.options(), [(catalog.request_topic("realtime").name, b"holder",
                                                   J({"id": "holder", "prompt": count, "max_tokens": 600}), [])])
        finals, done_at = await _follow(reader, batch_ids + ["holder"], 240, tokens=tokens)
        holder_done_ms = (done_at["holder"] + time.time() - time.monotonic()) * 1000
    await reader.stop()
    assert metrics.suspended.labels("batch")._value.get() >= suspended + 4  # all but the contended cap of 2
    assert isinstance(finals["holder"], DoneReply)
    # the realtime request held batch at its cap until after the deadline: the suspended ones expired waiting
    assert holder_done_ms > deadline, "the realtime request ended before the batch deadline: nothing to test"
    for i in batch_ids:
        done = finals[i]
        assert isinstance(done, DoneReply) and done.finish_reason == "deadline", done
        seqs = tokens[i]
        assert sorted(seqs) == list(range(done.seq)), i
        assert "".join(seqs[k] for k in sorted(seqs)) == done.text, i


async def test_paused_partitions_resume_and_complete(settings, catalog, engine, group_id):
    small = msgspec.structs.replace(catalog.request_topic("batch"), max_waiting=4, batch_size=4,
                                    max_in_engine=2, contended_in_engine=2)
    tight = msgspec.structs.replace(catalog, topic=[small if t.name == small.name else t for t in catalog.topic])
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    ids = [f"p-{i}" for i in range(24)]
    saw_pause = []
    async with running_worker(settings, tight, engine, group_id=group_id) as w:
        await produce(settings.kafka.options(), [(small.name, i.encode(), _req(i, 8), []) for i in ids])

        async def watch(_):
            saw_pause.append(w.paused["batch"])
            assert w.scheduler.waiting("batch") <= 4 + 4  # bounded: never more than a window past the cap

        finals, _ = await _follow(reader, ids, 300, on_final=watch)
        assert not w.paused["batch"]
    await reader.stop()
    assert all(isinstance(finals.get(i), DoneReply) for i in ids)
    assert any(saw_pause), "the batch partitions were never paused"


async def test_batch_progresses_under_a_realtime_stream(settings, catalog, engine, group_id):
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    batch_ids = [f"sb-{i}" for i in range(12)]
    rt_ids = []
    async with running_worker(settings, catalog, engine, group_id=group_id):
        await produce(settings.kafka.options(),
                      [(catalog.request_topic("batch").name, i.encode(), _req(i, 16), []) for i in batch_ids])
        batch_done = []

        async def stream():
            for k in range(40):  # a continuous realtime stream, 8 per second
                rid = f"sr-{k}"
                rt_ids.append(rid)
                await produce(settings.kafka.options(),
                              [(catalog.request_topic("realtime").name, rid.encode(), _req(rid, 16), [])])
                await asyncio.sleep(0.125)

        async def on_final(r):
            if r.id.startswith("sb-"):
                batch_done.append(len(rt_ids))

        producer = asyncio.create_task(stream())
        finals, _ = await _follow(reader, batch_ids, 300, on_final=on_final)
        await producer
    await reader.stop()
    assert all(isinstance(finals.get(i), DoneReply) for i in batch_ids)
    # Batch answers arrived while the realtime stream was still being published.
    assert batch_done and min(batch_done) < 40, batch_done


async def test_step_admission_fits_the_engine_steps_and_caps_batch_from_them(settings, catalog, engine, group_id):
    """Admission "step" on the real engine: vLLM reports every step, the worker fits the step time from
    them, and batch's cap beside realtime comes from that fit; every request is still answered."""
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    batch_ids = [f"stb-{i}" for i in range(24)]
    rt_ids = [f"str-{i}" for i in range(6)]
    async with running_worker(settings, catalog, engine, group_id=group_id, admission="step") as w:
        budget = w.scheduler.step_budget
        assert w.dispatch.steps_reported  # from vLLM's step stats, not from the outputs' timing
        await produce(settings.kafka.options(),
                      [(catalog.request_topic("batch").name, i.encode(), _req(i, 16 + 24 * (k % 3)), [])
                       for k, i in enumerate(batch_ids)])
        # about 65 steps of 24, then 16, then 8 requests decoding: the model needs decoded tokens per step
        # that vary to tell the fixed part from the part per token
        end = time.monotonic() + 120
        while budget.model.fit() is None and time.monotonic() < end:
            await asyncio.sleep(0.1)
        fit = budget.model.fit()
        assert fit is not None, (budget.clock.steps, budget.model.n)
        assert 0 < fit.fixed < 10 and 0 < fit.per_token < 1 and 0 < fit.per_prompt_token < 1, fit
        assert metrics.engine_step.labels("per_token")._value.get() > 0
        caps = []

        async def watch():
            while True:  # batch's cap while realtime has work: set by the fit, within the class's bounds
                caps.append(w.scheduler._cap("batch"))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        await produce(settings.kafka.options(),
                      [(catalog.request_topic("realtime").name, i.encode(), _req(i, 16), []) for i in rt_ids])
        finals, _ = await _follow(reader, batch_ids + rt_ids, 400)
        watcher.cancel()
    await reader.stop()
    assert all(isinstance(finals.get(i), DoneReply) for i in batch_ids + rt_ids), len(finals)
    batch = catalog.request_topic("batch")
    measured = [cap for cap, from_budget in caps if from_budget]
    assert measured, caps[:20]
    assert all(batch.min_in_engine <= cap <= batch.max_in_engine for cap in measured), measured
