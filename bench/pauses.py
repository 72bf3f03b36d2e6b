"""Tail latency at a steady request rate, with the worker's start-up heap frozen and thawed.

    python bench/pauses.py [--rate 800] [--seconds 20] [--reps 2] [--token-ms 1] [--max-tokens 4]

What full garbage collections cost a stream's latency when a worker serves hundreds of requests a
second. Two arms in one run, rotated, on the engine stand-in of bench/overhead.py (the bundled
model's tokenizer, `--token-ms` per token, streamed requests):

  frozen  the worker as it runs: `Worker.start` freezes its start-up heap (worker/worker.py)
  thawed  the same worker with that heap thawed right after its start (`gc.unfreeze()`), as every
          worker ran before the freeze: each full collection walks the start-up objects again

Requests come from a separate process at `--rate` for `--seconds`, so the publisher's pace does not
stop when the worker's process does. Latency is read afterwards off the records' own timestamps:
the request's (set by the publisher) to its first token record's and to its `done`'s (set by the
worker's producer), in milliseconds. Prints p50 / p99 / p99.9 / max per arm (median over the
repetitions, [min-max]), the full collections in the window and how many of the worker's health
monitor ticks came more than 0.1 s late (`sluice_event_loop_lag_seconds`); plots e2e latency over each
arm's last run (bench/pauses.png). A short run before them, not counted, takes the process's first
calls (new topics' metadata, the tokenizer's first use).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common, harness  # noqa: E402
from bench.overhead import FullCollections, TokenizingFakeEngine, until_committed  # noqa: E402
from loadgen.burst import percentile, read_topic  # noqa: E402
from worker import metrics  # noqa: E402
from worker.worker import Worker  # noqa: E402

OUT = Path(__file__).resolve().parent
ARMS = ["frozen", "thawed"]
QUANTILES = (50, 99, 99.9, 100)


async def publish_steadily(topic: str, rate: float, seconds: float, tag: str, max_tokens: int) -> None:
    """(The publisher process.) `rate` streamed requests a second for `seconds`, sent every 10 ms."""
    from aiokafka import AIOKafkaProducer

    s = common.settings()
    producer = AIOKafkaProducer(**s.kafka.options(), linger_ms=2)
    await producer.start()
    try:
        total, sent, start = int(rate * seconds), 0, time.monotonic()
        while sent < total:
            due = min(total, int((time.monotonic() - start) * rate) + 1)
            for i in range(sent, due):
                rid = f"{tag}-{i}"
                await producer.send(topic, msgspec.json.encode(
                    {"id": rid, "prompt": f"amount {i} USD, merchant grocery, country DE", "max_tokens": max_tokens,
                     "stream": True}), key=rid.encode())
            sent = due
            await asyncio.sleep(0.01)
        await producer.flush()
    finally:
        await producer.stop()


def latencies(requests: list, replies: list) -> dict[str, tuple[float, float | None, float | None]]:
    """Per request id: (published at, ms; first token record - published, ms; done - published, ms),
    from the records' timestamps. None where that reply is missing."""
    published = {r.key.decode(): r.timestamp for r in requests}
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    for r in replies:
        reply = msgspec.json.decode(r.value)
        rid = reply.get("id")
        if rid not in published:
            continue
        if reply.get("type") == "token" and reply.get("seq") == 0:
            first[rid] = min(first.get(rid, r.timestamp), r.timestamp)
        elif reply.get("type") == "done":
            done[rid] = min(done.get(rid, r.timestamp), r.timestamp)
    return {rid: (at, first[rid] - at if rid in first else None, done[rid] - at if rid in done else None)
            for rid, at in published.items()}


def summary(lat: dict) -> dict:
    """Percentiles of time to first token and end to end (ms), and how many requests had no `done`."""
    ttft = [v[1] for v in lat.values() if v[1] is not None]
    e2e = [v[2] for v in lat.values() if v[2] is not None]
    return {"requests": len(lat), "without_done": sum(v[2] is None for v in lat.values()),
            "ttft_ms": {str(q): percentile(ttft, q) for q in QUANTILES},
            "e2e_ms": {str(q): percentile(e2e, q) for q in QUANTILES}}


def latency_row(results: list[dict]) -> dict:
    """An arm's repetitions (each a `summary`) as median and spread per quantile, and its missing `done`s."""
    return {"without_done": sum(r["without_done"] for r in results),
            **{what: {q: harness.spread([r[what][q] for r in results]) for q in map(str, QUANTILES)}
               for what in ("ttft_ms", "e2e_ms")}}


def print_latency(row: dict, quantiles=("50", "99", "99.9")) -> None:
    for what, name in (("ttft_ms", "first token"), ("e2e_ms", "done")):
        print(f"  publish -> {name:11s} " + "  ".join(
            f"p{q} {row[what][q]['median']:.0f} ms [{row[what][q]['min']:.0f}-{row[what][q]['max']:.0f}]"
            for q in quantiles) + f"  max {row[what]['100']['median']:.0f} ms")


def plot_done_latency(last: dict[str, dict], path: Path, title: str, label=lambda arm: arm) -> None:
    """`done` latency of each arm's last run over the time each request was published (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm, lat in last.items():
        t0 = min(v[0] for v in lat.values())
        pts = sorted((v[0] - t0, v[2]) for v in lat.values() if v[2] is not None)
        ax.scatter([p[0] / 1000 for p in pts], [max(p[1], 1) for p in pts], s=2, label=label(arm), alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("request published at (s from the first)")
    ax.set_ylabel("publish -> done (ms)")
    ax.set_title(title)
    ax.legend(markerscale=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(path: Path, args, arms: dict) -> None:
    path.write_text(msgspec.json.format(msgspec.json.encode(
        {"args": vars(args), "arms": arms, "machine": common.machine(), "date": common.today(),
         "rev": common.git_rev()}), indent=2).decode())


def late_ticks() -> tuple[float, float]:
    """(ticks, ticks later than 0.1 s) of the worker's health monitor so far (`sluice_event_loop_lag_seconds`)."""
    count = metrics.REGISTRY.get_sample_value("sluice_event_loop_lag_seconds_count") or 0.0
    quick = metrics.REGISTRY.get_sample_value("sluice_event_loop_lag_seconds_bucket", {"le": "0.1"}) or 0.0
    return count, count - quick


async def one_run(s, engine, arm: str, args) -> tuple[dict, FullCollections, dict]:
    cat = await common.fresh_catalog(s, "pau")
    topic = cat.request_topic("standard").name
    group = f"pau-{uuid.uuid4().hex[:6]}"
    worker = Worker(s.override(group_id=group, redis_key_prefix=f"pau-{uuid.uuid4().hex[:6]}"), cat, engine)
    done = lambda: sum(metrics.requests_completed.labels("standard", r)._value.get()  # noqa: E731
                       for r in ("length", "stop"))
    before, n = done(), int(args.rate * args.seconds)
    await worker.start()
    try:
        if arm == "thawed":
            gc.unfreeze()
        while not worker.consumer.assignment():
            await asyncio.sleep(0.01)
        tps = sorted(tp for tp in worker.consumer.assignment() if tp.topic == topic)
        publisher = subprocess.Popen([sys.executable, __file__, "--publish", topic, str(args.rate), str(args.seconds),
                                      uuid.uuid4().hex[:6], str(args.max_tokens)])
        try:
            ticks_before, late_before = late_ticks()
            with FullCollections() as full:
                await until_committed(s, group, tps, n, f"{arm:6s}", lambda: int(done() - before))
            ticks, late = late_ticks()
        finally:
            publisher.wait(60)
        if publisher.returncode:
            raise SystemExit(f"the publisher exited with {publisher.returncode}")
    finally:
        await worker.stop()
    lat = latencies(await read_topic(s.kafka.options(), topic), await read_topic(s.kafka.options(), cat.replies.name))
    return {**summary(lat), "monitor_ticks": ticks - ticks_before, "late_ticks": late - late_before}, full, lat


async def main(args) -> None:
    from transformers import AutoTokenizer

    s = common.settings()
    engine = TokenizingFakeEngine(AutoTokenizer.from_pretrained(s.engine.model), args.token_ms / 1000)
    runs: dict[str, list] = {arm: [] for arm in ARMS}
    last: dict[str, dict] = {}
    # a process's first run pays for first calls (new topics' metadata, the tokenizer's first use): not counted
    await one_run(s, engine, "frozen", argparse.Namespace(**{**vars(args), "seconds": 2}))
    for order in harness.orders(ARMS, args.reps):
        for arm in order:
            result, full, lat = await one_run(s, engine, arm, args)
            result["full_collections"] = {"count": full.count, "ms": 1000 * full.seconds, "longest_ms": 1000 * full.longest}
            runs[arm].append(result)
            last[arm] = lat
    print(f"\n{args.rate:g} streamed requests/s for {args.seconds:g} s, {args.max_tokens} tokens each, {args.token_ms} ms "
          f"per token, real tokenizer; {args.reps} repetitions in rotated order; {common.machine()}; {common.today()}; "
          f"rev {common.git_rev()}")
    out = {}
    for arm, rs in runs.items():
        row = latency_row(rs)
        for k in ("count", "ms", "longest_ms"):
            row[f"full_collections_{k}"] = harness.spread([r["full_collections"][k] for r in rs])
        row["late_ticks"] = harness.spread([r["late_ticks"] for r in rs])
        row["monitor_ticks"] = harness.spread([r["monitor_ticks"] for r in rs])
        out[arm] = row
        print(f"{arm}:")
        print_latency(row)
        fc, fm, fl = (row[f"full_collections_{k}"] for k in ("count", "ms", "longest_ms"))
        print(f"  full collections while timed: {fc['median']:.0f} [{fc['min']:.0f}-{fc['max']:.0f}], "
              f"{fm['median']:.0f} ms in all, the longest {fl['median']:.1f} ms [{fl['min']:.1f}-{fl['max']:.1f}]")
        lt, mt = row["late_ticks"], row["monitor_ticks"]
        print(f"  health monitor ticks later than 0.1 s (sluice_event_loop_lag_seconds): {lt['median']:.0f} "
              f"[{lt['min']:.0f}-{lt['max']:.0f}] of {mt['median']:.0f}")
        if row["without_done"]:
            print(f"  requests without a done: {row['without_done']}")
    f, t = out["frozen"]["e2e_ms"], out["thawed"]["e2e_ms"]
    print(f"thawed / frozen, done p99: {t['99']['median'] / max(f['99']['median'], 1):.2f}; "
          f"p99.9: {t['99.9']['median'] / max(f['99.9']['median'], 1):.2f}")
    write_json(OUT / "pauses.json", args, out)
    plot_done_latency(last, OUT / "pauses.png", f"{args.rate:g} streamed requests/s, {args.max_tokens} tokens each: "
                      "start-up heap frozen or thawed")
    print(f"wrote {OUT / 'pauses.json'} and {OUT / 'pauses.png'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--publish":
        topic, rate, seconds, tag, max_tokens = sys.argv[2:7]
        asyncio.run(publish_steadily(topic, float(rate), float(seconds), tag, int(max_tokens)))
        sys.exit(0)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=800)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--token-ms", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=4)
    from worker.service import run_loop

    run_loop(main(p.parse_args()))
