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
