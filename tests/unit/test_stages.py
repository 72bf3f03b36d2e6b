"""Commits, revoke and suspension through the stages over the in-memory doubles and the fake engine."""

import asyncio
import time

import pytest

from schemas import DoneReply, Request, TokenReply
from tests.unit.harness import CATALOG, J, Memory, running, until
from worker.fake_engine import FakeEngine


def tp_of(mem, cls, partition=0):
    return next(tp for tp in mem.broker.logs if tp.topic == CATALOG.request_topic(cls).name and tp.partition == partition)


def one_stream(mem, done) -> dict[int, str]:
    """The token records read as one stream: no seq with two texts, seqs 0..done.seq-1, joined to done.text."""
    texts: dict[int, str] = {}
    for t in mem.tokens():
        assert texts.setdefault(t.seq, t.text) == t.text, f"seq {t.seq} repeated with other text"
    assert sorted(texts) == list(range(done.seq)) and "".join(texts[i] for i in range(done.seq)) == done.text
    return texts


class Gated(FakeEngine):
    """Holds the request whose prompt is "hold" until `release` is set."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def generate(self, request_id, prompt_ids, params, priority):
        if prompt_ids == self.prompt_ids(Request(id="x", prompt="hold")):
            await self.release.wait()
        async for d in super().generate(request_id, prompt_ids, params, priority):
            yield d


async def test_commits_never_pass_an_unfinished_record():
    mem = Memory(partitions=1, engine=Gated())
    mem.send("standard", J({"id": "slow", "prompt": "hold", "max_tokens": 2}), b"slow")
    for i in range(5):
        mem.send("standard", J({"id": f"f{i}", "prompt": "x", "max_tokens": 2}), f"f{i}".encode())
    async with running(mem):
        assert await until(lambda: len(mem.finals()) == 5)
        await until(lambda: False, timeout=0.1)  # a few commit intervals
        assert mem.broker.committed.get(tp_of(mem, "standard"), 0) == 0  # offset 0 still running
        mem.engine.release.set()
        assert await until(mem.all_committed)
    assert sorted(mem.finals()) == ["f0", "f1", "f2", "f3", "f4", "slow"]


async def test_revoked_partitions_drop_waiting_work_and_the_next_owner_answers_it():
    mem = Memory(partitions=2, engine=FakeEngine(token_delay_s=0.01))
    for i in range(40):
        mem.send("batch", J({"id": f"b{i}", "prompt": "x", "max_tokens": 3}), f"b{i}".encode())
    async with running(mem) as w:
        await until(lambda: len(mem.finals()) >= 3)
        mine = w.consumer.assignment()
        await mem.consumer.assign(set())  # a rebalance takes everything away
        assert w.scheduler.waiting() == 0 and not w.tracker.partitions()
        await mem.consumer.assign(mine)  # and gives it back: read again from the committed offsets
        assert await until(mem.all_committed, timeout=20)
        assert w.ready
    finals = mem.finals()
    assert sorted(finals) == sorted(f"b{i}" for i in range(40))
    for rid, replies in finals.items():  # a repeat after the revoke is the stored answer again
        assert all(r == replies[0] for r in replies), rid


async def test_realtime_suspends_batch_and_batch_streams_stay_gapless():
    mem = Memory(partitions=1, engine=FakeEngine(token_delay_s=0.005), max_num_seqs=4)
    for i in range(4):
        mem.send("batch", J({"id": f"b{i}", "prompt": f"batch {i}", "max_tokens": 60}), f"b{i}".encode())
    async with running(mem) as w:
        assert await until(lambda: w.scheduler.running("batch") == 4)
        for i in range(3):
            mem.send("realtime", J({"id": f"r{i}", "prompt": "now", "max_tokens": 5}), f"r{i}".encode())
        assert await until(mem.all_committed, timeout=20)
    assert any(rid.endswith("#2") for rid in mem.engine.started)  # a suspended request ran again
    assert mem.engine.aborted, "no batch request was suspended"
    finals = mem.finals()
    tokens = mem.tokens()
    for i in range(4):
        (done,) = finals[f"b{i}"]
        assert isinstance(done, DoneReply) and done.usage.completion_tokens == 60
        mine = [t for t in tokens if t.id == f"b{i}"]
        assert [t.seq for t in mine] == list(range(done.seq))
        assert "".join(t.text for t in mine) == done.text


async def test_revoke_aborts_running_requests_and_the_next_owner_continues_them():
    mem = Memory(partitions=1, engine=FakeEngine(token_delay_s=0.02), revoke_grace_s=0.1)
    mem.send("standard", J({"id": "long", "prompt": "x", "max_tokens": 100}), b"long")
    async with running(mem) as w:
        assert await until(lambda: len([t for t in mem.tokens() if t.id == "long"]) >= 5)
        mine = w.consumer.assignment()
        started = time.monotonic()
        await mem.consumer.assign(set())  # a rebalance takes the partition away mid-stream
        assert time.monotonic() - started < 2
        assert not w.dispatch.tasks, "a task of the revoked partition still runs"
        sent = len(mem.replies())
        await asyncio.sleep(0.3)
        assert len(mem.replies()) == sent  # the aborted attempt sends nothing more
        assert not any(mem.broker.committed.values())
        await mem.consumer.assign(mine)  # it comes back: read again, continued from its progress
        assert await until(mem.all_committed, timeout=20)
    (done,) = mem.finals()["long"]
    assert done.resumed and done.usage.completion_tokens == 100
    one_stream(mem, done)


async def test_a_failed_token_delivery_is_sent_again_before_done():
    from aiokafka.errors import KafkaConnectionError

    mem = Memory(partitions=1)
    failed = []

    def fail(topic, value):
        if value and value.startswith(b'{"type":"token"') and b'"seq":3,' in value and not failed:
            failed.append(value)
            return KafkaConnectionError("lost on the way")
        return None

    mem.producer.fail = fail
    mem.send("standard", J({"id": "t1", "prompt": "x", "max_tokens": 8}), b"t1")
    async with running(mem):
        assert await until(mem.all_committed)
    assert failed
    replies = [r for r in mem.replies() if r.id == "t1"]
    at = next(i for i, r in enumerate(replies) if isinstance(r, DoneReply))
    assert {r.seq for r in replies[:at] if isinstance(r, TokenReply)} == set(range(replies[at].seq))


async def test_the_final_reply_and_its_commit_wait_for_the_stored_answer():
    """The answer is stored before the final reply is produced (fenced runs store nothing and send
    nothing), and the offset is committed after both: a redelivery always finds the answer."""
    mem = Memory(partitions=1)
    mem.answers.hold = asyncio.Event()
    mem.send("standard", J({"id": "a1", "prompt": "x", "max_tokens": 2}), b"a1")
    async with running(mem):
        assert await until(lambda: len(mem.tokens()) == 2)
        await asyncio.sleep(0.2)
        assert "a1" not in mem.finals(), "the final reply went out before its answer was stored"
        assert not any(mem.broker.committed.values()), "committed before the answer was stored"
        mem.answers.hold.set()
        assert await until(mem.all_committed)
    assert mem.answers.answers["default:a1"] and "a1" in mem.finals()


async def test_token_records_wait_for_their_progress_while_redis_is_away():
    mem = Memory(partitions=1, engine=FakeEngine(token_delay_s=0.01))
    mem.answers.available = False
    mem.send("standard", J({"id": "h1", "prompt": "x", "max_tokens": 60}), b"h1")
    async with running(mem):
        await asyncio.sleep(0.3)  # generating while Redis is away
        assert not mem.tokens(), "a token record went out before its progress was stored"
        mem.answers.available = True
        assert await until(lambda: len(mem.tokens()) > 0)
        assert len(mem.answers.progress.get("default:h1", {})) >= len(mem.tokens())  # each one sent was stored first
        assert await until(mem.all_committed)
    (done,) = mem.finals()["h1"]
    tokens = mem.tokens()
    assert [t.seq for t in tokens] == list(range(done.seq))
    assert "".join(t.text for t in tokens) == done.text


async def test_held_back_token_records_go_out_before_done_if_redis_never_returns():
    mem = Memory(partitions=1)
    mem.answers.available = False
    mem.send("standard", J({"id": "h2", "prompt": "x", "max_tokens": 12}), b"h2")
    async with running(mem):
        assert await until(mem.all_committed)
    replies = [r for r in mem.replies() if r.id == "h2"]
    assert isinstance(replies[-1], DoneReply)
    assert all(r.unchecked for r in replies)  # run without its stored answer: the replies say so
    assert [r.seq for r in replies[:-1]] == list(range(replies[-1].seq))
    assert "".join(r.text for r in replies[:-1]) == replies[-1].text


class Pausable(FakeEngine):
    """Generates while `running` is set: clearing it freezes the engine like a SIGSTOPped worker."""

    def __init__(self):
        super().__init__(token_delay_s=0.005)
        self.running = asyncio.Event()
        self.running.set()

    async def generate(self, request_id, prompt_ids, params, priority):
        async for d in super().generate(request_id, prompt_ids, params, priority):
            await self.running.wait()
            yield d


async def test_a_worker_that_wakes_after_its_request_moved_sends_nothing_more():
    """Worker A is frozen mid-stream; the group gives its partition to B, which continues the request
    from A's progress and answers it. When A wakes up it still holds the request: its next write is
    refused (B claimed the request), so A stops without a token or a done."""
    from worker.doubles import MemoryConsumer

    mem = Memory(partitions=1, engine=Pausable())
    mem.send("standard", J({"id": "z1", "prompt": "x", "max_tokens": 80}), b"z1")
    a = mem.worker()
    await a.start()
    try:
        assert await until(lambda: len(mem.tokens()) >= 5)
        mem.engine.running.clear()  # A freezes, past its session timeout
        # B: its own consumer and engine; the same broker and Redis
        b = type(a)(mem.settings, CATALOG, FakeEngine(), consumer=MemoryConsumer(mem.broker),
                    producer=mem.producer, answers=mem.answers)
        await b.start()
        try:
            assert await until(lambda: "z1" in mem.finals(), timeout=10)
            sent = len(mem.replies())
            mem.engine.running.set()  # A wakes up, still holding z1
            await asyncio.sleep(0.5)
            assert len(mem.replies()) == sent, "the woken worker sent more records"
            assert a.ready  # fenced is not a failure: the revoke that follows lets the partition go
        finally:
            await b.stop(grace_s=1)
    finally:
        await a.stop(grace_s=1)
    (done,) = mem.finals()["z1"]
    assert done.resumed
    one_stream(mem, done)


async def test_the_same_id_many_times_at_once_is_answered_once_and_every_record_ends():
    mem = Memory(partitions=1)
    for _ in range(9):
        mem.send("realtime", J({"id": "dup", "prompt": "x", "max_tokens": 3}), b"dup")
    async with running(mem) as w:
        assert await until(mem.all_committed), mem.broker.committed
        assert w.ready
    finals = mem.finals()["dup"]
    assert finals and all(f == finals[0] for f in finals)  # repeats, if any, are the stored answer again
    texts: dict[int, str] = {}
    for t in mem.tokens():
        assert texts.setdefault(t.seq, t.text) == t.text


async def test_a_redis_blip_then_a_kill_loses_and_changes_nothing():
    """Redis goes away mid-stream (token records are held back), comes back (they go out, each after
    its progress is stored), then the worker dies. The next owner re-sends exactly what was sent and
    continues: one `done`, gapless seqs, the text of an uninterrupted run (the fake engine continues
    like greedy decoding; tests/integration/test_chaos.py checks the same with the real model)."""
    from worker.doubles import MemoryConsumer, MemoryProducer
    from worker.engine import GenParams

    mem = Memory(partitions=1, engine=Pausable())
    mem.send("standard", J({"id": "rb", "prompt": "blip", "max_tokens": 90}), b"rb")
    a = type(mem.worker())(mem.settings, CATALOG, mem.engine, consumer=MemoryConsumer(mem.broker),
                           producer=MemoryProducer(mem.broker), answers=mem.answers)
    await a.start()
    try:
        assert await until(lambda: len(mem.tokens()) >= 3)
        mem.answers.available = False  # the blip
        held_from = len(mem.tokens())
        await asyncio.sleep(0.2)
        assert len(mem.tokens()) <= held_from + 1, "token records went out while their progress could not be stored"
        mem.answers.available = True
        assert await until(lambda: len(mem.tokens()) >= held_from + 5)
        mem.engine.running.clear()  # the worker dies: no more progress, no drain, no commit
        sent_by_a = {t.seq: t.text for t in mem.tokens()}
        stored = mem.answers.progress["default:rb"]
        assert set(sent_by_a) <= set(stored), "a token record went out before its progress was stored"
        b = type(a)(mem.settings, CATALOG, FakeEngine(), consumer=MemoryConsumer(mem.broker),
                    producer=mem.producer, answers=mem.answers)
        await b.start()
        try:
            assert await until(lambda: "rb" in mem.finals(), timeout=10)
        finally:
            await b.stop(grace_s=1)
    finally:
        await a.stop(grace_s=0.2)
    (done,) = mem.finals()["rb"]
    assert done.resumed
    texts = one_stream(mem, done)
    assert done.usage.completion_tokens == 90
    assert all(texts[s] == text for s, text in sent_by_a.items())  # what the dead worker sent stands
    ref = FakeEngine()
    uninterrupted = [d.text async for d in ref.generate("ref", ref.prompt_ids(Request(id="r", prompt="blip")),
                                                         GenParams(90), 0)]
    assert done.text == "".join(uninterrupted)


async def test_records_read_before_a_revoke_are_not_taken_after_it():
    """A rebalance lands while intake waits out its micro-batch window with records in hand: those
    records belong to the new owner. Taking them anyway ran requests of a partition this worker no
    longer owned, and left offsets marked taken, so that when the partition came back its records
    were skipped as "already taken" and a later commit passed them unanswered."""
    from aiokafka import TopicPartition

    mem = Memory(partitions=1)

    def runs(rid):
        return [s for s in mem.engine.started if s.startswith(f"{rid}@")]

    tp = TopicPartition(CATALOG.request_topic("batch").name, 0)  # batch waits 200 ms for more after the first
    async with running(mem) as w:
        everything = w.consumer.assignment()
        mem.send("batch", J({"id": "w1", "prompt": "x", "max_tokens": 3}), b"w1")
        assert await until(lambda: mem.consumer.polls > 0 and mem.consumer._position.get(tp) == 1, timeout=5)
        await mem.consumer.assign(everything - {tp})  # revoked inside the window
        await asyncio.sleep(0.4)
        assert not runs("w1"), "a request of a revoked partition ran"
        assert w.tracker.pending(tp) == 0 and tp not in w.tracker.partitions()
        await mem.consumer.assign(everything)  # it comes back: read again from the committed offset
        assert await until(mem.all_committed, timeout=10)
    assert [f.id for f in mem.finals()["w1"]] == ["w1"] and len(runs("w1")) == 1


async def test_a_partition_that_comes_straight_back_during_the_window_loses_nothing():
    """Revoked and assigned again while intake waits out its window: the consumer restarts the
    partition at its committed offset and the window's second read picks the records up again. They
    belong to the old generation and are put back, not dropped (found by `sluice chaos`: hundreds of
    requests skipped and committed past)."""
    from aiokafka import TopicPartition

    mem = Memory(partitions=1)
    tp = TopicPartition(CATALOG.request_topic("batch").name, 0)
    async with running(mem) as w:
        everything = w.consumer.assignment()
        for i in range(3):
            mem.send("batch", J({"id": f"c{i}", "prompt": "x", "max_tokens": 3}), f"c{i}".encode())
        assert await until(lambda: mem.consumer._position.get(tp) == 3, timeout=5)
        await mem.consumer.assign(everything - {tp})
        await mem.consumer.assign(everything)  # straight back, inside the 200 ms window
        assert await until(mem.all_committed, timeout=10)
    assert sorted(mem.finals()) == ["c0", "c1", "c2"]


async def test_a_record_read_during_a_redis_failover_waits_for_its_stored_answer():
    """Redis is away when an answered id is read again (a redelivery during a master failover): the
    record waits for Redis instead of running again, then gets the stored answer re-sent."""
    mem = Memory(partitions=1, redis_lookup_wait_s=5)
    mem.send("standard", J({"id": "f1", "prompt": "x", "max_tokens": 4}), b"f1")
    async with running(mem):
        assert await until(mem.all_committed)
        first = mem.finals()["f1"]
        mem.answers.available = False
        mem.send("standard", J({"id": "f1", "prompt": "x", "max_tokens": 4}), b"f1")
        await asyncio.sleep(0.5)
        assert len(mem.finals()["f1"]) == 1, "answered while the stored answer could not be looked up"
        mem.answers.available = True
        assert await until(mem.all_committed)
    finals = mem.finals()["f1"]
    assert len(finals) == 2 and finals[0] == finals[1] == first[0] and not finals[1].unchecked
    assert len([s for s in mem.engine.started if s.startswith("f1@")]) == 1


async def test_an_answer_that_cannot_be_stored_is_marked_on_its_done():
    """Redis goes away between the last token and the answer: the `done` still goes out (and its
    offset is committed), marked `unchecked`, since a later attempt may answer the id again; the
    token records before it were stored and are not marked."""
    mem = Memory(partitions=1)
    mem.answers.hold = asyncio.Event()
    mem.send("standard", J({"id": "u1", "prompt": "x", "max_tokens": 3}), b"u1")
    async with running(mem):
        assert await until(lambda: len(mem.tokens()) == 3)
        mem.answers.available = False  # the answer write fails
        mem.answers.hold.set()
        assert await until(mem.all_committed)
    (done,) = mem.finals()["u1"]
    assert done.unchecked and "default:u1" not in mem.answers.answers
    assert not any(t.unchecked for t in mem.tokens())


async def test_stage_times_say_where_a_request_spent_its_end_to_end_time():
    from worker import metrics

    def sample(name, **labels):
        return metrics.REGISTRY.get_sample_value(name, {"class": "standard", **labels}) or 0.0

    before = {st: (sample("sluice_stage_seconds_count", stage=st), sample("sluice_stage_seconds_sum", stage=st))
              for st in metrics.STAGES}
    e2e_before = sample("sluice_end_to_end_seconds_sum")
    mem = Memory(partitions=1, engine=Gated())
    mem.send("standard", J({"id": "staged", "prompt": "hold", "max_tokens": 2}), b"staged")
    async with running(mem):
        await asyncio.sleep(0.3)  # held in the engine
        mem.engine.release.set()
        assert await until(lambda: list(mem.finals()) == ["staged"])
    spent = {st: sample("sluice_stage_seconds_sum", stage=st) - before[st][1] for st in metrics.STAGES}
    assert all(sample("sluice_stage_seconds_count", stage=st) - before[st][0] == 1 for st in metrics.STAGES)
    assert 0.2 <= spent["engine"] < 2  # held for most of the 0.3 s
    assert spent["reply"] < spent["engine"] and spent["admission"] < spent["engine"]
    # the stages tile the end-to-end time: record timestamp -> read -> engine -> out of it -> answered
    assert sum(spent.values()) == pytest.approx(sample("sluice_end_to_end_seconds_sum") - e2e_before, abs=0.01)


@pytest.mark.parametrize("seq, held, since_sent_s, chunk_tokens, chunk_s, due", [
    (0, 1, 0.0, 8, 0.05, True),     # the first record goes at once
    (0, 0, 9.9, 8, 0.05, False),    # nothing held, nothing sent
    (3, 1, 0.01, 8, 0.05, False),   # a record went out 10 ms ago: hold for company
    (3, 7, 0.049, 8, 0.05, False),
    (3, 8, 0.0, 8, 0.05, True),     # enough tokens
    (3, 1, 0.05, 8, 0.05, True),    # chunk_ms since the last record
    (3, 1, 0.35, 8, 0.05, True),    # a slow engine step: its token goes as it comes, not a step later
    (3, 1, 0.0, 8, 0.0, True),      # chunk_ms 0: a record per output
    (3, 1, 0.0, 1, 0.05, True),     # chunk_tokens 1: a record per token
])
def test_when_held_tokens_go_out(seq, held, since_sent_s, chunk_tokens, chunk_s, due):
    from worker.runner import flush_due
    assert flush_due(seq, held, since_sent_s, chunk_tokens, chunk_s) is due


@pytest.mark.parametrize("token_delay_s, chunk_ms, most_tokens_per_record", [(0.03, 20, 1), (0.0, 1000, 8)])
async def test_a_slow_engine_streams_each_token_as_it_comes_a_fast_one_coalesces(token_delay_s, chunk_ms,
                                                                                 most_tokens_per_record):
    # chunks of 8 tokens: engine steps of 30 ms against 20 ms send every token at once (none waits a
    # step for company); instant steps against 1 s fill records of 8 tokens
    mem = Memory(partitions=1, engine=FakeEngine(token_delay_s=token_delay_s), stream_chunk_tokens=8,
                 stream_chunk_ms=chunk_ms)
    mem.send("realtime", J({"id": "s", "prompt": "x", "max_tokens": 24}), b"s")
    async with running(mem):
        assert await until(lambda: "s" in mem.finals())
    done = mem.finals()["s"][0]
    one_stream(mem, done)
    sizes = [len(t.token_ids) for t in mem.tokens()]
    assert sum(sizes) == 24 and max(sizes) == most_tokens_per_record
    if most_tokens_per_record > 1:
        assert len(sizes) < 24 / 2


async def test_an_idle_intake_wait_returns_records_of_a_partition_assigned_during_it(monkeypatch):
    """An idle loop waits long for records (`IDLE_WAIT_MS`); a partition the group hands it meanwhile
    is read in that same wait, not after it."""
    from aiokafka.structs import TopicPartition

    from worker import intake

    monkeypatch.setattr(intake, "IDLE_WAIT_MS", 20_000)
    mem = Memory(partitions=2)
    topic = CATALOG.request_topic("standard").name
    async with running(mem):
        everything = set(mem.consumer.assignment())
        await mem.consumer.assign({tp for tp in everything if tp.partition == 0})
        await asyncio.sleep(0.3)  # every loop is in its wait now, partition 1 not among the assigned
        await mem.consumer.assign(everything)
        started = time.monotonic()
        mem.broker.append(topic, J({"id": "late", "prompt": "hi", "max_tokens": 2}), b"late", partition=1)
        assert await until(lambda: "late" in mem.finals(), timeout=15)
        assert time.monotonic() - started < 5  # well inside the 20 s wait it was read in
    assert TopicPartition(topic, 1) in everything  # the partition came with the second assignment


async def test_a_deadline_that_passes_while_suspended_ends_the_stream_with_a_done():
    """A batch request suspended mid-stream for realtime work, whose deadline passes before it is
    admitted again, has streamed tokens: it ends as one that passes while generating does, with a
    `done` (finish "deadline") after every token record it sent, not an error saying it never ran."""
    mem = Memory(partitions=1, engine=FakeEngine(token_delay_s=0.005), max_num_seqs=4)
    async with running(mem) as w:
        deadline = int(time.time() * 1000) + 1500  # from when the worker runs: its start may be slow
        for i in range(4):
            mem.send("batch", J({"id": f"b{i}", "prompt": f"batch {i}", "max_tokens": 1000, "deadline_ms": deadline}),
                     f"b{i}".encode())
        assert await until(lambda: w.scheduler.running("batch") == 4 and len(mem.tokens()) >= 8)
        for i in range(4):  # realtime holds every slot past the batch deadline
            mem.send("realtime", J({"id": f"r{i}", "prompt": "now", "max_tokens": 400}), f"r{i}".encode())
        assert await until(mem.all_committed, timeout=20)
    assert mem.engine.aborted, "no batch request was suspended"
    finals = mem.finals()
    for i in range(4):
        (done,) = finals[f"b{i}"]
        assert isinstance(done, DoneReply), done
        assert done.finish_reason == "deadline"
        assert 0 < done.usage.completion_tokens < 1000
        mine = [t for t in mem.tokens() if t.id == f"b{i}"]  # every token record it sent, then the done
        assert [t.seq for t in mine] == list(range(done.seq)) and done.seq > 0
        assert "".join(t.text for t in mine) == done.text


async def test_a_deadline_that_passes_between_owners_ends_the_continued_stream_with_a_done():
    """A request whose partition moves mid-stream and whose deadline passes before the next owner
    reads it: the next owner re-sends what the first one streamed and ends it with a `done`
    (finish "deadline", resumed), not an error saying it never ran."""
    mem = Memory(partitions=1, engine=FakeEngine(token_delay_s=0.02), revoke_grace_s=0.1)
    async with running(mem) as w:
        # sent once the worker runs: a start slower than the deadline (seen on a loaded 2-core machine)
        # would end the request before its first token, not between owners
        deadline = int(time.time() * 1000) + 2000
        mem.send("standard", J({"id": "long", "prompt": "x", "max_tokens": 1000, "deadline_ms": deadline}), b"long")
        assert await until(lambda: len([t for t in mem.tokens() if t.id == "long"]) >= 5)
        mine = w.consumer.assignment()
        await mem.consumer.assign(set())  # a rebalance takes the partition away mid-stream
        first = [t for t in mem.tokens() if t.id == "long"]
        await asyncio.sleep(max(0.0, deadline / 1000 - time.time()) + 0.1)
        await mem.consumer.assign(mine)  # it comes back after its deadline
        assert await until(mem.all_committed, timeout=20)
    (done,) = mem.finals()["long"]
    assert isinstance(done, DoneReply), done
    assert done.finish_reason == "deadline" and done.resumed
    assert done.seq == len(first) and done.usage.completion_tokens > 0
    one_stream(mem, done)  # the first owner's records, re-sent unchanged, then the done


async def test_once_redis_has_been_away_past_the_wait_later_records_run_at_once():
    """The lookup wait rides out a master failover. In a longer outage the first records wait it out
    and run unchecked; records read after that run at once, unchecked, instead of each batch waiting
    the whole wait again (which left each class one batch per wait for as long as Redis was away)."""
    mem = Memory(partitions=1, redis_lookup_wait_s=3)
    async with running(mem):
        mem.answers.available = False
        sent = time.monotonic()
        mem.send("standard", J({"id": "w1", "prompt": "x", "max_tokens": 2}), b"w1")
        assert await until(lambda: "w1" in mem.finals(), timeout=10)
        assert time.monotonic() - sent >= 2.5  # it waited for Redis
        for i in range(3):  # still away: each of these is read in a batch of its own
            sent = time.monotonic()
            mem.send("standard", J({"id": f"w{i + 2}", "prompt": "x", "max_tokens": 2}), f"w{i + 2}".encode())
            assert await until(lambda: f"w{i + 2}" in mem.finals(), timeout=10)
            assert time.monotonic() - sent < 2.0, "waited for Redis again in an outage that outlasted the wait"
        mem.answers.available = True
        assert await until(mem.all_committed)
        mem.answers.available = False  # a new outage: the wait applies again
        sent = time.monotonic()
        mem.send("standard", J({"id": "w9", "prompt": "x", "max_tokens": 2}), b"w9")
        assert await until(lambda: "w9" in mem.finals(), timeout=10)
        assert time.monotonic() - sent >= 2.5
    assert all(r.unchecked for rid in ("w1", "w2", "w3", "w4", "w9") for r in mem.finals()[rid])


@pytest.mark.parametrize("stamp, believed, arrived", [
    (90_000, True, 90_000),       # an ordinary record: its own timestamp
    (100_000, True, 100_000),     # read the moment it was produced
    (130_000, True, 100_000),     # a producer's clock a little ahead: now
    (160_001, False, 100_000),    # further ahead than clock skew explains
    (0, False, 100_000),          # CreateTime 0
    (-1, False, 100_000),         # no timestamp (-1)
    (50_000, True, 50_000),       # as old as the topic keeps records
    (49_999, False, 100_000),     # older than that
])
def test_a_record_timestamp_that_cannot_be_true_gives_way_to_the_read_time(stamp, believed, arrived):
    from worker.intake import arrival_ms
    assert arrival_ms(stamp, 100_000, 50_000) == (arrived, believed)


async def test_a_producer_set_timestamp_of_zero_neither_jumps_its_class_queue_nor_skews_its_latency():
    """CreateTime is the producer's to set: a record stamped 0 (or an hour ahead) waits its turn behind
    records read before it, is timed from when it was read, and the audit keeps what the producer said."""
    from worker import metrics

    def sample(name):
        return metrics.REGISTRY.get_sample_value(name, {"class": "batch"}) or 0.0

    e2e, untrusted = sample("sluice_end_to_end_seconds_sum"), sample("sluice_untrusted_timestamps_total")
    mem = Memory(partitions=1, engine=Gated(), max_num_seqs=1)
    now_ms = int(time.time() * 1000)
    async with running(mem):
        mem.send("batch", J({"id": "held", "prompt": "hold", "max_tokens": 2}), b"held")
        await asyncio.sleep(0.3)  # holds the engine's only slot (batch's floor is one)
        mem.send("batch", J({"id": "first", "prompt": "x", "max_tokens": 2}), b"first", timestamp_ms=now_ms - 1000)
        mem.send("batch", J({"id": "zero", "prompt": "x", "max_tokens": 2}), b"zero", timestamp_ms=0)
        mem.send("batch", J({"id": "ahead", "prompt": "x", "max_tokens": 2}), b"ahead",
                 timestamp_ms=now_ms + 3_600_000)
        await asyncio.sleep(0.3)  # all three read and waiting
        mem.engine.release.set()
        assert await until(lambda: len(mem.finals()) == 4)
    assert list(mem.finals()) == ["held", "first", "zero", "ahead"]
    assert sample("sluice_untrusted_timestamps_total") - untrusted == 2
    assert sample("sluice_end_to_end_seconds_sum") - e2e < 30  # not 56 years
    produced = {a.id: a.produced_ms for a in mem.audit()}
    assert produced["zero"] == 0 and produced["ahead"] == now_ms + 3_600_000
