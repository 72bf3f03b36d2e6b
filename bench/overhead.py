"""The worker's own cost per request, with the engine replaced by one that answers at once.

    python bench/overhead.py [--requests 20000] [--profile]

Pre-publishes N non-streaming requests, then times one worker (decode -> admit ->
fake engine -> done reply -> Redis answer -> commit) until every offset is
committable. Reference in the same run: a bare aiokafka pipe that reads the same
records and produces one reply each with no processing, the ceiling of the Kafka
path on this machine. Prints requests/s of both and their ratio; `--profile`
adds the hottest functions of the worker run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
import uuid
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from loadgen.burst import produce  # noqa: E402
from worker import metrics  # noqa: E402
from worker.fake_engine import FakeEngine  # noqa: E402
from worker.worker import Worker  # noqa: E402


async def publish(s, topic: str, n: int, tag: str) -> None:
    items = [(topic, f"{tag}-{i}".encode(), msgspec.json.encode(
        {"id": f"{tag}-{i}", "prompt": f"amount {i} USD, merchant grocery", "max_tokens": 4, "stream": False}), [])
        for i in range(n)]
    for k in tqdm(range(0, n, 2000), desc="publishing", unit="x2000", mininterval=2):
        await produce(s.kafka.options(), items[k:k + 2000])


async def bare_pipe(s, cat, n: int) -> float:
    """Read n records, produce one reply each, commit: no decoding, no engine."""
    consumer = AIOKafkaConsumer(cat.request_topic("standard").name, **s.kafka.options(),
                                group_id=f"pipe-{uuid.uuid4().hex[:6]}", enable_auto_commit=False,
                                auto_offset_reset="earliest", fetch_max_wait_ms=50)
    producer = AIOKafkaProducer(**s.kafka.options(), linger_ms=2)
    await consumer.start()
    await producer.start()
    seen, start = 0, None
    try:
        while seen < n:
            batch = await consumer.getmany(timeout_ms=100, max_records=500)
            start = start or (time.perf_counter() if batch else None)
            futs = []
            for recs in batch.values():
                for r in recs:
                    futs.append(await producer.send(cat.replies.name, b'{"type":"done"}', key=r.key))
            await asyncio.gather(*futs)
            seen += len(futs)
            if batch:
                await consumer.commit()
        return n / (time.perf_counter() - start)
    finally:
        await consumer.stop()
        await producer.stop()


async def sluice_worker(s, cat, n: int, profile: bool) -> tuple[float, pstats.Stats | None]:
    fresh = s.override(group_id=f"ovh-{uuid.uuid4().hex[:6]}",
                                    redis_key_prefix=f"ovh-{uuid.uuid4().hex[:6]}")  # nothing answered yet
    worker = Worker(fresh, cat, FakeEngine())
    done = lambda: metrics.requests_completed.labels("standard", "length")._value.get()  # noqa: E731
    before = done()
    prof = cProfile.Profile() if profile else None
    await worker.start()
    try:
        while metrics.records_consumed.labels("standard")._value.get() == 0 and not worker.consumer.assignment():
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        if prof:
            prof.enable()
        with tqdm(total=n, desc="sluice worker", unit="req", mininterval=2) as bar:
            last = 0
            while done() - before < n:
                await asyncio.sleep(0.05)
                bar.update(int(done() - before) - last)
                last = int(done() - before)
        elapsed = time.perf_counter() - start
        if prof:
            prof.disable()
        return n / elapsed, (pstats.Stats(prof) if prof else None)
    finally:
        await worker.stop()


async def main(args) -> None:
    s = common.settings()
    n = args.requests
    cat = await common.fresh_catalog(s, "ovh")
    await publish(s, cat.request_topic("standard").name, n, uuid.uuid4().hex[:6])
    pipe = await bare_pipe(s, cat, n)
    rate, _ = await sluice_worker(s, cat, n, profile=False)
    # Profiling slows the run several-fold, so it gets a run of its own over the same records.
    stats = (await sluice_worker(s, cat, n, profile=True))[1] if args.profile else None
    print(f"\n{n} non-streaming requests, fake engine, {args.loop}; {common.machine()}; {common.today()}; rev {common.git_rev()}")
    print(f"bare aiokafka pipe   {pipe:8.0f} req/s")
    print(f"sluice worker        {rate:8.0f} req/s")
    print(f"sluice / bare pipe   {rate / pipe:8.2f}")
    if stats:
        print("\nhottest functions of a second, profiled worker run (own time):")
        stats.sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                   help="event loop; `sluice worker` runs on uvloop when it is installed")
    a = p.parse_args()
    if a.loop == "uvloop":
        from worker.service import run_loop

        run_loop(main(a))
    else:
        asyncio.run(main(a))
