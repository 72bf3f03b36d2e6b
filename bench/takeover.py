"""How long the group takes to give a stopped or killed worker's partitions to the others.

    python bench/takeover.py [--tries 3] [--session-timeout-ms 10000] [--heartbeat-ms 0]

Each try starts one `sluice worker` process (the fake engine: a takeover has nothing to do with the
model) and a plain aiokafka consumer in the same group on a fresh standard topic, waits until they
share it, ends the worker, and times until the consumer holds every partition. Arms, in rotated
order per try:
  killed, guard on    SIGKILL of the worker's process group; its group guard sends LeaveGroup
  killed, guard off   the same with SLUICE_GROUP_LEAVE_ON_DEATH=false: the session timeout decides
  drained             SIGTERM: the worker drains and leaves the group itself
Needs the dev stack (`sluice dev up`). Prints medians [min-max] and the ratio guard on / off;
writes bench/takeover.json. The survivor heartbeats at the workers' interval.
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
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import topics  # noqa: E402
from bench import common, harness  # noqa: E402

ARMS = ("killed, guard on", "killed, guard off", "drained")


async def worker_and_survivor(kafka_options: dict, catalog, workdir: Path, session_ms: int, heartbeat_ms: int,
                              launcher: tuple[str, ...] = (), **env_extra):
    """A fake-engine `sluice worker` (own process group, log in workdir/worker.log) and a plain consumer
    in its group, once the worker is ready and the two share the standard topic: (proc, consumer, partitions).
    `launcher`: what starts the worker (the image's `python -m worker.container_init`, say)."""
    from aiokafka import AIOKafkaConsumer

    topic = catalog.request_topic("standard")
    group, port = f"takeover-{uuid.uuid4().hex[:6]}", common.free_port()
    prefix = catalog.replies.name[: -len("sluice.replies")]
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(topics.write_renamed(prefix, workdir / "topics.toml")),
           "SLUICE_GROUP_ID": group, "SLUICE_METRICS_PORT": str(port), "SLUICE_ENGINE_KIND": "fake",
           "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_REDIS_KEY_PREFIX": f"takeover-{uuid.uuid4().hex[:6]}",
           "SLUICE_GROUP_SESSION_TIMEOUT_MS": str(session_ms),
           "SLUICE_GROUP_HEARTBEAT_INTERVAL_MS": str(heartbeat_ms), **env_extra}
    log = open(workdir / "worker.log", "wb")
    # its own process group, so a kill takes the whole worker, as a container runtime's would
    proc = subprocess.Popen([*launcher, sys.executable, "-m", "worker.cli", "worker"], env=env, stdout=log, stderr=log,
                            start_new_session=True, cwd=ROOT)
    survivor = AIOKafkaConsumer(topic.name, **kafka_options, group_id=group, session_timeout_ms=session_ms,
                                heartbeat_interval_ms=heartbeat_ms)
    await survivor.start()
    try:
        await common.wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout=120, poll_s=0.2)
        end = time.monotonic() + 60
        while not 0 < len(survivor.assignment()) < topic.partitions:
            if time.monotonic() > end:
                raise RuntimeError(f"the worker and the consumer never shared {topic.name}")
            await survivor.getmany(timeout_ms=100)
    except BaseException:
        proc.kill()
        await survivor.stop()
        raise RuntimeError("worker: " + (workdir / "worker.log").read_text()[-2000:]) from None
    return proc, survivor, topic.partitions


async def seconds_until_all(survivor, partitions: int, limit_s: float) -> float:
    """From now until `survivor` holds every partition (or `limit_s`)."""
    started = time.monotonic()
    while len(survivor.assignment()) < partitions and time.monotonic() - started < limit_s:
        await survivor.getmany(timeout_ms=20)
    return time.monotonic() - started


async def end_worker(proc, arm: str) -> None:
    if arm == "drained":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    await asyncio.to_thread(proc.wait, 120)


async def one(s, arm: str, workdir: Path, args) -> float:
    cat = await common.fresh_catalog(s, "to")
    extra = {"SLUICE_GROUP_LEAVE_ON_DEATH": "false"} if arm == "killed, guard off" else {}
    proc, survivor, partitions = await worker_and_survivor(s.kafka.options(), cat, workdir, args.session_timeout_ms,
                                                           args.heartbeat_ms, **extra)
    try:
        await asyncio.sleep(2)  # both settled
        started = time.monotonic()
        await end_worker(proc, arm)
        await seconds_until_all(survivor, partitions, 120)
        return time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        await survivor.stop()


async def main(args) -> None:
    s = common.settings()
    if not args.heartbeat_ms:
        args.heartbeat_ms = s.override(group_session_timeout_ms=args.session_timeout_ms).group.heartbeat_ms()
    workdir = ROOT / "bench" / ".takeover"
    workdir.mkdir(exist_ok=True)
    seconds: dict[str, list[float]] = {a: [] for a in ARMS}
    orders = harness.orders(list(ARMS), args.tries)
    with tqdm(total=len(ARMS) * args.tries, desc="takeovers", unit="try") as bar:
        for order in orders:
            for arm in order:
                seconds[arm].append(await one(s, arm, workdir, args))
                bar.update()
    spread = {a: harness.spread(v) for a, v in seconds.items()}
    ratio = harness.spread([a / b for a, b in zip(seconds["killed, guard on"], seconds["killed, guard off"])])
    print(f"\nworker ended -> survivor holds every partition; session timeout {args.session_timeout_ms} ms, heartbeat "
          f"{args.heartbeat_ms} ms, {args.tries} tries in rotated order; embedded broker; {common.machine()}; "
          f"{common.today()}; rev {common.git_rev()}")
    for arm, v in spread.items():
        print(f"  {arm:18s} {v['median']:6.2f} s  [{v['min']:.2f}-{v['max']:.2f}]")
    print(f"killed: guard on / guard off {ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]")
    out = ROOT / "bench" / "takeover.json"
    out.write_text(json.dumps({"args": vars(args), "seconds": seconds, "spread": spread, "ratio_on_off": ratio,
                               "machine": common.machine(), "date": common.today(), "rev": common.git_rev()},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--session-timeout-ms", type=int, default=10000)
    p.add_argument("--heartbeat-ms", type=int, default=0, help="0: the workers' default, 1 s or a third of the session timeout when that is shorter")
    asyncio.run(main(p.parse_args()))
