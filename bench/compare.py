"""sluice through Kafka vs. vLLM's own paths on the same engine, like with like, in one run.

    python bench/compare.py [--requests 128] [--prompt-tokens 128] [--max-tokens 32] [--reps 3] [--engine-start inprocess]

Arms (each in its own process, started once and kept for every repetition):

  offline    vLLM `LLM.generate` on all prompts in one call (the ceiling)
  server     vLLM's OpenAI-compatible server (`bench/serve_arm.py`), one streaming HTTP
             client per request (SSE, `/v1/completions`)
  sluice     `sluice worker`, KV pages off; requests published to the standard topic,
             streamed token records read back from Kafka
  sluice+kv  the same with KV pages saved to Redis Cluster (`--no-pages-arm` drops it)
  sluice+kv@B  with `--budget-mib-s B`: pages saved within a budget of B MiB/s
             (`kv.save_budget_mib_s`); the pages it stored and skipped are read off its /metrics

Every arm gets the same engine arguments (`worker.engine.engine_args` from one settings
object), the same executor (`--engine-start`: vLLM's two processes, an engine core and its
spawned model runner, or `inprocess`, the engine core running the model itself as a sluice
worker's does by default on CPU), the same reserved CPUs (`--reserved-cpus`), `ignore_eos` (sluice: SLUICE_IGNORE_EOS)
so every request generates exactly `--max-tokens`, and the same warm-up. Before any ratio is
printed the script checks, from each arm's own log, the engine configuration vLLM resolved, the
KV cache it sized and the cores it computes on (`bench/harness.py: check_alike`), and that every
arm generated the same token ids for every request (`check_outputs`); either mismatch stops the
run. Each repetition uses fresh prompts (so no arm meets a prefix it cached earlier) and runs
the arms in a rotated order. Prints each arm's throughput and latency as median [min-max]
over the repetitions and the per-repetition ratios against offline and server, and where the
CPU went while each arm ran: its own process, its engine processes, and the Redis Cluster and
broker that `sluice dev up` started (by their pid files); writes bench/compare.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import common, harness  # noqa: E402
from loadgen.burst import COUNTRIES, MERCHANTS, ReplyReader, percentile, produce  # noqa: E402
from schemas import DoneReply, ErrorReply, TokenReply  # noqa: E402
from worker.engine import engine_args, resolve_dtype  # noqa: E402

OUT = Path(__file__).resolve().parent
WARM_UP = [f"warm up {i}" for i in range(8)]


def prompts(model: str, n: int, tokens: int, seed: int = 11) -> list[str]:
    """n distinct transaction-history prompts of about `tokens` tokens each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lines = [f"Customer {seed}-{i} card history:"]
        while len(tok.encode("\n".join(lines))) < tokens + 16:
            lines.append(f"{round(rng.lognormvariate(3.5, 1.2), 2)} USD at {rng.choice(MERCHANTS)} in "
                         f"{rng.choice(COUNTRIES)}, card {'present' if rng.random() < 0.6 else 'not present'}")
        ids = tok.encode("\n".join(lines))[: tokens - 12]
        out.append(tok.decode(ids) + "\nIs the last transaction fraudulent? Explain:")
    return out


def stats(name: str, span: float, outputs: dict[str, list[int]], ttft: list[float], e2e: list[float],
          chunks: int | None = None) -> dict:
    """`chunks`: the streamed pieces the arm delivered (SSE events, token records), when it streams."""
    done, toks = len(outputs), sum(map(len, outputs.values()))
    return {"name": name, "seconds": span, "requests": done, "output_tokens": toks,
            "req_per_s": done / span, "tok_per_s": toks / span,
            "chunks_per_request": float("nan") if chunks is None else chunks / max(1, done),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99)}


# -- offline: a child process that runs one repetition per line on its stdin -------------------

def offline_child(args) -> None:
    from vllm import LLM, SamplingParams

    from worker.engine import describe_config

    s, _ = common.bench_engine_settings(args)
    inprocess = common.inprocess_vllm_arm()
    extra = {}
    if inprocess is not None:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        extra["distributed_executor_backend"] = UniProcExecutor
    llm = LLM(**engine_args(s.engine, resolve_dtype(s.engine.dtype, "cpu")), **extra)
    if inprocess is not None:
        common.check_inprocess_vllm_arm(llm.llm_engine.vllm_config, inprocess)
    print(harness.ARM_ENGINE + json.dumps(describe_config(llm.llm_engine.vllm_config)), flush=True)
    llm.generate(WARM_UP, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    print("READY", flush=True)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for line in sys.stdin:
        ask = json.loads(line)  # the repetition and its prompts, made by the parent
        rep, texts = ask["rep"], ask["texts"]
        t0 = time.monotonic()
        outs = llm.generate(texts, sp, use_tqdm=False)
        span = time.monotonic() - t0
        outputs = {f"{rep}-{i}": list(o.outputs[0].token_ids) for i, o in enumerate(outs)}
        # Offline returns everything at the end: every request's e2e is the whole span.
        print("RESULT " + json.dumps({**stats("offline", span, outputs, [], [span] * len(outs)), "outputs": outputs}),
              flush=True)


class OfflineArm(common.ChildArm):
    def __init__(self, args):
        super().__init__("offline", [sys.executable, __file__, "--child-offline", *sys.argv[1:], "--model", args.model],
                         common.arm_env(args), OUT / ".compare-offline.log")

    async def run(self, rep: int, texts: list[str]) -> dict:
        return await self.ask(json.dumps({"rep": rep, "texts": texts}))


# -- server ------------------------------------------------------------------------------------

class ServerArm:
    name = "server"

    def __init__(self, args):
        self.args, self.log_path = args, OUT / ".compare-server.log"

    async def start(self) -> None:
        import aiohttp

        self.port = common.free_port()
        s, _ = common.bench_engine_settings(self.args)
        self.proc = subprocess.Popen(
            [sys.executable, str(OUT / "serve_arm.py"), "--port", str(self.port), "--host", "127.0.0.1",
             *common.vllm_cli_flags(engine_args(s.engine, resolve_dtype(s.engine.dtype, "cpu"))), "--uvicorn-log-level",
             "warning"], env=common.arm_env(self.args), cwd=ROOT, stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        await common.wait_http(f"http://127.0.0.1:{self.port}/health", self.proc)
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=3600))
        await asyncio.gather(*(self._one(t, 8) for t in WARM_UP))

    async def _one(self, text: str, max_tokens: int, bar=None):
        body = {"model": self.args.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True, "return_token_ids": True}
        t0 = time.monotonic()
        first, ids, chunks = None, [], 0
        async with self.http.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("token_ids"):
                    first = first or time.monotonic() - t0
                    ids += choices[0]["token_ids"]
                    chunks += 1
        if bar:
            bar.update(1)
        return first or time.monotonic() - t0, time.monotonic() - t0, ids, chunks

    async def run(self, rep: int, texts: list[str]) -> dict:
        t0 = time.monotonic()
        with tqdm(total=len(texts), desc=f"server   rep {rep}", unit="req", mininterval=2) as bar:
            res = await asyncio.gather(*(self._one(t, self.args.max_tokens, bar) for t in texts))
        span = time.monotonic() - t0
        outputs = {f"{rep}-{i}": r[2] for i, r in enumerate(res)}
        return {**stats("server", span, outputs, [r[0] for r in res], [r[1] for r in res], sum(r[3] for r in res)),
                "outputs": outputs}

    async def stop(self) -> None:
        await self.http.close()
        common.stop_process(self.proc, 30)


# -- sluice ------------------------------------------------------------------------------------

class SluiceArm:
    def __init__(self, args, s, pages: bool, budget_mib_s: float = 0):
        self.args, self.s, self.pages, self.budget = args, s, pages, budget_mib_s
        self.burst = args.burst_s
        self.name = ("sluice+kv" if pages else "sluice") + (
            f"@{budget_mib_s:g}" + (f"+{self.burst:g}s" if self.burst != 1 else "") if budget_mib_s else "")
        self.metrics_port = common.free_port()
        self.log_path = OUT / f".compare-{self.name}.log"
        self.stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        # pages live 10 minutes, not an hour: a repetition takes about one, and the pages of every
        # repetition (and their replicas) beside four engines filled 24 GB once (an engine was OOM-killed)
        _, env = common.bench_engine_settings(self.args, SLUICE_KV_PAGES=str(self.pages).lower(),
                                              SLUICE_IGNORE_EOS="true", SLUICE_LOG_LEVEL="info",
                                              SLUICE_KV_TTL_S="600", SLUICE_KV_SAVE_BUDGET_MIB_S=str(self.budget),
                                              SLUICE_KV_SAVE_BURST_S=str(self.burst),
                                              SLUICE_METRICS_PORT=str(self.metrics_port),
                                              SLUICE_KAFKA_FETCH_MAX_WAIT_MS=str(self.args.fetch_max_wait_ms))
        env[common.RESERVED_CPUS_ENV] = str(self.args.reserved_cpus)
        procs = []
        self.cat = await self.stack.enter_async_context(
            common.worker_process(self.s, "bc", self.log_path, procs, **env))
        self.proc = procs[0]
        self.pid = self.proc.pid
        self.topic = self.cat.request_topic("standard").name
        self.tag = uuid.uuid4().hex[:6]
        await self._burst([{"id": f"{self.tag}-w{i}", "prompt": t, "max_tokens": 8} for i, t in enumerate(WARM_UP)])

    async def _burst(self, bodies: list[dict], bar=None):
        reader = ReplyReader(self.s.kafka.options(), self.cat.replies.name)
        await reader.start()
        first, done, ids = {}, {}, {b["id"]: {} for b in bodies}
        try:
            t0 = time.monotonic()
            await produce(self.s.kafka.options(),
                          [(self.topic, b["id"].encode(), msgspec.json.encode(b), []) for b in bodies])
            while len(done) < len(bodies):
                if self.proc.poll() is not None:  # a worker that failed closed: stop, do not wait forever
                    raise SystemExit(f"{self.name}: the worker exited with {self.proc.returncode} after "
                                     f"{len(done)} of {len(bodies)} answers; see {self.log_path}")
                async for r in reader.records(timeout_ms=100):
                    if r.id not in ids or r.id in done:
                        continue
                    now = time.monotonic()
                    if isinstance(r, TokenReply):
                        first.setdefault(r.id, now)
                        ids[r.id][r.seq] = r.token_ids
                    elif isinstance(r, (DoneReply, ErrorReply)):
                        done[r.id] = (now, r)
                        if bar:
                            bar.update(1)
            errors = [r for _, r in done.values() if isinstance(r, ErrorReply)]
            if errors:
                raise SystemExit(f"{self.name}: {len(errors)} error replies, e.g. {errors[0]}")
            self.seqs = ids  # token records per request, by seq
            return t0, first, done, {k: [t for _, chunk in sorted(v.items()) for t in chunk] for k, v in ids.items()}
        finally:
            await reader.stop()

    async def run(self, rep: int, texts: list[str]) -> dict:
        bodies = [{"id": f"{self.tag}-{rep}-{i}", "prompt": t, "max_tokens": self.args.max_tokens}
                  for i, t in enumerate(texts)]
        pages0 = await self.page_counts()
        with tqdm(total=len(bodies), desc=f"{self.name:8s} rep {rep}", unit="req", mininterval=2) as bar:
            t0, first, done, ids = await self._burst(bodies, bar)
        await asyncio.sleep(1)  # connector counts ride on later steps' reports: let the last ones land
        pages = {k: (v - pages0[k]) / len(bodies) for k, v in (await self.page_counts()).items()}
        span = max(t for t, _ in done.values()) - t0
        outputs = {k.removeprefix(f"{self.tag}-"): v for k, v in ids.items()}
        chunks = sum(len(per_seq) for per_seq in self.seqs.values())
        return {**stats(self.name, span, outputs, [first[i] - t0 for i in done], [done[i][0] - t0 for i in done],
                        chunks), **pages, "outputs": outputs}

    async def page_counts(self) -> dict[str, float]:
        """KV pages this worker stored and skipped over budget so far (per request once differenced)."""
        return {"pages_stored": await common.scrape_metric(self.metrics_port, "sluice_kv_pages_total", op="stored"),
                "pages_over_budget": await common.scrape_metric(self.metrics_port, "sluice_kv_save_failures_total",
                                                                reason="over_budget")}

    async def stop(self) -> None:
        await self.stack.aclose()


async def idle_cores(arms, seconds: float = 5) -> dict[str, float]:
    """Cores each arm's processes keep busy while no requests are sent."""
    await asyncio.sleep(3)
    before = {a.name: sum(harness.cpu_seconds(a.pid).values()) for a in arms}
    await asyncio.sleep(seconds)
    return {a.name: (sum(harness.cpu_seconds(a.pid).values()) - before[a.name]) / seconds for a in arms}


# -- the run -----------------------------------------------------------------------------------

def table(summary: dict[str, dict]) -> str:
    cols = ("req_per_s", "tok_per_s", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "chunks_per_request",
            "cpu_front_ms_per_request", "cpu_engine_ms_per_request", "cpu_redis_ms_per_request",
            "cpu_broker_ms_per_request", "pages_stored", "pages_over_budget")
    heads = {"pages_stored": "pages stored/req", "pages_over_budget": "pages skipped/req", "cpu_front_ms_per_request": "front cpu ms/req", "cpu_engine_ms_per_request": "engine cpu ms/req",
             "cpu_redis_ms_per_request": "redis cpu ms/req", "cpu_broker_ms_per_request": "broker cpu ms/req",
             "chunks_per_request": "chunks/req"}
    rows = [f"{'arm':16s}" + "".join(f"{heads.get(c, c):>22s}" for c in cols)]
    for name, per in summary.items():
        cells = []
        for c in cols:
            v = per.get(c)
            cells.append("-" if v is None or v["median"] != v["median"] else f"{v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]")
        rows.append(f"{name:16s}" + "".join(f"{x:>22s}" for x in cells))
    return "\n".join(rows)


async def main(args) -> None:
    s = common.settings()
    args.model = args.model or s.engine.model
    args.fetch_max_wait_ms = args.fetch_max_wait_ms or s.kafka.fetch_max_wait_ms
    arms = [OfflineArm(args), ServerArm(args), SluiceArm(args, s, pages=False)]
    if not args.no_pages_arm:
        arms.append(SluiceArm(args, s, pages=True))
    if args.budget_mib_s:
        arms.append(SluiceArm(args, s, pages=True, budget_mib_s=args.budget_mib_s))
    by_name = {a.name: a for a in arms}
    started = []
    try:
        for arm in arms:
            print(f"{arm.name}: starting ...", flush=True)
            await arm.start()
            started.append(arm)
        reports = {a.name: harness.arm_report(a.log_path.read_text(errors="replace")) for a in arms}
        harness.check_alike(reports)
        # Arms wait while the others run: what each uses while it waits competes with the one measured.
        idle = await idle_cores(arms)
        runs: dict[str, list[dict]] = {a.name: [] for a in arms}
        for rep, order in enumerate(harness.orders(list(by_name), args.reps)):
            texts = prompts(args.model, args.requests, args.prompt_tokens, seed=11 + rep)
            for name in order:
                arm = by_name[name]
                cpu0 = {**harness.cpu_seconds(arm.pid), **harness.service_cpu_seconds()}
                result = await arm.run(rep, texts)
                cpu1 = {**harness.cpu_seconds(arm.pid), **harness.service_cpu_seconds()}
                # where the CPU went while this arm ran: its own process (front end), its engine
                # processes, and the Redis Cluster and broker on the same cores
                result.update({f"cpu_{k}_ms_per_request": 1000 * (cpu1[k] - cpu0[k]) / len(texts) for k in cpu0})
                runs[name].append(result)
        idle_after = await idle_cores(arms)
    finally:
        for arm in started:
            await arm.stop()
    compared = harness.check_outputs({n: {k: v for r in rs for k, v in r.pop("outputs").items()}
                                      for n, rs in runs.items()})
    summary = {n: {k: harness.spread([r[k] for r in rs]) for k in rs[0] if k not in ("name",)}
               for n, rs in runs.items()}
    ratios = {f"{arm}/{ref}": harness.spread([a["tok_per_s"] / b["tok_per_s"] for a, b in zip(runs[arm], runs[ref])])
              for arm in runs if arm.startswith("sluice") for ref in ("offline", "server")}
    for arm in runs:
        if arm.startswith("sluice+kv"):
            ratios[f"{arm}/sluice"] = harness.spread([a["tok_per_s"] / b["tok_per_s"]
                                                      for a, b in zip(runs[arm], runs["sluice"])])
    print(f"\n{args.requests} requests x ~{args.prompt_tokens} prompt tokens x {args.max_tokens} output tokens "
          f"(ignore_eos), greedy, {args.reps} repetitions in rotated order; {common.machine()}; {common.today()}; "
          f"rev {common.git_rev()}; workers' fetch wait {args.fetch_max_wait_ms} ms")
    first = reports[arms[0].name]
    print("every arm: " + ", ".join(f"{k}={first[k]}" for k in harness.COMPARED))
    for name, r in reports.items():
        print(f"  {name:10s} kv_connector={r.get('kv_connector')}, {r['binding']}")
    print(f"same token ids in every arm for all {compared} requests; cores used by each arm while waiting "
          f"(before / after the runs): "
          + ", ".join(f"{k} {v:.2f} / {idle_after[k]:.2f}" for k, v in idle.items()))
    print(table(summary))
    for k, v in ratios.items():
        print(f"throughput {k:18s} {v['median']:.3f}  [{v['min']:.3f}-{v['max']:.3f}]  runs "
              + " ".join(f"{x:.3f}" for x in v["runs"]))
    (OUT / "compare.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "child_offline"}, "arms": reports, "summary": summary,
         "runs": runs, "ratios": ratios, "requests_compared": compared,
         "idle_cores_per_arm": {"before": idle, "after": idle_after},
         "machine": common.machine(), "date": common.today(), "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'compare.json'}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--reserved-cpus", type=int, default=0,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every arm (0: every arm computes on every core)")
    p.add_argument("--no-pages-arm", action="store_true", help="leave out sluice with KV pages in Redis")
    p.add_argument("--budget-mib-s", type=float, default=0,
                   help="add an arm saving pages within this budget (kv.save_budget_mib_s)")
    p.add_argument("--burst-s", type=float, default=1.0,
                   help="seconds of unused budget that arm's bucket keeps (kv.save_burst_s); the arm is named @B+Ns")
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--engine-start", choices=("forkserver", "inprocess"), default="forkserver",
                   help="every arm's engine: vLLM's multiprocess executor (a spawned model runner), or the "
                        "engine core running the model itself (sluice's default on CPU); the same in every arm")
    p.add_argument("--fetch-max-wait-ms", type=int, default=None,
                   help="kafka.fetch_max_wait_ms of the sluice arms (default: the setting's); idle arms poll the "
                        "broker this often while the others run")
    p.add_argument("--child-offline", action="store_true", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    if a.child_offline:
        offline_child(a)
    else:
        asyncio.run(main(a))
