"""How long a long prompt's KV pages wait, once computed, until Redis has them.

    python bench/page_lag.py [--requests 3] [--prompt-tokens 1536] [--max-tokens 96]

A worker that dies within that time leaves those pages unsaved, and its successor computes that
part of the prompt again. One `sluice worker` on fresh topics of its own (the dev stack, as every
bench), `--requests` streamed requests with the failover bench's prompts sent one after another
(`sluice ask`), then the worker's own counts: `sluice_kv_page_lag_seconds_total` over the pages
stored (from the engine step that computed a page until Redis acknowledged its own SET), beside the writer's
time per page (`sluice_kv_seconds_total{op="stored"}`: framing and the SET round, each batch of
pages counted once). Engine settings are the worker's defaults (`SLUICE_DTYPE` and the rest from
the environment). Writes bench/page_lag.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.resume import long_prompt  # noqa: E402

OUT = Path(__file__).resolve().parent


async def main(args) -> dict:
    from transformers import AutoTokenizer

    s = common.settings()
    tok = AutoTokenizer.from_pretrained(s.engine.model)
    log_path = OUT / ".page-lag-worker.log"
    port = common.free_port()
    answers = []
    async with common.worker_process(s, "lag", log_path, SLUICE_METRICS_PORT=str(port), SLUICE_LOG_LEVEL="info"):
        env = {**os.environ, "SLUICE_TOPICS_FILE": str(log_path.with_suffix(".topics.toml")),
               "SLUICE_KAFKA_IDEMPOTENCE": "false"}
        # Two one-token requests at the end: the engine ships the writer's counts with its next step, and
        # they ride on a request that finishes after that step (vLLM finishes a step's requests before it
        # reads the step's connector output), so an engine gone idle holds the last counts until then.
        for i in range(args.requests + 2):
            last = i >= args.requests
            prompt = "tail" if last else tok.decode(long_prompt(tok, 2000 + i, args.prompt_tokens))
            done = subprocess.run([sys.executable, "-m", "worker.cli", "ask", "--json", "--max-tokens",
                                   "1" if last else str(args.max_tokens), prompt],
                                  env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"sluice ask failed: {done.stderr[-2000:]}")
            reply = json.loads(done.stdout.strip().splitlines()[-1])
            if not last:
                # `sluice ask` says how long the request took, as its client saw it
                took = next((line for line in (done.stderr + done.stdout).splitlines() if line.startswith("done in")), "")
                answers.append({"usage": reply.get("usage"), "client": took})
                print(f"request {i + 1}/{args.requests}: {took}", flush=True)
            await asyncio.sleep(0 if last else 2)
        scrape = {name: await common.scrape_metric(port, metric, **labels) for name, metric, labels in (
            ("pages", "sluice_kv_pages_total", {"op": "stored"}),
            ("lag_s", "sluice_kv_page_lag_seconds_total", {}),
            ("encode_s", "sluice_kv_seconds_total", {"op": "stored", "part": "encode"}),
            ("redis_s", "sluice_kv_seconds_total", {"op": "stored", "part": "redis"}))}
    if not scrape["pages"]:
        raise SystemExit("no pages stored: are KV pages on (SLUICE_KV_PAGES)?")
    per_page = {k: scrape[k] / scrape["pages"] for k in ("lag_s", "encode_s", "redis_s")}
    print(f"\npages stored {scrape['pages']:.0f}; per page: lag {per_page['lag_s']:.3f} s (computed -> in Redis); "
          f"writer time, each batch counted once: framing {per_page['encode_s']:.4f} s, SET round "
          f"{per_page['redis_s']:.4f} s")
    return {"machine": common.machine(), "date": common.today(), "rev": common.git_rev(), "args": vars(args),
            "dtype": s.engine.dtype, "requests": answers, "counts": scrape, "per_page": per_page}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=96)
    result = asyncio.run(main(p.parse_args()))
    (OUT / "page_lag.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT / 'page_lag.json'}")
