"""Redis trouble degrades, never stops: a master killed mid-run, and the whole cluster unreachable.

Both tests restore the embedded cluster before they end, whatever happens.
"""

import asyncio
import os
import signal
import subprocess
import time

import pytest

from loadgen.burst import make_requests, run_burst
from schemas import DoneReply
from tests.integration.helpers import running_worker
from worker import devstack, metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def cli(*args) -> str:
    _, redis_cli = devstack.redis_binaries()
    return subprocess.run([redis_cli, "-h", devstack.HOST, "-p", str(devstack.REDIS_PORTS[0]), *args],
                          capture_output=True, text=True, timeout=5).stdout


def masters() -> list[int]:
    ports = []
    for line in cli("cluster", "nodes").splitlines():
        parts = line.split()
        if len(parts) > 2 and "master" in parts[2] and "fail" not in parts[2]:
            ports.append(int(parts[1].split(":")[1].split("@")[0]))
    return ports


def pid_of(port: int) -> int:
    svc = next(s for s in devstack.REDIS if s.port == port)
    return int(svc.pidfile(devstack.DEFAULT_DIR.resolve()).read_text())


async def wait_cluster_ok(timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        info = cli("cluster", "info")
        if "cluster_state:ok" in info and len([ln for ln in cli("cluster", "nodes").splitlines()
                                                if "fail" not in ln and "connected" in ln]) == 6:
            return
        await asyncio.sleep(0.5)
    raise AssertionError("redis cluster did not recover:\n" + cli("cluster", "nodes"))


async def wait_redis_back(w, timeout=60):
    end = time.monotonic() + timeout
    while not await w.answers.ping() and time.monotonic() < end:
        await asyncio.sleep(1)
    assert w.answers.available and metrics.redis_up._value.get() == 1


async def test_master_killed_mid_run(settings, catalog, engine, group_id):
    await wait_cluster_ok()
    # The worker's seed node, when it is a master, is the hard case: a client rebuilt from the URL alone
    # would knock on the dead node for ever.
    seed_port = int(settings.redis.url.rsplit(":", 1)[1].split("/")[0])
    victim = seed_port if seed_port in masters() else masters()[0]
    killed = []

    def on_token(_reply):
        if not killed:
            os.kill(pid_of(victim), signal.SIGKILL)  # its replica takes over after the node timeout
            killed.append(time.monotonic())

    try:
        async with running_worker(settings, catalog, engine, group_id=group_id) as w:
            out = await run_burst(settings.kafka.options(), catalog,
                                  make_requests(12, seed=21, prefix="failover", max_tokens=48), timeout_s=300,
                                  on_token=on_token)
            assert killed
            for rid, o in out.items():
                assert isinstance(o.final, DoneReply) and not o.problems, (rid, o.final, o.problems)
            # once the replica is promoted, the worker talks to Redis again
            await wait_redis_back(w)
    finally:
        devstack.up(log=lambda *_: None)  # the killed node comes back as a replica
        await wait_cluster_ok()


async def test_whole_cluster_unreachable_then_back(settings, catalog, engine, group_id, stack):
    await wait_cluster_ok()
    pids = [pid_of(p) for p in devstack.REDIS_PORTS]
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # every node hangs: connections open, no answers
        async with running_worker(settings, catalog, engine, group_id=group_id, redis_lookup_wait_s=20) as w:
            out = await run_burst(settings.kafka.options(), catalog,
                                  make_requests(6, seed=22, prefix="dark", max_tokens=24), timeout_s=300)
            assert all(isinstance(o.final, DoneReply) and not o.problems for o in out.values())
            # they waited for Redis until the outage was the lookup wait (20 s) old, counted from the
            # worker's first failed call: at its start, some seconds before the burst (the group join)
            since = w.answers.unavailable_since
            assert since is not None
            assert all(o.done_at - since >= 19.5 for o in out.values()), [o.done_at - since for o in out.values()]
            assert not w.answers.available and metrics.redis_up._value.get() == 0
            # no call waits on the hung cluster once it is known to be away: a single task reconnects
            slowest = 0.0
            for _ in range(24):  # 6 s: three of the reconnect task's attempts, each up to four timeouts
                started = time.monotonic()
                assert await w.answers.get("default:anything") is None
                slowest = max(slowest, time.monotonic() - started)
                await asyncio.sleep(0.25)
            assert slowest < 0.3, slowest
            # still dark, and the outage is older than the wait: these run at once, unchecked, rather
            # than each batch waiting the whole 20 s again
            out = await run_burst(settings.kafka.options(), catalog,
                                  make_requests(6, seed=24, prefix="darker", max_tokens=24), timeout_s=300)
            assert all(isinstance(o.final, DoneReply) and o.final.unchecked and not o.problems for o in out.values())
            assert all(o.done_at - o.sent_at < 15 for o in out.values()), [o.done_at - o.sent_at for o in out.values()]
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            pids = []
            await wait_cluster_ok()
            await wait_redis_back(w)
            light = make_requests(6, seed=23, prefix="light", max_tokens=24)
            out = await run_burst(settings.kafka.options(), catalog, light, timeout_s=300)
            assert all(isinstance(o.final, DoneReply) and not o.problems for o in out.values())
            # back to normal: answers are stored again
            await w.answers.flush()
            assert all([await w.answers.get(f"default:{body['id']}") for _cls, body in light])
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
