"""What long prompts cost the other streams of a worker: tokenized in a thread, or on the event loop.

    python bench/long_prompts.py [--rate 100] [--long-rate 2] [--long-kib 256] [--seconds 20] [--reps 2]

A worker tokenizes every prompt before it runs. A prompt at the 256 KiB limit takes tens to
hundreds of milliseconds to tokenize, and while it does, nothing else on the worker's event loop
moves. Two arms in one run, rotated, on the engine stand-in of bench/overhead.py (the bundled
model's tokenizer, `--token-ms` per token):

  thread  the worker as it runs: text over `LONG_TEXT_CHARS` (16,384 characters) is tokenized in
          a thread, through the tokenizer's call that lets go of the GIL (worker/runner.py: tokenized)
  loop    the same worker with that bound raised past any prompt: every prompt tokenized on the
          event loop, as every worker did before

Steady streamed requests (`--rate` a second, short prompts, `--max-tokens` each) go to the standard
topic; `--long-rate` prompts of `--long-kib` KiB a second go to the batch topic, both from separate
processes. The long prompts exceed the bundled model's context, so each is refused after it is
tokenized (`payload_too_large`), as a flood of them from a careless or hostile producer would be:
only their tokenizing costs the worker. Latency of the steady requests is read off the records'
timestamps (bench/pauses.py). Prints p50 / p99 / max of time to first token and to `done` per arm
(median over the repetitions, [min-max]) and loop / thread at p99; plots `done` latency over each
arm's last run (bench/long_prompts.png).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common, harness  # noqa: E402
from bench.overhead import TokenizingFakeEngine, until_committed  # noqa: E402
from bench.pauses import latencies, latency_row, plot_done_latency, print_latency, summary, write_json  # noqa: E402
from loadgen.burst import read_topic  # noqa: E402
from worker import metrics, prompt_tokens, runner  # noqa: E402
from worker.worker import Worker  # noqa: E402

OUT = Path(__file__).resolve().parent
ARMS = ["thread", "loop"]
BOUND = prompt_tokens.LONG_TEXT_CHARS  # the worker's own, before any arm changes it


async def publish_long(topic: str, rate: float, seconds: float, tag: str, kib: int) -> None:
    """(A publisher process.) `rate` long prompts a second for `seconds`."""
    from aiokafka import AIOKafkaProducer

    s = common.settings()
    producer = AIOKafkaProducer(**s.kafka.options(), linger_ms=2, max_request_size=4 << 20)
    await producer.start()
    text = ("amount 12.50 USD, merchant grocery, country DE; " * (kib * 1024 // 40 + 1))[:kib * 1024]
    try:
        total, start = int(rate * seconds), time.monotonic()
        for i in range(total):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            rid = f"{tag}-long-{i}"
            await producer.send(topic, msgspec.json.encode({"id": rid, "prompt": text, "max_tokens": 4}),
                                key=rid.encode())
        await producer.flush()
    finally:
        await producer.stop()


def tokenize_on(arm: str) -> None:
    bound = BOUND if arm == "thread" else 1 << 40
    runner.LONG_TEXT_CHARS = bound  # where the runner decides to use a thread
    prompt_tokens.LONG_TEXT_CHARS = bound  # where encode_text picks the call that lets go of the GIL


async def one_run(s, engine, arm: str, args) -> tuple[dict, dict]:
    cat = await common.fresh_catalog(s, "lp")
    steady, long_topic = cat.request_topic("standard").name, cat.request_topic("batch").name
    group = f"lp-{uuid.uuid4().hex[:6]}"
    worker = Worker(s.override(group_id=group, redis_key_prefix=f"lp-{uuid.uuid4().hex[:6]}"), cat, engine)
    done = lambda: sum(metrics.requests_completed.labels("standard", r)._value.get()  # noqa: E731
                       for r in ("length", "stop"))
    refused = lambda: metrics.requests_completed.labels("batch", "payload_too_large")._value.get()  # noqa: E731
    before, refused_before, n = done(), refused(), int(args.rate * args.seconds)
    tag = uuid.uuid4().hex[:6]
    await worker.start()
    try:
        while not worker.consumer.assignment():
            await asyncio.sleep(0.01)
        tps = sorted(tp for tp in worker.consumer.assignment() if tp.topic == steady)
        publishers = [subprocess.Popen([sys.executable, str(OUT / "pauses.py"), "--publish", steady, str(args.rate),
                                        str(args.seconds), tag, str(args.max_tokens)]),
                      subprocess.Popen([sys.executable, __file__, "--publish-long", long_topic, str(args.long_rate),
                                        str(args.seconds), tag, str(args.long_kib)])]
        try:
            await until_committed(s, group, tps, n, f"{arm:6s}", lambda: int(done() - before))
        finally:
            for p in publishers:
                p.wait(120)
        if any(p.returncode for p in publishers):
            raise SystemExit(f"a publisher exited with {[p.returncode for p in publishers]}")
    finally:
        await worker.stop()
    lat = latencies(await read_topic(s.kafka.options(), steady), await read_topic(s.kafka.options(), cat.replies.name))
    return {**summary(lat), "long_prompts_refused": refused() - refused_before}, lat


async def main(args) -> None:
    from transformers import AutoTokenizer

    s = common.settings()
    engine = TokenizingFakeEngine(AutoTokenizer.from_pretrained(s.engine.model), args.token_ms / 1000)
    runs: dict[str, list] = {arm: [] for arm in ARMS}
    last: dict[str, dict] = {}
    tokenize_on("thread")
    # a process's first run pays for first calls (new topics' metadata, the tokenizer's first use): not counted
    await one_run(s, engine, "thread", argparse.Namespace(**{**vars(args), "seconds": 2}))
    for order in harness.orders(ARMS, args.reps):
        for arm in order:
            tokenize_on(arm)
            result, lat = await one_run(s, engine, arm, args)
            runs[arm].append(result)
            last[arm] = lat
    tokenize_on("thread")
    print(f"\n{args.rate:g} streamed requests/s ({args.max_tokens} tokens, {args.token_ms} ms per token) beside "
          f"{args.long_rate:g} prompts/s of {args.long_kib} KiB, for {args.seconds:g} s; real tokenizer; {args.reps} "
          f"repetitions in rotated order; {common.machine()}; {common.today()}; rev {common.git_rev()}")
    out = {}
    for arm, rs in runs.items():
        row = {**latency_row(rs), "long_prompts_refused": harness.spread([r["long_prompts_refused"] for r in rs])}
        out[arm] = row
        print(f"{arm} (long prompts refused per run: {row['long_prompts_refused']['median']:.0f}):")
        print_latency(row, ("50", "99"))
        if row["without_done"]:
            print(f"  requests without a done: {row['without_done']}")
    t, lo = out["thread"], out["loop"]
    print(f"loop / thread, p99: first token {lo['ttft_ms']['99']['median'] / max(t['ttft_ms']['99']['median'], 1):.2f}, "
          f"done {lo['e2e_ms']['99']['median'] / max(t['e2e_ms']['99']['median'], 1):.2f}")
    write_json(OUT / "long_prompts.json", args, out)
    plot_done_latency(last, OUT / "long_prompts.png",
                      f"{args.rate:g} streamed requests/s beside {args.long_rate:g} prompts/s of {args.long_kib} KiB",
                      label=lambda arm: "long prompts tokenized in a thread" if arm == "thread" else "tokenized on the loop")
    print(f"wrote {OUT / 'long_prompts.json'} and {OUT / 'long_prompts.png'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--publish-long":
        topic, rate, seconds, tag, kib = sys.argv[2:7]
        asyncio.run(publish_long(topic, float(rate), float(seconds), tag, int(kib)))
        sys.exit(0)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=100)
    p.add_argument("--long-rate", type=float, default=2)
    p.add_argument("--long-kib", type=int, default=256)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--token-ms", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=8)
    from worker.service import run_loop

    run_loop(main(p.parse_args()))
