"""Does a worker's memory stay flat while it answers requests for a long time?

    python bench/soak.py [--rounds 25] [--requests 20000] [--engine fake|vllm] [--out soak]

One `sluice worker` on fresh topics (the fake engine by default: the worker's own memory, not a
model's). Each round publishes N standard requests (half of them streaming, 4 tokens each), waits
until the worker's group has committed every one, then reads the worker process's resident memory
(VmRSS, /proc), and that of the processes below it (vLLM's engine core, where the KV connector
runs). Prints MiB per round and the growth over the second half of the rounds per 100,000
requests (the first rounds fill caches and pools that then stay), and the requests answered and
committed per second over the rounds; writes bench/soak.json and bench/soak.png (`--out`).

A worker that keeps something per request grows without end and is OOM-killed after days: before
the fake engine's request-id lists were bounded, a fake-engine worker grew about 80 bytes a request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from loadgen.burst import produce  # noqa: E402
from worker.engine_guard import resident_bytes, resident_bytes_below  # noqa: E402

HERE = Path(__file__).resolve().parent


def rss_mib(pid: int) -> float:
    return resident_bytes(pid) / 2**20


def below_mib(pid: int) -> float:
    """Resident memory of every process below `pid` (vLLM's engine core, its forkserver), as the
    worker's sluice_engine_processes_resident_bytes reads it."""
    return resident_bytes_below(pid) / 2**20


def growth_per_100k(points: list[tuple[int, float]]) -> float:
    """MiB per 100,000 requests over the second half of the rounds (least squares)."""
    half = points[len(points) // 2:]
    if len(half) < 2:
        return 0.0
    xs, ys = [p[0] for p in half], [p[1] for p in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var * 100_000


async def committed(probe: AIOKafkaConsumer, tps: list[TopicPartition]) -> int:
    return sum([(await probe.committed(tp)) or 0 for tp in tps])


async def soak(args) -> dict:
    s = common.settings()
    group = f"soak-{uuid.uuid4().hex[:6]}"
    procs: list = []
    env = {"SLUICE_GROUP_ID": group, "SLUICE_CLASSES": "standard", "SLUICE_LOG_LEVEL": "warning"}
    if args.engine == "fake":
        env["SLUICE_ENGINE_KIND"] = "fake"
    points: list[tuple[int, float]] = []
    engine_points: list[tuple[int, float]] = []
    round_seconds: list[float] = []  # publish to committed, each round
    async with common.worker_process(s, "soak", HERE / ".soak-worker.log", procs, **env) as cat:
        pid = procs[0].pid
        topic = cat.request_topic("standard").name
        probe = AIOKafkaConsumer(**s.kafka.options(), group_id=group, enable_auto_commit=False)
        await probe.start()
        try:
            tps = [TopicPartition(topic, p) for p in sorted(probe.partitions_for_topic(topic) or ())]
            if not tps:
                await probe._client.force_metadata_update()
                tps = [TopicPartition(topic, p) for p in sorted(probe.partitions_for_topic(topic) or ())]
            points.append((0, rss_mib(pid)))
            engine_points.append((0, below_mib(pid)))
            total = args.rounds * args.requests
            with tqdm(total=total, desc="soak", unit="req", mininterval=2) as bar:
                for r in range(args.rounds):
                    round_started = time.perf_counter()
                    tag = uuid.uuid4().hex[:6]
                    items = [(topic, f"{tag}-{i}".encode(), msgspec.json.encode(
                        {"id": f"{tag}-{i}", "prompt": f"amount {i} USD, merchant grocery", "max_tokens": 4,
                         "stream": i % 2 == 0}), []) for i in range(args.requests)]
                    for k in range(0, len(items), 5000):
                        await produce(s.kafka.options(), items[k:k + 5000])
                    want = (r + 1) * args.requests
                    while (done := await committed(probe, tps)) < want:
                        if procs[0].poll() is not None:
                            raise RuntimeError(f"the worker exited ({procs[0].returncode}) in round {r}")
                        bar.update(done - bar.n)  # redrawn at most every mininterval
                        await asyncio.sleep(0.2)
                    bar.update(want - bar.n)
                    round_seconds.append(time.perf_counter() - round_started)
                    points.append((want, rss_mib(pid)))
                    engine_points.append((want, below_mib(pid)))
                    bar.set_postfix(rss_mib=f"{points[-1][1]:.0f}")
        finally:
            await probe.stop()
    return {"points": points, "growth_mib_per_100k": growth_per_100k(points), "round_seconds": round_seconds,
            "requests_per_s": args.rounds * args.requests / sum(round_seconds),
            "onednn_cache_capacity": s.engine.onednn_cache_capacity,
            "engine_points": engine_points, "engine_growth_mib_per_100k": growth_per_100k(engine_points)}


def plot(points: list[tuple[int, float]], path: Path, title: str, below: list[tuple[int, float]] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([p[0] / 1000 for p in points], [p[1] for p in points], marker="o", label="worker")
    if any(mib for _, mib in below):
        ax.plot([p[0] / 1000 for p in below], [p[1] for p in below], marker="s", label="processes below it (engine)")
        ax.legend(fontsize=8)
    ax.set_xlabel("requests answered and committed (thousands)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--engine", choices=["fake", "vllm"], default="fake")
    ap.add_argument("--out", default="soak", help="bench/OUT.json and bench/OUT.png")
    args = ap.parse_args()
    started = time.time()
    out = asyncio.run(soak(args))
    head = (f"{args.rounds} rounds x {args.requests} requests, {args.engine} engine\n{common.machine()}; "
            f"{common.today()}; rev {common.git_rev()}")
    print(head)
    print("  requests   worker MiB   processes below it (the engine's) MiB")
    for (n, mib), (_, below) in zip(out["points"], out["engine_points"]):
        print(f"  {n:>9,}  {mib:9.1f}  {below:9.1f}")
    print(f"growth over the second half, per 100,000 requests: worker {out['growth_mib_per_100k']:+.2f} MiB, "
          f"processes below it {out['engine_growth_mib_per_100k']:+.2f} MiB")
    capacity = out["onednn_cache_capacity"]
    print(f"answered and committed {out['requests_per_s']:,.1f} requests/s over the rounds "
          f"(oneDNN primitive cache: {'its default' if capacity is None else capacity})")
    record = {"command": " ".join(sys.argv), "machine": common.machine(), "date": common.today(),
              "rev": common.git_rev(), "engine": args.engine, "seconds": round(time.time() - started, 1), **out}
    (HERE / f"{args.out}.json").write_text(json.dumps(record, indent=1))
    plot(out["points"], HERE / f"{args.out}.png", head, out["engine_points"])
    print(f"wrote {HERE / args.out}.json, .png")


if __name__ == "__main__":
    main()
