"""Shared set-up for benchmarks: embedded stack, model, one in-process engine, fresh topics."""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import uuid
from datetime import datetime, timezone
from pathlib import Path

import topics
from topics.admin import apply
from worker import devstack
from worker.model import prepare
from worker.settings import load


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.machine()}"


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def settings(**env):
    devstack.up(log=lambda *_: None)
    model = prepare(log=lambda *_: None)
    base = {"SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_METRICS_PORT": "0", "SLUICE_MODEL": str(model),
            "SLUICE_LOG_LEVEL": "warning", "SLUICE_REDIS_KEY_PREFIX": f"bench-{uuid.uuid4().hex[:6]}"}
    from worker.logs import configure

    configure("warning", "console")
    return load(environ={**os.environ, **base, **env})


async def fresh_catalog(s, tag: str):
    cat = topics.load(s.topics_file).renamed(f"b{tag}{uuid.uuid4().hex[:6]}.")
    await apply(s.kafka_common(), cat)
    return cat


async def engine(s):
    from worker.engine import VllmEngine
    from worker.service import engine_config

    return await asyncio.to_thread(VllmEngine, engine_config(s))


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"
