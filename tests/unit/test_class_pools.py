"""Class-dedicated pools: a worker with SLUICE_CLASSES consumes only those classes' request topics."""

import pytest

from tests.unit.harness import CATALOG, J, Memory, running, until


async def test_a_realtime_pool_worker_leaves_other_classes_to_their_pool():
    mem = Memory(classes="realtime")
    for cls in ("realtime", "standard", "batch"):
        mem.send(cls, J({"id": f"{cls}-1", "prompt": "hello", "max_tokens": 3}))
    async with running(mem) as w:
        assert {t.latency_class for t in w.catalog.requests} == {"realtime"}
        assert await until(lambda: "realtime-1" in mem.finals())
        assert set(w.liveness.polls) == {"realtime"}  # health watches only the intake loops it runs
    assert set(mem.finals()) == {"realtime-1"}  # the others wait, uncommitted, for their own pool
    standard = [tp for tp in mem.broker.logs if tp.topic == CATALOG.request_topic("standard").name]
    assert standard and all(mem.broker.committed.get(tp) in (None, 0) for tp in standard)


def test_a_pool_for_a_class_the_topics_file_lacks_is_refused():
    one_class = CATALOG.serving(["batch"])
    assert [t.latency_class for t in one_class.requests] == ["batch"]
    assert one_class.replies == CATALOG.replies and one_class.dlq == CATALOG.dlq
    with pytest.raises(ValueError, match="no request topic for class realtime"):
        one_class.serving(["realtime"])
