"""A `sluice worker` whose group join does not complete exits instead of waiting for ever: a first
join the coordinator holds, and a rejoin the broker stops answering mid-rebalance.

aiokafka's `start` returns once the group has assigned partitions. The embedded broker holds the
first join of a new group for half the rebalance timeout of the member that opened it, so a member
with a 10-minute rebalance timeout holds every join into that group for 5 minutes: the shape of a
coordinator that never completes a join. Before `SLUICE_GROUP_JOIN_S`, a worker joining such a group
stayed not ready, never exiting (so never restarted), and ignored SIGTERM until the join completed.
The engine is the fake one there: what is under test is the Kafka client's join. The last test
loads a real engine: a join begun while it loads (worker/early_join.py)."""

import asyncio
import contextlib
import re
import signal
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer

from tests.integration.helpers import abandon_join, fails_closed_while_broker_stopped, http_get
from tests.integration.test_worker_process import spawn_worker, start_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_held_group_join_ends_the_worker(settings, catalog, model_dir, tmp_path):
    group = f"held-{uuid.uuid4().hex[:6]}"
    holder = AIOKafkaConsumer(catalog.request_topic("batch").name, **settings.kafka.options(), group_id=group,
                              session_timeout_ms=600_000, rebalance_timeout_ms=600_000, heartbeat_interval_ms=3000)
    holding = asyncio.create_task(holder.start())  # its own join is held too: it never returns here
    await asyncio.sleep(1)
    bounded, port, _ = spawn_worker(catalog, model_dir, tmp_path, group=group, log_name="bounded.log",
                                    SLUICE_ENGINE_KIND="fake", SLUICE_GROUP_JOIN_S="6")
    stopped, stopped_port, _ = spawn_worker(catalog, model_dir, tmp_path, group=group, log_name="stopped.log",
                                            SLUICE_ENGINE_KIND="fake")  # the default bound: minutes
    try:
        since = time.monotonic()
        await asyncio.sleep(4)
        assert not holding.done(), "the broker did not hold the join: nothing here is under test"
        assert http_get(stopped_port, "/readyz")[0] == 503 and stopped.poll() is None
        stopped.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        rc = await asyncio.to_thread(stopped.wait, 30)
        assert rc == 0 and time.monotonic() - sigterm_at < 10, "SIGTERM during a held join"

        rc = await asyncio.to_thread(bounded.wait, 40)
        assert rc == 1
        took = time.monotonic() - since
        out = (tmp_path / "bounded.log").read_text()
        assert f"consumer group {group} did not take this worker in within 6 s" in out, out[-2000:]
        assert 6 <= took < 25, took
        assert http_get(port, "/readyz")[0] is None  # gone, not left not-ready
    finally:
        for proc in (bounded, stopped):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        await abandon_join(holder, holding)


async def test_a_rejoin_held_by_a_broker_that_stops_mid_rebalance_fails_the_worker(settings, catalog, model_dir,
                                                                                    tmp_path):
    """A rebalance begins (a second member joins), and the broker stops answering before the worker's
    rejoin completes: its partitions are revoked and none come back. Before, its intake loops, with
    nothing assigned, kept /readyz green; now the rejoin's clock fails it past the bound."""
    proc, port, group = await start_worker(
        catalog, model_dir, tmp_path, SLUICE_ENGINE_KIND="fake", SLUICE_GROUP_JOIN_S="8",
        SLUICE_DRAIN_GRACE_S="2", SLUICE_STOP_MARGIN_S="6")
    joiner = AIOKafkaConsumer(catalog.request_topic("batch").name, **settings.kafka.options(), group_id=group)
    joining = asyncio.create_task(joiner.start())
    try:
        end = time.monotonic() + 30
        while '"out_of_group_s": 0.0' in http_get(port, "/readyz")[1]:  # the worker's rejoin has begun
            assert time.monotonic() < end and not joining.done(), "no rebalance reached the worker"
            await asyncio.sleep(0.05)
        await fails_closed_while_broker_stopped(proc, port, "group rejoin not completed", "SLUICE_GROUP_JOIN_S=8",
                                                within_s=12)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        await abandon_join(joiner, joining)


async def test_a_rebalance_that_completes_stops_the_rejoin_clock(settings, catalog, model_dir, tmp_path):
    """The control on the real broker: the worker's partitions are revoked as a second member joins,
    and assigned again as the rebalance completes, which must stop the rejoin's clock. Were the
    assignment not seen (a Kafka client that does not call the listener after every rejoin), every
    ordinary rebalance would end the worker once the bound had passed."""
    from loadgen.burst import produce

    proc, port, group = await start_worker(catalog, model_dir, tmp_path, SLUICE_ENGINE_KIND="fake",
                                           SLUICE_GROUP_JOIN_S="8")
    joiner = AIOKafkaConsumer(catalog.request_topic("batch").name, **settings.kafka.options(), group_id=group)
    try:
        await joiner.start()  # returns once the rebalance has completed and the joiner has its partitions
        assert joiner.assignment(), "the joiner took no partition: no rebalance to ride out"
        end = time.monotonic() + 20  # past the bound, twice over
        while time.monotonic() < end:
            code, body = http_get(port, "/readyz")
            assert code == 200 and proc.poll() is None, body
            await asyncio.sleep(0.5)
        assert '"out_of_group_s": 0.0' in body, body
        # and it still answers: the standard class's partitions came back to it
        await produce(settings.kafka.options(), [(catalog.request_topic("standard").name, b"k",
                                                  b'{"id": "after-rebalance", "prompt": "x", "max_tokens": 2}', [])])
        end = time.monotonic() + 20
        while not any("request_answered" in line and "after-rebalance" in line
                      for line in (tmp_path / "worker.log").read_text().splitlines()):
            assert time.monotonic() < end, "the request after the rebalance was not answered"
            await asyncio.sleep(0.2)
    finally:
        await joiner.stop()
        proc.kill()
        proc.wait()


def _first_line(log_path, event: str) -> int | None:
    """The index of the worker log's first line for `event` (None when there is none)."""
    lines = log_path.read_text(errors="replace").splitlines()
    return next((i for i, line in enumerate(lines) if re.search(f'"event": ?"{event}"', line)), None)


async def _members(settings, group: str) -> int:
    from aiokafka.admin import AIOKafkaAdminClient

    from worker.early_join import live_members

    admin = AIOKafkaAdminClient(**settings.kafka.options())
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([group])
        return live_members(response)
    finally:
        await admin.close()


async def test_a_worker_joins_while_its_engine_loads_only_once_no_other_member_serves(settings, catalog,
                                                                                       model_dir, tmp_path):
    """A real engine's load (tens of seconds) and the coordinator's hold on a new group's join (about
    5 s here) no longer add up where the group has no one else (worker/early_join.py). While another
    member serves the partitions, the loading worker leaves them to it; once that member has left,
    it joins without waiting for its engine, becomes ready with it, and answers."""
    from loadgen.burst import ReplyReader, produce
    from schemas import DoneReply
    from worker.group_guard import leave_group

    group = f"early-{uuid.uuid4().hex[:6]}"
    holder = AIOKafkaConsumer(catalog.request_topic("standard").name, **settings.kafka.options(), group_id=group)
    await holder.start()
    proc, port, _ = spawn_worker(catalog, model_dir, tmp_path, group=group, SLUICE_LOG_LEVEL="info")
    log = tmp_path / "worker.log"
    try:
        end = time.monotonic() + 120
        while _first_line(log, "group_join_after_loading") is None:
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.5)  # two more looks at the group
        assert _first_line(log, "engine_ready") is None, "the engine loaded before the test could tell"
        assert _first_line(log, "group_joining_while_loading") is None, log.read_text()[-2000:]
        assert await _members(settings, group) == 1  # the holder alone: the loading worker stayed out

        # the embedded broker numbers a new group's first generation 0, from which aiokafka sends no
        # LeaveGroup on stop: the holder leaves explicitly, as a worker's own stop does
        assert await leave_group(settings.kafka.options(), group, holder._coordinator.member_id, 10) == 0
        await holder.stop()

        end = time.monotonic() + 400
        while http_get(port, "/readyz")[0] != 200:
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
            await asyncio.sleep(0.2)
        joined, ready = _first_line(log, "group_joining_while_loading"), _first_line(log, "engine_ready")
        assert joined is not None and ready is not None and joined < ready, log.read_text()[-3000:]

        reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
        await reader.start()
        await produce(settings.kafka.options(), [(catalog.request_topic("standard").name, b"early",
                                                  b'{"id": "early", "prompt": "Hello", "max_tokens": 4}', [])])
        done = None
        end = time.monotonic() + 120
        while done is None and time.monotonic() < end:
            async for r in reader.records():
                if isinstance(r, DoneReply) and r.id == "early":
                    done = r
        await reader.stop()
        assert done is not None and done.usage.completion_tokens > 0, log.read_text()[-2000:]
    finally:
        with contextlib.suppress(Exception):
            await holder.stop()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
