"""10,000 generated records through intake: each ends as exactly one final reply or dead letter,
every partition's watermark passes it, and the worker stays healthy."""

import asyncio
import threading

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadgen.chaos import fuzz
from tests.unit.harness import CATALOG, Memory, until
from worker import metrics
from worker.worker import Worker

records = fuzz.records


class _Running:
    """One worker over the doubles, on a loop of its own thread, shared by every example:
    hypothesis calls the test synchronously, and starting a worker per example would cost more
    than the records. Intake windows are zero so that each example settles in milliseconds."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.mem = Memory(partitions=2)
        catalog = CATALOG.__class__([msgspec.structs.replace(t, window_ms=0) for t in CATALOG.topic])
        self.worker = Worker(self.mem.settings, catalog, self.mem.engine, **self.mem.clients())
        self.scanned: dict = {}
        self.finals = 0
        self.call(self.worker.start())

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def ended(self) -> int:
        """Records that ended so far: final replies on any topic, dead letters (read incrementally), and
        runs fenced by a later record with the same id (that one answers the id)."""
        for tp, log in list(self.mem.broker.logs.items()):
            if tp.topic in REQUEST_TOPICS or tp.topic == CATALOG.audit.name:
                continue
            seen = self.scanned.get(tp, 0)
            for rec in log[seen:]:
                self.finals += tp.topic == CATALOG.dlq.name or not rec.value.startswith(b'{"type":"token"')
            self.scanned[tp] = len(log)
        return self.finals + int(metrics.fenced._value.get())

    async def send(self, batch) -> None:
        for cls, key, value, headers in batch:
            self.mem.send(cls, value, key, headers)


REQUEST_TOPICS = {t.name for t in CATALOG.requests}
_worker: _Running | None = None


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(records(), min_size=10, max_size=10))
def test_ten_thousand_generated_records_each_end_once(batch):
    global _worker
    if _worker is None:
        _worker = _Running()
    w = _worker
    before = w.call(_count(w))
    w.call(w.send(batch))
    assert w.call(until(w.mem.all_committed, timeout=30)), w.mem.broker.committed
    assert w.worker.ready and w.worker.supervisor.failure is None, w.worker.supervisor.failure
    assert w.call(until(lambda: w.ended() == before + len(batch), timeout=5)), (w.ended() - before, batch)


async def _count(w: _Running) -> int:
    return w.ended()


def teardown_module():
    if _worker is not None:
        _worker.call(_worker.worker.stop(grace_s=1))
        _worker.loop.call_soon_threadsafe(_worker.loop.stop)
