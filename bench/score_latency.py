"""What Kafka and sluice add to a realtime score, in milliseconds.

    python bench/score_latency.py [--rate 1] [--seconds 30] [--reps 3] [--fetch-wait-ms 50,5]

Realtime `kind: score` requests (the `fraud` template on seeded transaction events) at a steady
rate, the same events in every arm:

  direct          the worker's own engine adapter (`worker.engine.VllmEngine`, KV pages off) in one
                  process, no Kafka: render the template, tokenize, one engine step with the labels'
                  log-probabilities; timed per event from submit to the scores
  sluice@<ms>     `sluice worker` (KV pages off) with `fetch.max.wait.ms` = <ms> for its consumer and
                  the client's reply reader; timed per event from the client's send to the client
                  reading the `done` reply

Breakdown for sluice (medians, ms), from the Kafka record timestamps (one clock, this machine):
  worker  request record's timestamp -> done record's timestamp (broker fetch, intake, Redis claim,
          engine, answer stored, reply produced)
  reply   done record's timestamp -> the client has read it (the reply fetch)
  added   sluice's median minus direct's: what Kafka and sluice add on top of the engine

Arms are alike (`bench/harness.py`: engine configuration, KV cache, CPU binding, checked from
each arm's log), run in rotated order per repetition, and the scores of every arm must agree
to 1e-6. Prints p50/p99 per arm (median [min-max] over repetitions); writes
bench/score_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import time
import uuid
from pathlib import Path

import msgspec
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import common, harness  # noqa: E402
from loadgen.burst import percentile  # noqa: E402
from loadgen.events import transactions  # noqa: E402
from schemas import DoneReply, ErrorReply  # noqa: E402

OUT = Path(__file__).resolve().parent


def events_for(rep: int, n: int) -> list[dict]:
    return transactions(n, seed=100 + rep)


async def steady(n: int, rate: float, one, desc: str | None = None) -> list:
    """Start `one(i)` for i in range(n) at `rate` per second; gather their results."""
    t0 = time.monotonic()
    tasks = []
    with tqdm(total=n, unit="req", mininterval=2, desc=desc, disable=desc is None) as bar:
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            task = asyncio.create_task(one(i))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        return await asyncio.gather(*tasks)


# -- direct: the engine adapter in a child process ----------------------------------------------

def direct_child(args) -> None:
    from schemas.templates import Templates
    from worker.engine import GenParams, VllmEngine

    s, _ = common.bench_engine_settings(args, SLUICE_KV_PAGES="false")
    engine = VllmEngine(s)
    print(harness.ARM_ENGINE + json.dumps(engine.resolved), flush=True)
    template = Templates().get("fraud")
    labels = list(template.labels)

    async def score(event: dict, rid: str) -> tuple[float, dict]:
        t0 = time.monotonic()
        ids = engine.render_ids(template.render(event), template.chat, template.system)
        firsts = tuple(x[0] for x in engine.label_ids(labels, template.chat))
        lp = {}
        async for d in engine.generate(rid, ids, GenParams(max_tokens=1, logprob_token_ids=firsts), priority=0):
            lp = d.logprobs or lp
        w = [math.exp(lp[t]) for t in firsts]
        return time.monotonic() - t0, {label: x / sum(w) for label, x in zip(labels, w)}

    async def serve():
        await asyncio.gather(*(score(e, f"w{i}") for i, e in enumerate(transactions(8, seed=1))))
        print("READY", flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            rep = int(line)
            evs = events_for(rep, args.n)
            res = await steady(len(evs), args.rate, lambda i: score(evs[i], f"{rep}-{i}"))
            print("RESULT " + json.dumps({"latency_s": [r[0] for r in res],
                                          "scores": {evs[i]["id"]: r[1] for i, r in enumerate(res)}}), flush=True)

    asyncio.run(serve())
    engine.shutdown()


# -- sluice -------------------------------------------------------------------------------------

class SluiceArm:
    def __init__(self, args, s, fetch_wait_ms: int):
        self.args, self.s, self.fetch_wait_ms = args, s, fetch_wait_ms
        self.name = f"sluice@{fetch_wait_ms}"
        self.log_path = OUT / f".score-{self.name}.log"
        self.stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        self.port = common.free_port()
        _, env = common.bench_engine_settings(self.args, SLUICE_KV_PAGES="false", SLUICE_LOG_LEVEL="info",
                                              SLUICE_KAFKA_FETCH_MAX_WAIT_MS=str(self.fetch_wait_ms),
                                              SLUICE_METRICS_PORT=str(self.port))
        env[common.RESERVED_CPUS_ENV] = str(self.args.reserved_cpus)
        procs = []
        self.cat = await self.stack.enter_async_context(
            common.worker_process(self.s, "bs", self.log_path, procs, **env))
        self.pid = procs[0].pid
        self.topic = self.cat.request_topic("realtime").name
        self.reader = AIOKafkaConsumer(**self.s.kafka.options(), enable_auto_commit=False,
                                       fetch_max_wait_ms=self.fetch_wait_ms)
        await self.reader.start()
        self.stack.push_async_callback(self.reader.stop)
        parts = self.reader.partitions_for_topic(self.cat.replies.name) or set()
        while not parts:
            await self.reader._client.force_metadata_update()
            parts = self.reader.partitions_for_topic(self.cat.replies.name) or set()
        tps = [TopicPartition(self.cat.replies.name, p) for p in sorted(parts)]
        self.reader.assign(tps)
        await self.reader.seek_to_end(*tps)
        for tp in tps:
            await self.reader.position(tp)
        from aiokafka import AIOKafkaProducer

        self.producer = AIOKafkaProducer(**self.s.kafka.options(), linger_ms=0)
        await self.producer.start()
        self.stack.push_async_callback(self.producer.stop)
        self.waiting: dict[str, asyncio.Future] = {}
        self.pump = asyncio.create_task(self._read())
        self.stack.push_async_callback(self._stop_pump)
        await asyncio.gather(*(self._score(e, f"w{i}-{uuid.uuid4().hex[:4]}")
                               for i, e in enumerate(transactions(8, seed=1))))

    async def _stop_pump(self) -> None:
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)

    async def _read(self) -> None:
        from schemas import ReplyCodec

        codec = ReplyCodec()
        while True:
            batches = await self.reader.getmany(timeout_ms=1000)
            now = time.time()
            for recs in batches.values():
                for rec in recs:
                    reply = codec.decode(rec.value)
                    if not isinstance(reply, (DoneReply, ErrorReply)):
                        continue  # token records: the score is final only with `done`
                    fut = self.waiting.pop(reply.id, None)
                    if fut is not None and not fut.done():
                        fut.set_result((reply, rec.timestamp / 1000, now))

    async def _score(self, event: dict, rid: str) -> dict:
        body = {"id": rid, "kind": "score", "template": "fraud", "event": event}
        fut = self.waiting[rid] = asyncio.get_running_loop().create_future()
        sent = time.time()
        md = await (await self.producer.send(self.topic, msgspec.json.encode(body), key=rid.encode()))
        reply, done_ts, read_at = await fut
        if not isinstance(reply, DoneReply) or not reply.scores:
            raise SystemExit(f"{self.name}: {reply}")
        return {"latency_s": read_at - sent, "worker_s": done_ts - md.timestamp / 1000, "reply_s": read_at - done_ts,
                "scores": reply.scores}

    async def run(self, rep: int) -> dict:
        evs = events_for(rep, self.args.n)
        tag = uuid.uuid4().hex[:6]
        before = await common.stage_totals(self.port, "realtime")
        res = await steady(len(evs), self.args.rate, lambda i: self._score(evs[i], f"{tag}-{rep}-{i}"),
                           desc=f"{self.name} rep {rep}")
        stages = common.stage_means_ms(before, await common.stage_totals(self.port, "realtime"))
        return {"latency_s": [r["latency_s"] for r in res], "worker_s": [r["worker_s"] for r in res],
                "reply_s": [r["reply_s"] for r in res], "stages_ms": stages,
                "scores": {evs[i]["id"]: r["scores"] for i, r in enumerate(res)}}

    async def stop(self) -> None:
        await self.stack.aclose()


class DirectArm(common.ChildArm):
    def __init__(self, args):
        super().__init__("direct", [sys.executable, __file__, "--child-direct", *sys.argv[1:], "--model", args.model],
                         common.arm_env(args), OUT / ".score-direct.log")

    async def run(self, rep: int) -> dict:
        return await self.ask(str(rep))


def ms(values: list[float], q: float) -> float:
    return 1000 * percentile(values, q)


async def main(args) -> None:
    s = common.settings()
    args.model = args.model or s.engine.model
    args.n = int(args.rate * args.seconds)
    arms = [DirectArm(args)] + [SluiceArm(args, s, int(w)) for w in args.fetch_wait_ms.split(",")]
    by_name = {a.name: a for a in arms}
    started, runs = [], {a.name: [] for a in arms}
    try:
        for arm in arms:
            print(f"{arm.name}: starting ...", flush=True)
            await arm.start()
            started.append(arm)
        reports = {a.name: harness.arm_report(a.log_path.read_text(errors="replace")) for a in arms}
        harness.check_alike(reports)
        for rep, order in enumerate(harness.orders(list(by_name), args.reps)):
            for name in order:
                print(f"rep {rep}: {name}", flush=True)
                runs[name].append(await by_name[name].run(rep))
    finally:
        for arm in started:
            await arm.stop()
    # the same events must get the same scores in every arm
    worst = 0.0
    for name, rs in runs.items():
        for rep, r in enumerate(rs):
            for eid, sc in r["scores"].items():
                ref = runs["direct"][rep]["scores"][eid]
                worst = max(worst, max(abs(sc[k] - ref[k]) for k in ref))
    if worst > 1e-6:
        raise SystemExit(f"scores differ between arms by up to {worst:.2e}: not the same work")
    summary = {}
    for name, rs in runs.items():
        row = {f"p{q}": harness.spread([ms(r["latency_s"], q) for r in rs]) for q in (50, 99)}
        if name != "direct":
            for part in ("worker_s", "reply_s"):
                row[part.removesuffix("_s") + "_p50"] = harness.spread([ms(r[part], 50) for r in rs])
            row["added_p50"] = harness.spread([ms(r["latency_s"], 50) - ms(d["latency_s"], 50)
                                               for r, d in zip(rs, runs["direct"])])
            row["stages_mean_ms"] = {st: harness.spread([r["stages_ms"][st] for r in rs])
                                     for st in rs[0]["stages_ms"]}
        summary[name] = row
    print(f"\n{args.n} realtime fraud scores at {args.rate}/s per run, {args.reps} repetitions in rotated order; "
          f"{common.machine()}; {common.today()}; rev {common.git_rev()}")
    first = reports["direct"]
    print("every arm: " + ", ".join(f"{k}={first[k]}" for k in harness.COMPARED))
    print(f"scores equal in every arm (max difference {worst:.1e})")
    print(f"{'arm':12s} {'p50 ms':>20s} {'p99 ms':>20s} {'worker p50':>20s} {'reply p50':>20s} {'added p50':>20s}")

    def cell(row, key):
        v = row.get(key)
        return f"{v['median']:.1f} [{v['min']:.1f}-{v['max']:.1f}]" if v else "-"

    for name, row in summary.items():
        print(f"{name:12s} " + " ".join(f"{cell(row, k):>20s}" for k in ("p50", "p99", "worker_p50", "reply_p50",
                                                                          "added_p50")))
    print("inside the worker, mean ms per request (sluice_stage_seconds): fetch = record timestamp to read, "
          "admission = intake window + stored-answer lookup and claim + queue, engine, reply = answer stored + done "
          "produced and acknowledged")
    for name, row in summary.items():
        if "stages_mean_ms" in row:
            print(f"{name:12s} " + "  ".join(f"{st} {cell(row['stages_mean_ms'], st)}" for st in row["stages_mean_ms"]))
    (OUT / "score_latency.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "child_direct"}, "arms": reports, "summary": summary,
         "runs": {n: [{k: v for k, v in r.items() if k != "scores"} for r in rs] for n, rs in runs.items()},
         "max_score_difference": worst, "machine": common.machine(), "date": common.today(),
         "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'score_latency.json'}")
    print("median over reps of per-run p50, ms: " + ", ".join(
        f"{n} {statistics.median(ms(r['latency_s'], 50) for r in rs):.1f}" for n, rs in runs.items()))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1.0,
                   help="events per second; keep it under the engine's capacity, or the arms measure their queues")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fetch-wait-ms", default="50,5", help="one sluice arm per value (comma-separated)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--reserved-cpus", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--child-direct", action="store_true", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    if a.child_direct:
        a.n = int(a.rate * a.seconds)
        direct_child(a)
    else:
        asyncio.run(main(a))
