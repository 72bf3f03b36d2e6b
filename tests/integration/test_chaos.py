"""Two workers in one group; one is killed with SIGKILL mid-stream. Nothing is lost, nothing differs.

Every request still gets exactly one `done` after dropping repeated (id, seq); seqs
are gapless; each text equals an uninterrupted greedy run of the same prompt; the
surviving worker continued the dead one's requests from their progress, loading
the prefix's KV pages from Redis instead of recomputing them.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import msgspec
import pytest

from loadgen.burst import ReplyReader, produce
from schemas import DoneReply, Request, TokenReply
from tests.integration.helpers import free_port, http_get, metric, prefixed_topics_file
from worker import engine_guard
from worker.engine import GenParams

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N, MAX_TOKENS = 6, 160


def prompt(k: int) -> str:
    return (f"Inventory log {k}. Each line lists an item number and its shelf. " +
            " ".join(f"Item {k * 100 + i} is on shelf {(k + i) % 9}." for i in range(14)) +
            f" Now count upward by ones starting at {k * 1000}: {k * 1000}, {k * 1000 + 1}, {k * 1000 + 2},")


def start(env, tmp_path, name):
    port = free_port()
    log = open(tmp_path / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker"], env={**env, "SLUICE_METRICS_PORT": str(port)},
                            stdout=log, stderr=log)
    return proc, port


async def wait_ready(proc, port, log_path, timeout=600):
    end = time.monotonic() + timeout
    while http_get(port, "/readyz")[0] != 200:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < end, "worker never became ready"
        await asyncio.sleep(0.5)


async def test_sigkill_mid_stream_loses_and_changes_nothing(settings, catalog, engine, model_dir, tmp_path):
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(prefixed_topics_file(catalog, tmp_path / "topics.toml")),
           "SLUICE_GROUP_ID": f"chaos-{uuid.uuid4().hex[:6]}", "SLUICE_MODEL": str(model_dir),
           "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_REDIS_KEY_PREFIX": settings.redis.key_prefix,
           "SLUICE_LOG_LEVEL": "info", "SLUICE_CPU_KVCACHE_GIB": "1"}
    victim, vport = start(env, tmp_path, "victim")
    survivor, sport = start(env, tmp_path, "survivor")
    reader = ReplyReader(settings.kafka.bootstrap, catalog.replies.name)
    try:
        await wait_ready(victim, vport, tmp_path / "victim.log")
        await wait_ready(survivor, sport, tmp_path / "survivor.log")
        await asyncio.sleep(8)  # let the group settle with both members
        await reader.start()
        tag = uuid.uuid4().hex[:6]
        ids = [f"chaos-{tag}-{k}" for k in range(N)]
        await produce(settings.kafka.bootstrap, [
            (catalog.request_topic("standard").name, rid.encode(),
             msgspec.json.encode({"id": rid, "prompt": prompt(k), "max_tokens": MAX_TOKENS}), [])
            for k, rid in enumerate(ids)])
        tokens: dict[str, dict[int, str]] = {rid: {} for rid in ids}
        finals: dict[str, list[DoneReply]] = {rid: [] for rid in ids}
        killed = False
        deadline = time.monotonic() + 900
        while any(not f for f in finals.values()) and time.monotonic() < deadline:
            async for r in reader.records():
                if r.id not in tokens:
                    continue
                if isinstance(r, TokenReply):
                    seen = tokens[r.id].get(r.seq)
                    assert seen is None or seen == r.text, f"{r.id} seq {r.seq} repeated with other text"
                    tokens[r.id][r.seq] = r.text
                elif isinstance(r, DoneReply):
                    finals[r.id].append(r)
            if not killed and all(len(t) >= 4 for t in tokens.values()):
                engine_procs = {p: engine_guard.start_time(p)
                                for p in engine_guard.descendants(engine_guard.parents(), victim.pid)}
                victim.send_signal(signal.SIGKILL)  # no drain, no commit, no goodbye
                victim.wait()
                killed = True
        assert killed, "the streams never got going"
        # the victim's engine processes die with it instead of polling on as orphans
        assert engine_procs, "the victim had no engine processes"
        end = time.monotonic() + 15
        while any(engine_guard.running(p, t) for p, t in engine_procs.items()) and time.monotonic() < end:
            await asyncio.sleep(0.2)
        assert not any(engine_guard.running(p, t) for p, t in engine_procs.items()), engine_procs
        metrics_text = http_get(sport, "/metrics")[1]
    finally:
        await reader.stop()
        for p in (victim, survivor):
            if p.poll() is None:
                p.kill()
    survivor_log = (tmp_path / "survivor.log").read_text()
    for rid in ids:
        assert finals[rid], (rid, survivor_log[-3000:])
        done = finals[rid][0]
        assert all(f.seq == done.seq and f.text == done.text for f in finals[rid]), rid  # repeats are identical
        assert sorted(tokens[rid]) == list(range(done.seq)), (rid, sorted(tokens[rid]))
        assert "".join(tokens[rid][s] for s in range(done.seq)) == done.text
    resumed = [rid for rid in ids if finals[rid][0].resumed]
    assert resumed, "no request was on the killed worker"
    assert metric(metrics_text, "sluice_requests_resumed_total") >= len(resumed)
    assert metric(metrics_text, "sluice_prefill_tokens_total", source="redis") > 0, metrics_text[-2000:]
    # the same prompts, uninterrupted, on another engine: the same text
    for k, rid in enumerate(ids):
        ref = []
        async for d in engine.generate(f"ref-{rid}", engine.prompt_ids(Request(id=rid, prompt=prompt(k))),
                                       GenParams(MAX_TOKENS), 0):
            ref.append(d.text)
        assert "".join(ref) == finals[rid][0].text, rid
