"""Run a chaos scenario: topics of its own, worker processes, the workload and fuzz on schedule,
the faults, a live auditor; then the report. Exit status 1 when any loss or conflict column is
not zero."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

import topics
from loadgen.chaos import faults as faults_mod
from loadgen.chaos import fuzz, workload
from loadgen.chaos.audit import Audit, failed
from loadgen.chaos.pool import Pool
from schemas import DoneReply, ErrorReply, RequestCodec
from schemas.codec import BadRequest
from topics.admin import apply as apply_topics


@dataclass(frozen=True)
class Scenario:
    engine: str = "fake"  # fake | vllm
    requests: int = 10_000
    fuzz: int = 2_000
    rate: float = 60.0  # valid requests per second
    workers: int = 3
    faults: str = faults_mod.DEFAULT
    seed: int = 7
    token_ms: int = 20  # fake engine: time per token, so that faults land mid-stream
    max_tokens: tuple[int, int] = (4, 24)
    settle_s: float = 300.0  # after the last send, how long answers may take
    ready_s: float = 900.0
    dev_dir: Path = Path(".sluice/dev")
    out: Path = Path("out/chaos")


def _item_time(rng: random.Random, window: float) -> float:
    return rng.uniform(0, window)


class Run:
    def __init__(self, scenario: Scenario, settings, progress=None):
        self.sc, self.settings = scenario, settings
        self.run_id = f"chaos-{scenario.seed}-{uuid.uuid4().hex[:6]}"
        self.catalog = topics.load().renamed(f"{self.run_id}.")
        self.audit = Audit()
        self.progress = progress
        self.sent_valid = 0
        self.max_offset: dict[tuple[str, int], int] = {}
        self.unsendable = 0
        self.send_retries = 0
        self.series: list[dict] = []
        self.snapshot_errors = 0
        self._offsets_client: AIOKafkaConsumer | None = None

    def _worker_env(self) -> dict:
        sc, s = self.sc, self.settings
        out = self.sc.out / self.run_id
        env = {**os.environ,
               "SLUICE_TOPICS_FILE": str(topics.write_renamed(f"{self.run_id}.", out / "topics.toml")),
               "SLUICE_GROUP_ID": self.run_id, "SLUICE_REDIS_KEY_PREFIX": self.run_id,
               "SLUICE_KAFKA_IDEMPOTENCE": "false",  # the embedded broker has no InitProducerId
               "SLUICE_KAFKA_REQUEST_TIMEOUT_MS": str(self.request_timeout_ms),
               "SLUICE_LOG_LEVEL": "info"}
        if sc.engine == "fake":
            env.update(SLUICE_ENGINE_KIND="fake", SLUICE_FAKE_TOKEN_MS=str(sc.token_ms))
        else:
            env.update(SLUICE_ENGINE_KIND="vllm", SLUICE_MODEL=s.engine.model,
                       SLUICE_CPU_KVCACHE_GIB=os.environ.get("SLUICE_CPU_KVCACHE_GIB", "1"))
        return env

    # a broker pause must outlast the producers' request timeout; a short timeout keeps the pause short
    request_timeout_ms = 5000

    async def main(self) -> dict:
        sc = self.sc
        out = sc.out / self.run_id
        out.mkdir(parents=True, exist_ok=True)
        kinds = {k.strip() for k in sc.faults.split(",") if k.strip()}
        faults_mod.check_stack(sc.dev_dir, kinds)
        missing, drift = await apply_topics(self.settings.kafka.options(), self.catalog, create=True)
        if drift:
            raise RuntimeError(f"topic drift: {drift}")
        window = sc.requests / sc.rate
        plan = workload.plan(sc.requests, sc.rate, sc.seed, self.run_id, sc.max_tokens)
        rng = random.Random(sc.seed)
        # A record with neither key nor value cannot be sent with this client (aiokafka asserts);
        # generate until `fuzz` records can be.
        fuzzed: list = []
        extra = 0
        while sc.fuzz and len(fuzzed) < sc.fuzz:
            fuzzed = [f for f in fuzz.generate(sc.fuzz + extra, sc.seed, self.catalog.replies.name)
                      if f[1] is not None or f[2] is not None][: sc.fuzz]
            extra += max(10, sc.fuzz // 20)
        items = [(p.at_s, "valid", p) for p in plan] + [(_item_time(rng, window), "fuzz", f) for f in fuzzed]
        items.sort(key=lambda x: x[0])
        schedule = faults_mod.schedule(sc.faults, window) if sc.faults else []

        pool = Pool(self._worker_env(), out / "workers", sc.workers)
        injector = faults_mod.Injector(pool, sc.dev_dir, random.Random(sc.seed + 1),
                                       self.settings.group.session_timeout_ms / 1000, self.request_timeout_ms / 1000)
        reader = _Reader(self.settings.kafka.options(), self.catalog, self.audit)
        await reader.start()
        tasks: list[asyncio.Task] = []
        t_start = time.monotonic()
        try:
            await pool.start(sc.ready_s)
            pool.t0 = time.monotonic()
            pool.note("ready", f"{sc.workers} workers")
            tasks = [asyncio.create_task(c) for c in (
                reader.run(), pool.watch(), self._snapshots(), self._faults(injector, schedule, pool),
                self._sample(pool))]
            await self._send(items, pool)
            pool.note("sent", f"{self.sent_valid} requests, {len(fuzzed) - self.unsendable} fuzzed")
            await self._settle(pool, tasks)
            pool.note("settled", f"{self.audit.pending()} pending")
            await self._final_commits()
        finally:
            injector.resume_all()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.to_thread(pool.stop_all)
            await reader.stop()
            if self._offsets_client is not None:
                await self._offsets_client.stop()
        counts = self.audit.counts()
        counts["worker_exits"] = sum(1 for _, what, _ in pool.events if what == "exit")
        counts["unsendable_fuzz"] = self.unsendable
        counts["send_retries"] = self.send_retries
        return {"run": self.run_id, "engine": sc.engine, "seed": sc.seed, "workers": sc.workers,
                "scenario": {k: str(v) for k, v in vars(sc).items()},
                "seconds": time.monotonic() - t_start, "counts": counts, "failed": failed(counts),
                "errors_by_code": self.audit.errors_by_code(), "events": pool.events, "spans": injector.spans,
                "violations": self.audit.violations, "lost_ids": self.audit.lost_ids(), "uncommitted_partitions": self.audit.uncommitted,
                "series": self.series, "snapshot_errors": self.snapshot_errors}

    async def _send(self, items, pool: Pool) -> None:
        producer = AIOKafkaProducer(**self.settings.kafka.options(), acks="all", linger_ms=5,
                                    max_request_size=16 << 20, request_timeout_ms=120_000)
        await producer.start()
        codec = RequestCodec(self.settings.limits)
        retry: list = []
        try:
            pending = []
            for at_s, kind, item in items:
                delay = pool.t0 + at_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                pending.append(await self._send_one(producer, codec, kind, item, retry))
                while retry:  # sends that failed (the broker paused, say) go again, same record
                    pending.append(await self._send_one(producer, codec, *retry.pop(0), retry))
                pending = [f for f in pending if f is not None and not f.done()]
            while pending or retry:
                if pending:
                    await asyncio.wait(pending)
                pending = [await self._send_one(producer, codec, kind, item, retry) for kind, item in retry]
                retry.clear()
                pending = [f for f in pending if f is not None]
        finally:
            await producer.stop()

    async def _send_one(self, producer, codec, kind, item, retry):
        if kind == "valid":
            topic = self.catalog.request_topic(item.latency_class).name
            key, value, headers = item.id.encode(), _json(item.body), []
        else:
            cls, key, value, headers = item
            topic = self.catalog.request_topic(cls).name
        try:
            fut = await producer.send(topic, value, key=key, headers=headers)
        except Exception:  # a record the client itself refuses to send (no key and no value, say)
            self.unsendable += kind == "fuzz"
            return None

        def sent(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                self.send_retries += 1
                retry.append((kind, item))
                return
            md = f.result()
            coords = (topic, md.partition, md.offset)
            self.max_offset[coords[:2]] = max(self.max_offset.get(coords[:2], -1), md.offset)
            if kind == "valid":
                self.sent_valid += 1
                self.audit.sent(item.id, item.streamed, coords)
            else:
                self.audit.fuzzed(coords, _reply_id(codec, value, headers, key))

        fut.add_done_callback(sent)
        return fut

    async def _settle(self, pool: Pool, tasks) -> None:
        end = time.monotonic() + self.sc.settle_s
        faults = tasks[3]
        while (self.audit.pending() or not faults.done()) and time.monotonic() < end:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception():
                    raise t.exception()
            await asyncio.sleep(0.5)

    async def _group_offsets(self) -> dict[tuple[str, int], int]:
        """The group's committed offsets (OffsetFetch without joining the group)."""
        if self._offsets_client is None:
            self._offsets_client = AIOKafkaConsumer(**self.settings.kafka.options(), group_id=self.run_id,
                                                    enable_auto_commit=False, request_timeout_ms=5000)
            await self._offsets_client.start()
        tps = [TopicPartition(t.name, p) for t in self.catalog.requests for p in range(t.partitions)]
        got = await asyncio.gather(*(self._offsets_client.committed(tp) for tp in tps))
        return {(tp.topic, tp.partition): o for tp, o in zip(tps, got) if o is not None}

    async def _snapshots(self) -> None:
        while True:
            try:
                async with asyncio.timeout(10):
                    offsets = await self._group_offsets()
                self.audit.committed(int(time.time() * 1000), offsets)
            except (Exception, TimeoutError):  # the broker may be paused: a missed snapshot checks nothing
                self.snapshot_errors += 1
            await asyncio.sleep(2)

    async def _final_commits(self) -> None:
        """Wait (bounded) for the group to commit past every record sent, then record where it got."""
        offsets: dict = {}
        end = time.monotonic() + 60
        want = {tp: o + 1 for tp, o in self.max_offset.items()}
        while time.monotonic() < end:
            try:
                offsets = await self._group_offsets()
            except Exception:
                await asyncio.sleep(1)
                continue
            self.audit.committed(int(time.time() * 1000), offsets)
            if all(offsets.get(tp, 0) >= o for tp, o in want.items()):
                break
            await asyncio.sleep(1)
        self.audit.ends(offsets, want)

    async def _faults(self, injector, schedule, pool: Pool) -> None:
        """Each fault at its time, concurrently: a kill may land while another worker is paused."""
        started = []
        for fault in schedule:
            delay = pool.t0 + fault.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            started.append(asyncio.create_task(injector.apply(fault)))
        try:
            await asyncio.gather(*started)
        finally:
            for t in started:
                t.cancel()

    async def _sample(self, pool: Pool) -> None:
        last_sent = last_answered = 0
        while True:
            await asyncio.sleep(1)
            answered = sum(bool(r.finals) for r in self.audit.requests.values())
            self.series.append({"t": round(time.monotonic() - pool.t0, 1), "sent_per_s": self.sent_valid - last_sent,
                                "answered_per_s": answered - last_answered, "in_flight": self.sent_valid - answered,
                                "workers": len(pool.alive())})
            last_sent, last_answered = self.sent_valid, answered
            if self.progress:
                self.progress(self, pool)


def _json(body: dict) -> bytes:
    import msgspec

    return msgspec.json.encode(body)


def _reply_id(codec: RequestCodec, value, headers, key) -> str | None:
    """The id a worker answers this record under (None: it can only be dead-lettered)."""
    try:
        return codec.decode(value, headers, key).id
    except BadRequest as bad:
        return bad.id
    except Exception:
        return None


class _Reader:
    """Reads the run's reply and dead-letter topics from their beginning into the audit."""

    def __init__(self, kafka_opts: dict, catalog, audit: Audit):
        self.catalog, self.audit = catalog, audit
        self.consumer = AIOKafkaConsumer(**kafka_opts, enable_auto_commit=False, fetch_max_wait_ms=50,
                                         max_partition_fetch_bytes=16 << 20)
        self.finals = 0

    async def start(self) -> None:
        await self.consumer.start()
        tps = []
        for topic in (self.catalog.replies.name, self.catalog.dlq.name):
            parts = None
            for _ in range(100):
                parts = self.consumer.partitions_for_topic(topic)
                if parts:
                    break
                await self.consumer._client.force_metadata_update()
                await asyncio.sleep(0.1)
            tps += [TopicPartition(topic, p) for p in sorted(parts or [])]
        self.consumer.assign(tps)
        await self.consumer.seek_to_beginning(*tps)

    async def run(self) -> None:
        dlq = self.catalog.dlq.name
        while True:
            batches = await self.consumer.getmany(timeout_ms=500, max_records=5000)
            for tp, recs in batches.items():
                for rec in recs:
                    if tp.topic == dlq:
                        h = {k: v for k, v in rec.headers}
                        try:
                            coords = (h["x-sluice-source-topic"].decode(), int(h["x-sluice-source-partition"]),
                                      int(h["x-sluice-source-offset"]))
                        except (KeyError, ValueError, UnicodeDecodeError):
                            self.audit.malformed += 1
                            continue
                        self.audit.dead_letter(coords, rec.timestamp)
                    else:
                        r = self.audit.reply(rec.value, rec.timestamp)
                        self.finals += isinstance(r, (DoneReply, ErrorReply))

    async def stop(self) -> None:
        await self.consumer.stop()
