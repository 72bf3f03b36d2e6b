"""The engine dies under a running worker (SIGKILL, as the OOM killer sends): the worker fails closed.

On CPU the engine core runs the model itself (`SLUICE_ENGINE_START=inprocess`, the default), so
that one process is the whole engine. The worker must notice, say why, exit non-zero so that its
supervisor restarts it, and leave no engine process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid

import pytest

from tests.integration.helpers import cmdline, http_get, prefixed_topics_file
from tests.integration.kill_resume import start, wait_ready
from worker import engine_guard

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("victim", ["core", "forkserver"])
async def test_a_killed_engine_core_makes_the_worker_exit_1_naming_the_engine(settings, catalog, model_dir, tmp_path,
                                                                              victim):
    """`forkserver`: the process that started the engine core dies instead. vLLM then takes the core
    for dead (its exit status can no longer be read) and never stops it: before, it kept running,
    3 GB of memory, after the worker had exited."""
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(prefixed_topics_file(catalog, tmp_path / "topics.toml")),
           "SLUICE_GROUP_ID": f"death-{uuid.uuid4().hex[:6]}", "SLUICE_MODEL": str(model_dir),
           "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_REDIS_KEY_PREFIX": settings.redis.key_prefix,
           "SLUICE_LOG_LEVEL": "info", "SLUICE_CPU_KVCACHE_GIB": "1", "SLUICE_ENGINE_HEALTH_INTERVAL_S": "1"}
    env.pop("SLUICE_ENGINE_START", None)  # the default
    proc, port = start(env, tmp_path, "worker")
    log_path = tmp_path / "worker.log"
    try:
        await wait_ready(proc, port, log_path)
        parent_of = engine_guard.parents()
        servers = [p for p, pp in parent_of.items() if pp == proc.pid and b"multiprocessing.forkserver" in cmdline(p)]
        cores = [p for p, pp in parent_of.items() if pp in servers]
        assert len(cores) == 1, f"expected one engine core under the worker's forkserver: {servers}, {cores}"
        assert not [p for p, pp in parent_of.items() if pp == cores[0]], "a model runner process was started"
        os.kill(cores[0] if victim == "core" else servers[0], signal.SIGKILL)
        seen_503 = []
        end = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < end:
            status, body = http_get(port, "/readyz")
            if status == 503:
                seen_503.append(body)
            await asyncio.sleep(0.1)
        rc = proc.poll()
        log = log_path.read_text()
        assert rc == 1, f"worker still running or exited {rc} after its engine died:\n{log[-3000:]}"
        failed = [json.loads(line) for line in log.splitlines() if '"worker_failed"' in line]
        assert failed and "engine" in failed[0]["reason"], log[-3000:]
        for body in seen_503:  # while it drained, readiness said why
            assert "engine" in body, body
        # nothing of the engine outlives the worker: the forkserver and the engine core are gone
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and set(servers + cores) & set(engine_guard.parents()):
            await asyncio.sleep(0.2)
        assert not set(servers + cores) & set(engine_guard.parents())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
