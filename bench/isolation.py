"""What realtime latency costs batch throughput: sluice's contention caps against vLLM's own scheduling.

    python bench/isolation.py [--rate 4] [--seconds 20] [--backlog 300] [--caps 2,16,48] [--reps 3]

One engine (real model, `ignore_eos` so every request does the same work in every run), shared by
every run, each run starting from an idle engine. Realtime requests arrive at a steady rate for
`--seconds`; a batch backlog (non-streaming, as a backfill sends it) lands `--backlog-after`
seconds in and outlasts the window. Runs:

  sluice rt alone        realtime through the realtime topic, nothing else
  sluice batch alone     the backlog through the batch topic, nothing else
  sluice cap=N           both; batch held to N engine slots while realtime has work
                         (`contended_in_engine`), one run per value of `--caps`
  sluice slo             both, SLUICE_ADMISSION=slo with realtime `slo_ms = --slo-ms`: batch's cap
                         follows realtime latency (only with `--slo-ms`)
  sluice step            both, SLUICE_ADMISSION=step (stretch `--stretch`): batch's cap follows the
                         engine's step time as the worker measures it
  vllm rt alone          realtime straight into the engine (`AsyncLLM` via the worker's adapter),
                         no Kafka
  vllm batch alone       the backlog straight into the engine
  vllm priority          both straight into the engine, class priorities (0 and 10): vLLM's own
                         priority scheduling alone
  vllm fifo              both straight into the engine, one priority: first come, first served

For each: realtime end-to-end p50/p99, batch tokens generated per second from the backlog's landing
to the end of the realtime stream, and all engine output tokens per second over the run (counted
at the engine, so requests that finish together in bursts are measured fairly), and the engine's
step time (median interval between two outputs of one request) with the tokens each step made:
what realtime latency depends on, and what limits the frontier. The frontier (realtime p99 loaded/alone
against the batch throughput kept, loaded/alone) is plotted to bench/isolation.png; medians over
`--reps` repetitions (runs rotated) in bench/isolation.json.
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
from bench import common, frontier, harness  # noqa: E402
from loadgen.burst import ReplyReader, percentile, produce  # noqa: E402
from schemas import DoneReply, ErrorReply, Request  # noqa: E402
from worker import metrics  # noqa: E402
from worker.engine import GenParams  # noqa: E402
from worker.worker import Worker  # noqa: E402

OUT = Path(__file__).resolve().parent


def prompt(i: int) -> str:
    """Depends on `i` only, so every run sees the same prompts."""
    return (f"Transaction {i}: amount {10 + 7 * i % 900}.50 USD, merchant electronics, country BR, card not "
            f"present, {i % 13} transactions in 24h. Explain whether it is fraud:")


def body(rid: str, i: int, max_tokens: int, stream: bool = True) -> bytes:
    return msgspec.json.encode({"id": rid, "max_tokens": max_tokens, "stream": stream, "prompt": prompt(i)})


class CountingEngine:
    """The engine, counting the tokens it generates (time, batch or not, how many): batch throughput is
    measured in engine tokens, since requests that run in lockstep finish in bursts."""

    def __init__(self, eng):
        self.eng, self.events = eng, []

    def __getattr__(self, name):
        return getattr(self.eng, name)

    async def generate(self, request_id, prompt_ids, params, priority):
        batch = "-bk" in request_id
        async for d in self.eng.generate(request_id, prompt_ids, params, priority):
            self.events.append((time.monotonic(), batch, len(d.token_ids), request_id))
            yield d


class Window:
    """Realtime latencies of one run, and when its backlog landed."""

    def __init__(self, eng: CountingEngine):
        self.eng, self.first_event = eng, len(eng.events)
        self.rt: dict[str, float] = {}
        self.backlog_at: float | None = None
        self.start = time.monotonic()
        self.extra: dict[str, float] = {}  # sluice loaded runs: batch's cap in force, the step fit

    def summary(self, args) -> dict:
        lat = list(self.rt.values())
        out = {"rt_p50": percentile(lat, 50) if lat else None, "rt_p99": percentile(lat, 99) if lat else None,
               "rt_n": len(lat)}
        events = self.eng.events[self.first_event:]
        end = self.start + args.seconds
        out["tokens_per_s"] = sum(n for t, _, n, _ in events if self.start <= t <= end) / args.seconds
        if self.backlog_at is not None:
            # batch tokens from the backlog's landing to the end of the realtime stream (the same span alone)
            span_end = self.backlog_at + (args.seconds - args.backlog_after)
            out["batch_tok_per_s"] = sum(n for t, b, n, _ in events if b and self.backlog_at <= t <= span_end) / (
                span_end - self.backlog_at)
        out.update(self.extra)
        out["step_ms"] = step_ms(events, self.start, end)
        if out["step_ms"] is not None:
            out["tokens_per_step"] = out["tokens_per_s"] * out["step_ms"] / 1000
        return out


def step_ms(events, start: float, end: float) -> float | None:
    """Median interval between two consecutive single-token outputs of one request inside the window:
    one engine step (each running request gets one token per decode step)."""
    last: dict[str, float] = {}
    gaps = []
    for t, _, n, rid in events:
        if start <= t <= end and n == 1 and rid in last:
            gaps.append(t - last[rid])
        last[rid] = t
    return percentile(gaps, 50) * 1000 if gaps else None


async def sluice_run(s, eng, args, rt: bool, batch: bool, cap: int | None, slo_ms: int | None = None,
                     admission: str | None = None) -> Window:
    tag = uuid.uuid4().hex[:6]  # ids are idempotency keys: never reuse them across runs
    cat = await common.fresh_catalog(s, "iso")
    if cap is not None:
        bt = msgspec.structs.replace(cat.request_topic("batch"), contended_in_engine=cap,
                                     min_in_engine=min(cap, cat.request_topic("batch").min_in_engine))
        cat = msgspec.structs.replace(cat, topic=[bt if t.name == bt.name else t for t in cat.topic])
    if slo_ms is not None:
        rtt = msgspec.structs.replace(cat.request_topic("realtime"), slo_ms=slo_ms)
        cat = msgspec.structs.replace(cat, topic=[rtt if t.name == rtt.name else t for t in cat.topic])
    admission = admission or ("slo" if slo_ms is not None else "fixed")
    worker = Worker(s.override(group_id=f"bench-{uuid.uuid4().hex[:6]}", admission=admission,
                               step_stretch=args.stretch), cat, eng)
    await worker.start()
    while not worker.consumer.assignment():
        await asyncio.sleep(0.1)
    reader = ReplyReader(s.kafka.options(), cat.replies.name)
    await reader.start()
    w, sent = Window(eng), {}
    producer = AIOKafkaProducer(**s.kafka.options(), linger_ms=0)
    await producer.start()
    n = int(args.rate * args.seconds) if rt else 0

    async def backlog():
        await asyncio.sleep(args.backlog_after)
        w.backlog_at = time.monotonic()
        await produce(s.kafka.options(), [(cat.request_topic("batch").name, f"{tag}-bk{i}".encode(),
                                           body(f"{tag}-bk{i}", 10_000 + i, args.batch_tokens, stream=False), [])
                                          for i in range(args.backlog)])

    async def publish():
        start = time.monotonic()
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))
            rid = f"{tag}-rt{i}"
            sent[rid] = time.monotonic()
            await producer.send_and_wait(cat.request_topic("realtime").name, body(rid, i, args.rt_tokens),
                                         key=rid.encode())

    caps: list[int] = []
    suspended_before = metrics.suspended.labels("batch")._value.get()

    async def watch_cap():  # batch's cap while realtime has work, once the backlog landed
        while True:
            await asyncio.sleep(0.1)
            if w.backlog_at is not None and worker.scheduler.running("realtime") + worker.scheduler.waiting("realtime"):
                caps.append(worker.scheduler.cap("batch"))

    tasks = [asyncio.create_task(publish())] + ([asyncio.create_task(backlog())] if batch else [])
    watcher = asyncio.create_task(watch_cap())
    end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < end or (len(w.rt) < n and time.monotonic() < end + args.timeout):
            async for r in reader.records(timeout_ms=50):
                if not isinstance(r, (DoneReply, ErrorReply)):
                    continue
                now = time.monotonic()
                if r.id in sent and r.id not in w.rt:
                    w.rt[r.id] = now - sent[r.id]
        await asyncio.gather(*tasks)
        if rt and batch and caps:
            w.extra["batch_cap"] = percentile(caps, 50)
            w.extra["batch_suspended"] = metrics.suspended.labels("batch")._value.get() - suspended_before
        fit = worker.scheduler.step_budget.model.fit() if worker.scheduler.step_budget is not None else None
        if fit is not None:
            w.extra["fit_fixed_ms"], w.extra["fit_per_token_ms"] = fit.fixed * 1000, fit.per_token * 1000
            w.extra["fit_per_prompt_token_ms"] = fit.per_prompt_token * 1000
    finally:
        watcher.cancel()
        await producer.stop()
        await reader.stop()
        await worker.stop(grace_s=0)
    return w


async def vllm_run(eng, args, rt: bool, batch: bool, batch_priority: int) -> Window:
    """Straight into the engine: the same requests, vLLM's scheduler alone decides."""
    w, tag = Window(eng), uuid.uuid4().hex[:6]
    n = int(args.rate * args.seconds) if rt else 0

    async def one(rid: str, i: int, max_tokens: int, priority: int):
        ids = eng.prompt_ids(Request(id=rid, prompt=prompt(i)))
        async for _ in eng.generate(rid, ids, GenParams(max_tokens), priority):
            pass

    async def realtime():
        start, tasks = time.monotonic(), []
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))

            async def timed(i=i, t0=time.monotonic()):
                await one(f"{tag}-rt{i}", i, args.rt_tokens, 0)
                w.rt[f"rt{i}"] = time.monotonic() - t0
            tasks.append(asyncio.create_task(timed()))
        await asyncio.gather(*tasks)

    async def backlog():
        await asyncio.sleep(args.backlog_after)
        w.backlog_at = time.monotonic()

        await asyncio.gather(*(one(f"{tag}-bk{i}", 10_000 + i, args.batch_tokens, batch_priority)
                               for i in range(args.backlog)))

    bt = asyncio.create_task(backlog()) if batch else None
    rtt = asyncio.create_task(realtime())
    await asyncio.sleep(args.seconds)
    await asyncio.wait_for(rtt, args.timeout)
    if bt is not None:
        bt.cancel()  # the backlog outlasts the window: abort what is left
        await asyncio.gather(bt, return_exceptions=True)
    return w


async def settle(eng, timeout: float = 120.0) -> None:
    """Until the engine holds no request, so each run starts from an idle engine."""
    end = time.monotonic() + timeout
    while eng.unfinished() and time.monotonic() < end:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1)


def step_model(runs: dict[str, list[dict]], summary: dict) -> dict:
    """Per side (sluice, vllm): the step-time fit over its runs and the frontier it implies (bench/frontier.py)."""
    model = {}
    for side in ("sluice", "vllm"):
        points = [(r["tokens_per_step"], r["step_ms"]) for name, rs in runs.items() if name.startswith(side)
                  for r in rs if r.get("step_ms") and r.get("tokens_per_step")]
        rt, batch = summary.get(f"{side} rt alone", {}), summary.get(f"{side} batch alone", {})
        if len(points) < 2 or "tokens_per_s" not in rt or "batch_tok_per_s" not in batch:
            continue
        fixed, per_token = frontier.fit_steps(points)
        f, g = frontier.shares(per_token, rt["tokens_per_s"]["median"], batch["batch_tok_per_s"]["median"])
        model[side] = {"fixed_ms": fixed, "per_token_ms": per_token, "rt_share": f, "batch_share": g,
                       "kept_at_1.2": frontier.kept_at(1.2, f, g), "ratio_at_kept_0.5": frontier.ratio_at(0.5, f, g),
                       "runs_fitted": len(points)}
    return model


def print_model(model: dict) -> None:
    for side, m in model.items():
        print(f"{side} step time: {m['fixed_ms']:.1f} ms + {m['per_token_ms']:.2f} ms per token in the step "
              f"(fit over {m['runs_fitted']} runs); realtime alone takes {m['rt_share']:.2f} of the engine, batch "
              f"alone {m['batch_share']:.2f}; model frontier: batch keeps at most {m['kept_at_1.2']:.2f} of its "
              f"throughput at realtime x1.2, and keeping 0.5 costs realtime x{m['ratio_at_kept_0.5']:.2f}")


def plot(summary: dict, path: Path, model: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in summary.items():
        if "p99_ratio" not in row:
            continue
        x, y = row["batch_kept"]["median"], row["p99_ratio"]["median"]
        ax.errorbar(x, y, xerr=[[x - row["batch_kept"]["min"]], [row["batch_kept"]["max"] - x]],
                    yerr=[[y - row["p99_ratio"]["min"]], [row["p99_ratio"]["max"] - y]],
                    fmt="o" if name.startswith("sluice") else "s", capsize=3, label=name)
    for side, m in (model or {}).items():
        ks = [i / 100 for i in range(0, 100)]
        pts = [(k, frontier.ratio_at(k, m["rt_share"], m["batch_share"])) for k in ks]
        pts = [(k, r) for k, r in pts if r < 50]
        ax.plot([k for k, _ in pts], [r for _, r in pts], ls="--", lw=1,
                label=f"{side} step-time model ({m['fixed_ms']:.0f} + {m['per_token_ms']:.1f} ms/token)")
    ax.axhline(1.2, color="grey", ls=":", lw=1)
    ax.axvline(0.5, color="grey", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("batch throughput kept (loaded / alone)")
    ax.set_ylabel("realtime p99 end-to-end, loaded / alone")
    ax.set_title("Isolation frontier: lower right is better")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args) -> None:
    s = common.settings(SLUICE_IGNORE_EOS="true")
    print("loading the engine ...")
    eng = CountingEngine(await common.engine(s))
    caps = [int(c) for c in args.caps.split(",")]
    runs = {"sluice rt alone": lambda: sluice_run(s, eng, args, True, False, None),
            "sluice batch alone": lambda: sluice_run(s, eng, args, False, True, None),
            **{f"sluice cap={c}": (lambda c=c: sluice_run(s, eng, args, True, True, c)) for c in caps},
            **({"sluice slo": lambda: sluice_run(s, eng, args, True, True, None, args.slo_ms)} if args.slo_ms else {}),
            "sluice step": lambda: sluice_run(s, eng, args, True, True, None, admission="step"),
            "vllm rt alone": lambda: vllm_run(eng, args, True, False, 10),
            "vllm batch alone": lambda: vllm_run(eng, args, False, True, 10),
            "vllm priority": lambda: vllm_run(eng, args, True, True, 10),
            "vllm fifo": lambda: vllm_run(eng, args, True, True, 0)}
    if args.runs:
        wanted = args.runs.split(",")
        unknown = set(wanted) - set(runs)
        if unknown:
            raise SystemExit(f"unknown runs {sorted(unknown)}; known: {list(runs)}")
        runs = {k: v for k, v in runs.items() if k in wanted}
    results: dict[str, list[dict]] = {k: [] for k in runs}
    try:
        async def warm(i):
            async for _ in eng.generate(f"warm-{i}", eng.prompt_ids(Request(id="w", prompt=prompt(i))), GenParams(16), 0):
                pass
        await asyncio.gather(*(warm(i) for i in range(8)))
        order_all = harness.orders(list(runs), args.reps)
        with tqdm(total=len(runs) * args.reps, desc="runs", unit="run") as bar:
            for order in order_all:
                for name in order:
                    results[name].append((await runs[name]()).summary(args))
                    bar.write(f"{name}: {results[name][-1]}")
                    (OUT / "isolation.json").write_text(json.dumps({"partial": True, "runs": results}))
                    await settle(eng)
                    bar.update(1)
    finally:
        eng.shutdown()
    summary: dict[str, dict] = {}
    for name, rs in results.items():
        row = {k: harness.spread([r[k] for r in rs if r.get(k) is not None]) for k in rs[0] if rs[0][k] is not None}
        side = "sluice" if name.startswith("sluice") else "vllm"
        if "rt_p99" in row and "batch_tok_per_s" in row and f"{side} rt alone" in results \
                and f"{side} batch alone" in results:  # a loaded run: against its side's alone runs
            row["p99_ratio"] = harness.spread([r["rt_p99"] / a["rt_p99"]
                                               for r, a in zip(rs, results[f"{side} rt alone"])])
            row["batch_kept"] = harness.spread([r["batch_tok_per_s"] / max(a["batch_tok_per_s"], 1e-9)
                                                for r, a in zip(rs, results[f"{side} batch alone"])])
        summary[name] = row
    print(f"\nrealtime {args.rate}/s for {args.seconds}s x {args.rt_tokens} tokens; backlog {args.backlog} x "
          f"{args.batch_tokens} tokens landing at {args.backlog_after}s; ignore_eos; {args.reps} repetitions; "
          f"{common.machine()}; {common.today()}; rev {common.git_rev()}")

    def cell(row, key, fmt="{:.2f}"):
        v = row.get(key)
        return (fmt.format(v["median"]) + " [" + fmt.format(v["min"]) + "-" + fmt.format(v["max"]) + "]") if v else "-"

    cols = ("rt_p50", "rt_p99", "batch_tok_per_s", "tokens_per_s", "step_ms", "tokens_per_step", "p99_ratio",
            "batch_kept", "batch_cap", "batch_suspended")
    print(f"{'run':20s}" + "".join(f"{c:>22s}" for c in cols))
    for name, row in summary.items():
        print(f"{name:20s}" + "".join(f"{cell(row, c):>22s}" for c in cols))
    model = step_model(results, summary)
    print_model(model)
    for name, row in summary.items():
        if "fit_fixed_ms" in row:
            print(f"{name}: the worker's own step fit at each run's end: {cell(row, 'fit_fixed_ms', '{:.1f}')} ms + "
                  f"{cell(row, 'fit_per_token_ms', '{:.2f}')} ms per decoded token + "
                  f"{cell(row, 'fit_per_prompt_token_ms', '{:.2f}')} ms per prompt token in the step")
    (OUT / "isolation.json").write_text(json.dumps({"args": vars(args), "summary": summary, "runs": results,
                                                    "model": model, "machine": common.machine(),
                                                    "date": common.today(), "rev": common.git_rev()}, indent=2))
    plot(summary, OUT / "isolation.png", model)
    print(f"wrote {OUT / 'isolation.json'} and {OUT / 'isolation.png'}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=4.0, help="realtime requests per second")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rt-tokens", type=int, default=16)
    p.add_argument("--backlog", type=int, default=300)
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--backlog-after", type=float, default=3.0, help="seconds into the realtime stream")
    p.add_argument("--caps", default="2,16,48", help="batch contended_in_engine values to sweep")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--slo-ms", type=int, default=None,
                   help="add the `sluice slo` run: SLO admission with this realtime slo_ms")
    p.add_argument("--stretch", type=float, default=1.2, help="SLUICE_STEP_STRETCH of the `sluice step` run")
    p.add_argument("--runs", default=None, help="comma-separated subset of the runs (default: all)")
    p.add_argument("--report", type=Path, default=None,
                   help="run nothing: print the step-time model of a saved isolation.json and redraw its plot")
    a = p.parse_args()
    if a.report:
        saved = json.loads(a.report.read_text())
        print(f"{a.report}: rev {saved.get('rev')}, {saved.get('date')}, {saved.get('machine')}")
        saved["model"] = step_model(saved["runs"], saved["summary"])
        print_model(saved["model"])
        a.report.write_text(json.dumps(saved, indent=2))
        plot(saved["summary"], a.report.with_suffix(".png"), saved["model"])
    else:
        asyncio.run(main(a))
