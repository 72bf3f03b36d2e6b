"""Two workers in one group; one is killed with SIGKILL mid-stream. Nothing is lost, nothing differs.

Every request still gets exactly one `done` after dropping repeated (id, seq); seqs
are gapless; each text equals an uninterrupted greedy run of the same prompt; the
surviving worker continued the dead one's requests from their progress, loading
the prefix's KV pages from Redis instead of recomputing them.
"""

import asyncio
import json
import uuid
from datetime import datetime

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
    # its guard named the streams it was running, each of which resumed on the survivor (so did the
    # survivor's own: a rebalance revokes every partition, and aborts their runs)
    named = set(named_by_guard(run.victim_log))
    assert named and named <= set(resumed), (named, resumed)
    assert "handoff_adopted" not in run.survivor_log  # the handoff is off by default
    assert metric(run.survivor_metrics, "sluice_requests_resumed_total") >= len(resumed)
    assert metric(run.survivor_metrics, "sluice_prefill_tokens_total", source="redis") > 0, run.survivor_metrics[-2000:]
    # the same prompts, uninterrupted, on another engine: the same text
    for rid, text in prompts.items():
        ref = []
        async for d in engine.generate(f"ref-{rid}", engine.prompt_ids(Request(id=rid, prompt=text)),
                                       GenParams(MAX_TOKENS), 0):
            ref.append(d.text)
        assert "".join(ref) == run.finals[rid][0].text, rid


def named_by_guard(victim_log: str) -> list[str]:
    lines = [json.loads(line) for line in victim_log.splitlines() if '"worker_died_running"' in line]
    assert len(lines) == 1, victim_log[-2000:]
    return [r["id"] for r in lines[0]["running"]]


def logged(log: str, event: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{") and f'"{event}"' in line]


def stamp(line: dict) -> float:
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


async def test_with_the_handoff_a_dead_worker_s_streams_go_on_before_the_group_moves_them(
        settings, catalog, engine, model_dir, tmp_path):
    """SLUICE_GROUP_HANDOFF: the SIGKILLed worker's guard hands its running streams over through Redis;
    the survivor claims each from the dead run and continues it before the rebalance gives it the
    partitions. When they come, it makes a run still going the record's (`handoff_landed`), or sends
    a finished one's `done` again from its stored answer: never a second resume. The streams are as
    whole, and their texts as an uninterrupted run's, as without the handoff."""
    tag = uuid.uuid4().hex[:6]
    ids = spread_ids(f"handoff-{tag}", N, catalog.request_topic("standard").partitions)
    prompts = {rid: prompt(k) for k, rid in enumerate(ids)}
    async def rebalanced(send, collect):
        """With the streams done, until the survivor has read each handed-over record again (the
        rebalance may come after the handed-over runs finished: the embedded broker holds it)."""
        victim_log, survivor_log = tmp_path / "victim.log", tmp_path / "survivor.log"
        end = asyncio.get_running_loop().time() + 90
        while asyncio.get_running_loop().time() < end:
            if '"worker_died_running"' in victim_log.read_text():
                named = set(named_by_guard(victim_log.read_text()))
                seen = {line["request_id"] for event in ("handoff_landed", "duplicate_answered_from_store")
                        for line in logged(survivor_log.read_text(), event)}
                if named <= seen:
                    return
            await asyncio.sleep(0.5)

    run = await kill_mid_stream(settings, catalog, tmp_path, model_dir, prompts, MAX_TOKENS,
                                extra_env={"SLUICE_GROUP_HANDOFF": "true"}, after=rebalanced)
    assert_one_stream_each(run, prompts)  # a second `done` of a request is the same as its first
    # (the survivor's own streams resume too: a rebalance revokes every partition, and aborts their runs)
    resumed = sorted(rid for rid in prompts if run.finals[rid][0].resumed)
    named = sorted(named_by_guard(run.victim_log))
    assert named and set(named) <= set(resumed), (named, resumed)
    handed = logged(run.victim_log, "handed_over")
    assert len(handed) == 1 and handed[0]["requests"] == len(named), run.victim_log[-2000:]
    adopted = logged(run.survivor_log, "handoff_adopted")
    assert sorted(a["request_id"] for a in adopted) == named, run.survivor_log[-3000:]
    assigned_at = run.killed_at + seconds_to_takeover(run)
    assert all(run.killed_at < stamp(a) < assigned_at for a in adopted), (run.killed_at, assigned_at, adopted)
    # resumed once each, at the adoption, before the partitions came
    resumes = [r for r in logged(run.survivor_log, "request_resumed") if r["request_id"] in named]
    assert sorted(r["request_id"] for r in resumes) == named and all(stamp(r) < assigned_at for r in resumes)
    landed = {a["request_id"] for a in logged(run.survivor_log, "handoff_landed")}
    again = {a["request_id"] for a in logged(run.survivor_log, "duplicate_answered_from_store")}
    assert landed | again == set(named) and not landed & again, (landed, again)
    # (a `done` sent again from the store may come after the reader stopped: at most one more)
    assert all(1 <= len(run.finals[rid]) <= 1 + (rid in again) for rid in named), {r: len(run.finals[r]) for r in named}
    assert metric(run.survivor_metrics, "sluice_handoff_total", outcome="adopted") == len(named)
    for rid in named:  # the same prompts, uninterrupted: the same text
        ref = []
        async for d in engine.generate(f"ref-{rid}", engine.prompt_ids(Request(id=rid, prompt=prompts[rid])),
                                       GenParams(MAX_TOKENS), 0):
            ref.append(d.text)
        assert "".join(ref) == run.finals[rid][0].text, rid
