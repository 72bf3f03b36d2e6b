"""Joining the group while the engine loads (worker/early_join.py): how a DescribeGroups answer is
read, and a worker built before its engine, whose join began first, serving once the engine is attached.
The decision against a real coordinator, and a real engine's load: tests/integration/test_group_join.py."""

import asyncio
from types import SimpleNamespace

import pytest

from tests.unit.harness import CATALOG, J, Memory, until
from worker.early_join import live_members
from worker.worker import Worker

MEMBER = ("member-1", "client", "/127.0.0.1", b"", b"")


def described(error_code: int, state: str, members: list):
    return SimpleNamespace(groups=[(error_code, "g", state, "consumer", "range", members)])


@pytest.mark.parametrize("error_code, state, members, expected", [
    (0, "Empty", [], 0),  # a new group, or one whose members all left
    (0, "Dead", [], 0),  # a group the coordinator has removed
    (0, "Stable", [], 0),  # the embedded broker's answer once its last member left
    (0, "Stable", [MEMBER], 1),
    (0, "PreparingRebalance", [MEMBER, MEMBER], 2),  # a rebalance: its members are still there
    (0, "CompletingRebalance", [MEMBER], 1),
    (16, "", [], None),  # NOT_COORDINATOR: cannot say, so the worker joins once loaded
    (30, "", [], None),  # GROUP_AUTHORIZATION_FAILED: these credentials may not describe the group
])
def test_live_members_of_a_describe_groups_answer(error_code, state, members, expected):
    assert live_members(described(error_code, state, members)) == expected


async def test_a_worker_built_before_its_engine_serves_once_attached_with_the_join_begun_first():
    mem = Memory(partitions=1)
    w = Worker(mem.settings, CATALOG, None, **mem.clients())
    assert w.engine is None and w.runner is None
    w.begin_join()  # as `join_when_alone` does while the engine loads
    assert await until(lambda: bool(mem.consumer.assignment()))  # joined before any engine exists
    assert mem.consumer._paused == mem.consumer.assignment()  # and not fetched until it does
    mem.send("standard", J({"id": "early", "prompt": "x", "max_tokens": 3}), b"early")
    w.attach(mem.engine)
    await w.start()
    try:
        assert w.ready and not mem.consumer._paused  # resumed at the start
        assert await until(lambda: "early" in mem.finals())
        assert await until(mem.all_committed)
    finally:
        await w.stop(grace_s=1)
    (done,) = mem.finals()["early"]
    assert done.finish_reason in ("length", "stop") and done.usage.completion_tokens == 3


async def test_a_worker_whose_engine_did_not_load_cancels_a_held_join_and_stops_its_consumer():
    mem = Memory(partitions=1)
    mem.consumer.join_held = asyncio.Event()  # the coordinator holds the join, as a new group's first is
    stops = []
    stop = mem.consumer.stop

    async def counted_stop():
        stops.append(True)
        await stop()

    mem.consumer.stop = counted_stop
    w = Worker(mem.settings, CATALOG, None, **mem.clients())
    w.begin_join()
    await asyncio.sleep(0.05)
    assert not w._joining.done()
    async with asyncio.timeout(5):  # the load failed: the worker exits without waiting for the join
        await w.abandon()
    assert w._joining.cancelled() and stops == [True]
    assert not mem.consumer.assignment()
