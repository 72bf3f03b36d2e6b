"""Without Redis Cluster the worker keeps serving; it only loses the repeated-id check."""

import asyncio
import pytest

from loadgen.burst import make_requests, run_burst
from schemas import DoneReply
from tests.integration.helpers import running_worker
from worker import metrics

pytestmark = pytest.mark.integration


async def test_requests_complete_while_redis_is_unreachable(settings, catalog, engine, group_id):
    # Port 1 on loopback: nothing listens, so every Redis call fails fast.
    async with running_worker(settings, catalog, engine, group_id=group_id, redis_url="redis://127.0.0.1:1") as w:
        out = await run_burst(settings.kafka.options(), catalog, make_requests(6, seed=5, prefix="nr", max_tokens=4),
                              timeout_s=120)
        assert not w.answers.available
        assert metrics.redis_up._value.get() == 0
    assert all(isinstance(o.final, DoneReply) and not o.problems for o in out.values())
    # run without their stored answers and progress (past SLUICE_REDIS_LOOKUP_WAIT_S), and saying so
    assert all(o.final.unchecked for o in out.values())


async def test_a_cluster_that_evicts_keys_stops_the_worker_at_start_unless_allowed(settings):
    """An evicting maxmemory-policy would drop stored answers, progress and claims under memory
    pressure; the worker refuses to start on one, naming the fix, unless told to accept it."""
    from redis.asyncio.cluster import RedisCluster

    from worker import preflight

    assert await preflight.check_redis(settings.redis) == "ok"  # the embedded cluster: noeviction
    client = RedisCluster.from_url(settings.redis.client_url())
    await client.initialize()
    primary = client.get_primaries()[0]
    try:
        await client.config_set("maxmemory-policy", "allkeys-lru", target_nodes=primary)
        with pytest.raises(preflight.StartupError, match="allkeys-lru.*SLUICE_REDIS_ALLOW_EVICTION"):
            await preflight.check_redis(settings.redis)
        assert await preflight.check_redis(settings.override(redis_allow_eviction=True).redis) == "ok"
    finally:
        await client.config_set("maxmemory-policy", "noeviction", target_nodes=primary)
        await client.aclose()


async def test_a_full_cluster_that_refuses_writes_is_served_degraded(settings, catalog, engine, group_id):
    """maxmemory reached under noeviction: every write is refused (OOM) while connections are
    accepted. The worker serves on, its replies marked unchecked; a later burst in the same outage
    does not wait for Redis again (a reconnect does not end the outage, a write that succeeds does);
    and it stores again once there is room."""
    from redis.asyncio.cluster import RedisCluster

    client = RedisCluster.from_url(settings.redis.client_url())
    await client.initialize()
    try:
        await client.config_set("maxmemory", "1", target_nodes=client.PRIMARIES)
        async with running_worker(settings, catalog, engine, group_id=group_id, redis_lookup_wait_s=10) as w:
            out = await run_burst(settings.kafka.options(), catalog,
                                  make_requests(4, seed=7, prefix="full", max_tokens=4), timeout_s=120)
            assert all(isinstance(o.final, DoneReply) and o.final.unchecked and not o.problems for o in out.values())
            seen = set()
            for _ in range(50):  # 5 s: the store's reconnect task tries twice; the cluster still refuses writes
                seen.add(w.answers.available)
                await asyncio.sleep(0.1)
            assert seen == {False}, "a reconnect to a cluster that refuses writes counted it available"
            out = await run_burst(settings.kafka.options(), catalog,
                                  make_requests(4, seed=9, prefix="fuller", max_tokens=4), timeout_s=120)
            assert all(isinstance(o.final, DoneReply) and o.final.unchecked and not o.problems for o in out.values())
            assert all(o.done_at - o.sent_at < 7 for o in out.values()), [o.done_at - o.sent_at for o in out.values()]
            assert w.ready and w.supervisor.failure is None
            await client.config_set("maxmemory", "0", target_nodes=client.PRIMARIES)
            for _ in range(100):  # the store's reconnect task finds Redis writable again within seconds
                await w.answers.put_later("default:probe", b"{}")
                if w.answers.available:
                    break
                await asyncio.sleep(0.2)
            out = await run_burst(settings.kafka.options(), catalog,
                                  make_requests(4, seed=8, prefix="room", max_tokens=4), timeout_s=120)
            assert all(isinstance(o.final, DoneReply) and not o.final.unchecked for o in out.values())
    finally:
        await client.config_set("maxmemory", "0", target_nodes=client.PRIMARIES)
        await client.aclose()
