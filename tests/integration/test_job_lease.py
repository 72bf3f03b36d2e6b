"""A backfill job's lease in the real Redis Cluster: one run at a time on any machine, a killed run's
lease ending on its own, and a run that can no longer be sure of its lease writing nothing more."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import msgspec
import pytest

from loadgen.burst import produce
from loadgen.events import transactions
from schemas import DoneReply, Usage
from schemas.codec import ReplyCodec
from tests.integration.helpers import prefixed_topics_file, read_topic
from tests.integration.test_backfill import create_topic, read_all
from worker import job_lease
from worker.job_lease import JobLease, LeaseHeld, LeaseLost, lease_key

pytestmark = pytest.mark.integration


async def test_one_holder_at_a_time_and_a_killed_holders_lease_ends_on_its_own(settings):
    client = await job_lease.connect(settings.redis)
    key = lease_key(settings.redis.key_prefix, f"t-{uuid.uuid4().hex[:8]}")
    try:
        first = JobLease(client, key, "job", lease_s=2)
        await first.acquire()
        second, told = JobLease(client, key, "job", lease_s=2), []
        # the first renews: held all the while the second waits, and the refusal names it
        with pytest.raises(LeaseHeld, match=re.escape(first.holder)):
            await second.acquire(wait_s=3, waiting=told.append)
        assert told == [first.holder]
        first._task.cancel()  # killed: no more renewals, nothing released
        t0 = time.monotonic()
        await second.acquire()
        assert 0.5 < time.monotonic() - t0 < 4, "taken once the killed holder's lease ended, not before"
        # the first wakes: it may not write, cannot renew, and its release leaves the second's lease alone
        with pytest.raises(LeaseLost, match="not renewed within"):
            first.check()
        assert not await first.renew()
        await first.release()
        assert (await client.get(key)).decode() == second.holder
        second.check()
        # a lease taken from under its holder (its own lease ran out while it was cut off): found at the renewal
        await client.set(key, b"another run", px=2000)
        assert not await second.renew() and second.lost == "another run took its lease"
        await second.release()
        assert await client.get(key) == b"another run"
        # a lease that vanished (a failover lost it) is lost too, and not taken again: a run elsewhere
        # may have held it in between
        third = JobLease(client, key, "job", lease_s=2)
        await client.delete(key)
        await third.acquire()
        await client.delete(key)
        assert not await third.renew() and "gone from Redis" in third.lost
        assert await client.get(key) is None
    finally:
        await client.delete(key)
        await client.aclose()


async def test_a_run_that_cannot_renew_writes_no_result_after_its_lease_ends(settings, catalog, tmp_path):
    """An answer that comes after the lease's end is not written, although the run has not yet been told
    the lease is lost: a run elsewhere may hold it by then and write that result itself."""
    from worker.backfill import Backfill, Job

    prefix = catalog.replies.name[: -len("sluice.replies")]
    source, out = f"{prefix}lease-src", f"{prefix}lease-out"
    await create_topic(settings, source, 1)
    event = transactions(1, seed=5)[0]
    await produce(settings.kafka.options(), [(source, b"e", msgspec.json.encode(event), [])]
                  + [(source, b"x", b"{not json", [])] * 3)
    job = Job(source=source, out=out, template="fraud")
    bf = Backfill(settings, catalog, job, state_dir=tmp_path, max_in_flight=1, lease_s=2, log=lambda *_: None)
    run = asyncio.create_task(bf.run())
    # the event's request is out: the run holds the lease and waits for its answer (no worker here); the
    # three records after it wait for its slot
    await read_topic(settings.kafka.options(), catalog.request_topic("batch").name, 1, timeout_s=60)
    assert bf.lease is not None and not run.done()
    bf.lease._task.cancel()  # renewals stop getting through (a connection that hangs), and no one says so
    await asyncio.sleep(2.2)  # past the lease
    assert bf.lease.lost is None
    done = DoneReply(f"{job.id}-0-0", 0, "", "scored", Usage(20, 1), scores={"legit": 0.9, "fraud": 0.1})
    await produce(settings.kafka.options(), [(catalog.replies.name, done.id.encode(), ReplyCodec().encode(done), [])])
    with pytest.raises(LeaseLost, match="not renewed within"):
        await asyncio.wait_for(run, 30)
    assert await read_all(settings, out) == []


@pytest.mark.slow
async def test_a_second_machines_run_is_refused_and_a_paused_run_that_wakes_stops(settings, catalog, tmp_path):
    """Real processes, each with its own checkpoint directory as on two machines; no worker answers,
    so each run holds the job while it waits."""
    from worker.backfill import Job

    prefix = catalog.replies.name[: -len("sluice.replies")]
    source, out = f"{prefix}lease-cli-src", f"{prefix}lease-cli-out"
    await create_topic(settings, source, 1)
    await produce(settings.kafka.options(), [(source, e["id"].encode(), msgspec.json.encode(e), [])
                                             for e in transactions(3, seed=6)])
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(prefixed_topics_file(catalog, tmp_path / "topics.toml")),
           "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_LOG_LEVEL": "warning",
           "SLUICE_REDIS_KEY_PREFIX": settings.redis.key_prefix}
    key = lease_key(settings.redis.key_prefix, Job(source=source, out=out, template="fraud").id)

    def start(where: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "worker.cli", "backfill", "--source", source, "--out", out,
                                 "--template", "fraud", "--state-dir", str(tmp_path / where), "--lease-s", "3"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    client = await job_lease.connect(settings.redis)
    procs = []
    try:
        first = start("a")
        procs.append(first)
        for _ in range(600):
            holder = await client.get(key)
            if holder:
                break
            assert first.poll() is None, first.stdout.read()
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the first run did not take the job's lease")
        assert f"pid {first.pid} " in holder.decode()

        second = start("b")
        procs.append(second)
        output, _ = await asyncio.to_thread(second.communicate, timeout=60)
        assert second.returncode == 1 and "is running elsewhere" in output and f"pid {first.pid} " in output, output
        assert "waiting for the job's lease" in output

        first.send_signal(signal.SIGSTOP)  # paused past its lease: a run elsewhere takes the job
        third = start("c")
        procs.append(third)
        for _ in range(200):
            holder = await client.get(key)
            if holder and f"pid {third.pid} " in holder.decode():
                break
            assert third.poll() is None, third.stdout.read()
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the paused run's lease did not pass to the new run")
        first.send_signal(signal.SIGCONT)  # it wakes, finds its lease gone, and stops with one line
        output, _ = await asyncio.to_thread(first.communicate, timeout=60)
        assert first.returncode == 1 and "stopped writing results" in output, output
        assert f"pid {third.pid} " in (await client.get(key)).decode(), "the woken run left the new run's lease alone"

        third.send_signal(signal.SIGTERM)  # stops and releases: the job can be taken at once
        await asyncio.to_thread(third.communicate, timeout=60)
        assert third.returncode == 130 and await client.get(key) is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
        await client.delete(key)
        await client.aclose()
    assert await read_all(settings, out) == []
