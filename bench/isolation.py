"""Realtime latency alone vs. under a saturating batch backlog, sluice classes vs. one FIFO class.

    python bench/isolation.py [--rate 4] [--seconds 20] [--backlog 300]

Four runs on one engine (real model): realtime requests at a steady rate
(a) alone and (b) with a backlog landing on the batch topic a few seconds into
the stream (non-streaming, as a backfill would send it) and outlasting it, first through the
latency classes (realtime topic), then for the FIFO baseline through the batch
topic like everything else. Prints realtime p50/p99 end-to-end latency per run
and the loaded/unloaded ratios; writes bench/isolation.json and bench/isolation.png.
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
from aiokafka import AIOKafkaProducer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from loadgen.burst import ReplyReader, percentile, produce  # noqa: E402
from schemas import DoneReply, ErrorReply  # noqa: E402
from worker.worker import Worker  # noqa: E402

OUT = Path(__file__).resolve().parent


def body(rid: str, i: int, max_tokens: int, stream: bool = True) -> bytes:
    """The prompt depends on `i` only, so every run sees the same prompts (and output lengths)."""
    return msgspec.json.encode({
        "id": rid, "max_tokens": max_tokens, "stream": stream,
        "prompt": f"Transaction {i}: amount {10 + 7 * i % 900}.50 USD, merchant electronics, country BR, card not "
                  f"present, {i % 13} transactions in 24h. Explain whether it is fraud:"})


async def run(s, eng, mode: str, loaded: bool, args) -> list[float]:
    tag = uuid.uuid4().hex[:6]  # ids are idempotency keys: never reuse them across runs
    cat = await common.fresh_catalog(s, mode[0] + ("l" if loaded else "u"))
    if mode == "fifo":
        # One class for everything, admitted as it arrives: no intake window.
        fifo = msgspec.structs.replace(cat.request_topic("batch"), window_ms=0)
        cat = msgspec.structs.replace(cat, topic=[fifo if t.name == fifo.name else t for t in cat.topic])
    rt_topic = cat.request_topic("realtime" if mode == "classes" else "batch").name
    worker = Worker(s.override(group_id=f"bench-{uuid.uuid4().hex[:6]}"), cat, eng)
    await worker.start()
    while not worker.consumer.assignment():
        await asyncio.sleep(0.1)
    reader = ReplyReader(s.kafka.options(), cat.replies.name)
    await reader.start()
    try:
        n = int(args.rate * args.seconds)
        sent: dict[str, float] = {}
        lat: dict[str, float] = {}
        label = f"{mode:7s} {'loaded' if loaded else 'alone':6s}"

        producer = AIOKafkaProducer(**s.kafka.options(), linger_ms=0)
        await producer.start()

        async def backlog():
            await asyncio.sleep(args.backlog_after)  # a backfill lands while realtime flows
            await produce(s.kafka.options(), [(cat.request_topic("batch").name, f"{tag}-bk{i}".encode(),
                                               body(f"{tag}-bk{i}", i, args.batch_tokens, stream=False), [])
                                              for i in range(args.backlog)])

        async def publish():
            if loaded:
                asyncio.create_task(backlog())
            start = time.monotonic()
            for i in range(n):
                await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))
                rid = f"{tag}-rt{i}"
                sent[rid] = time.monotonic()
                await producer.send_and_wait(rt_topic, body(rid, i, args.rt_tokens), key=rid.encode())

        pub = asyncio.create_task(publish())
        with tqdm(total=n, desc=label, unit="req", mininterval=2) as bar:
            end = time.monotonic() + args.seconds + args.timeout
            while len(lat) < n and time.monotonic() < end:
                async for r in reader.records():
                    if isinstance(r, (DoneReply, ErrorReply)) and r.id in sent and r.id not in lat:
                        lat[r.id] = time.monotonic() - sent[r.id]
                        bar.update(1)
        await pub
        await producer.stop()
        if len(lat) < n:
            print(f"  {n - len(lat)} realtime requests unanswered within the timeout; counted as {args.timeout}s")
            lat.update({rid: float(args.timeout) for rid in sent if rid not in lat})
        return list(lat.values())
    finally:
        await reader.stop()
        await worker.stop(grace_s=0)


async def settle(eng, timeout: float = 60.0) -> None:
    """Wait until the engine holds no request, so each run starts from an idle engine."""
    end = time.monotonic() + timeout
    while eng.unfinished() and time.monotonic() < end:
        await asyncio.sleep(0.1)
    if eng.unfinished():
        print(f"  engine still holds {eng.unfinished()} requests")


async def warm_up(eng) -> None:
    """A few requests straight to the engine, so no run pays for first-use costs."""
    from schemas import Request
    from worker.engine import GenParams

    async def one(i):
        ids = eng.prompt_ids(Request(id="w", prompt=f"warm up {i}"))
        async for _ in eng.generate(f"warm-{i}", ids, GenParams(16), 0):
            pass

    await asyncio.gather(*(one(i) for i in range(8)))


def plot(results: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, vals in results.items():
        xs = sorted(vals)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("realtime end-to-end latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Realtime latency: alone vs. saturating batch backlog")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args) -> None:
    s = common.settings()
    print("loading the engine ...")
    eng = await common.engine(s)
    results = {}
    await warm_up(eng)
    try:
        for mode in ("classes", "fifo"):
            for loaded in (False, True):
                results[f"{mode} {'loaded' if loaded else 'alone'}"] = await run(s, eng, mode, loaded, args)
                await settle(eng)
    finally:
        eng.shutdown()
    print(f"\nrealtime {args.rate}/s for {args.seconds}s, {args.rt_tokens} tokens; backlog {args.backlog} x "
          f"{args.batch_tokens} tokens; {common.machine()}; {common.today()}; rev {common.git_rev()}")
    print(f"{'run':16s} {'p50 s':>7s} {'p99 s':>7s}")
    summary = {}
    for name, vals in results.items():
        summary[name] = {"p50": percentile(vals, 50), "p99": percentile(vals, 99), "n": len(vals)}
        print(f"{name:16s} {summary[name]['p50']:7.3f} {summary[name]['p99']:7.3f}")
    for mode in ("classes", "fifo"):
        a, b = summary[f"{mode} alone"], summary[f"{mode} loaded"]
        summary[f"{mode} ratio"] = {"p50": b["p50"] / a["p50"], "p99": b["p99"] / a["p99"]}
        print(f"{mode:7s} loaded/alone: p50 x{b['p50'] / a['p50']:.2f}  p99 x{b['p99'] / a['p99']:.2f}")
    (OUT / "isolation.json").write_text(json.dumps({"args": vars(args), "summary": summary,
                                                    "machine": common.machine(), "date": common.today()}, indent=2))
    plot(results, OUT / "isolation.png")
    print(f"wrote {OUT / 'isolation.json'} and {OUT / 'isolation.png'}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=4.0, help="realtime requests per second")
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--rt-tokens", type=int, default=16)
    p.add_argument("--backlog", type=int, default=300)
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--backlog-after", type=float, default=3.0, help="seconds into the realtime stream")
    p.add_argument("--timeout", type=float, default=120.0)
    asyncio.run(main(p.parse_args()))
