"""A worker SIGKILLed mid-stream: how long until its request streams again, with KV pages and without.

    python bench/failover.py [--reps 3] [--prompt-tokens 1500] [--max-tokens 96]

Two modes, each a pair of `sluice worker` processes in one consumer group on its own topics:
  pages      KV pages in Redis on: the survivor loads the prefix (prompt + tokens already sent)
  recompute  KV pages off: the survivor computes the prefix again
With `--budget-mib-s B` the pages mode saves pages within B MiB/s (`kv.save_budget_mib_s`, a bucket
that keeps `--burst-s` seconds of unused budget, `kv.save_burst_s`): the
survivor loads the leading pages that were saved and computes the rest.
Each repetition sends one long streaming request to a pair, waits until `--kill-after-tokens` of
its token records have arrived (2 by default: just after the prefill), SIGKILLs the worker that
owns it (its whole process group: no drain, no commit), counts the pair's pages in Redis at that
moment, and times, on the client's clock:
  detect     kill -> the survivor's `partitions_assigned` (the group noticed: session timeout,
             rebalance); with `--handoff on`, kill -> the survivor's `handoff_adopted` (the dead
             worker's guard handed the request over through Redis, before the rebalance)
  resent     kill -> the first record of the resumed stream (the survivor re-sends the records
             stored before the kill, before it computes anything)
  resume     detect -> the first token generated after the kill (progress lookup, pages
             loaded or prefix recomputed, one decode step)
  first      kill -> first token generated after the kill (detect + resume)
  done       kill -> the `done` record
and reads from the survivor's `sluice_prefill_tokens_total` how many tokens of the resumed prefix
were loaded from Redis and how many computed, and from its `sluice_kv_seconds_total{op="loaded"}`
how long loading those pages took, by part (the Redis round, checks, the copy into the KV cache).
The killed worker is restarted and the pair settles before the next repetition; modes alternate.
Both modes run with the same engine settings and binding (checked from the logs); the stream
must come out whole (gapless seqs, one done). Writes bench/failover.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import topics  # noqa: E402
from bench import common, harness  # noqa: E402
from bench.resume import long_prompt  # noqa: E402
from loadgen.burst import ReplyReader, produce  # noqa: E402
from schemas import DoneReply, ErrorReply, TokenReply  # noqa: E402
from topics.admin import apply  # noqa: E402

OUT = Path(__file__).resolve().parent


class Pair:
    """Two workers of one mode: same group, same topics, same settings."""

    def __init__(self, s, args, mode: str):
        self.s, self.args, self.mode = s, args, mode
        prefix = f"fo{mode[:2]}{uuid.uuid4().hex[:6]}."
        self.topics_file = OUT / f".failover-{mode}.topics.toml"
        self.topics_file.write_text((ROOT / "topics" / "default.toml").read_text()
                                    .replace('name = "sluice.', f'name = "{prefix}sluice.'))
        self.cat = topics.load(self.topics_file)
        _, engine_env = common.bench_engine_settings(
            args, SLUICE_KV_PAGES=str(mode == "pages").lower(),
            SLUICE_KV_SAVE_BUDGET_MIB_S=str(args.budget_mib_s if mode == "pages" else 0),
            SLUICE_KV_SAVE_BURST_S=str(args.burst_s))
        self.env = {**os.environ, **engine_env, common.RESERVED_CPUS_ENV: str(args.reserved_cpus),
                    "SLUICE_TOPICS_FILE": str(self.topics_file), "SLUICE_KAFKA_IDEMPOTENCE": "false",
                    "SLUICE_GROUP_ID": f"fo-{mode}-{uuid.uuid4().hex[:6]}", "SLUICE_LOG_LEVEL": "info",
                    "SLUICE_METRICS_HOST": "127.0.0.1", "SLUICE_COMPILE_MODE": args.compile_mode,
                    "SLUICE_REDIS_KEY_PREFIX": f"fo-{mode}-{uuid.uuid4().hex[:6]}",
                    **({"SLUICE_GROUP_SESSION_TIMEOUT_MS": str(args.session_timeout_ms)}
                       if args.session_timeout_ms else {}),
                    **({"SLUICE_GROUP_HEARTBEAT_INTERVAL_MS": str(args.heartbeat_ms)} if args.heartbeat_ms else {}),
                    "SLUICE_GROUP_LEAVE_ON_DEATH": str(args.leave_on_death == "on").lower(),
                    "SLUICE_GROUP_HANDOFF": str(args.handoff == "on").lower()}
        self.key_prefix = self.env["SLUICE_REDIS_KEY_PREFIX"]
        self.procs: dict[str, tuple[subprocess.Popen, int, Path]] = {}
        self.starts = 0
        self.ready_s: list[float] = []  # process start -> /readyz 200, per start

    async def start(self, name: str) -> None:
        port = common.free_port()
        self.starts += 1
        log = OUT / f".failover-{self.mode}-{name}-{self.starts}.log"
        proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker"],
                                env={**self.env, "SLUICE_METRICS_PORT": str(port)}, cwd=ROOT,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = (proc, port, log)
        t0 = time.monotonic()
        await common.wait_http(f"http://127.0.0.1:{port}/readyz", proc, poll_s=0.2)
        self.ready_s.append(time.monotonic() - t0)

    async def metric(self, name: str, family: str) -> float:
        """Sum of one metric over its labels, read from a worker's /metrics."""
        return await common.scrape_metric(self.procs[name][1], family)

    def stop(self) -> None:
        for proc, _, _ in self.procs.values():
            if proc.poll() is None:
                common.stop_process(proc, 30)
        self.topics_file.unlink(missing_ok=True)


def stored_pages(redis, key_prefix: str) -> int:
    """KV pages under one pair's key prefix, counted on every primary of the cluster."""
    from worker import kv_pages

    return sum(1 for _ in redis.scan_iter(match=kv_pages.key_pattern(key_prefix), count=1000,
                                          target_nodes=redis.PRIMARIES))


async def prefill_by_source(pair: Pair, name: str) -> dict[str, float]:
    """A worker's prompt tokens so far by where their KV came from (counted when a request ends)."""
    return {src: await common.scrape_metric(pair.procs[name][1], "sluice_prefill_tokens_total", source=src)
            for src in ("redis", "computed", "local_cache")}


async def page_load_seconds(pair: Pair, name: str) -> dict[str, float]:
    """A worker's seconds spent loading KV pages so far, by part (counted when a request ends)."""
    from worker.metrics import KV_SECONDS_PARTS

    return {part: await common.scrape_metric(pair.procs[name][1], "sluice_kv_seconds_total", op="loaded", part=part)
            for part in KV_SECONDS_PARTS["loaded"]}


def assignments(log: Path) -> list[float]:
    """Wall-clock times of every `partitions_assigned` a worker logged."""
    return [datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
            for line in log.read_text(errors="replace").splitlines() if '"partitions_assigned"' in line]


def assigned_after(log: Path, t_kill: float) -> float | None:
    """Wall-clock time of the first `partitions_assigned` the survivor logged after the kill."""
    return min((ts for ts in assignments(log) if ts > t_kill), default=None)


def adopted_at(log: Path, request_id: str) -> float | None:
    """Wall-clock time the survivor adopted the request from the dead worker's handoff (SLUICE_GROUP_HANDOFF)."""
    for line in log.read_text(errors="replace").splitlines():
        if '"handoff_adopted"' in line and request_id in line:
            return datetime.fromisoformat(json.loads(line)["timestamp"].replace("Z", "+00:00")).timestamp()
    return None


def resumed_at_seq(log: Path, request_id: str) -> int | None:
    """The seq the survivor continued from (every record before it was stored before the kill)."""
    for line in log.read_text(errors="replace").splitlines():
        if '"request_resumed"' in line and request_id in line:
            return json.loads(line)["next_seq"]
    return None


async def one_failover(pair: Pair, rep: int, prompt: str, redis) -> dict:
    s = pair.s
    reader = ReplyReader(s.kafka.options(), pair.cat.replies.name)
    await reader.start()
    rid = f"fo-{pair.mode}-{rep}-{uuid.uuid4().hex[:6]}"
    tokens: dict[int, list[int]] = {}
    resumed_before = {n: await pair.metric(n, "sluice_requests_resumed_total") for n in pair.procs}
    prefill_before = {n: await prefill_by_source(pair, n) for n in pair.procs}
    load_before = {n: await page_load_seconds(pair, n) for n in pair.procs}
    pages_before = stored_pages(redis, pair.key_prefix)
    try:
        t_sent = time.time()
        await produce(s.kafka.options(), [(pair.cat.request_topic("standard").name, rid.encode(), msgspec.json.encode(
            {"id": rid, "prompt": prompt, "max_tokens": pair.args.max_tokens}), [])])
        t_kill = victim = t_done = t_first_record = None
        arrivals: list[tuple[float, int]] = []  # (time, seq) of token records read after the kill
        seq_at_kill = 0
        end = time.monotonic() + 900
        while t_done is None and time.monotonic() < end:
            async for r in reader.records(timeout_ms=50):
                if r.id != rid:
                    continue
                now = time.time()
                if isinstance(r, TokenReply):
                    t_first_record = t_first_record or now
                    tokens[r.seq] = r.token_ids
                    if t_kill is not None:
                        arrivals.append((now, r.seq))
                elif isinstance(r, DoneReply):
                    t_done, done = now, r
                elif isinstance(r, ErrorReply):
                    raise SystemExit(f"{pair.mode}: error reply {r}")
            if t_kill is None and len(tokens) >= pair.args.kill_after_tokens:
                # the owner is the worker holding an engine slot (tokens are counted only at the end)
                holding = [n for n in pair.procs if await pair.metric(n, "sluice_requests_in_engine") > 0]
                if len(holding) != 1:
                    raise SystemExit(f"{pair.mode}: cannot tell the owner: in engine on {holding or 'neither'}")
                victim = holding[0]
                proc = pair.procs[victim][0]
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and its engine: a machine gone
                t_kill, seq_at_kill = time.time(), max(tokens)
                proc.wait()
                # what the insurance holds: the victim writes no more, the survivor has not resumed yet
                pages_at_kill = stored_pages(redis, pair.key_prefix) - pages_before
        if t_done is None:
            raise SystemExit(f"{pair.mode}: no done within 900 s")
    finally:
        await reader.stop()
    survivor = next(n for n in pair.procs if n != victim)
    t_assigned = assigned_after(pair.procs[survivor][2], t_kill)
    # A rebalance while both workers live means a live worker missed its heartbeats (a session timeout
    # too short for this machine); after the kill the survivor should be assigned once.
    unforced = sum(t_sent < ts < t_kill for _, _, log in pair.procs.values() for ts in assignments(log))
    survivor_assigned = sum(t_kill < ts < t_done for ts in assignments(pair.procs[survivor][2]))
    if await pair.metric(survivor, "sluice_requests_resumed_total") - resumed_before[survivor] < 1:
        raise SystemExit(f"{pair.mode}: the survivor did not resume the request (was the owner killed?)")
    if sorted(tokens) != list(range(done.seq)):
        raise SystemExit(f"{pair.mode}: the stream has gaps: {sorted(tokens)} for done.seq {done.seq}")
    # the resumed request is the only one the survivor ended since `prefill_before`
    after = await prefill_by_source(pair, survivor)
    prefill = {src: int(after[src] - prefill_before[survivor][src]) for src in after}
    load_after = await page_load_seconds(pair, survivor)
    page_load = {part: load_after[part] - load_before[survivor][part] for part in load_after}
    await pair.start(victim)  # back to two workers for the next repetition
    await asyncio.sleep(pair.args.settle_s)
    # Records the survivor re-sends (those stored before the kill) come first; the first token generated
    # after the kill is the first record at or past the survivor's `next_seq`.
    next_seq = resumed_at_seq(pair.procs[survivor][2], rid)
    if next_seq is None:
        raise SystemExit(f"{pair.mode}: the survivor logged no request_resumed for {rid}")
    # With the handoff the survivor takes the request when it adopts it, before the rebalance assigns it
    t_adopted = adopted_at(pair.procs[survivor][2], rid)
    if pair.args.handoff == "on" and t_adopted is None:
        raise SystemExit(f"{pair.mode}: the handoff is on and the survivor did not adopt {rid}")
    t_taken = t_adopted or t_assigned
    t_resent = min((t for t, seq in arrivals if seq < next_seq and t > (t_taken or t_kill)), default=None)
    t_first = min((t for t, seq in arrivals if seq >= next_seq), default=None)
    if t_first is None or t_resent is None:
        raise SystemExit(f"{pair.mode}: after the kill: re-sent {t_resent}, new tokens {t_first}")
    return {"seq_at_kill": seq_at_kill, "detect_s": (t_taken - t_kill) if t_taken else None,
            "assigned_s": (t_assigned - t_kill) if t_assigned else None, "handed_over": t_adopted is not None,
            "resume_s": (t_first - t_taken) if t_taken else None, "first_s": t_first - t_kill,
            "resent_s": t_resent - t_kill,
            "done_s": t_done - t_kill, "tokens": sum(map(len, tokens.values())),
            "rebalances_before_kill": unforced, "survivor_assignments_after_kill": survivor_assigned,
            "pages_at_kill": pages_at_kill, "resume_prefill_tokens": prefill, "resume_page_load_s": page_load,
            "first_record_to_kill_s": t_kill - t_first_record}


async def main(args) -> None:
    from redis.cluster import RedisCluster
    from transformers import AutoTokenizer

    s = common.settings()
    args.model = args.model or s.engine.model
    tok = AutoTokenizer.from_pretrained(args.model)
    redis = RedisCluster.from_url(s.redis.url)
    pairs = {m: Pair(s, args, m) for m in ("pages", "recompute")}
    runs: dict[str, list[dict]] = {m: [] for m in pairs}
    try:
        for pair in pairs.values():
            await apply(s.kafka.options(), pair.cat)
            for name in ("a", "b"):
                print(f"{pair.mode}: starting worker {name} ...", flush=True)
                await pair.start(name)
        await asyncio.sleep(args.settle_s)
        reports = {f"{m}-{n}": harness.arm_report(p.procs[n][2].read_text(errors="replace"))
                   for m, p in pairs.items() for n in p.procs}
        harness.check_alike(reports)
        for rep, order in enumerate(harness.orders(list(pairs), args.reps)):
            prompt = tok.decode(long_prompt(tok, 1000 + rep, args.prompt_tokens))
            for mode in order:
                r = await one_failover(pairs[mode], rep, prompt, redis)
                runs[mode].append(r)
                print(f"rep {rep} {mode:9s} killed after {r['seq_at_kill'] + 1} token records: detect "
                      f"{r['detect_s']:.2f} s, re-sent {r['resent_s']:.2f} s, resume {r['resume_s']:.2f} s, "
                      f"first new token {r['first_s']:.2f} s, "
                      f"done {r['done_s']:.2f} s; rebalances before the kill {r['rebalances_before_kill']}, "
                      f"survivor assignments after it {r['survivor_assignments_after_kill']}; pages stored at the "
                      f"kill ({r['first_record_to_kill_s']:.2f} s after the first token record) {r['pages_at_kill']}, "
                      f"the resumed prefix's tokens loaded {r['resume_prefill_tokens']['redis']}, "
                      f"computed {r['resume_prefill_tokens']['computed']}; loading pages took "
                      + ", ".join(f"{part} {sec:.3f} s" for part, sec in r["resume_page_load_s"].items()),
                      flush=True)
    finally:
        for p in pairs.values():
            p.stop()
    summary = {m: {k: harness.spread([r[k] for r in rs]) for k in ("detect_s", "resent_s", "resume_s", "first_s",
                                                                    "done_s")}
               for m, rs in runs.items()}
    ratio = harness.spread([a["first_s"] / b["first_s"] for a, b in zip(runs["pages"], runs["recompute"])])
    resume_ratio = harness.spread([a["resume_s"] / b["resume_s"] for a, b in zip(runs["pages"], runs["recompute"])])
    group = s.override(**({"group_session_timeout_ms": args.session_timeout_ms} if args.session_timeout_ms else {}),
                       **({"group_heartbeat_interval_ms": args.heartbeat_ms} if args.heartbeat_ms else {})).group
    print(f"\nSIGKILL after {args.kill_after_tokens} token records, ~{args.prompt_tokens}-token prompt, "
          f"{args.max_tokens} tokens, session timeout "
          f"{group.session_timeout_ms} ms, heartbeat {group.heartbeat_ms()} ms, group guard {args.leave_on_death}, "
          f"handoff {args.handoff}, "
          f"compile mode {args.compile_mode}, "
          f"page save budget {f'{args.budget_mib_s:g} MiB/s, {args.burst_s:g} s burst' if args.budget_mib_s else 'none'}, "
          f"{args.reps} repetitions alternating; {common.machine()}; {common.today()}; rev {common.git_rev()}")
    first = next(iter(reports.values()))
    print("every worker: " + ", ".join(f"{k}={first[k]}" for k in harness.COMPARED))
    print(f"{'mode':10s}" + "".join(f"{k:>24s}" for k in ("detect s", "kill->re-sent s", "resume s",
                                                           "kill->first new token s", "kill->done s")))
    for m, row in summary.items():
        print(f"{m:10s}" + "".join(f"{v['median']:>10.2f} [{v['min']:.2f}-{v['max']:.2f}]".rjust(24)
                                   for v in row.values()))
    print(f"kill -> first resumed token, pages / recompute: {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]")
    print(f"detect -> first resumed token, pages / recompute: {resume_ratio['median']:.3f} "
          f"[{resume_ratio['min']:.3f}-{resume_ratio['max']:.3f}]")
    for m, rs in runs.items():
        print(f"{m}: pages stored at the kill " + ", ".join(str(r["pages_at_kill"]) for r in rs)
              + "; the resumed prefix's tokens loaded from Redis / computed "
              + ", ".join(f"{r['resume_prefill_tokens']['redis']}/{r['resume_prefill_tokens']['computed']}" for r in rs))
    unforced = sum(r["rebalances_before_kill"] for rs in runs.values() for r in rs)
    extra = sum(max(0, r["survivor_assignments_after_kill"] - 1) for rs in runs.values() for r in rs)
    # handed over, a request can be answered before the rebalance that assigns its partition
    early = sum(r["survivor_assignments_after_kill"] == 0 for rs in runs.values() for r in rs)
    print(f"rebalances while both workers lived (a live worker evicted): {unforced}; "
          f"extra survivor rebalances after a kill: {extra}; answered before the survivor's rebalance: {early}")
    # the first two starts of each pair compiled side by side; the later ones are restarts beside an idle worker
    restarts = [t for p in pairs.values() for t in p.ready_s[2:]]
    firsts = [t for p in pairs.values() for t in p.ready_s[:2]]
    print(f"worker start to ready ({args.compile_mode}): first starts (two at a time) "
          + ", ".join(f"{t:.1f}" for t in firsts) + " s; restarts " + ", ".join(f"{t:.1f}" for t in restarts) + " s")
    (OUT / "failover.json").write_text(json.dumps(
        {"args": vars(args), "workers": reports, "runs": runs, "summary": summary, "ratio_first": ratio,
         "ratio_resume": resume_ratio, "session_timeout_ms": group.session_timeout_ms,
         "heartbeat_ms": group.heartbeat_ms(),
         "ready_s": {m: p.ready_s for m, p in pairs.items()},
         "machine": common.machine(), "date": common.today(), "rev": common.git_rev()}, indent=2))
    print(f"wrote {OUT / 'failover.json'}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--session-timeout-ms", type=int, default=None,
                   help="SLUICE_GROUP_SESSION_TIMEOUT_MS of every worker (default: the setting's default)")
    p.add_argument("--heartbeat-ms", type=int, default=None,
                   help="SLUICE_GROUP_HEARTBEAT_INTERVAL_MS of every worker (default: the setting's default, "
                        "1 s or a third of the session timeout when that is shorter)")
    p.add_argument("--leave-on-death", choices=["on", "off"], default="on",
                   help="SLUICE_GROUP_LEAVE_ON_DEATH: the killed worker's guard takes it out of the group at once")
    p.add_argument("--handoff", choices=["on", "off"], default="off",
                   help="SLUICE_GROUP_HANDOFF: the killed worker's guard hands its running requests to the survivor "
                        "through Redis; detect is then kill -> the survivor's adoption, not its assignment")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kill-after-tokens", type=int, default=2,
                   help="SIGKILL the owner once this many token records have arrived (pages are saved behind "
                        "the engine: a kill right after the prefill finds few of the prompt's pages stored)")
    p.add_argument("--settle-s", type=float, default=8.0, help="after a (re)start, for the group to settle")
    p.add_argument("--compile-mode", default="graph-cache", choices=["auto", "graph-cache", "eager"],
                   help="SLUICE_COMPILE_MODE of every worker (graph-cache: restarts load the compiled graphs)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--reserved-cpus", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--budget-mib-s", type=float, default=0, help="the pages mode saves within this budget")
    p.add_argument("--burst-s", type=float, default=1.0, help="seconds of unused budget its bucket keeps (kv.save_burst_s)")
    return p


if __name__ == "__main__":
    asyncio.run(main(parser().parse_args()))
