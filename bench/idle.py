"""What an idle worker costs: the CPU of a `sluice worker` process with nothing to do, and what it
adds to the broker's and the Redis Cluster's, against the same services with no worker at all.

    python bench/idle.py [--fetch-max-wait-ms 50,500] [--reps 3] [--seconds 30] [--engine fake]

Each repetition measures, in rotated order, the stack alone (the reference) and one worker per
fetch wait, started on fresh topics and left `--settle-s` to join its group before the window.
Prints cores used (CPU seconds per second; median [min-max]) and what each worker adds over the
reference. `--engine vllm` starts the real engine (its idle threads count in the worker's row).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import msgspec
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common, harness  # noqa: E402

OUT = Path(__file__).resolve().parent


async def window(seconds: float, pid: int | None) -> dict[str, float]:
    """Cores used over `seconds` by the worker process (and its children) and by the services."""
    def sample():
        own = harness.cpu_seconds(pid) if pid is not None else {}
        return {**{f"worker {k}": v for k, v in own.items()}, **harness.service_cpu_seconds()}

    before, t0 = sample(), time.monotonic()
    await asyncio.sleep(seconds)
    after, span = sample(), time.monotonic() - t0
    return {k: (after[k] - before[k]) / span for k in before}


async def measure(s, arm: str, args) -> dict[str, float]:
    if arm == "stack alone":
        return await window(args.seconds, None)
    env = {"SLUICE_KAFKA_FETCH_MAX_WAIT_MS": arm.split()[-1].removesuffix("ms"), "SLUICE_ENGINE_KIND": args.engine}
    procs: list = []
    async with common.worker_process(s, "idle", OUT / ".idle-worker.log", procs, **env):
        await asyncio.sleep(args.settle_s)
        return await window(args.seconds, procs[0].pid)


async def main(args) -> None:
    s = common.settings()
    waits = [int(w) for w in args.fetch_max_wait_ms.split(",")]
    arms = ["stack alone"] + [f"worker fetch wait {w}ms" for w in waits]
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    orders = list(harness.orders(arms, args.reps))
    with tqdm(total=len(orders) * len(arms), desc="idle windows", unit="window") as bar:
        for order in orders:
            for arm in order:
                runs[arm].append(await measure(s, arm, args))
                bar.update(1)
    keys = sorted({k for rs in runs.values() for r in rs for k in r})
    summary = {a: {k: harness.spread([r[k] for r in rs]) for k in keys if k in rs[0]} for a, rs in runs.items()}
    added = {a: {k: harness.spread([r[k] - ref[k] for r, ref in zip(runs[a], runs["stack alone"])])
                 for k in ("broker", "redis")} for a in arms[1:]}
    print(f"\nidle for {args.seconds:g} s after {args.settle_s:g} s to settle, engine {args.engine}, {args.reps} "
          f"repetitions in rotated order; {common.machine()}; {common.today()}; rev {common.git_rev()}")
    print("cores used (CPU seconds per second), median [min-max]:")
    for arm, row in summary.items():
        print(f"  {arm:26s} " + "  ".join(f"{k} {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]"
                                           for k, v in row.items()))
    print("added over the stack alone, in the same repetition:")
    for arm, row in added.items():
        print(f"  {arm:26s} " + "  ".join(f"{k} {v['median']:+.3f} [{v['min']:+.3f}-{v['max']:+.3f}]"
                                           for k, v in row.items()))
    out = OUT / "idle.json"
    out.write_text(msgspec.json.format(msgspec.json.encode(
        {"args": vars(args), "runs": runs, "summary": summary, "added": added, "machine": common.machine(),
         "date": common.today(), "rev": common.git_rev()}), indent=2).decode())
    print(f"wrote {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fetch-max-wait-ms", default="50,500")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--settle-s", type=float, default=5)
    p.add_argument("--engine", choices=["fake", "vllm"], default="fake")
    asyncio.run(main(p.parse_args()))
