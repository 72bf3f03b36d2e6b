"""A `sluice worker` process that dies leaves its consumer group at once (worker/group_guard.py).

Real broker, real worker processes; the engine is the fake one because the guard has nothing to
do with the engine (tests/integration/test_chaos.py checks the same with the real engine and
model). The survivor is a plain aiokafka consumer in the worker's group, so the time it takes to
hold every partition is the broker's and the guard's, not a second worker's start-up.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from bench.takeover import seconds_until_all, worker_and_survivor

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SESSION_MS = 10000  # the default


async def _worker_and_survivor(settings, catalog, tmp_path, launcher=(), **env_extra):
    return await worker_and_survivor(settings.kafka.options(), catalog, tmp_path, SESSION_MS, 1000, launcher,
                                     **env_extra)


def _guard_lines(worker_log: str) -> list[str]:
    return [line for line in worker_log.splitlines() if '"group_left_for_dead_worker"' in line]


async def _kill_and_time(settings, catalog, tmp_path, **env_extra) -> float:
    """SIGKILL the worker's process group; seconds until the survivor holds every partition."""
    proc, survivor, partitions = await _worker_and_survivor(settings, catalog, tmp_path, **env_extra)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return await seconds_until_all(survivor, partitions, 60)
    finally:
        await survivor.stop()


async def test_a_killed_worker_leaves_its_group_before_its_session_timeout(settings, catalog, tmp_path):
    took = await _kill_and_time(settings, catalog, tmp_path)
    worker_log = (tmp_path / "worker.log").read_text()
    left = _guard_lines(worker_log)
    assert left and '"error_code": 0' in left[-1], worker_log[-2000:]
    # without the guard the coordinator waits out the session timeout first (the control below)
    assert took < SESSION_MS / 1000, took


async def test_without_the_guard_the_survivor_waits_out_the_session_timeout(settings, catalog, tmp_path):
    """The control: the same kill with SLUICE_GROUP_LEAVE_ON_DEATH=false."""
    took = await _kill_and_time(settings, catalog, tmp_path, SLUICE_GROUP_LEAVE_ON_DEATH="false")
    assert not _guard_lines((tmp_path / "worker.log").read_text())
    assert took >= SESSION_MS / 1000, took


def _guards_of(pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(pid), "-f", "worker.group_guard"], capture_output=True,
                          text=True).stdout.split()


def _last_generation(worker_log: str) -> int | None:
    lines = [json.loads(line) for line in worker_log.splitlines() if '"partitions_assigned"' in line]
    return lines[-1].get("generation") if lines else None


async def test_a_clean_stop_stands_the_guard_down(settings, catalog, tmp_path):
    """A drained worker leaves the group itself and its guard stands down. When both members joined
    in the group's first generation, which the embedded broker numbers 0, aiokafka's own LeaveGroup
    is skipped and the worker sends it (`group_left`); either way the survivor takes over before
    the session timeout."""
    proc, survivor, partitions = await _worker_and_survivor(settings, catalog, tmp_path)
    try:
        guards = _guards_of(proc.pid)  # this worker's
        assert guards, "no guard process is running beside the worker"
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 60)
        took = await seconds_until_all(survivor, partitions, 60)
    finally:
        await survivor.stop()
    worker_log = (tmp_path / "worker.log").read_text()
    assert rc == 0, worker_log[-2000:]
    assert not _guard_lines(worker_log)  # the consumer left the group itself; the guard had nothing to do
    if _last_generation(worker_log) == 0:
        assert '"group_left"' in worker_log, worker_log[-2000:]
    assert took < SESSION_MS / 1000, (took, _last_generation(worker_log))
    still = [pid for pid in guards if os.path.exists(f"/proc/{pid}")]
    assert not still, f"guard processes outlived a clean stop: {still}"



async def test_a_guard_killed_under_a_running_worker_is_started_again_and_still_covers_it(settings, catalog,
                                                                                         tmp_path):
    """The guard SIGKILLed while the worker runs (the OOM killer, a stray `pkill`): the worker starts
    another within seconds, and its own death later still takes it out of the group at once."""
    proc, survivor, partitions = await _worker_and_survivor(settings, catalog, tmp_path)
    try:
        first = _guards_of(proc.pid)
        assert len(first) == 1, first
        os.kill(int(first[0]), signal.SIGKILL)
        end = asyncio.get_running_loop().time() + 10
        while (now := _guards_of(proc.pid)) in ([], first) and asyncio.get_running_loop().time() < end:
            await survivor.getmany(timeout_ms=100)
        assert len(now) == 1 and now != first, (first, now)
        await asyncio.sleep(1)  # the new guard has read its settings and member id
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        took = await seconds_until_all(survivor, partitions, 60)
    finally:
        if proc.poll() is None:  # a failed check must not leave the worker running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        await survivor.stop()
    worker_log = (tmp_path / "worker.log").read_text()
    restarted = [json.loads(line) for line in worker_log.splitlines() if '"guard_restarted"' in line]
    assert [r["guard"] for r in restarted] == ["group"] and restarted[0]["pid"] == int(now[0]), worker_log[-2000:]
    left = _guard_lines(worker_log)
    assert left and '"error_code": 0' in left[-1], worker_log[-2000:]
    assert took < SESSION_MS / 1000, took

async def test_under_the_images_init_a_killed_worker_still_leaves_its_group(settings, catalog, tmp_path):
    """The image starts `python -m worker.container_init sluice worker`: the worker is the init's
    child, and the init waits for the guard before it exits with the worker's status."""
    init = (sys.executable, "-m", "worker.container_init")
    proc, survivor, partitions = await _worker_and_survivor(settings, catalog, tmp_path, launcher=init)
    try:
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        assert len(children) == 1, children  # the worker; its guards live in sessions of their own
        os.kill(int(children[0]), signal.SIGKILL)  # the worker alone, not its init
        took = await seconds_until_all(survivor, partitions, 60)
        rc = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
        await survivor.stop()
    worker_log = (tmp_path / "worker.log").read_text()
    assert _guard_lines(worker_log), worker_log[-2000:]
    assert took < SESSION_MS / 1000, took
    assert rc == 128 + signal.SIGKILL  # the worker's status, as a shell would report it


async def test_a_killed_worker_s_guard_names_the_requests_it_was_running(settings, catalog, tmp_path):
    """Streams in the engine when the worker is SIGKILLed: its guard's `worker_died_running` names each
    one, with the record it came from, and none of the survivor's partitions."""
    from aiokafka import AIOKafkaProducer

    proc, survivor, partitions = await _worker_and_survivor(settings, catalog, tmp_path, SLUICE_FAKE_TOKEN_MS="100")
    topic = catalog.request_topic("standard").name
    sent: dict[int, tuple[str, int]] = {}  # partition -> (request id, offset)
    try:
        theirs = {tp.partition for tp in survivor.assignment()}
        producer = AIOKafkaProducer(**settings.kafka.options())
        await producer.start()
        try:
            for partition in range(partitions):
                rid = f"named-{partition}-{uuid.uuid4().hex[:6]}"
                meta = await producer.send_and_wait(topic, json.dumps(
                    {"id": rid, "prompt": "hello", "max_tokens": 400, "stream": True}).encode(), partition=partition)
                sent[partition] = (rid, meta.offset)
        finally:
            await producer.stop()
        await asyncio.sleep(4)  # the worker reads them and streams (400 tokens at 100 ms each: 40 s)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        end = asyncio.get_running_loop().time() + 20
        while '"worker_died_running"' not in (tmp_path / "worker.log").read_text():
            assert asyncio.get_running_loop().time() < end, (tmp_path / "worker.log").read_text()[-2000:]
            await survivor.getmany(timeout_ms=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        await survivor.stop()
    worker_log = (tmp_path / "worker.log").read_text()
    died = [json.loads(line) for line in worker_log.splitlines() if '"worker_died_running"' in line]
    assert len(died) == 1, worker_log[-2000:]
    named = {(run["id"], run["topic"], run["partition"], run["offset"]) for run in died[0]["running"]}
    mine = {(rid, topic, p, offset) for p, (rid, offset) in sent.items() if p not in theirs}
    assert mine and named == mine, (named, mine, theirs)
    assert all(run["owner"] and run["tenant"] == "default" and run["cls"] == "standard" for run in died[0]["running"])
