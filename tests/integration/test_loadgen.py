"""`sluice loadgen` against the embedded stack and a worker on the real engine."""

import json

import pytest

from loadgen.run import run, write_reports
from loadgen.workload import Workload
from tests.integration.helpers import running_worker

pytestmark = pytest.mark.integration


async def test_loadgen_run_writes_three_reports(settings, catalog, engine, group_id, tmp_path):
    workload = Workload(rate=4, seconds=3, arrival="fixed", max_tokens=(4, 8), seed=1)
    async with running_worker(settings, catalog, engine, group_id=group_id):
        timings = await run(settings.kafka.options(), catalog, workload, drain_s=120, show_progress=False)
    summary = write_reports(timings, workload, tmp_path)
    assert len(timings) == 11  # fixed arrivals at 0.25 s steps below 3 s
    assert summary["all"]["completed"] == 11 and summary["all"]["errors"] == 0
    for t in timings:
        assert t.sent <= t.first_token <= t.done and 1 <= t.completion_tokens <= 8
    report = json.loads((tmp_path / "loadgen.json").read_text())
    assert report["summary"]["all"]["e2e_s"]["p50"] > 0
    assert (tmp_path / "loadgen.png").stat().st_size > 1000
    assert "| all | 11 |" in (tmp_path / "loadgen.md").read_text()


async def test_a_record_on_the_reply_topic_that_is_no_reply_is_skipped_by_every_reader(settings, catalog):
    """The reply topic is shared: a record another writer put there (or a reply type a newer version
    adds) used to raise out of the reader under loadgen, the demo and every backfill, whose replies
    then went unread."""
    import msgspec

    from loadgen.burst import ReplyReader, produce
    from schemas import DoneReply, Usage

    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    await reader.start()
    try:
        done = msgspec.json.encode(DoneReply("r-1", 0, "", "stop", Usage(1, 0)))
        await produce(settings.kafka.options(), [(catalog.replies.name, b"x", value, []) for value in
                                                 (b"not a reply", b'{"type":"summary","id":"r-0"}', b"", done)])
        got = []
        for _ in range(50):
            got += [r async for r in reader.records(timeout_ms=100)]
            if got:
                break
    finally:
        await reader.stop()
    assert [r.id for r in got] == ["r-1"] and isinstance(got[0], DoneReply)
    assert reader.unreadable == 3
