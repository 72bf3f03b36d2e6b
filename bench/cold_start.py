"""Worker cold start: engine construction to first token, first start and restart, per compile mode.

    python bench/cold_start.py [--modes auto,graph-cache,eager] [--engine-starts inprocess,forkserver,spawn] [--worker]
    python bench/cold_start.py --modes graph-cache --engine-starts forkserver,spawn --alternate 3
    python bench/cold_start.py --modes graph-cache --join-early 3

For each `SLUICE_COMPILE_MODE`, two engine starts in fresh processes with one compile cache
(`VLLM_CACHE_ROOT`, empty before the first): the first start compiles, the restart may load
what the first one cached. Each start is timed from the process's start to the end of a
one-token generation, and its log is searched for whether vLLM loaded its compile cache or
compiled again because its cache failed to load (and why). Then one short greedy generation per mode is compared with the
`auto` mode's, so a mode that changes outputs is caught. With more than one `--engine-starts`
(`SLUICE_ENGINE_START`: the engine core forked from a preloaded forkserver, running the model
itself or spawning its model runner, or spawned as vLLM does) every compile mode is measured with each, each pair with its own empty cache. `--worker` also times what an operator
waits for: a whole `sluice worker` process (settings, preflight, engine, warm-up, consumer group)
from its start to `/readyz` answering 200, first start and restart, with the same cache.
Writes bench/cold_start.json. `--join-early K` times worker restarts that join their (new, empty)
group while the engine loads against ones that join once it has loaded, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common, harness  # noqa: E402

OUT = Path(__file__).resolve().parent
CHILD = """
import asyncio, json, sys, time
t0, n, tokens = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
from bench import common
from worker.engine import GenParams
async def main():
    s = common.settings(SLUICE_IGNORE_EOS="true")
    eng = await common.engine(s)
    text = []
    async for d in eng.generate("cold", eng._tokenizer.encode("The capital of France is"), GenParams(12), 0):
        text.append(d.text)
    ready = time.time() - t0
    out = {"ready_s": ready, "text": "".join(text)}
    if n:  # steady decoding once started: what a mode costs per step, not only at start
        async def one(i):
            async for _ in eng.generate(f"tp{i}", eng._tokenizer.encode(f"Request {i}: tell a story"),
                                        GenParams(tokens), 0):
                pass
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        out["decode_tok_s"] = n * tokens / (time.perf_counter() - start)
    eng.shutdown()
    print("RESULT " + json.dumps(out), flush=True)
asyncio.run(main())
"""


def start(mode: str, cache: Path, n: int = 0, tokens: int = 0, engine_start: str = "inprocess") -> dict:
    # vLLM's info level in every mode: it is where vLLM says it loaded its AOT compile cache
    env = {**os.environ, "SLUICE_COMPILE_MODE": mode, "SLUICE_ENGINE_START": engine_start, "VLLM_CACHE_ROOT": str(cache),
           "PYTHONPATH": str(OUT.parent), "VLLM_LOGGING_LEVEL": "INFO"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(t0), str(n), str(tokens)], env=env,
                          capture_output=True, text=True,
                          timeout=900, cwd=OUT.parent)
    log = proc.stdout + proc.stderr
    line = next((x for x in log.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{mode}: the engine did not start:\n{log[-2000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    again = re.search(r"Compiling model again due to a load failure.*reason: (.*)", log)
    cores = re.search(r"core ids=(\[[0-9, ]*\])", log)  # where vLLM's model runner computes (its own log)
    result["core_ids"] = cores.group(1) if cores else None
    # vLLM's model runner logs as "(Worker pid=...)" in its own process; `inprocess` has none
    result["runner_process"] = "(Worker pid=" in log
    result.update(recompiled_because=again.group(1)[:200] if again else None,
                  aot_loaded="Directly load AOT compilation" in log)
    return result


def worker_start(mode: str, cache: Path, session_timeout_ms: int | None = None, engine_start: str = "inprocess",
                 **env) -> float:
    """Seconds from a `sluice worker` process's start to its /readyz answering 200 (each in a new group).

    The worker is ready once it holds its partitions; the embedded broker holds a new group's first
    join for about half the session timeout (`bench/group_join.py`), so that setting is part of it
    where the worker joins after its engine has loaded (`SLUICE_GROUP_JOIN_EARLY=false`, or a group
    with other members). `env`: more settings for the worker.
    """
    import asyncio

    group = {"SLUICE_GROUP_SESSION_TIMEOUT_MS": str(session_timeout_ms)} if session_timeout_ms else {}

    async def run() -> float:
        s = common.settings()
        t0 = time.monotonic()
        async with common.worker_process(s, "cold", worker_log(mode, engine_start), SLUICE_COMPILE_MODE=mode,
                                         SLUICE_ENGINE_START=engine_start,
                                         VLLM_CACHE_ROOT=str(cache), **group, **env):
            return time.monotonic() - t0

    return asyncio.run(run())


def worker_log(mode: str, engine_start: str) -> Path:
    return OUT / f".cold-{mode}-{engine_start}.log"


TIMELINE = ("group_joining_while_loading", "partitions_assigned", "engine_ready", "worker_started")


def timeline(log: str) -> dict[str, float]:
    """Seconds from a worker's `engine_loading` line to the first line of each TIMELINE event (info logs)."""
    from datetime import datetime

    stamps: dict[str, float] = {}
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
            at = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        stamps.setdefault(record.get("event"), at)
    if "engine_loading" not in stamps:
        return {}
    return {e: round(stamps[e] - stamps["engine_loading"], 2) for e in TIMELINE if e in stamps}


def join_early(args) -> None:
    """`--join-early K`: `sluice worker` restarts to /readyz with SLUICE_GROUP_JOIN_EARLY on and off in
    turn (alternating order), K rounds, one warm compile cache; each worker's log must show the join
    its arm asked for. Writes bench/cold_start_join_early.json."""
    mode, how = args.modes.split(",")[0], args.engine_starts.split(",")[0]
    samples: dict[str, list[float]] = {"on": [], "off": []}
    marks_by_arm: dict[str, list[dict]] = {"on": [], "off": []}
    reports: dict[str, dict] = {}  # each start's engine configuration and cores, read from its log
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / mode
        start(mode, cache, engine_start=how)  # fills the cache: every start below is a restart
        rounds = [("on", "off") if k % 2 == 0 else ("off", "on") for k in range(args.join_early)]
        for order in tqdm(rounds, desc="rounds", unit="round"):
            for arm in order:
                ready = worker_start(mode, cache, args.session_timeout_ms, how, SLUICE_LOG_LEVEL="info",
                                     SLUICE_GROUP_JOIN_EARLY="true" if arm == "on" else "false")
                text = worker_log(mode, how).read_text(errors="replace")
                marks = timeline(text)
                if ("group_joining_while_loading" in marks) != (arm == "on"):
                    raise SystemExit(f"the worker of arm {arm} {'joined' if arm == 'off' else 'did not join'} while "
                                     f"its engine loaded: no comparison ({worker_log(mode, how)})")
                samples[arm].append(ready)
                marks_by_arm[arm].append(marks)
                reports[f"{arm}-{len(samples[arm])}"] = harness.arm_report(text)
    harness.check_alike(reports)  # the arms differ only in when they join, or nothing here compares them
    setup = next(iter(reports.values()))
    print(f"\n{common.machine()}; {common.today()}; rev {common.git_rev()}; {mode}, {how}, {args.join_early} rounds "
          f"in alternating order, each worker in a new group; session timeout "
          + (f"{args.session_timeout_ms} ms" if args.session_timeout_ms else "the default")
          + "; every start's engine set up alike (" + ", ".join(f"{k}={setup[k]}" for k in harness.COMPARED) + ")")
    spread = {arm: harness.spread(ts) for arm, ts in samples.items()}
    for arm, sp in spread.items():
        print(f"join early {arm:3s}: sluice worker start to /readyz {sp['median']:5.1f} s [{sp['min']:.1f}-{sp['max']:.1f}]"
              f" ({', '.join(f'{t:.1f}' for t in samples[arm])})")
    print(f"on / off: {spread['on']['median'] / spread['off']['median']:.2f}, "
          f"{spread['off']['median'] - spread['on']['median']:.1f} s sooner")
    print("seconds from engine_loading, median by arm: " + "; ".join(
        f"{arm}: " + ", ".join(f"{event} {harness.spread([m[event] for m in ms])['median']:.1f}"
                               for event in TIMELINE if all(event in m for m in ms))
        for arm, ms in marks_by_arm.items()))
    (OUT / "cold_start_join_early.json").write_text(json.dumps(
        {"args": vars(args), "samples": samples, "timelines": marks_by_arm, "engine_setup": setup,
         "machine": common.machine(), "date": common.today(),
         "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'cold_start_join_early.json'}")


def alternate(args) -> None:
    """`--alternate K`: engine restarts with a warm cache, each `--engine-starts` in turn, K rounds:
    restart time and decoding rate per start method, median [min-max], and their ratio."""
    starts, mode = args.engine_starts.split(","), args.modes.split(",")[0]
    samples: dict[str, list[dict]] = {how: [] for how in starts}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / mode
        start(mode, cache, engine_start=starts[0])  # fills the cache: every start below is a restart
        rounds = [starts if k % 2 == 0 else starts[::-1] for k in range(args.alternate)]
        for order in tqdm(rounds, desc="rounds", unit="round"):
            for how in order:
                samples[how].append(start(mode, cache, args.decode_requests, args.decode_tokens, how))
    bindings = {r["core_ids"] for rs in samples.values() for r in rs}
    if len(bindings) != 1:
        raise SystemExit(f"the starts computed on different cores ({bindings}): no comparison")
    print(f"\n{common.machine()}; {common.today()}; rev {common.git_rev()}; {mode}, {args.alternate} rounds in "
          f"alternating order, {args.decode_requests} requests x {args.decode_tokens} tokens at once after each restart; "
          f"every start's model computed on cores {bindings.pop()} (read from its log)")
    for how, rs in samples.items():
        ready, tok = harness.spread([r["ready_s"] for r in rs]), harness.spread([r["decode_tok_s"] for r in rs])
        print(f"{how:11s} restart {ready['median']:5.1f} s [{ready['min']:.1f}-{ready['max']:.1f}]   decoding "
              f"{tok['median']:6.1f} tokens/s [{tok['min']:.1f}-{tok['max']:.1f}]   greedy text "
              f"{'the same in every start' if len({r['text'] for rs_ in samples.values() for r in rs_}) == 1 else 'DIFFERS'}")
    if len(starts) == 2:
        a, b = starts
        med = lambda how, k: harness.spread([r[k] for r in samples[how]])["median"]  # noqa: E731
        ratio = lambda k: med(a, k) / med(b, k)  # noqa: E731
        print(f"{a} / {b}: restart {ratio('ready_s'):.2f}, decoding {ratio('decode_tok_s'):.2f}")
    (OUT / "cold_start_alternate.json").write_text(json.dumps(
        {"args": vars(args), "samples": samples, "machine": common.machine(), "date": common.today(),
         "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'cold_start_alternate.json'}")


def main(args) -> None:
    if args.alternate:
        return alternate(args)
    if args.join_early:
        return join_early(args)
    starts = args.engine_starts.split(",")
    pairs = [(mode, how) for mode in args.modes.split(",") for how in starts]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, how in tqdm(pairs, desc="modes", unit="mode"):
            name = mode if len(starts) == 1 else f"{mode}/{how}"
            cache = Path(tmp) / name.replace("/", "-")
            rows[name] = {"compile_mode": mode, "engine_start": how, "first": start(mode, cache, engine_start=how),
                          "restart": start(mode, cache, args.decode_requests, args.decode_tokens, how)}
            if args.worker:
                rows[name]["worker_ready_s"] = [worker_start(mode, cache, args.session_timeout_ms, how)
                                                for _ in range(2)]
    print(f"\n{common.machine()}; {common.today()}; rev {common.git_rev()}")
    print(f"{'mode':12s} {'first s':>8s} {'restart s':>9s}  restart: vLLM's compile cache")
    for mode, r in rows.items():
        first, again = r["first"], r["restart"]
        why = (f"failed to load, compiled again: {again['recompiled_because']}" if again["recompiled_because"]
               else "nothing to load (no compilation)" if r["compile_mode"] == "eager"
               else "AOT compile cache loaded" if again.get("aot_loaded") else "no load failure reported")
        print(f"{mode:12s} {first['ready_s']:8.1f} {again['ready_s']:9.1f}  {why}")
    for mode, r in rows.items():
        if "decode_tok_s" in r["restart"]:
            print(f"{mode:12s} decoding after the restart: {r['restart']['decode_tok_s']:.1f} tokens/s "
                  f"({args.decode_requests} requests x {args.decode_tokens} tokens at once, ignore_eos)")
    for mode, r in rows.items():
        if "worker_ready_s" in r:
            print(f"{mode:12s} sluice worker start to /readyz: " + ", ".join(f"{t:.1f} s" for t in r["worker_ready_s"])
                  + " (both after the engine starts above, so the cache is warm for both; session timeout "
                  + (f"{args.session_timeout_ms} ms)" if args.session_timeout_ms else "the default)"))
    reference = next((r for r in rows.values() if r["compile_mode"] == "auto"), next(iter(rows.values())))["first"]["text"]
    for mode, r in rows.items():
        same = r["first"]["text"] == reference == r["restart"]["text"]
        print(f"{mode}: greedy text {'equals' if same else 'DIFFERS from'} auto's")
    by_start = {how: [r for r in rows.values() if r["engine_start"] == how] for how in starts}
    for how, rs in by_start.items():
        print(f"{how}: the model ran in " + ", ".join(sorted({"a spawned runner process" if r[k]["runner_process"]
                                                             else "the engine core" for r in rs
                                                             for k in ("first", "restart")})))
    if args.worker and len(starts) >= 2:  # each start method against the last one listed
        base = starts[-1]
        for how in starts[:-1]:
            for mode in args.modes.split(","):
                a, b = (next(r for r in by_start[h] if r["compile_mode"] == mode) for h in (how, base))
                f, s_ = a["worker_ready_s"], b["worker_ready_s"]
                print(f"{mode}: worker ready, {how} / {base}: {sum(f) / len(f):.1f} s / {sum(s_) / len(s_):.1f} s "
                      f"= {sum(f) / sum(s_):.2f}; engine restart {a['restart']['ready_s']:.1f} s / "
                      f"{b['restart']['ready_s']:.1f} s; decoding after it "
                      f"{a['restart'].get('decode_tok_s', float('nan')) / b['restart'].get('decode_tok_s', float('nan')):.2f}")
    (OUT / "cold_start.json").write_text(json.dumps({"rows": rows, "session_timeout_ms": args.session_timeout_ms,
                                                    "machine": common.machine(),
                                                    "date": common.today(), "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'cold_start.json'}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="auto,graph-cache,eager")
    p.add_argument("--engine-starts", default="inprocess",
                   help="SLUICE_ENGINE_START values to measure each mode with (inprocess,forkserver,spawn: all; "
                        "with --worker each is set against the last one listed)")
    p.add_argument("--decode-requests", type=int, default=32,
                   help="after each restart, time this many requests decoded at once (0: skip)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--alternate", type=int, default=0, metavar="K",
                   help="instead: K rounds of restarts of the first mode, each engine start in turn (alternating "
                        "order), restart time and decoding per start method; writes bench/cold_start_alternate.json")
    p.add_argument("--worker", action="store_true", help="also time `sluice worker` start to /readyz, twice")
    p.add_argument("--join-early", type=int, default=0, metavar="K",
                   help="instead: K rounds of `sluice worker` restarts of the first mode, SLUICE_GROUP_JOIN_EARLY on "
                        "and off in turn; writes bench/cold_start_join_early.json")
    p.add_argument("--session-timeout-ms", type=int, default=None,
                   help="the workers' SLUICE_GROUP_SESSION_TIMEOUT_MS (default: the settings' default)")
    main(p.parse_args())
