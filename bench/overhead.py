"""The worker's own cost per request, with an engine that takes a fixed time per token.

    python bench/overhead.py [--requests 20000] [--reps 3] [--token-ms 1] [--max-tokens 4] [--profile]

For each mode (non-streaming, then streaming) and repetition, N requests are published to a
fresh standard topic, then two arms read them in a rotated order, each as its own consumer
group, with the clock stopped when the group's committed offsets cover every record:

  bare pipe  a bare aiokafka consumer that produces as many reply records per request as the
             worker did (no decoding, no engine, no Redis), then commits: the ceiling of the
             Kafka path on this machine
  sluice     one `Worker` (decode -> admit -> engine -> token records -> done -> Redis answer ->
             commit) on an engine that tokenizes prompts with the bundled model's tokenizer,
             waits `--token-ms` per token and detokenizes what it emits (`TokenizingFakeEngine`)

The worker logs as a deployed one does (its configured level and format, info and JSON by default:
a line per answered request) to bench/.overhead-worker.log.

Prints requests/s per arm (median [min-max] over the repetitions) and the ratio, the rate up to the
last answer (before its offsets were committed), the worker's CPU per request and its full
garbage collections; `--profile` adds the hottest functions of one extra profiled streaming run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import sys
import time
import uuid
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common, harness  # noqa: E402
from loadgen.burst import produce  # noqa: E402
from worker import metrics  # noqa: E402
from worker.engine import Delta  # noqa: E402
from worker.fake_engine import FakeEngine  # noqa: E402
from worker.prompt_tokens import encode_text  # noqa: E402
from worker.worker import Worker  # noqa: E402


class TokenizingFakeEngine(FakeEngine):
    """The fake engine's timing and token sequence, with the worker-process work a real engine adds:
    prompts tokenized by the model's tokenizer, generated ids detokenized into text."""

    def __init__(self, tokenizer, token_delay_s: float):
        super().__init__(token_delay_s=token_delay_s)
        self.tokenizer = tokenizer

    def prompt_ids(self, request):
        return encode_text(self.tokenizer, request.prompt or "")

    async def generate(self, request_id, prompt_ids, params, priority):
        async for d in super().generate(request_id, prompt_ids, params, priority):
            ids = [100 + t for t in d.token_ids]  # ordinary vocabulary tokens
            yield Delta(self.tokenizer.decode(ids), ids, d.finish_reason, d.logprobs)


async def publish(s, topic: str, n: int, tag: str, stream: bool, max_tokens: int) -> None:
    items = [(topic, f"{tag}-{i}".encode(), msgspec.json.encode(
        {"id": f"{tag}-{i}", "prompt": f"amount {i} USD, merchant grocery, country DE", "max_tokens": max_tokens,
         "stream": stream}), []) for i in range(n)]
    for k in range(0, n, 5000):
        await produce(s.kafka.options(), items[k:k + 5000])


async def until_committed(s, group: str, tps: list[TopicPartition], n: int, desc: str, progress
                          ) -> tuple[float, float]:
    """Seconds until `group` has committed offsets covering n records, and until `progress()` (which
    also counts for the bar) first reached n: the last answer, before its offsets were committed."""
    probe = AIOKafkaConsumer(**s.kafka.options(), group_id=group, enable_auto_commit=False)
    await probe.start()
    start = time.perf_counter()
    answered = None
    try:
        with tqdm(total=n, desc=desc, unit="req", mininterval=2) as bar:
            while True:
                bar.n = min(n, progress())
                bar.refresh()
                if bar.n >= n and answered is None:
                    answered = time.perf_counter() - start
                if bar.n >= n and sum([(await probe.committed(tp)) or 0 for tp in tps]) >= n:
                    return time.perf_counter() - start, answered
                await asyncio.sleep(0.02)
    finally:
        await probe.stop()


async def bare_pipe(s, cat, n: int, replies_per_request: int) -> float:
    topic = cat.request_topic("standard").name
    group = f"pipe-{uuid.uuid4().hex[:6]}"
    consumer = AIOKafkaConsumer(topic, **s.kafka.options(), group_id=group, enable_auto_commit=False,
                                auto_offset_reset="earliest", fetch_max_wait_ms=s.kafka.fetch_max_wait_ms)
    producer = AIOKafkaProducer(**s.kafka.options(), linger_ms=2)
    await consumer.start()
    await producer.start()
    seen = 0

    async def pump():
        nonlocal seen
        while True:
            batch = await consumer.getmany(timeout_ms=100, max_records=500)
            futs = []
            for recs in batch.values():
                for r in recs:
                    for _ in range(replies_per_request):
                        futs.append(await producer.send(cat.replies.name, b'{"type":"done"}', key=r.key))
            await asyncio.gather(*futs)
            seen += sum(map(len, batch.values()))
            if batch:
                await consumer.commit()

    task = asyncio.create_task(pump())
    try:
        while not consumer.assignment():
            await asyncio.sleep(0.01)
        tps = sorted(consumer.assignment())
        return n / (await until_committed(s, group, tps, n, "bare pipe", lambda: seen))[0]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await consumer.stop()
        await producer.stop()


class FullCollections:
    """The garbage collector's full (oldest-generation) collections while it is open: how many, how long
    in all, and the longest (the event loop, and every stream on it, stands still for each)."""

    def __init__(self):
        self.count, self.seconds, self.longest, self._began = 0, 0.0, 0.0, 0.0

    def _watch(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            took = time.perf_counter() - self._began
            self.count += 1
            self.seconds += took
            self.longest = max(self.longest, took)

    def __enter__(self):
        gc.callbacks.append(self._watch)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._watch)


async def sluice_worker(s, cat, n: int, engine, profile: bool = False
                        ) -> tuple[float, float, pstats.Stats | None, float, FullCollections, float]:
    """(requests/s, reply records per request, profile, CPU seconds per request of this process,
    the full collections in the timed window, requests/s up to the last answer)"""
    group = f"ovh-{uuid.uuid4().hex[:6]}"
    fresh = s.override(group_id=group, redis_key_prefix=f"ovh-{uuid.uuid4().hex[:6]}")  # nothing answered yet
    worker = Worker(fresh, cat, engine)
    done = lambda: sum(metrics.requests_completed.labels("standard", r)._value.get()  # noqa: E731
                       for r in ("length", "stop"))
    replies = lambda: sum(metrics.reply_records.labels(t)._value.get() for t in ("token", "done"))  # noqa: E731
    before, replies_before = done(), replies()
    prof = cProfile.Profile() if profile else None
    await worker.start()
    try:
        while not worker.consumer.assignment():
            await asyncio.sleep(0.01)
        tps = sorted(tp for tp in worker.consumer.assignment() if tp.topic == cat.request_topic("standard").name)
        if prof:
            prof.enable()
        cpu = time.process_time()
        with FullCollections() as full:
            seconds, answered = await until_committed(s, group, tps, n, "sluice worker", lambda: int(done() - before))
        cpu = time.process_time() - cpu
        if prof:
            prof.disable()
        return (n / seconds, (replies() - replies_before) / n, (pstats.Stats(prof) if prof else None), cpu / n, full,
                n / answered)
    finally:
        await worker.stop()


# Where a function's own time is counted: the first part whose marker is in its file (or name).
PARTS = (("Kafka client (aiokafka)", ("/aiokafka/",)), ("Redis client (redis-py, hiredis)", ("/redis/", "hiredis")),
         ("tokenizer", ("/transformers/", "/tokenizers/", "tokenizers.")), ("metrics (prometheus-client)",
         ("/prometheus_client/",)), ("wire codec (msgspec)", ("msgspec",)), ("logging (structlog)", ("/structlog/",)),
         ("sluice (worker/, schemas/)", ("/worker/", "/schemas/")), ("bench engine stand-in", ("/bench/",)),
         ("event loop (asyncio, uvloop)", ("/asyncio/", "uvloop", "_asyncio")))


def components(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Share of profiled own time by part, largest first. A builtin's time (isinstance, bytes.join,
    ...) goes to the parts of the functions that called it, in proportion."""
    def part_of(func) -> str:
        where = f"{func[0]} {func[2]}"
        return next((p for p, marks in PARTS if any(m in where for m in marks)), "other (stdlib)")

    totals: dict[str, float] = {}
    for func, (_, _, own, _, callers) in stats.stats.items():
        if func[0] == "~" and callers:
            spent = sum(c[2] for c in callers.values()) or 1.0
            for caller, c in callers.items():
                totals[part_of(caller)] = totals.get(part_of(caller), 0.0) + own * c[2] / spent
        else:
            totals[part_of(func)] = totals.get(part_of(func), 0.0) + own
    whole = sum(totals.values()) or 1.0
    return sorted(((p, t / whole) for p, t in totals.items()), key=lambda x: -x[1])


async def main(args) -> None:
    from transformers import AutoTokenizer

    from worker.logs import configure

    # the worker's own default level (the bench settings quiet everything else), or SLUICE_LOG_LEVEL
    s = common.settings(SLUICE_LOG_LEVEL=os.environ.get("SLUICE_LOG_LEVEL", "info"))
    worker_log = Path(__file__).resolve().parent / ".overhead-worker.log"
    configure(s.ops.log_level, s.ops.log_format, file=worker_log.open("w", buffering=1))  # as `sluice worker`
    engine = TokenizingFakeEngine(AutoTokenizer.from_pretrained(s.engine.model), args.token_ms / 1000)
    n, results = args.requests, {}
    for stream in (False, True):
        mode = "streaming" if stream else "non-streaming"
        rates = {"bare pipe": [], "sluice": []}
        cpu_us, full_count, full_ms, full_longest_ms, to_answer = [], [], [], [], []
        per_request = 1.0
        for rep, order in enumerate(harness.orders(["sluice", "bare pipe"], args.reps)):
            cat = await common.fresh_catalog(s, "ovh")
            await publish(s, cat.request_topic("standard").name, n, uuid.uuid4().hex[:6], stream, args.max_tokens)
            for arm in order:
                if arm == "sluice":
                    rate, per_request, _, cpu, full, answered_rate = await sluice_worker(s, cat, n, engine)
                    to_answer.append(answered_rate)
                    cpu_us.append(cpu * 1e6)
                    full_count.append(full.count)
                    full_ms.append(1000 * full.seconds)
                    full_longest_ms.append(1000 * full.longest)
                else:
                    rate = await bare_pipe(s, cat, n, max(1, round(per_request)))
                rates[arm].append(rate)
        results[mode] = {"rates": {k: harness.spread(v) for k, v in rates.items()},
                         "ratio": harness.spread([a / b for a, b in zip(rates["sluice"], rates["bare pipe"])]),
                         "reply_records_per_request": per_request,
                         "sluice_cpu_us_per_request": harness.spread(cpu_us),
                         "sluice_to_last_answer": harness.spread(to_answer),
                         "full_collections": harness.spread(full_count),
                         "full_collection_ms": harness.spread(full_ms),
                         "longest_full_collection_ms": harness.spread(full_longest_ms)}
    print(f"\n{n} requests x {args.max_tokens} tokens, {args.token_ms} ms per token, real tokenizer, clock stopped at "
          f"the committed offsets, {args.reps} repetitions in rotated order, {args.loop}, worker logs at "
          f"{s.ops.log_level} ({s.ops.log_format}) to {worker_log.name}; {common.machine()}; "
          f"{common.today()}; rev {common.git_rev()}")
    for mode, r in results.items():
        print(f"{mode} ({r['reply_records_per_request']:.1f} reply records per request):")
        for arm, v in r["rates"].items():
            print(f"  {arm:10s} {v['median']:8.0f} req/s  [{v['min']:.0f}-{v['max']:.0f}]")
        print(f"  sluice / bare pipe {r['ratio']['median']:.2f}  [{r['ratio']['min']:.2f}-{r['ratio']['max']:.2f}]")
        a = r["sluice_to_last_answer"]
        print(f"  sluice to the last answer {a['median']:.0f} req/s [{a['min']:.0f}-{a['max']:.0f}] (before the "
              f"offsets were committed, which the rate above waits for: at once when every record is finished, "
              f"else every {s.group.commit_interval_ms} ms)")
        c = r["sluice_cpu_us_per_request"]
        print(f"  sluice process CPU {c['median']:.0f} us per request [{c['min']:.0f}-{c['max']:.0f}] "
              f"(5,000 req/s on one core would allow 200)")
        fc, fm, fl = r["full_collections"], r["full_collection_ms"], r["longest_full_collection_ms"]
        print(f"  full garbage collections while timed: {fc['median']:.0f} [{fc['min']:.0f}-{fc['max']:.0f}], "
              f"{fm['median']:.0f} ms in all [{fm['min']:.0f}-{fm['max']:.0f}], "
              f"the longest {fl['median']:.1f} ms [{fl['min']:.1f}-{fl['max']:.1f}]")
    out = Path(__file__).resolve().parent / "overhead.json"
    out.write_text(msgspec.json.format(msgspec.json.encode(
        {"args": vars(args), "results": results, "worker_log": {"level": s.ops.log_level, "format": s.ops.log_format},
         "machine": common.machine(), "date": common.today(),
         "rev": common.git_rev()}), indent=2).decode())
    print(f"wrote {out}")
    if args.profile:
        cat = await common.fresh_catalog(s, "ovh")
        await publish(s, cat.request_topic("standard").name, n, uuid.uuid4().hex[:6], True, args.max_tokens)
        stats = (await sluice_worker(s, cat, n, engine, profile=True))[2]
        print("\nwhere a profiled streaming run's CPU goes (own time by part; the profiler inflates small calls):")
        for part, share in components(stats):
            print(f"  {part:32s} {100 * share:5.1f}%")
        print("\nhottest functions (own time):")
        stats.sort_stats("tottime").print_stats(15)
        if args.profile_out:
            stats.dump_stats(args.profile_out)
            print(f"wrote {args.profile_out} (pstats: python -m pstats {args.profile_out})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--token-ms", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-out", help="with --profile: also write the profile here, for pstats or snakeviz")
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                   help="event loop; `sluice worker` runs on uvloop when it is installed")
    a = p.parse_args()
    if a.loop == "uvloop":
        from worker.service import run_loop

        run_loop(main(a))
    else:
        asyncio.run(main(a))
