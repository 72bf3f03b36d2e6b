"""Two workers in one group; one is killed with SIGKILL mid-stream. Nothing is lost, nothing differs.

Every request still gets exactly one `done` after dropping repeated (id, seq); seqs
are gapless; each text equals an uninterrupted greedy run of the same prompt; the
surviving worker continued the dead one's requests from their progress, loading
the prefix's KV pages from Redis instead of recomputing them.
"""

import uuid

import pytest

from schemas import Request
from tests.integration.helpers import metric
from tests.integration.kill_resume import assert_one_stream_each, kill_mid_stream, seconds_to_takeover, spread_ids
from worker.engine import GenParams

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N, MAX_TOKENS = 6, 160


def prompt(k: int) -> str:
    return (f"Inventory log {k}. Each line lists an item number and its shelf. " +
            " ".join(f"Item {k * 100 + i} is on shelf {(k + i) % 9}." for i in range(14)) +
            f" Now count upward by ones starting at {k * 1000}: {k * 1000}, {k * 1000 + 1}, {k * 1000 + 2},")


async def test_sigkill_mid_stream_loses_and_changes_nothing(settings, catalog, engine, model_dir, tmp_path):
    tag = uuid.uuid4().hex[:6]
    ids = spread_ids(f"chaos-{tag}", N, catalog.request_topic("standard").partitions)
    prompts = {rid: prompt(k) for k, rid in enumerate(ids)}
    run = await kill_mid_stream(settings, catalog, tmp_path, model_dir, prompts, MAX_TOKENS)
    assert not run.orphaned_engine_procs
    # its guard took it out of the group: the coordinator accepted the LeaveGroup (how much sooner the
    # partitions move is timed in test_group_guard.py, where the survivor is a plain consumer)
    left = [line for line in run.victim_log.splitlines() if '"group_left_for_dead_worker"' in line]
    assert left and '"error_code": 0' in left[-1], run.victim_log[-2000:]
    assert seconds_to_takeover(run) is not None, run.survivor_log[-2000:]
    assert_one_stream_each(run, prompts)
    resumed = [rid for rid in prompts if run.finals[rid][0].resumed]
    assert resumed, "no request was on the killed worker"
    assert metric(run.survivor_metrics, "sluice_requests_resumed_total") >= len(resumed)
    assert metric(run.survivor_metrics, "sluice_prefill_tokens_total", source="redis") > 0, run.survivor_metrics[-2000:]
    # the same prompts, uninterrupted, on another engine: the same text
    for rid, text in prompts.items():
        ref = []
        async for d in engine.generate(f"ref-{rid}", engine.prompt_ids(Request(id=rid, prompt=text)),
                                       GenParams(MAX_TOKENS), 0):
            ref.append(d.text)
        assert "".join(ref) == run.finals[rid][0].text, rid
