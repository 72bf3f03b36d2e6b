"""Shared set-up for benchmarks: embedded stack, model, one in-process engine, fresh topics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import sys
import time
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
    cat = topics.load(s.worker.topics_file).renamed(f"b{tag}{uuid.uuid4().hex[:6]}.")
    await apply(s.kafka.options(), cat)
    return cat


async def engine(s):
    from worker.engine import VllmEngine

    return await asyncio.to_thread(VllmEngine, s)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_http(url: str, proc, timeout: float = 600) -> None:
    """Until `url` answers 200; fails early if `proc` exits."""
    import aiohttp

    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode}")
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
    raise TimeoutError(url)


def stop_process(proc, grace: float = 60) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.asynccontextmanager
async def worker_process(s, tag: str, log_path: Path, **env):
    """`sluice worker` in its own process on fresh prefixed topics; yields the catalog once it is ready."""
    prefix = f"{tag}{uuid.uuid4().hex[:6]}."
    root = Path(__file__).resolve().parent.parent
    topics_file = log_path.with_suffix(".topics.toml")
    topics_file.write_text((root / "topics" / "default.toml").read_text()
                           .replace('name = "sluice.', f'name = "{prefix}sluice.'))
    cat = topics.load(topics_file)
    await apply(s.kafka.options(), cat)
    port = free_port()
    full = {**os.environ, "SLUICE_TOPICS_FILE": str(topics_file), "SLUICE_METRICS_PORT": str(port),
            "SLUICE_METRICS_HOST": "127.0.0.1", "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_MODEL": s.engine.model,
            "SLUICE_GROUP_ID": f"{tag}-{uuid.uuid4().hex[:6]}", "SLUICE_LOG_LEVEL": "warning",
            "SLUICE_REDIS_KEY_PREFIX": f"{tag}-{uuid.uuid4().hex[:6]}", **env}
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker"], env=full, cwd=root,
                            stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), start_new_session=True)
    try:
        await wait_http(f"http://127.0.0.1:{port}/readyz", proc)
        yield cat
    finally:
        stop_process(proc)
        topics_file.unlink(missing_ok=True)


def run_offline_child(script: str, model: str) -> dict:
    """Re-run `script` with --child-offline in its own process; returns the JSON of its RESULT line."""
    import json

    cmd = [sys.executable, script, "--child-offline", *sys.argv[1:], "--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(script).resolve().parent.parent)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"offline run failed:\n{out.stderr[-4000:]}")


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"
