"""A broker killed and started again under a running worker, mid-stream: every request is answered,
its streamed tokens gapless, and every offset committed; the worker stays ready throughout.

The broker is a second Tansu that keeps its logs in S3 storage (tests/integration/durable_broker.py),
so that it comes back with its topics, records and committed offsets as a Kafka broker restarted
on its own disks does. The engine is the session's real one. In the runs here the engine finished
the streams while the broker was down; their token records waited in the producer and went out
once it was back, and the restarted broker kept the group's membership (no rebalance). The test
does not require either: a rebalance, or tokens sent while the broker is down, would pass too."""

import asyncio
import time
import uuid

import pytest

import topics
from loadgen.burst import run_burst
from schemas import DoneReply
from tests.integration.durable_broker import DurableBroker
from tests.integration.helpers import committed_offsets, free_port, running_worker
from topics.admin import apply

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def durable_broker():
    broker = DurableBroker(free_port(), free_port())
    try:
        await broker.start_storage()
        await broker.start()
        yield broker
    finally:
        broker.stop()


# how long the broker stays dead: shorter than the group's session timeout (10 s), and longer, so that
# the coordinator may drop the worker's membership; both within the worker's outage bounds (120 s)
@pytest.mark.parametrize("down_s", [3.0, 15.0])
async def test_a_broker_killed_and_started_again_mid_stream_loses_nothing(settings, engine, durable_broker, down_s):
    s = settings.override(kafka_bootstrap=durable_broker.bootstrap)
    catalog = topics.load().renamed(f"br{uuid.uuid4().hex[:6]}.")
    await apply(s.kafka.options(), catalog)
    group = f"g-{uuid.uuid4().hex[:6]}"
    run = uuid.uuid4().hex[:6]  # answers are stored by id: each run's ids are new
    requests = [("standard", {"id": f"restart-{run}-{i}", "prompt": f"Count from {i} to 1000: {i}, {i + 1},",
                              "max_tokens": 160}) for i in range(6)]
    restart: dict = {}

    async def kill_and_start_again() -> None:
        durable_broker.kill()
        restart["killed_at"] = time.monotonic()
        await asyncio.sleep(down_s)
        await durable_broker.start()
        restart["back_at"] = time.monotonic()

    def on_token(reply) -> None:
        if reply.seq >= 3 and "task" not in restart:  # streams are under way
            restart["task"] = asyncio.get_running_loop().create_task(kill_and_start_again())

    async with running_worker(s, catalog, engine, group_id=group) as worker:
        out = await run_burst(s.kafka.options(), catalog, requests, timeout_s=240, on_token=on_token)
        assert "task" in restart, "no token streamed: the broker was never restarted"
        await restart["task"]
        ready, failure = worker.ready, worker.supervisor.failure
        request_topic = catalog.request_topic("standard").name
        end = time.monotonic() + 30  # the worker commits within its commit interval once answers are sent
        while sum((await committed_offsets(s, group, {request_topic})).values()) < len(requests):
            assert time.monotonic() < end, await committed_offsets(s, group, {request_topic})
            await asyncio.sleep(0.5)

    assert ready and failure is None, failure
    unanswered = {rid: o.problems for rid, o in out.items() if not isinstance(o.final, DoneReply)}
    assert not unanswered, unanswered
    # a `done` sent but not yet committed when the broker died is read again and answered again from
    # its stored answer (the contract is at least once per record); a token repeated with other text,
    # a gap, or a `done` that is not what its tokens say, would be a problem
    problems = {rid: [p for p in o.problems if p != "second final reply"] for rid, o in out.items()}
    assert not any(problems.values()), problems
    spanning = [rid for rid, o in out.items() if o.first_token_at < restart["killed_at"] and o.done_at > restart["back_at"]]
    assert spanning, "no stream ran across the restart: nothing here is under test"
    for o in out.values():
        assert o.text == o.final.text and o.final.usage.completion_tokens > 0
