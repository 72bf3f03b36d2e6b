"""Two real workers in one group; one is SIGKILLed mid-stream. Shared by the SmolLM2 and MLA tests.

`kill_mid_stream` runs the scenario and returns what the reply topic showed;
`assert_one_stream_each` checks the stream guarantees every model must keep.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime

import msgspec
from aiokafka.partitioner import DefaultPartitioner

from loadgen.burst import ReplyReader, produce
from schemas import DoneReply, TokenReply
from tests.integration.helpers import free_port, http_get, prefixed_topics_file
from worker import engine_guard


@dataclass
class KillRun:
    tokens: dict[str, dict[int, str]]
    finals: dict[str, list[DoneReply]]
    survivor_metrics: str = ""
    survivor_log: str = ""
    orphaned_engine_procs: list[int] = field(default_factory=list)
    victim_log: str = ""
    killed_at: float = 0.0  # wall clock, as the workers' log timestamps
    after: object = None  # what the `after` callback returned


def start(env, tmp_path, name):
    port = free_port()
    log = open(tmp_path / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker"], env={**env, "SLUICE_METRICS_PORT": str(port)},
                            stdout=log, stderr=log)
    return proc, port


def partition_of(key: bytes, partitions: int) -> int:
    """The partition the producer's default partitioner picks for `key` (murmur2, as Java's)."""
    every = list(range(partitions))
    return DefaultPartitioner()(key, every, every)


def spread_ids(prefix: str, n: int, partitions: int) -> list[str]:
    """`n` request ids whose keys land on as many different partitions as there are (cycling after),
    so that every member of a group that owns any partition owns some of the requests."""
    ids, wanted, i = [], 0, 0
    while len(ids) < n:
        rid = f"{prefix}-{i}"
        if partition_of(rid.encode(), partitions) == wanted:
            ids.append(rid)
            wanted = (wanted + 1) % partitions
        i += 1
    return ids


def last_assignment(log_path, topic: str) -> set[int] | None:
    """`topic`'s partitions in the worker's latest partitions_assigned log line; None before any."""
    latest = None
    for line in log_path.read_text(errors="replace").splitlines():
        if '"partitions_assigned"' not in line or not line.startswith("{"):
            continue
        named = msgspec.json.decode(line)["partitions"]
        latest = {int(p[len(topic) + 1:-1]) for p in named if p.startswith(f"{topic}[")}
    return latest


async def wait_for_split(log_paths, topic: str, partitions: int, timeout=120) -> list[set[int]]:
    """Until every worker owns some of `topic` and together they own each partition once."""
    end = time.monotonic() + timeout
    while True:
        owned = [last_assignment(p, topic) for p in log_paths]
        if all(owned) and sorted(p for o in owned for p in o) == list(range(partitions)):
            return owned
        assert time.monotonic() < end, f"the group never split {topic} between its workers: {owned}"
        await asyncio.sleep(0.5)


async def wait_ready(proc, port, log_path, timeout=900):
    end = time.monotonic() + timeout
    while http_get(port, "/readyz")[0] != 200:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < end, "worker never became ready"
        await asyncio.sleep(0.5)


async def read_until_done(reader, ids, tokens, finals, deadline, on_batch=None):
    while any(not finals[rid] for rid in ids) and time.monotonic() < deadline:
        async for r in reader.records():
            if r.id not in tokens:
                continue
            if isinstance(r, TokenReply):
                seen = tokens[r.id].get(r.seq)
                assert seen is None or seen == r.text, f"{r.id} seq {r.seq} repeated with other text"
                tokens[r.id][r.seq] = r.text
            elif isinstance(r, DoneReply):
                finals[r.id].append(r)
        if on_batch:
            on_batch()


async def kill_mid_stream(settings, catalog, tmp_path, model_dir, prompts: dict[str, str], max_tokens: int,
                          after=None, extra_env=None, one_compiles=False) -> KillRun:
    """`prompts` by request id; `after(send, collect)` runs with the survivor still serving.
    `one_compiles`: the survivor starts once the victim is ready, for a model no start has compiled yet."""
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(prefixed_topics_file(catalog, tmp_path / "topics.toml")),
           "SLUICE_GROUP_ID": f"chaos-{uuid.uuid4().hex[:6]}", "SLUICE_MODEL": str(model_dir),
           "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_REDIS_KEY_PREFIX": settings.redis.key_prefix,
           "SLUICE_LOG_LEVEL": "info", "SLUICE_CPU_KVCACHE_GIB": "1", **(extra_env or {})}
    victim, vport = start(env, tmp_path, "victim")
    survivor = sport = None
    reader = ReplyReader(settings.kafka.options(), catalog.replies.name)
    ids = list(prompts)
    run = KillRun({rid: {} for rid in ids}, {rid: [] for rid in ids})
    standard = catalog.request_topic("standard")
    topic = standard.name

    async def send(requests: dict[str, dict]) -> None:
        await produce(settings.kafka.options(), [(topic, rid.encode(), msgspec.json.encode({"id": rid, **body}), [])
                                                 for rid, body in requests.items()])

    async def collect(more_ids, timeout=900) -> dict[str, list[DoneReply]]:
        for rid in more_ids:
            run.tokens.setdefault(rid, {})
            run.finals.setdefault(rid, [])
        await read_until_done(reader, more_ids, run.tokens, run.finals, time.monotonic() + timeout)
        return {rid: run.finals[rid] for rid in more_ids}

    try:
        if one_compiles:  # the survivor loads what the victim compiled instead of compiling it beside it
            await wait_ready(victim, vport, tmp_path / "victim.log")
        survivor, sport = start(env, tmp_path, "survivor")
        await wait_ready(victim, vport, tmp_path / "victim.log")
        await wait_ready(survivor, sport, tmp_path / "survivor.log")
        victim_owns, _ = await wait_for_split([tmp_path / "victim.log", tmp_path / "survivor.log"], topic,
                                              standard.partitions)
        on_victim = [rid for rid in ids if partition_of(rid.encode(), standard.partitions) in victim_owns]
        assert on_victim, f"no request id lands on the victim's partitions {victim_owns}: use spread_ids"
        await asyncio.sleep(2)  # margin after both logged their share, before the first record
        await reader.start()
        await send({rid: {"prompt": p, "max_tokens": max_tokens} for rid, p in prompts.items()})
        engine_procs: dict[int, float] = {}

        def kill_once_streaming():
            if victim.poll() is None and all(len(t) >= 4 for rid, t in run.tokens.items() if rid in prompts):
                engine_procs.update({p: engine_guard.start_time(p)
                                     for p in engine_guard.descendants(engine_guard.parents(), victim.pid)})
                run.killed_at = time.time()
                victim.send_signal(signal.SIGKILL)  # no drain, no commit, no goodbye
                victim.wait()

        await read_until_done(reader, ids, run.tokens, run.finals, time.monotonic() + 900, kill_once_streaming)
        assert victim.poll() is not None, "the streams never got going"
        assert engine_procs, "the victim had no engine processes"
        # the victim's engine processes die with it instead of polling on as orphans
        end = time.monotonic() + 15
        while any(engine_guard.running(p, t) for p, t in engine_procs.items()) and time.monotonic() < end:
            await asyncio.sleep(0.2)
        run.orphaned_engine_procs = [p for p, t in engine_procs.items() if engine_guard.running(p, t)]
        run.survivor_metrics = http_get(sport, "/metrics")[1]
        if after is not None:
            run.after = await after(send, collect)
    finally:
        await reader.stop()
        for p in (victim, survivor):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    run.survivor_log = (tmp_path / "survivor.log").read_text()
    run.victim_log = (tmp_path / "victim.log").read_text()
    return run


def seconds_to_takeover(run: KillRun) -> float | None:
    """From the kill to the survivor's first `partitions_assigned` after it (log timestamps)."""
    for line in run.survivor_log.splitlines():
        if '"partitions_assigned"' in line and line.startswith("{"):
            stamp = msgspec.json.decode(line)["timestamp"]
            at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            if at > run.killed_at:
                return at - run.killed_at
    return None


def assert_one_stream_each(run: KillRun, ids) -> None:
    """Exactly one answer per id (repeats identical), gapless seqs, tokens that add up to the answer."""
    for rid in ids:
        assert run.finals[rid], (rid, run.survivor_log[-3000:])
        done = run.finals[rid][0]
        assert all(f.seq == done.seq and f.text == done.text for f in run.finals[rid]), rid
        assert sorted(run.tokens[rid]) == list(range(done.seq)), (rid, sorted(run.tokens[rid]))
        assert "".join(run.tokens[rid][s] for s in range(done.seq)) == done.text
