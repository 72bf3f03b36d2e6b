"""sluice backfill vs. vLLM offline scoring of the same events, one run.

    python bench/backfill.py [--events 1024]

Publishes N seeded transaction events to a fresh topic, then scores them
  offline  vLLM `LLM.generate` in its own process: the `fraud` template rendered
           per event, one step each with the labels' log-probabilities (the ceiling)
  sluice   `sluice worker` in its own process; `sluice backfill` over the whole
           topic through the batch class, results written to an output topic
and prints both throughputs (events/s), their ratio, and how far sluice's scores
are from the offline ones for the same events. Writes bench/backfill.json.

Both arms get the same engine arguments (`worker.engine.engine_args` from the same
settings) and the same reserved CPUs (`--reserved-cpus`); the engine configuration each arm's
vLLM resolved, its KV cache size and its CPU binding are read from its own log and the script
stops if they differ (`bench/harness.py`). sluice runs without KV pages (the offline arm has no
connector). Rendering and tokenization are inside the timed window in both arms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path

import msgspec
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import common, harness  # noqa: E402
from worker.engine import engine_args, resolve_dtype  # noqa: E402
from loadgen.burst import produce, read_topic  # noqa: E402
from loadgen.events import transactions  # noqa: E402

OUT = Path(__file__).resolve().parent


def offline_child(args) -> None:
    """Own process: render, score with vLLM offline, print one JSON line."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from schemas.templates import Templates

    template = Templates().get("fraud")
    s, _ = common.bench_engine_settings(args)
    llm = LLM(**engine_args(s.engine, resolve_dtype("auto", "cpu")))
    from worker.engine import describe_config

    print(harness.ARM_ENGINE + json.dumps(describe_config(llm.llm_engine.vllm_config)), flush=True)
    tok = llm.get_tokenizer()

    def ids(text: str) -> list[int]:
        msgs = ([{"role": "system", "content": template.system}] if template.system else []) + \
            [{"role": "user", "content": text}]
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)

    labels = list(template.labels)
    firsts = [tok.encode(label, add_special_tokens=False)[0] for label in labels]
    events = transactions(args.events, seed=args.seed)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=firsts)
    llm.generate([TokensPrompt(prompt_token_ids=ids(template.render(e))) for e in events[:8]], sp,
                 use_tqdm=False)  # warm-up
    t0 = time.monotonic()
    # rendering and tokenization inside the timed window, as the worker does them per record
    prompts = [TokensPrompt(prompt_token_ids=ids(template.render(e))) for e in events]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    span = time.monotonic() - t0
    scores = {}
    for e, o in zip(events, outs):
        lp = o.outputs[0].logprobs[0]
        w = [math.exp(lp[t].logprob) for t in firsts]
        scores[e["id"]] = {label: x / sum(w) for label, x in zip(labels, w)}
    print("RESULT " + json.dumps({"seconds": span, "events": len(outs), "scores": scores}), flush=True)


def run_offline(args) -> dict:
    return common.run_offline_child(__file__, args.model, env=common.arm_env(args), log_path=OUT / ".backfill-offline.log")


async def run_sluice(args, s) -> dict:
    from schemas.events import BackfillResult
    from worker.backfill import Backfill, Job

    _, env = common.bench_engine_settings(args, SLUICE_KV_PAGES="false", SLUICE_LOG_LEVEL="info")
    env[common.RESERVED_CPUS_ENV] = str(args.reserved_cpus)
    async with common.worker_process(s, "bb", OUT / ".backfill-worker.log", **env) as cat:
        prefix = cat.replies.name[: -len("sluice.replies")]
        source, out = f"{prefix}events", f"{prefix}scored"
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(**s.kafka.options())
        await admin.start()
        await admin.create_topics([NewTopic(source, 6, 1)])
        await admin.close()
        events = transactions(args.events, seed=args.seed)
        await produce(s.kafka.options(), [(source, e["id"].encode(), msgspec.json.encode(e), []) for e in events])
        # warm the worker with a few score requests of another job
        warm = Backfill(s, cat, Job(source=source, out=f"{out}-warm", template="fraud", stop="8",
                                    name=f"warm-{uuid.uuid4().hex[:6]}"), state_dir=OUT / ".backfill-state",
                        log=lambda *_: None)
        await warm.run()
        job = Job(source=source, out=out, template="fraud", name=f"bench-{uuid.uuid4().hex[:6]}")
        bf = Backfill(s, cat, job,
                      state_dir=OUT / ".backfill-state", max_in_flight=args.max_in_flight,
                      progress=lambda total, initial: tqdm(total=total, initial=initial, desc="sluice backfill",
                                                           unit="ev", mininterval=2),
                      log=lambda *_: None)
        t0 = time.monotonic()
        cp = await bf.run()
        span = time.monotonic() - t0
        assert cp.complete, "backfill did not complete"
        dec = msgspec.json.Decoder(BackfillResult)
        scores = {r.event_id: r.scores for r in (dec.decode(rec.value) for rec in await read_topic(s.kafka.options(), out))}
    return {"seconds": span, "events": cp.events, "errors": cp.errors, "scores": scores}


async def main(args) -> None:
    s = common.settings()
    args.model = args.model or s.engine.model
    print("offline: vLLM LLM in a child process ...", flush=True)
    off = run_offline(args)
    print(f"offline: {off['events'] / off['seconds']:.1f} events/s")
    print("sluice: `sluice worker` + backfill ...", flush=True)
    sl = await run_sluice(args, s)
    reports = {name: harness.arm_report((OUT / f".backfill-{name}.log").read_text(errors="replace"))
               for name in ("offline", "worker")}
    harness.check_alike(reports)
    binding = {name: r["binding"] for name, r in reports.items()}
    diffs = [abs(sl["scores"][k]["fraud"] - v["fraud"]) for k, v in off["scores"].items()
             if sl["scores"].get(k)]
    off_rate, sl_rate = off["events"] / off["seconds"], sl["events"] / sl["seconds"]
    print(f"\n{args.events} transaction events, template fraud, max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, {common.RESERVED_CPUS_ENV}={args.reserved_cpus}; "
          f"{common.machine()}; {common.today()}; rev {common.git_rev()}")
    print("both arms: " + ", ".join(f"{k}={reports['offline'][k]}" for k in harness.COMPARED))
    for name, b in binding.items():
        print(f"  binding {name}: {b}")
    print(f"offline  {off['events']:6d} events {off['seconds']:7.2f} s {off_rate:8.1f} events/s")
    print(f"sluice   {sl['events']:6d} events {sl['seconds']:7.2f} s {sl_rate:8.1f} events/s  ({sl['errors']} errors)")
    print(f"throughput sluice/offline: {sl_rate / off_rate:.3f}")
    print(f"P(fraud) |sluice - offline|: mean {sum(diffs) / max(1, len(diffs)):.2e}, max {max(diffs, default=0):.2e} "
          f"over {len(diffs)} events")
    (OUT / "backfill.json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items() if k != "child_offline"}, "offline_events_per_s": off_rate,
        "sluice_events_per_s": sl_rate, "ratio": sl_rate / off_rate, "score_diff_max": max(diffs, default=0),
        "binding": binding, "arms": reports, "rev": common.git_rev(),
        "machine": common.machine(), "date": common.today()}, indent=2))
    print(f"wrote {OUT / 'backfill.json'}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=1024)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-in-flight", type=int, default=512)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--reserved-cpus", type=int, default=0,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for both arms (0: both compute on every core)")
    p.add_argument("--model", default=None, help="default: the bundled model")
    p.add_argument("--child-offline", action="store_true", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    if a.child_offline:
        offline_child(a)
    else:
        asyncio.run(main(a))
