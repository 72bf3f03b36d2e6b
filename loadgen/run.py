"""`sluice loadgen`: publish a workload open-loop, follow the replies, write the reports."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaProducer
from tqdm import tqdm

from loadgen.burst import ReplyReader
from loadgen.report import Timing, summarize, write_json, write_markdown, write_png
from loadgen.workload import Workload
from schemas import DoneReply, ErrorReply, TokenReply


async def run(kafka_opts: dict, catalog, workload: Workload, drain_s: float = 120.0,
              show_progress: bool = True, signer=None) -> list[Timing]:
    """`signer` (schemas.signing.Signer): the tenant's identity - its dedicated topics (tenancy_mode
    topic) and, with a key, signed records (tenancy_mode signed)."""
    tenant = signer.tenant if signer is not None else None
    plan = workload.requests(prefix=f"lg{uuid.uuid4().hex[:6]}")
    timings = {body["id"]: Timing(cls, 0.0, None, None, None) for _, cls, body in plan}
    reader = ReplyReader(kafka_opts, catalog.replies.name)
    await reader.start()
    producer = AIOKafkaProducer(**kafka_opts, linger_ms=0)
    await producer.start()
    bar = tqdm(total=len(plan), desc="loadgen", unit="req", mininterval=1, disable=not show_progress)

    async def publish():
        start = time.monotonic()
        for at, cls, body in plan:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))  # open loop: never waits for replies
            timings[body["id"]].sent = time.monotonic()
            key, value = body["id"].encode(), msgspec.json.encode(body)
            await producer.send(catalog.request_topic(cls, tenant).name, value, key=key,
                                headers=signer.headers(key, value) if signer is not None else [])

    try:
        sender = asyncio.create_task(publish())
        pending = set(timings)
        deadline = time.monotonic() + workload.seconds + drain_s
        while pending and time.monotonic() < deadline:
            async for r in reader.records():
                t = timings.get(r.id)
                if t is None or r.id not in pending:
                    continue
                now = time.monotonic()
                if isinstance(r, TokenReply):
                    t.first_token = t.first_token or now
                    t.last_token = now
                else:
                    t.done = now
                    if isinstance(r, DoneReply):
                        t.completion_tokens = r.usage.completion_tokens
                        t.first_token = t.first_token or now
                        t.last_token = t.last_token or now
                    elif isinstance(r, ErrorReply):
                        t.error = r.code.value
                    pending.discard(r.id)
                    bar.update(1)
        await sender
    finally:
        bar.close()
        await producer.stop()
        await reader.stop()
    return list(timings.values())


def write_reports(timings: list[Timing], workload: Workload, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(timings)
    meta = {"requests": len(timings), "rate": workload.rate, "seconds": workload.seconds,
            "arrival": workload.arrival, "mix": workload.mix, "seed": workload.seed}
    write_json(summary, meta, out / "loadgen.json")
    write_markdown(summary, meta, out / "loadgen.md")
    write_png(timings, out / "loadgen.png")
    return summary
