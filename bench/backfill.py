"""sluice backfill vs. vLLM offline scoring of the same events.

    python bench/backfill.py [--events 1024] [--reps 3]

Each repetition publishes N transaction events (seeded by the repetition) to a fresh topic, and
both arms score the same events, in a rotated order:
  offline  vLLM `LLM.generate` in its own process: the `fraud` template rendered
           per event, one step each with the labels' log-probabilities (the ceiling)
  sluice   `sluice worker` in its own process; `sluice backfill` over the whole
           topic through the batch class, results written to an output topic
Both arms stay up for the whole run. Prints both throughputs (events/s, median [min-max]), the
ratio per repetition and its median, and how far sluice's scores are from the offline ones for
the same events. Writes bench/backfill.json.

Both arms get the same engine arguments (`worker.engine.engine_args` from the same
settings) and the same reserved CPUs (`--reserved-cpus`); the engine configuration each arm's
vLLM resolved, its KV cache size and its CPU binding are read from its own log and the script
stops if they differ (`bench/harness.py`). sluice runs without KV pages (the offline arm has no
connector). Rendering and tokenization are inside the timed window in both arms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
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
    """Own process: render, score with vLLM offline; one RESULT line per repetition asked on stdin."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from schemas.templates import Templates

    template = Templates().get("fraud")
    s, _ = common.bench_engine_settings(args)
    llm = LLM(**engine_args(s.engine, resolve_dtype(s.engine.dtype, "cpu")))
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
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=firsts)
    warm = transactions(8, seed=10_000)
    llm.generate([TokensPrompt(prompt_token_ids=ids(template.render(e))) for e in warm], sp, use_tqdm=False)
    print("READY", flush=True)
    for line in sys.stdin:
        events = transactions(args.events, seed=json.loads(line)["seed"])
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


class OfflineArm(common.ChildArm):
    def __init__(self, args):
        super().__init__("offline", [sys.executable, __file__, "--child-offline", *sys.argv[1:], "--model", args.model],
                         common.arm_env(args), OUT / ".backfill-offline.log")

    async def run(self, seed: int) -> dict:
        return await self.ask(json.dumps({"seed": seed}))


class SluiceArm:
    """`sluice worker` kept up for the whole run; each repetition is one backfill job over a fresh topic."""

    name = "sluice"
    log_path = OUT / ".backfill-worker.log"

    def __init__(self, args, s):
        self.args, self.s = args, s
        self.stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        _, env = common.bench_engine_settings(self.args, SLUICE_KV_PAGES="false", SLUICE_LOG_LEVEL="info")
        env[common.RESERVED_CPUS_ENV] = str(self.args.reserved_cpus)
        self.cat = await self.stack.enter_async_context(common.worker_process(self.s, "bb", self.log_path, **env))
        self.prefix = self.cat.replies.name[: -len("sluice.replies")]
        source = await self._publish("warm", 10_000, 8)  # warm the worker with a job of its own
        await self._job(source, "warm").run()

    async def _publish(self, tag: str, seed: int, n: int) -> str:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        source = f"{self.prefix}events-{tag}"
        admin = AIOKafkaAdminClient(**self.s.kafka.options())
        await admin.start()
        await admin.create_topics([NewTopic(source, 6, 1)])
        await admin.close()
        await produce(self.s.kafka.options(), [(source, e["id"].encode(), msgspec.json.encode(e), [])
                                               for e in transactions(n, seed=seed)])
        return source

    def _job(self, source: str, tag: str, bar: bool = False):
        from worker.backfill import Backfill, Job

        job = Job(source=source, out=f"{self.prefix}scored-{tag}", template="fraud",
                  name=f"bench-{tag}-{uuid.uuid4().hex[:6]}")
        progress = (lambda total, initial: tqdm(total=total, initial=initial, desc=f"sluice backfill {tag}",
                                                unit="ev", mininterval=2)) if bar else None
        return Backfill(self.s, self.cat, job, state_dir=OUT / ".backfill-state", max_in_flight=self.args.max_in_flight,
                        progress=progress, log=lambda *_: None)

    async def run(self, seed: int) -> dict:
        from schemas.events import BackfillResult

        tag = f"r{seed}-{uuid.uuid4().hex[:4]}"
        source = await self._publish(tag, seed, self.args.events)  # published before the clock starts
        bf = self._job(source, tag, bar=True)
        t0 = time.monotonic()
        cp = await bf.run()
        span = time.monotonic() - t0
        assert cp.complete, "backfill did not complete"
        dec = msgspec.json.Decoder(BackfillResult)
        scores = {r.event_id: r.scores for r in (dec.decode(rec.value) for rec in
                                                 await read_topic(self.s.kafka.options(), bf.job.out))}
        return {"seconds": span, "events": cp.events, "errors": cp.errors, "scores": scores}

    async def stop(self) -> None:
        await self.stack.aclose()


async def main(args) -> None:
    s = common.settings()
    args.model = args.model or s.engine.model
    arms = {"offline": OfflineArm(args), "sluice": SluiceArm(args, s)}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    started = []
    try:
        for name, arm in arms.items():
            print(f"{name}: starting ...", flush=True)
            await arm.start()
            started.append(arm)
        reports = {name: harness.arm_report(arm.log_path.read_text(errors="replace")) for name, arm in arms.items()}
        harness.check_alike(reports)
        for rep, order in enumerate(harness.orders(list(arms), args.reps)):
            for name in order:
                r = await arms[name].run(args.seed + rep)
                runs[name].append(r)
                print(f"rep {rep} {name}: {r['events'] / r['seconds']:.1f} events/s", flush=True)
    finally:
        for arm in started:
            await arm.stop()
    diffs = [abs(sl["scores"][k]["fraud"] - v["fraud"]) for off, sl in zip(runs["offline"], runs["sluice"])
             for k, v in off["scores"].items() if sl["scores"].get(k)]
    missing = sum(len(off["scores"]) - len(sl["scores"]) for off, sl in zip(runs["offline"], runs["sluice"]))
    if missing or max(diffs, default=1.0) > 1e-5:  # float32 rounding differs between batchings by ~1e-6
        raise SystemExit(f"the arms did not score the same events alike ({missing} missing, largest difference "
                         f"{max(diffs, default=float('nan')):.2e}): not the same work")
    rates = {name: [r["events"] / r["seconds"] for r in rs] for name, rs in runs.items()}
    ratio = harness.spread([a / b for a, b in zip(rates["sluice"], rates["offline"])])
    print(f"\n{args.events} transaction events per repetition, template fraud, {args.reps} repetitions in rotated "
          f"order, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"{common.RESERVED_CPUS_ENV}={args.reserved_cpus}; {common.machine()}; {common.today()}; rev {common.git_rev()}")
    print("both arms: " + ", ".join(f"{k}={reports['offline'][k]}" for k in harness.COMPARED))
    for name, rs in rates.items():
        v = harness.spread(rs)
        print(f"{name:8s} {v['median']:8.1f} events/s  [{v['min']:.1f}-{v['max']:.1f}]"
              + (f"  ({sum(r['errors'] for r in runs[name])} errors)" if name == "sluice" else ""))
    print(f"throughput sluice/offline: {ratio['median']:.3f}  [{ratio['min']:.3f}-{ratio['max']:.3f}]")
    print(f"P(fraud) |sluice - offline|: max {max(diffs):.2e} over {len(diffs)} events")
    (OUT / "backfill.json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items() if k != "child_offline"},
        "events_per_s": {name: harness.spread(rs) for name, rs in rates.items()}, "ratio": ratio,
        "runs": {name: [{k: v for k, v in r.items() if k != "scores"} for r in rs] for name, rs in runs.items()},
        "score_diff_max": max(diffs), "arms": reports, "rev": common.git_rev(),
        "machine": common.machine(), "date": common.today()}, indent=2))
    print(f"wrote {OUT / 'backfill.json'}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=1024)
    p.add_argument("--seed", type=int, default=5, help="repetition r scores the events of seed + r")
    p.add_argument("--reps", type=int, default=3)
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
