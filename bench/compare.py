"""sluice through Kafka vs. vLLM's own paths, same prompts, same machine, one run.

    python bench/compare.py [--requests 256] [--prompt-tokens 128] [--max-tokens 32]

Three runs of one workload (greedy, the bundled model, every request submitted
at once, the engine admitting up to `--max-num-seqs`):

  offline  vLLM `LLM.generate` on all prompts in one call (the ceiling)
  server   vLLM's OpenAI-compatible server in its own process, one streaming
           HTTP client per request (SSE, `/v1/completions`)
  sluice   `sluice worker` in its own process; requests published to the
           standard topic, streamed token replies read back from Kafka

Each path runs in its own process with the same engine arguments (built once by
`worker.engine.engine_args` from the same settings: dtype, lengths, batch sizes, priority
scheduling, prefix caching), the same reserved CPUs (`--reserved-cpus`, the script checks
each arm's binding in its log and stops if they differ), the same warm-up, and
sluice without KV pages (the others save none; `--sluice-pages` adds a fourth arm
with them, to show what they cost). Output token totals are compared: greedy
decoding on one model should give the same lengths, and the script says when not. Prints throughput (requests/s, output tokens/s), TTFT and
end-to-end percentiles, and the ratios sluice/offline and sluice/server;
writes bench/compare.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from worker.engine import engine_args, resolve_dtype  # noqa: E402
from loadgen.burst import COUNTRIES, MERCHANTS, ReplyReader, percentile, produce  # noqa: E402
from schemas import DoneReply, ErrorReply  # noqa: E402

OUT = Path(__file__).resolve().parent


def prompts(model: str, n: int, tokens: int, seed: int = 11) -> list[str]:
    """n distinct transaction-history prompts of about `tokens` tokens each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lines = [f"Customer {i} card history:"]
        while len(tok.encode("\n".join(lines))) < tokens + 16:
            lines.append(f"{round(rng.lognormvariate(3.5, 1.2), 2)} USD at {rng.choice(MERCHANTS)} in "
                         f"{rng.choice(COUNTRIES)}, card {'present' if rng.random() < 0.6 else 'not present'}")
        ids = tok.encode("\n".join(lines))[: tokens - 12]
        out.append(tok.decode(ids) + "\nIs the last transaction fraudulent? Explain:")
    return out


def stats(name: str, span: float, done: int, out_tokens: int, ttft: list[float], e2e: list[float]) -> dict:
    return {"name": name, "seconds": span, "requests": done, "output_tokens": out_tokens,
            "req_per_s": done / span, "tok_per_s": out_tokens / span,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99)}


# -- (a) offline -------------------------------------------------------------

def offline_child(args) -> None:
    """Runs in its own process: prints one JSON line with the result."""
    from vllm import LLM, SamplingParams

    texts = prompts(args.model, args.requests, args.prompt_tokens)
    s, _ = common.bench_engine_settings(args)
    llm = LLM(**engine_args(s.engine, resolve_dtype("auto", "cpu")))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm.generate([f"warm up {i}" for i in range(8)], SamplingParams(max_tokens=8), use_tqdm=False)
    t0 = time.monotonic()
    outs = llm.generate(texts, sp, use_tqdm=False)
    span = time.monotonic() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    # Offline returns everything at the end: every request's e2e is the whole span.
    print("RESULT " + json.dumps(stats("offline", span, len(outs), toks, [], [span] * len(outs))), flush=True)


def run_offline(args) -> dict:
    return common.run_offline_child(__file__, args.model, env=common.arm_env(args), log_path=OUT / ".compare-offline.log")


# -- (b) OpenAI server -------------------------------------------------------

async def run_server(args, texts: list[str]) -> dict:
    import aiohttp

    port = common.free_port()
    env = common.arm_env(args)
    s, _ = common.bench_engine_settings(args)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port), "--host", "127.0.0.1",
         *common.vllm_cli_flags(engine_args(s.engine, resolve_dtype("auto", "cpu"))), "--uvicorn-log-level", "warning"],
        env=env, cwd=ROOT, stdout=open(OUT / ".compare-server.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        await common.wait_http(f"http://127.0.0.1:{port}/health", proc)
        url = f"http://127.0.0.1:{port}/v1/completions"
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as http:
            async def one(text: str, bar=None):
                body = {"model": args.model, "prompt": text, "max_tokens": args.max_tokens, "temperature": 0.0,
                        "stream": True, "stream_options": {"include_usage": True}}
                t0 = time.monotonic()
                first, toks = None, 0
                async with http.post(url, json=body) as r:
                    r.raise_for_status()
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                            first = time.monotonic() - t0
                        if chunk.get("usage"):
                            toks = chunk["usage"]["completion_tokens"]
                if bar:
                    bar.update(1)
                return first or time.monotonic() - t0, time.monotonic() - t0, toks

            await asyncio.gather(*(one(f"warm up {i}") for i in range(8)))
            t0 = time.monotonic()
            with tqdm(total=len(texts), desc="server", unit="req", mininterval=2) as bar:
                res = await asyncio.gather(*(one(t, bar) for t in texts))
            span = time.monotonic() - t0
        return stats("server", span, len(res), sum(r[2] for r in res), [r[0] for r in res], [r[1] for r in res])
    finally:
        common.stop_process(proc, 30)


# -- (c) sluice --------------------------------------------------------------

async def run_sluice(args, texts: list[str], s, pages: bool = False) -> dict:
    _, env = common.bench_engine_settings(args, SLUICE_KV_PAGES=str(pages).lower())
    env[common.RESERVED_CPUS_ENV] = str(args.reserved_cpus)
    name = "sluice+kv" if pages else "sluice"
    async with common.worker_process(s, "bc", OUT / f".compare-{name}.log", **env) as cat:
        topic = cat.request_topic("standard").name
        tag = uuid.uuid4().hex[:6]

        async def burst(bodies: list[dict], bar=None):
            reader = ReplyReader(s.kafka.options(), cat.replies.name)
            await reader.start()
            sent, first, done = {}, {}, {}
            try:
                t0 = time.monotonic()
                for b in bodies:
                    sent[b["id"]] = t0
                await produce(s.kafka.options(), [(topic, b["id"].encode(), msgspec.json.encode(b), []) for b in bodies])
                while len(done) < len(bodies):
                    async for r in reader.records(timeout_ms=100):
                        if r.id not in sent or r.id in done:
                            continue
                        now = time.monotonic()
                        first.setdefault(r.id, now)
                        if isinstance(r, (DoneReply, ErrorReply)):
                            done[r.id] = (now, r)
                            if bar:
                                bar.update(1)
                return t0, sent, first, done
            finally:
                await reader.stop()

        await burst([{"id": f"{tag}-w{i}", "prompt": f"warm up {i}", "max_tokens": 8} for i in range(8)])
        bodies = [{"id": f"{tag}-{i}", "prompt": t, "max_tokens": args.max_tokens} for i, t in enumerate(texts)]
        with tqdm(total=len(bodies), desc=name, unit="req", mininterval=2) as bar:
            t0, sent, first, done = await burst(bodies, bar)
    span = max(t for t, _ in done.values()) - t0
    errors = [r for _, r in done.values() if isinstance(r, ErrorReply)]
    if errors:
        print(f"  {len(errors)} error replies, e.g. {errors[0]}")
    toks = sum(r.usage.completion_tokens for _, r in done.values() if isinstance(r, DoneReply))
    return stats(name, span, len(done), toks, [first[i] - sent[i] for i in done], [done[i][0] - sent[i] for i in done])


def table(results: list[dict]) -> str:
    rows = [f"{'path':9s} {'req/s':>7s} {'tok/s':>7s} {'ttft p50':>9s} {'ttft p99':>9s} {'e2e p50':>8s} {'e2e p99':>8s}"]
    for r in results:
        rows.append(f"{r['name']:9s} {r['req_per_s']:7.2f} {r['tok_per_s']:7.1f} {r['ttft_p50']:8.2f}s "
                    f"{r['ttft_p99']:8.2f}s {r['e2e_p50']:7.2f}s {r['e2e_p99']:7.2f}s")
    return re.sub(r"nans", "  - ", "\n".join(rows))


async def main(args) -> None:
    s = common.settings()
    args.model = args.model or s.engine.model
    texts = prompts(args.model, args.requests, args.prompt_tokens)
    results = []
    print("offline: loading vLLM LLM in a child process ...", flush=True)
    results.append(run_offline(args))
    print(f"offline: {results[-1]['req_per_s']:.2f} req/s")
    print("server: starting vLLM's OpenAI server ...", flush=True)
    results.append(await run_server(args, texts))
    print("sluice: starting `sluice worker` ...", flush=True)
    results.append(await run_sluice(args, texts, s))
    logs = {"offline": ".compare-offline.log", "server": ".compare-server.log", "sluice": ".compare-sluice.log"}
    if args.sluice_pages:
        print("sluice+kv: starting `sluice worker` with KV pages ...", flush=True)
        results.append(await run_sluice(args, texts, s, pages=True))
        logs["sluice+kv"] = ".compare-sluice+kv.log"
    binding = common.same_binding({k: (OUT / v).read_text(errors="replace") for k, v in logs.items()})
    by = {r["name"]: r for r in results}
    print(f"\n{args.requests} requests x ~{args.prompt_tokens} prompt tokens x {args.max_tokens} output tokens, "
          f"greedy, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"{common.RESERVED_CPUS_ENV}={args.reserved_cpus}; {common.machine()}; {common.today()}; rev {common.git_rev()}")
    for name, b in binding.items():
        print(f"  binding {name}: {b}")
    print(table(results))
    counts = {r["name"]: r["output_tokens"] for r in results}
    if max(counts.values()) > 1.02 * min(counts.values()):
        print(f"output token totals differ by more than 2% ({counts}): tokens/s ratios are not like with like")
    ratios = {f"{arm}/{ref}": by[arm]["tok_per_s"] / by[ref]["tok_per_s"]
              for arm in by if arm.startswith("sluice") for ref in ("offline", "server")}
    for k, v in ratios.items():
        print(f"throughput {k}: {v:.3f}")
    (OUT / "compare.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "child_offline"},
                                                  "results": results, "ratios": ratios, "binding": binding,
                                                  "output_tokens": counts,
                                                  "machine": common.machine(), "date": common.today()}, indent=2))
    print(f"wrote {OUT / 'compare.json'}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--reserved-cpus", type=int, default=0,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every arm (0: every arm computes on every core)")
    p.add_argument("--sluice-pages", action="store_true", help="a fourth arm: sluice with KV pages in Redis")
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--child-offline", action="store_true", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    if a.child_offline:
        offline_child(a)
    else:
        asyncio.run(main(a))
