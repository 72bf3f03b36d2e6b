"""A worker keeps nothing of a request once it is answered and committed.

A long-running worker answers millions of requests; anything it keeps per request (a task, a job,
a tenant's count, a pending offset) grows its memory until the OOM killer ends it. After a mixed
load (three classes, streaming and not, duplicates, malformed records, deadlines passed) has been
answered and committed, no request's bookkeeping is left and no `Job` is alive: not even the last
batch an intake loop read, or the last job admitted (an idle worker held those, with their
prompts, until its next fetch). `bench/soak.py` measures the same of `sluice worker` from outside:
its resident memory across hundreds of thousands of requests.
"""

import gc
import time

from tests.unit.harness import J, Memory, running, until
from worker.fake_engine import FakeEngine
from worker.runner import Job


def _live_jobs() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is Job]


async def test_nothing_of_an_answered_request_is_kept():
    mem = Memory(partitions=3, engine=FakeEngine(token_delay_s=0.001, tokens_per_delta=2))
    sent = set()
    passed = int(time.time() * 1000) - 1000
    for i in range(300):
        cls = ("realtime", "standard", "batch")[i % 3]
        body = {"id": f"r{i}", "prompt": f"amount {i} USD", "max_tokens": 8 if cls == "batch" else 4,
                "stream": i % 2 == 0}
        if i % 25 == 0:
            body["deadline_ms"] = passed  # answered deadline_exceeded without running
        mem.send(cls, J(body), f"r{i}".encode())
        sent.add(f"r{i}")
        if i % 30 == 0:
            mem.send(cls, J(body), f"r{i}".encode())  # a duplicate: answered from the stored answer
        if i % 40 == 0:
            mem.send(cls, b"{not json", f"bad{i}".encode())  # dead-lettered or answered invalid_request
    async with running(mem) as w:
        assert await until(lambda: sent <= set(mem.finals()) and mem.all_committed(), timeout=60), \
            f"{len(sent - set(mem.finals()))} unanswered"
        d = w.dispatch
        assert await until(lambda: not d.tasks, timeout=5), f"{len(d.tasks)} finished tasks still held"
        assert not d.engine_jobs and not d.scheduler.waiting() and not d.scheduler.running()
        assert not d._live, f"tenants still counted in flight: {d._live}"
        for tp in w.consumer.assignment():
            assert w.tracker.pending(tp) == 0, tp
        assert not _live_jobs(), f"{len(_live_jobs())} jobs still alive"
