"""Committed requests are not run again; a repeated id gets the stored answer, not a second run."""

import asyncio

import re

import msgspec
import pytest

from loadgen.burst import ReplyReader, make_requests, run_burst
from schemas import DoneReply
from tests.integration.helpers import committed_offsets, running_worker
from topics.admin import apply
from worker import metrics

pytestmark = pytest.mark.integration


async def _collect(reader, seconds):
    out = []
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end:
        async for r in reader.records():
            out.append(r)
    return out


async def test_restarted_worker_skips_committed_requests(settings, catalog, engine, group_id):
    requests = make_requests(9, seed=3, prefix="r", max_tokens=4)
    async with running_worker(settings, catalog, engine, group_id=group_id):
        first = await run_burst(settings.kafka.options(), catalog, requests, timeout_s=120)
    assert all(isinstance(o.final, DoneReply) for o in first.values())
    names = {t.name for t in catalog.requests}
    committed = await committed_offsets(settings, group_id, names)
    assert sum(committed.values()) == len(requests)

    completed = metrics.requests_completed.labels("realtime", "length")._value.get()
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    try:
        async with running_worker(settings, catalog, engine, group_id=group_id):
            again = await _collect(reader, 6)
    finally:
        await reader.stop()
    assert again == [], f"restarted worker answered committed requests again: {again[:3]}"
    assert metrics.requests_completed.labels("realtime", "length")._value.get() == completed


async def test_repeated_id_gets_the_stored_answer(settings, catalog, engine, group_id):
    body = {"id": "same-id", "prompt": "The sky is", "max_tokens": 6}
    # The repeat asks for its replies on a topic of its own, so nothing of the first run is read there.
    other = msgspec.structs.replace(catalog.replies, name=catalog.replies.name + ".again")
    again = msgspec.structs.replace(catalog, topic=[other if t.role == "replies" else t for t in catalog.topic])
    await apply(settings.kafka.options(), again)
    # a reply_to other than the default reply topic must be allowed (SLUICE_TENANCY_REPLY_TO)
    async with running_worker(settings, catalog, engine, group_id=group_id,
                              tenancy_reply_to=re.escape(other.name)) as w:
        first = await run_burst(settings.kafka.options(), catalog, [("batch", body)], timeout_s=60)
        assert await w.answers.ping(), "Redis Cluster should be reachable in this test"
        await w.answers.flush()  # answers are written in the background
        dup_before = metrics.duplicates.labels("batch")._value.get()
        second = await run_burst(settings.kafka.options(), again, [("batch", {**body, "reply_to": other.name})],
                                 timeout_s=60)
    a, b = first["same-id"], second["same-id"]
    assert isinstance(a.final, DoneReply) and a.tokens
    assert b.final == a.final  # identical done, re-sent from Redis
    assert b.tokens == {}  # nothing regenerated
    assert metrics.duplicates.labels("batch")._value.get() == dup_before + 1
