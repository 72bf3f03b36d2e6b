"""Where does vLLM's engine core stop growing as it meets new batch shapes, and what does a smaller
oneDNN primitive cache cost?

    python bench/engine_shapes.py [--tokens 320] [--stride 1] [--mixed 256] [--cache default --cache 64]

vLLM on CPU multiplies through oneDNN, which builds (JIT-compiles) one primitive per matrix shape and
keeps it in a cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`: oneDNN's default is 1024; a worker sets it
from `SLUICE_ONEDNN_CACHE_CAPACITY`). An engine step's shape is the number of tokens it runs, so a
worker admitting requests as they come meets many shapes, and the engine core grows with each new
one until the cache is full (bench/soak.py, `--engine vllm`).

Each arm starts the worker's own engine (`VllmEngine`, the worker's default settings, pages off) in
a fresh process with the arm's cache capacity (`default`: oneDNN's own). It runs one request at a
time whose prompt is N random tokens (one prefill step of N tokens, one output token), for
N = 1 .. --tokens (every --stride-th), twice. Pass 1 meets every shape for the first time; pass 2
meets them again, from the cache where it holds them, so pass 2's time against the default arm's
is what a smaller cache costs a step. Then a mixed load (`mixed_load`). The engine's processes'
resident memory is read every 8 steps. Writes bench/engine_shapes.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from bench.soak import below_mib  # noqa: E402

HERE = Path(__file__).resolve().parent
CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
SETTING_ENV = "SLUICE_ONEDNN_CACHE_CAPACITY"
EVERY = 8  # steps between memory readings
MIXED_OUTPUT = 16


def lengths(tokens: int, stride: int) -> list[int]:
    return list(range(1, tokens + 1, stride))


def engine_cache_env() -> list[str | None]:
    """The cache capacity each process below this one started with (what oneDNN read there)."""
    from worker.engine_guard import descendants, parents, started_environ

    started = (started_environ(pid) for pid in sorted(descendants(parents(), os.getpid())))
    return [env.get(CACHE_ENV) for env in started if env is not None]


async def mixed_load(engine, rng: random.Random, vocab: int, requests: int) -> dict:
    """A burst of requests with prompts of 8-256 random tokens, 16 tokens out each: continuous batching
    steps the engine through shapes as a worker's traffic does. Its time is what an arm's cache costs
    a long-running engine, after the passes have met every shape once."""
    from worker.engine import GenParams

    params = GenParams(max_tokens=MIXED_OUTPUT)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(8, 256))] for _ in range(requests)]

    async def one(i: int, ids: list[int]) -> int:
        out = 0
        async for delta in engine.generate(f"mixed-{i}", ids, params, 0):
            out += len(delta.token_ids)
        return out

    t0 = time.perf_counter()
    outputs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return {"requests": requests, "seconds": time.perf_counter() - t0, "output_tokens": sum(outputs),
            "prompt_tokens": sum(map(len, prompts))}


async def walk(tokens: int, stride: int, mixed_requests: int) -> dict:
    """One arm, in this process: the engine, two passes over the prompt lengths, then a mixed load."""
    from worker.engine import GenParams
    from worker.settings import load

    model = common.prepare(log=lambda *_: None)
    # ignore_eos: every arm's mixed load generates the same tokens
    s = load(environ={**os.environ, "SLUICE_MODEL": str(model), "SLUICE_KV_PAGES": "false",
                      "SLUICE_IGNORE_EOS": "true"})
    engine = await common.engine(s)
    try:
        rng = random.Random(7)
        vocab = 40_000  # below SmolLM2's 49,152; random ids so that no prefix is cached
        params = GenParams(max_tokens=1)
        memory: list[tuple[int, int, float]] = [(0, 0, below_mib(os.getpid()))]  # (pass, step, MiB)
        seconds = {1: [], 2: []}
        steps = lengths(tokens, stride)
        with tqdm(total=2 * len(steps), desc=f"{CACHE_ENV}={os.environ.get(CACHE_ENV, 'default')}", unit="step",
                  mininterval=2, file=sys.stderr) as bar:
            for pass_no in (1, 2):
                for i, n in enumerate(steps, 1):
                    ids = [rng.randrange(1, vocab) for _ in range(n)]
                    t0 = time.perf_counter()
                    async for _ in engine.generate(f"shape-{pass_no}-{n}", ids, params, 0):
                        pass
                    seconds[pass_no].append(time.perf_counter() - t0)
                    if i % EVERY == 0 or i == len(steps):
                        memory.append((pass_no, n, below_mib(os.getpid())))
                    bar.update(1)
        mixed = await mixed_load(engine, rng, vocab, mixed_requests)
        memory.append((3, 0, below_mib(os.getpid())))
        return {"memory": memory, "seconds": {str(k): v for k, v in seconds.items()}, "mixed": mixed,
                "resolved": engine.resolved, "engine_cache_env": engine_cache_env()}
    finally:
        engine.shutdown()


def run_arm(cache: str, tokens: int, stride: int, mixed: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != CACHE_ENV}
    # through the worker's own setting (worker.engine.engine_env); empty keeps oneDNN's default
    env[SETTING_ENV] = "" if cache == "default" else cache
    cmd = [sys.executable, __file__, "--tokens", str(tokens), "--stride", str(stride), "--mixed", str(mixed), "--child"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True)
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def check_arms(arms: dict[str, dict]) -> dict:
    """The engine configuration all arms share; refuses arms that differ in more than the cache."""
    resolved = {cache: {k: v for k, v in arm.pop("resolved").items() if k != "onednn_cache"}  # the arms' one difference
                for cache, arm in arms.items()}
    for cache, arm in arms.items():  # each arm's engine processes got its capacity, and only that
        if set(arm["engine_cache_env"]) != {None if cache == "default" else cache}:
            raise SystemExit(f"arm {cache}: the engine's processes started with {arm['engine_cache_env']}")
    tokens = {cache: arm["mixed"]["output_tokens"] for cache, arm in arms.items()}
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"the arms' mixed loads generated different numbers of tokens: {tokens}")
    if len({json.dumps(r, sort_keys=True) for r in resolved.values()}) != 1:
        raise SystemExit(f"the arms' engines differ: {resolved}")
    return next(iter(resolved.values()))


def summary(arms: dict[str, dict]) -> dict:
    out = {}
    for cache, arm in arms.items():
        mem = arm["memory"]
        first = [m for p, _, m in mem if p == 1]  # pass 3: after the mixed load
        second = [m for p, _, m in mem if p == 2]
        out[cache] = {"start_mib": mem[0][2], "after_pass1_mib": first[-1], "after_pass2_mib": second[-1],
                      "peak_mib": max(m for _, _, m in mem),
                      "after_mixed_mib": mem[-1][2],
                      "pass1_s": sum(arm["seconds"]["1"]), "pass2_s": sum(arm["seconds"]["2"]),
                      "mixed_s": arm["mixed"]["seconds"]}
    base = out.get("default")
    if base:
        for cache, row in out.items():
            row["pass2_vs_default"] = row["pass2_s"] / base["pass2_s"]
            row["mixed_vs_default"] = row["mixed_s"] / base["mixed_s"]
    return out


def plot(arms: dict[str, dict], tokens: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for cache, arm in arms.items():
        walked = [(p, step, mib) for p, step, mib in arm["memory"] if p in (0, 1, 2)]
        line, = ax.plot([step + (tokens if p == 2 else 0) for p, step, _ in walked], [m for *_, m in walked],
                        label=f"{CACHE_ENV}={cache}")
        ax.plot([2 * tokens], [arm["memory"][-1][2]], marker="o", color=line.get_color())  # after the mixed load
    ax.axvline(tokens, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"tokens in the step (pass 1: 1..{tokens}, each new; pass 2, right of the line: the same "
                  "again; dot: after the mixed load)", fontsize=8)
    ax.set_ylabel("engine processes' resident memory (MiB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=320, help="prompt lengths 1..N, one step each, twice")
    ap.add_argument("--cache", action="append", help="oneDNN primitive cache capacity per arm, or 'default'")
    ap.add_argument("--stride", type=int, default=1, help="every stride-th prompt length")
    ap.add_argument("--mixed", type=int, default=256, help="requests in the mixed load after the passes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(walk(args.tokens, args.stride, args.mixed))))
        return
    caches = args.cache or ["default", "64"]
    started = time.time()
    arms = {cache: run_arm(cache, args.tokens, args.stride, args.mixed) for cache in caches}
    resolved = check_arms(arms)
    table = summary(arms)
    for cache, row in table.items():
        print(f"{CACHE_ENV}={cache:>8}: engine {row['start_mib']:.0f} -> {row['after_pass1_mib']:.0f} MiB after "
              f"{len(lengths(args.tokens, args.stride))} new shapes, {row['after_pass2_mib']:.0f} after pass 2; "
              f"pass 1 {row['pass1_s']:.1f} s, "
              f"pass 2 {row['pass2_s']:.1f} s ({row.get('pass2_vs_default', float('nan')):.3f}x default); "
              f"mixed load {row['mixed_s']:.1f} s ({row.get('mixed_vs_default', float('nan')):.3f}x default), "
              f"{row['after_mixed_mib']:.0f} MiB after it")
    out = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
           "machine": common.machine(), "date": common.today(), "rev": common.git_rev(),
           "seconds": round(time.time() - started, 1), "tokens": args.tokens, "stride": args.stride,
           "mixed": args.mixed, "engine": resolved, "summary": table, "arms": arms}
    (HERE / "engine_shapes.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(arms, args.tokens, HERE / "engine_shapes.png",
         f"vLLM engine core memory by batch shapes met\n{out['machine']}, {out['date']}, rev {out['rev']}")


if __name__ == "__main__":
    main()
