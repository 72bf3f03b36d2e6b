"""Backfill bounds: offsets and ISO times, and a clear error for anything else."""

from datetime import datetime, timezone

import pytest

from worker.backfill import Job
from worker.backfill_range import RangeError, parse_bound


@pytest.mark.parametrize("text,want", [
    (None, None), ("", None), ("start", None), ("end", None), ("0", 0), ("1200", 1200),
    ("2026-11-01T00:00:00Z", datetime(2026, 11, 1, tzinfo=timezone.utc)),
    ("2026-11-01T02:00:00+02:00", datetime(2026, 11, 1, tzinfo=timezone.utc)),
    ("2026-11-01", datetime(2026, 11, 1, tzinfo=timezone.utc)),  # no zone: UTC
])
def test_bounds(text, want):
    assert parse_bound(text) == want


@pytest.mark.parametrize("text", ["-5", "yesterday", "12abc", "2026-13-01"])
def test_bad_bounds_say_what_is_accepted(text):
    with pytest.raises(RangeError, match="offset nor an ISO-8601 time"):
        parse_bound(text)


def test_job_id_is_stable_and_follows_the_arguments():
    a = Job(source="events", out="scored", template="fraud", start="0")
    assert a.id == Job(source="events", out="scored", template="fraud", start="0").id
    assert a.id != Job(source="events", out="scored", template="fraud", start="1").id
    assert Job(source="events", out="scored", template="fraud", name="june").id == "june"


@pytest.mark.parametrize("out,why", [
    ("sluice.replies", "a topic of the workers"),           # results would pose as replies
    ("sluice.requests.batch", "a topic of the workers"),    # ... or be read as requests
    ("payments.tx", "the source"),
])
def test_results_never_go_to_the_workers_topics_or_the_source(out, why):
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "worker.cli", "backfill", "--source", "payments.tx", "--out", out,
                        "--template", "fraud"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SLUICE_KAFKA_BOOTSTRAP": "127.0.0.1:1"})  # refused before connecting
    assert r.returncode == 1 and f"--out {out} is {why}" in r.stderr, r.stderr


def test_a_broker_that_cannot_be_reached_is_one_line_naming_it(tmp_path):
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "worker.cli", "backfill", "--source", "payments.tx", "--out", "res.x",
                        "--template", "fraud", "--state-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "SLUICE_KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    assert r.returncode == 1 and "sluice backfill: Kafka at 127.0.0.1:1: KafkaConnectionError" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Unclosed" not in r.stderr


def test_the_output_topic_is_as_durable_as_the_source():
    from worker.backfill import out_topic

    def described(*replica_counts):
        return {"topic": "events", "partitions": [{"partition": i, "replicas": list(range(n))}
                                                  for i, n in enumerate(replica_counts)]}

    topic = out_topic("scored", 6, described(3, 3, 3))
    assert (topic.name, topic.num_partitions, topic.replication_factor) == ("scored", 6, 3)
    assert out_topic("scored", 2, described(3, 6)).replication_factor == 3  # a partition being moved
    assert out_topic("scored", 1, described()).replication_factor == 1


async def test_a_second_run_of_a_job_over_the_same_checkpoint_is_refused_until_the_first_ends(tmp_path):
    """Refused before anything is read (the broker here cannot be reached); the lock goes with the
    process that held it, so a killed run leaves nothing to clean up."""
    import os
    import subprocess
    import sys

    import topics
    from worker.backfill import Backfill, Job, JobRunning, hold_job_lock
    from worker.settings import load

    job = Job(source="events", out="scored", template="fraud")
    settings = load(environ={"SLUICE_KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    second = Backfill(settings, topics.load(), job, state_dir=tmp_path)
    held = hold_job_lock(second.path.with_suffix(".lock"), job.id)
    with pytest.raises(JobRunning, match=f"job {job.id} is already running"):
        await second.run()
    os.close(held)
    # another process holding it, then killed: the next run may take it
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR);"
                               " fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(second.path.with_suffix(".lock"))], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(JobRunning):
        await second.run()
    holder.kill()
    holder.wait()
    os.close(hold_job_lock(second.path.with_suffix(".lock"), job.id))


@pytest.mark.parametrize("start,stop", [("20", "10"), ("2026-12-01T00:00:00Z", "2026-11-01T00:00:00+01:00")])
def test_a_range_that_ends_before_it_starts_is_refused_before_anything_is_read(start, stop, tmp_path):
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "worker.cli", "backfill", "--source", "payments.tx", "--out", "res.x",
                        "--template", "fraud", "--from", start, "--to", stop, "--state-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "SLUICE_KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    assert r.returncode == 1 and f"--from {start} is after --to {stop}" in r.stderr, r.stderr


@pytest.mark.parametrize("at,begin,end,range_end,goes_to", [
    (10, 40, 100, 200, 40),   # retention removed 10-39 before the job read them: on from the log start
    (10, 250, 300, 200, 250),  # removed past the range's end: the partition has nothing left to read
    (10, 11, 100, 200, 11),
])
def test_a_position_below_the_source_goes_on_from_its_start_never_from_its_end(at, begin, end, range_end, goes_to):
    from worker.backfill_range import past_the_source

    assert past_the_source(0, at, begin, end, range_end) == goes_to


def test_a_source_that_ends_below_the_job_was_created_again_and_stops_it():
    from worker.backfill_range import SourceChanged, past_the_source

    with pytest.raises(SourceChanged, match="created again"):
        past_the_source(3, 150, 0, 20, 200)
