"""What telling the group guard about each request costs the worker's event loop.

    python bench/guard_report.py [--requests 20000] [--per-turn 1] [--reps 3]

A worker tells its group guard each request that enters its engine and each that leaves
(worker/group_guard.py: `run` and `end` lines, through a pipe that never blocks, written once per
turn of the event loop), so that a dead worker's guard can name them and hand them over. This runs
a real guard process and the worker's own `RunReport`, on an event loop that turns `--per-turn`
requests' start and end at a time (1: every line its own write, the worst case), against the same
loop with nothing reported, alternating, and prints the CPU per request each way and the
difference. No broker or Redis: the guard only reads its pipe. Writes bench/guard_report.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402


async def one(report, jobs, per_turn: int) -> float:
    """CPU seconds per request for starting and ending every job, `per_turn` of them per loop turn."""
    started = time.process_time()
    for i in range(0, len(jobs), per_turn):
        batch = jobs[i:i + per_turn]
        for job in batch:
            if report is not None:
                report.started(job)
        await asyncio.sleep(0)  # a turn of the loop: the lines go out together
        for job in batch:
            if report is not None:
                report.ended(job)
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    return (time.process_time() - started) / len(jobs)


async def main(args) -> None:
    from aiokafka import TopicPartition
    from tqdm import tqdm

    from schemas import Request
    from worker.group_guard import GroupGuard
    from worker.runner import Job
    from worker.settings import KafkaSettings
    from worker.worker import RunReport

    guard = GroupGuard()
    guard.start(KafkaSettings(bootstrap="127.0.0.1:9", request_timeout_ms=1000), "bench", 1.0,
                stderr=open("/dev/null", "w"))
    guard.joined("member-1")
    report = RunReport(guard)
    jobs = [Job(Request(id=f"req-{i}", prompt="x"), "standard", 1, "sluice.replies",
                TopicPartition("sluice.requests.standard", i % 6), i, 0, owner=f"host:1:abcdef01#{i}")
            for i in range(args.requests)]
    runs: dict[str, list[float]] = {"reported": [], "not reported": []}
    try:
        for _ in tqdm(range(args.reps), desc="repetitions", unit="rep"):
            for arm in runs:
                runs[arm].append(await one(report if arm == "reported" else None, jobs, args.per_turn))
    finally:
        guard.close()
    med = {arm: statistics.median(v) * 1e6 for arm, v in runs.items()}
    print(f"{args.requests} requests, {args.per_turn} per loop turn, {args.reps} repetitions alternating; "
          f"{common.machine()}; {common.today()}; rev {common.git_rev()}")
    for arm, v in runs.items():
        print(f"{arm:13s} {med[arm]:6.2f} us CPU per request [{min(v) * 1e6:.2f}-{max(v) * 1e6:.2f}]")
    print(f"reporting start and end to the guard: {med['reported'] - med['not reported']:.2f} us per request")
    out = {"args": vars(args), "us_per_request": {arm: [x * 1e6 for x in v] for arm, v in runs.items()},
           "added_us": med["reported"] - med["not reported"], "machine": common.machine(),
           "date": common.today(), "rev": common.git_rev()}
    (ROOT / "bench" / "guard_report.json").write_text(json.dumps(out, indent=1) + "\n")
    print("wrote bench/guard_report.json")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--per-turn", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    asyncio.run(main(p.parse_args()))
