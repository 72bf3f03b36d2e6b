"""The ops server: sluice's and the process registry's metrics on one target; slow clients hold nothing up."""

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

from prometheus_client import Counter

from tests.unit.test_supervision import free_port, http_get
from worker import engine_guard
from worker.ops import OpsServer


async def test_metrics_serve_both_registries_and_readyz_follows_status():
    port, ready = free_port(), {"value": False}
    engine_side = Counter("vllm_like_test_total", "stands in for vLLM's metrics in the process registry")
    engine_side.inc(3)
    ops = OpsServer("127.0.0.1", port, lambda: (ready["value"], {"engine": "ok"}))
    await ops.start()
    try:
        status, body = await http_get(port, "/metrics")
        assert status == 200 and "sluice_engine_up" in body and "vllm_like_test_total 3.0" in body
        assert "sluice_ready 0.0" in body
        assert (await http_get(port, "/readyz"))[0] == 503
        ready["value"] = True
        assert "sluice_ready 1.0" in (await http_get(port, "/metrics"))[1]
        status, body = await http_get(port, "/readyz")
        assert status == 200 and '"engine": "ok"' in body
        assert (await http_get(port, "/healthz"))[0] == 200
        assert (await http_get(port, "/nope"))[0] == 404
    finally:
        await ops.stop()


async def test_the_processes_below_the_worker_report_their_memory():
    """vLLM's engine core is a process of its own: its memory is read at each scrape, summed with the
    rest below the worker (here a child holding 64 MiB, and its own child holding 32 MiB)."""
    port = free_port()
    hold = ("import subprocess, sys, time; b = bytearray({mib} << 20); b[::4096] = b'x' * len(b[::4096]); "
            "{then}; print('held', flush=True); time.sleep(60)")
    grandchild = hold.format(mib=32, then="pass")
    child = subprocess.Popen([sys.executable, "-c", hold.format(
        mib=64, then=f"g = subprocess.Popen([sys.executable, '-c', {grandchild!r}], stdout=subprocess.PIPE); "
                     "g.stdout.readline()")], stdout=subprocess.PIPE)
    ops, below = OpsServer("127.0.0.1", port, lambda: (True, {})), []
    await ops.start()
    try:
        assert child.stdout.readline() == b"held\n"
        below = engine_guard.descendants(engine_guard.parents(), child.pid)
        held = await scraped(port)
        assert held >= (64 + 32) << 20
        child.kill()
        child.wait()  # its child, orphaned, is no longer below this process either
        assert await scraped(port) < held - (80 << 20)
    finally:
        child.kill()
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await ops.stop()


async def scraped(port: int) -> float:
    body = (await http_get(port, "/metrics"))[1]
    return float(re.search(r"^sluice_engine_processes_resident_bytes (\S+)$", body, re.M).group(1))


async def test_a_client_that_never_finishes_its_request_blocks_no_probe():
    port = free_port()
    ops = OpsServer("127.0.0.1", port, lambda: (True, {}))
    await ops.start()
    stalled = []
    try:
        for _ in range(50):  # half-sent requests, left open
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            stalled.append(w)
        t0 = time.monotonic()
        assert (await asyncio.wait_for(http_get(port, "/readyz"), 2))[0] == 200
        assert time.monotonic() - t0 < 1
    finally:
        for w in stalled:
            w.close()
        await ops.stop()


def test_tenant_labels_are_bounded_whatever_producers_write():
    from worker import metrics

    labels = {metrics.tenant_label(f"tenant-{i}") for i in range(metrics.MAX_TENANT_LABELS * 3)}
    assert len(labels) <= metrics.MAX_TENANT_LABELS + 1 and metrics.OTHER_TENANTS in labels
    first = next(iter(metrics._tenants_seen))
    assert metrics.tenant_label(first) == first  # a tenant seen early keeps its own series
