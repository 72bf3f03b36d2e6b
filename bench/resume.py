"""Resuming a request on another worker: KV pages from Redis vs. recomputing the prefix.

    python bench/resume.py [--model smollm2|mla] [--prompts 6] [--prompt-tokens 1000] [--generated 64]

One engine (real model, KV pages on). For each ~1k-token prompt, a first owner
generates `--generated` tokens (its pages go to Redis) and "dies". Then, with the
local prefix cache emptied as on a fresh worker, the request is picked up with
prompt + generated tokens as its prefix, the way sluice resumes it:
  pages      the connector finds the prefix's pages in Redis and loads them
  recompute  the same prefix with the connector not consulted: full prefill
Prints the median time from pick-up to the first new token of each, their
ratio, the greedy continuations' agreement, and Redis store/load bandwidth
for the pages of one prompt, and the page bytes per token, measured in Redis and
expected from the model's KV shape. `--model mla` runs the tiny DeepSeek-V2-style
model (multi-head latent attention; `sluice model prepare --mla`) instead of
SmolLM2 (grouped-query attention, the same 30 layers). Writes bench/resume.json
(bench/resume-mla.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from loadgen.events import transactions  # noqa: E402

OUT = Path(__file__).resolve().parent


def long_prompt(tok, i: int, tokens: int) -> list[int]:
    lines = [f"Account {i}: card transactions of the last 30 days, oldest first."]
    for e in transactions(400, seed=100 + i):
        lines.append(f"{e['timestamp'][:16]} {e['amount']} {e['currency']} {e['merchant_id']} mcc {e['mcc']} "
                     f"{e['country']} {e['channel']}")
        if len(lines) % 8 == 0 and len(tok.encode("\n".join(lines))) > tokens:
            break
    ids = tok.encode("\n".join(lines))[:tokens - 10]
    return ids + tok.encode("\nThe riskiest transaction above is", add_special_tokens=False)


async def first_token(eng, rid: str, ids: list[int], tenant: str | None, max_tokens: int = 8):
    from worker.engine import GenParams

    t0 = time.monotonic()
    ttft, text, last = None, [], None
    async for d in eng.generate(rid, ids, GenParams(max_tokens, tenant=tenant, save_pages=tenant is not None), 0):
        if ttft is None and d.token_ids:
            ttft = time.monotonic() - t0
        text.append(d.text)
        last = d
    return ttft, "".join(text), last


async def wait_pages(redis, keys, timeout=120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(redis.exists(k) for k in keys):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError("pages were not stored")


MODELS = {"smollm2": "worker.model:prepare", "mla": "worker.model_mla:prepare_mla"}


def kv_bytes_per_token(config: dict, itemsize: int) -> tuple[str, int]:
    """What one token's KV takes across all layers, from the model's config."""
    layers = config["num_hidden_layers"]
    if "kv_lora_rank" in config:  # MLA: one latent plus the shared rope key per token and layer
        return "MLA latent", layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * itemsize
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return "GQA K+V", layers * 2 * config["num_key_value_heads"] * head_dim * itemsize


async def main(args) -> None:
    import importlib

    import torch
    from redis.cluster import RedisCluster

    from worker import kv_pages

    module, fn = MODELS[args.model].split(":")
    model_dir = getattr(importlib.import_module(module), fn)(log=lambda *_: None)
    s = common.settings(SLUICE_MODEL=str(model_dir))
    print("loading the engine ...", flush=True)
    eng = await common.engine(s)
    redis = RedisCluster.from_url(s.redis.url)
    tok = eng._tokenizer
    tenant = "bench"
    rows = []
    try:
        await first_token(eng, "warm", tok.encode("warm up"), None)
        for i in tqdm(range(args.prompts), desc="prompts", unit="prompt"):
            ids = long_prompt(tok, i, args.prompt_tokens)
            # the first owner: generates, its pages (prompt and decode) go to Redis
            _, gen_text, _ = await first_token(eng, f"owner-{i}", ids, tenant, args.generated)
            generated = tok.encode(gen_text, add_special_tokens=False)[: args.generated]
            prefix = ids + generated
            seed = kv_pages.root(eng.fingerprint, tenant)
            keys = [kv_pages.key(s.redis.key_prefix, d)
                    for d in kv_pages.chain(seed, prefix, eng.block_size, (len(prefix) - 1) // eng.block_size)]
            await wait_pages(redis, keys[: (len(ids) - 1) // eng.block_size])
            present = sum(bool(redis.exists(k)) for k in keys)
            # a fresh worker picks it up: nothing in its local prefix cache
            await eng.reset_prefix_cache()
            t_pages, text_pages, done = await first_token(eng, f"resume-{i}", prefix, tenant)
            await eng.reset_prefix_cache()
            t_recompute, text_recompute, _ = await first_token(eng, f"recompute-{i}", prefix, None)
            rows.append({"prefix_tokens": len(prefix), "pages_in_redis": present, "pages_needed": len(keys),
                         "loaded_tokens": (done.kv or {}).get("loaded_tokens", 0), "ttft_pages": t_pages,
                         "ttft_recompute": t_recompute, "same_text": text_pages == text_recompute})
        # bandwidth on the pages of the last prompt
        values = [redis.get(k) for k in keys[:present]]
        nbytes = sum(len(v) for v in values if v)
        t0 = time.monotonic()
        pipe = redis.pipeline(transaction=False)
        for k in keys[:present]:
            pipe.get(k)
        pipe.execute()
        load_s = time.monotonic() - t0
        t0 = time.monotonic()
        pipe = redis.pipeline(transaction=False)
        for k, v in zip(keys[:present], values):
            pipe.set(k, v, ex=s.kv.ttl_s)
        pipe.execute()
        store_s = time.monotonic() - t0
        itemsize = torch.empty(0, dtype=eng._llm.model_config.dtype).element_size()
        dtype = str(eng._llm.model_config.dtype).removeprefix("torch.")
    finally:
        eng.shutdown()
        redis.close()
    kind, expected = kv_bytes_per_token(json.loads((Path(model_dir) / "config.json").read_text()), itemsize)
    per_token = nbytes / present / eng.block_size
    med_pages = statistics.median(r["ttft_pages"] for r in rows)
    med_rec = statistics.median(r["ttft_recompute"] for r in rows)
    print(f"\n{args.prompts} prompts x ~{rows[0]['prefix_tokens']} prefix tokens ({args.generated} generated); "
          f"{common.machine()}; {common.today()}; rev {common.git_rev()}")
    print(f"{'prefix':>7s} {'pages':>9s} {'loaded':>7s} {'pages s':>8s} {'recompute s':>11s} same")
    for r in rows:
        print(f"{r['prefix_tokens']:7d} {r['pages_in_redis']:4d}/{r['pages_needed']:<4d} {r['loaded_tokens']:7d} "
              f"{r['ttft_pages']:8.3f} {r['ttft_recompute']:11.3f} {r['same_text']}")
    print(f"median pick-up to first new token: pages {med_pages:.3f} s, recompute {med_rec:.3f} s, "
          f"ratio {med_pages / med_rec:.3f}")
    print(f"redis: {present} pages, {nbytes / 1e6:.1f} MB; load {nbytes / load_s / 1e6:.0f} MB/s, "
          f"store {nbytes / store_s / 1e6:.0f} MB/s (one pipelined round each)")
    print(f"{args.model}: {per_token:.0f} page bytes per token in Redis ({eng.block_size}-token pages, {dtype}); "
          f"{kind} {expected} bytes per token")
    out = Path(args.out) if args.out else OUT / ("resume.json" if args.model == "smollm2" else f"resume-{args.model}.json")
    out.write_text(json.dumps({
        "args": vars(args), "model": str(model_dir), "dtype": dtype, "block_size": eng.block_size,
        "page_bytes_per_token": per_token, "kv_kind": kind, "kv_bytes_per_token": expected, "rows": rows, "median_pages_s": med_pages, "median_recompute_s": med_rec,
        "ratio": med_pages / med_rec, "load_mb_s": nbytes / load_s / 1e6, "store_mb_s": nbytes / store_s / 1e6,
        "sealed": s.redis.encryption_keys_file is not None, "machine": common.machine(), "date": common.today()},
        indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--generated", type=int, default=64)
    p.add_argument("--out", help="where to write the JSON (default bench/resume[-MODEL].json)")
    asyncio.run(main(p.parse_args()))
