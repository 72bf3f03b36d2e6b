"""The handoff (worker/handoff.py) over the in-memory doubles: a dead worker's running request,
handed over before its partition comes here, is claimed only from the dead run, continues from its
stored progress, finishes no offset here, and becomes the record's when the partition comes (or is
fenced by the run that claims it elsewhere). The real engine, Redis and broker: the handoff test of
tests/integration/test_chaos.py."""

import asyncio

from aiokafka import TopicPartition

from schemas import DoneReply, TokenReply
from tests.unit.harness import CATALOG, J, Memory, running, until
from worker import metrics
from worker.fake_engine import FakeEngine
from worker.handoff import runs_of

STANDARD = CATALOG.request_topic("standard").name
DEAD = "dead-host:1:abc#7"


class RecordReader:
    """The handoff's group-less consumer over the in-memory broker: aiokafka's assign, seek, pause, getmany."""

    def __init__(self, broker):
        self.broker, self.assigned, self.position, self.paused = broker, set(), {}, set()

    async def start(self):
        pass

    async def stop(self):
        pass

    def assign(self, tps):
        self.assigned, self.paused = set(tps), set()

    def seek(self, tp, offset):
        self.position[tp] = offset

    def pause(self, *tps):
        self.paused.update(tps)

    async def getmany(self, *tps, timeout_ms=0):
        got = {}
        for tp in tps or self.assigned:
            if tp in self.assigned and tp not in self.paused:
                records = self.broker.logs.get(tp, [])[self.position[tp]:]
                if records:
                    got[tp] = records
                    self.position[tp] += len(records)
        if not got:
            await asyncio.sleep(timeout_ms / 1000)
        return got


def dead_worker_s_request(mem: Memory, rid: str, partition: int = 1, emitted: int = 3) -> dict:
    """A streamed request on `partition`, claimed by the dead run with `emitted` tokens stored: its `run` line."""
    rec = mem.broker.append(STANDARD, J({"id": rid, "prompt": "a b c d e", "max_tokens": 12, "stream": True}),
                            partition=partition)
    mem.answers.owners[f"default:{rid}"] = DEAD
    for seq in range(emitted):
        mem.answers.progress.setdefault(f"default:{rid}", {})[seq] = ([1000 + seq], f"t{seq} ")
    return {"owner": DEAD, "id": rid, "tenant": "default", "cls": "standard", "topic": STANDARD,
            "partition": partition, "offset": rec.offset}


def others(partition: int = 1) -> set:
    """Every partition this worker reads but the dead worker's."""
    return {TopicPartition(t.name, p) for t in CATALOG.requests for p in range(2)} - {TopicPartition(STANDARD, partition)}


def handoff(mem: Memory, worker):
    worker.handoff._consumer_factory = lambda: RecordReader(mem.broker)
    return worker.handoff


def stream_of(mem: Memory, rid: str) -> tuple[dict[int, str], list]:
    seqs: dict[int, str] = {}
    for r in mem.tokens():
        if r.id == rid:
            assert seqs.setdefault(r.seq, r.text) == r.text
    return seqs, mem.finals().get(rid, [])


def counted(outcome: str) -> float:
    return metrics.handoff.labels(outcome)._value.get()


async def test_a_handed_over_request_continues_here_without_finishing_an_offset():
    mem = Memory(engine=FakeEngine(token_delay_s=0.01), group_handoff=True)
    async with running(mem) as w:
        await mem.consumer.assign(others())  # the dead worker's partition has not come here
        run = dead_worker_s_request(mem, "h1")
        before = counted("adopted")
        await handoff(mem, w).take([run], None)
        assert counted("adopted") == before + 1
        assert mem.answers.owners["default:h1"] != DEAD  # claimed from the dead run
        assert await until(lambda: stream_of(mem, "h1")[1])
        seqs, finals = stream_of(mem, "h1")
        done = finals[0]
        assert isinstance(done, DoneReply) and done.resumed and len(finals) == 1
        assert sorted(seqs) == list(range(done.seq)) and [seqs[s] for s in range(3)] == ["t0 ", "t1 ", "t2 "]
        assert "".join(seqs[s] for s in range(done.seq)) == done.text
        assert TopicPartition(STANDARD, 1) not in mem.broker.committed  # not this worker's offset
        assert not w.dispatch.handed_over  # forgotten once answered


async def test_the_partition_coming_here_makes_the_handed_over_run_the_record_s():
    """The rebalance gives this worker the partition while the handed-over run goes on: the record,
    read again, joins that run (one resume, one `done`), and its offset is committed once answered."""
    mem = Memory(engine=FakeEngine(token_delay_s=0.05), group_handoff=True)
    async with running(mem) as w:
        await mem.consumer.assign(others())
        run = dead_worker_s_request(mem, "h2")
        await handoff(mem, w).take([run], None)
        assert await until(lambda: len(stream_of(mem, "h2")[0]) > 4)  # generating here
        landed = counted("landed")
        await mem.consumer.assign(others() | {TopicPartition(STANDARD, 1)})  # the rebalance
        assert await until(lambda: counted("landed") == landed + 1)
        assert await until(lambda: stream_of(mem, "h2")[1] and mem.all_committed())
        seqs, finals = stream_of(mem, "h2")
        assert len(finals) == 1 and finals[0].resumed and sorted(seqs) == list(range(finals[0].seq))
        assert mem.broker.committed[TopicPartition(STANDARD, 1)] == 1
        assert mem.engine.started.count("h2@1:0#1") == 1  # run once here: the record started nothing new


async def test_a_handed_over_run_is_fenced_by_a_claim_taken_elsewhere():
    """Another worker was given the partition and claimed the request: the run here stops without a `done`."""
    mem = Memory(engine=FakeEngine(token_delay_s=0.05), group_handoff=True)
    async with running(mem) as w:
        await mem.consumer.assign(others())
        run = dead_worker_s_request(mem, "h3")
        fenced = metrics.fenced._value.get()
        await handoff(mem, w).take([run], None)
        assert await until(lambda: len(stream_of(mem, "h3")[0]) > 4)
        mem.answers.owners["default:h3"] = "elsewhere:2:def#0"
        assert await until(lambda: metrics.fenced._value.get() == fenced + 1)
        await asyncio.sleep(0.2)
        assert not stream_of(mem, "h3")[1]  # the other run answers it
        assert TopicPartition(STANDARD, 1) not in mem.broker.committed
        assert not w.dispatch.handed_over


async def test_only_a_request_the_dead_run_still_holds_is_adopted():
    mem = Memory(engine=FakeEngine(), group_handoff=True)
    async with running(mem) as w:
        await mem.consumer.assign(others())
        answered = dead_worker_s_request(mem, "h4")
        mem.answers.answers["default:h4"] = b"stored"
        taken = dead_worker_s_request(mem, "h5")
        mem.answers.owners["default:h5"] = "survivor:3:aaa#1"
        gone = dict(dead_worker_s_request(mem, "h6"), offset=99)  # its record cannot be read
        other_class = dict(dead_worker_s_request(mem, "h7"), topic="sluice.requests.elsewhere")
        counts = {o: counted(o) for o in ("adopted", "answered", "taken", "failed")}
        await handoff(mem, w).take([answered, taken, gone, other_class], None)
        assert {o: counted(o) - counts[o] for o in counts} == {"adopted": 0, "answered": 1, "taken": 1, "failed": 1}
        await asyncio.sleep(0.1)
        assert not mem.finals() and not [r for r in mem.tokens() if r.id in ("h4", "h5", "h6", "h7")]
        assert mem.answers.owners["default:h5"] == "survivor:3:aaa#1"


def test_runs_of_reads_only_whole_entries():
    good = {"owner": "a#1", "id": "r", "tenant": "t", "topic": "x", "partition": 0, "offset": 1}
    assert runs_of({b"runs": J([good, {"id": "no owner"}, 7]), b"at": b"12.5"}) == ([good], 12.5)
    assert runs_of({b"runs": b"not json"}) == ([], None)
    assert runs_of({b"runs": J({"a": 1})}) == ([], None)
    assert runs_of({}) == ([], None)
