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


async def test_lag_is_the_log_end_minus_the_committed_offset_per_class_and_partition():
    from aiokafka import TopicPartition

    from worker import metrics
    from worker.commits import Commits
    from worker.offsets import OffsetTracker

    mem = Memory()
    topic = CATALOG.request_topic("batch").name
    tp = TopicPartition(topic, 1)
    for i in range(5):
        mem.broker.logs[tp].append(None)  # only the log length matters here
    mem.consumer.subscribe([topic])
    await mem.consumer.start()
    tracker = OffsetTracker()
    # A class name of its own: the registry is shared with every worker this process ran before.
    commits = Commits(mem.consumer, tracker, 1, classes={topic: "lag-test"})

    def lag():
        return metrics.REGISTRY.get_sample_value("sluice_consumer_lag_records",
                                                 {"class": "lag-test", "partition": "1"})

    commits.report_lag()
    assert lag() is None  # nothing taken by this worker yet: unknown, not zero
    for off in range(5):
        tracker.take(tp, off)
    commits.report_lag()
    assert lag() == 5  # before its first commit the group stands at the first offset taken
    for off in range(3):
        tracker.finish(tp, off)
    await commits.commit()
    commits.report_lag()
    assert lag() == 2
    for off in (3, 4):
        tracker.finish(tp, off)
    await commits.commit()
    commits.report_lag()
    assert lag() == 0
    await mem.consumer.assign(set())  # revoked: its new owner reports it
    commits.report_lag()
    assert lag() is None


async def test_each_class_slo_is_exported_for_alerts():
    from worker import metrics

    async with running(Memory()):
        for t in CATALOG.requests:
            assert metrics.REGISTRY.get_sample_value("sluice_class_slo_seconds",
                                                     {"class": t.latency_class}) == t.slo_ms / 1000


def test_every_class_has_its_series_at_zero_before_its_first_request():
    from worker import metrics

    metrics.start_series(["zero-test"])  # what a worker does for its classes at start
    labels = {"class": "zero-test"}
    assert metrics.REGISTRY.get_sample_value("sluice_end_to_end_seconds_count", labels) == 0
    assert metrics.REGISTRY.get_sample_value("sluice_requests_completed_total", {**labels, "outcome": "internal"}) == 0
    assert metrics.REGISTRY.get_sample_value("sluice_prefill_tokens_total", {**labels, "source": "redis"}) == 0
