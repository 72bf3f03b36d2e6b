"""The fetch watch: how long the partitions a worker would read now have waited for a fetch answer."""

import pytest
from aiokafka.structs import TopicPartition

from worker.fetch_watch import FetchWatch

A, B = TopicPartition("sluice.requests.realtime", 0), TopicPartition("sluice.requests.batch", 3)


def watched(samples):
    """A watch fed `samples`: [(time, {partition: mark})], one per monitor tick."""
    feed = iter(samples)
    current = {}

    def marks():
        return current

    watch = FetchWatch(marks)
    for now, seen in feed:
        current = seen
        watch.sample(now)
    return watch


@pytest.mark.parametrize("samples, now, longest", [
    pytest.param([], 10.0, 0.0, id="nothing assigned"),
    pytest.param([(0.0, {A: 1}), (5.0, {A: 2}), (10.0, {A: 3})], 10.0, 0.0, id="answered every tick"),
    pytest.param([(0.0, {A: 1}), (5.0, {A: 1}), (10.0, {A: 1})], 10.0, 10.0, id="no answer since the first tick"),
    pytest.param([(0.0, {A: None}), (10.0, {A: None})], 12.0, 12.0, id="never answered: counted from the first tick"),
    pytest.param([(0.0, {A: 1}), (4.0, {A: 2}), (10.0, {A: 2})], 10.0, 6.0, id="counted from the last answer"),
    pytest.param([(0.0, {A: 1}), (5.0, {}), (10.0, {A: 1})], 10.0, 0.0,
                 id="paused or holding records meanwhile: its wait starts again"),
    pytest.param([(0.0, {A: 1, B: 7}), (10.0, {A: 2, B: 7})], 10.0, 10.0, id="the longest of several"),
    pytest.param([(0.0, {A: 1, B: 7}), (10.0, {A: 2})], 10.0, 0.0, id="a revoked partition is forgotten"),
])
def test_longest_wait(samples, now, longest):
    assert watched(samples).longest(now) == longest


def test_waits_forgotten_while_no_broker_answers_count_afresh():
    watch = watched([(0.0, {A: 1}), (10.0, {A: 1})])
    watch.forget()
    assert watch.longest(10.0) == 0.0
    watch.sample(12.0)
    assert watch.longest(15.0) == 3.0


def test_the_partitions_past_a_bound_are_named_longest_first():
    watch = watched([(0.0, {A: 1, B: 1}), (3.0, {A: 1, B: 2}), (9.0, {A: 1, B: 2})])
    assert watch.waiting(9.0, 5.0) == ["sluice.requests.realtime[0]", "sluice.requests.batch[3]"]
    assert watch.waiting(9.0, 7.0) == ["sluice.requests.realtime[0]"]
    assert watch.waiting(9.0, 10.0) == []
