"""Time the worker did not run is taken out of its health bounds (`worker/supervisor.py: unseen`)."""

import pytest
from aiokafka.structs import TopicPartition

from worker.commits import Commits
from worker.emitter import Emitter
from worker.fetch_watch import FetchWatch
from worker.offsets import OffsetTracker
from worker.supervisor import Liveness, unseen

NOW, LATE = 1000.0, 150.0  # the monitor woke at 1000 s, 150 s late: the worker stopped at about 850 s


@pytest.mark.parametrize("at, expected", [
    (840.0, 990.0),  # 10 s before the pause: 10 s before now
    (849.5, 999.5),  # just before it
    (851.0, 1000.0),  # a tick into it (the stop came after the tick was due): never past now
    (999.8, 999.8),  # taken since the worker woke (an intake poll that ran before the monitor): kept
    (1000.0, 1000.0),
    (None, None),  # no wait under way
])
def test_stamps_before_the_pause_move_on_by_its_length_and_later_ones_stay(at, expected):
    assert unseen(LATE, NOW)(at) == expected


def test_every_wait_of_the_liveness_record_is_discounted():
    liveness = Liveness(["realtime", "batch"])
    liveness.engine_progress = 845.0
    liveness.polls = {"realtime": 849.0, "batch": 999.9}
    liveness.out_of_group_since = 800.0
    liveness.broker_answered_at = 849.0
    liveness.broker_unanswered("no answer within 2 s")
    liveness.discount(unseen(LATE, NOW))
    assert liveness.engine_progress == 995.0
    assert liveness.polls == {"realtime": 999.0, "batch": 999.9}
    assert liveness.out_of_group_since == 950.0  # 50 s outside its group before the pause, 50 s now
    assert liveness.broker_outage_for(NOW) == pytest.approx(1.0)


def test_a_fetch_wait_counts_only_the_time_the_worker_ran():
    first, second = TopicPartition("t", 0), TopicPartition("t", 1)
    marks = {first: 1, second: 7}
    watch = FetchWatch(lambda: marks)
    watch.sample(840.0)  # both begin waiting; neither is answered again
    watch.discount(unseen(LATE, NOW))
    watch.sample(NOW)
    assert watch.longest(NOW) == pytest.approx(10.0)
    marks[second] = 8  # answered since the worker woke
    watch.sample(NOW + 1)
    assert watch.waiting(NOW + 1, 10.5) == ["t[0]"]


def test_the_reply_and_commit_outages_count_only_the_time_the_worker_ran():
    emitter = Emitter(producer=None, dlq_topic="sluice.dlq")
    commits = Commits(consumer=None, tracker=OffsetTracker(), interval_s=1.0)
    emitter.failing_since, commits.waiting_since = 840.0, 999.9  # one began before the pause, one since
    emitter.discount(unseen(LATE, NOW))
    commits.discount(unseen(LATE, NOW))
    assert (emitter.failing_since, commits.waiting_since) == (990.0, 999.9)
    emitter.failing_since = commits.waiting_since = None  # no outage under way: none begun by the discount
    emitter.discount(unseen(LATE, NOW))
    commits.discount(unseen(LATE, NOW))
    assert (emitter.failing_since, commits.waiting_since) == (None, None)
