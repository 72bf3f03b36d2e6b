"""KV pages in Redis Cluster with the real engine: a hit loads them, corruption and other tenants miss."""

import asyncio

import pytest
from redis.cluster import RedisCluster

from schemas import Request
from worker import kv_pages
from worker.engine import GenParams

pytestmark = pytest.mark.integration

PROMPT = ("Ledger of card transactions for customer 4411, most recent last, with merchant, country, "
          "channel and amount in US dollars. ") + " ".join(
    f"#{i}: merchant m-{i * 37 % 101} in {['US', 'GB', 'BR', 'NG'][i % 4]}, {['pos', 'ecommerce'][i % 2]}, "
    f"{(i * 53) % 900 + 0.99} USD." for i in range(24)) + " Summary of the risk:"


async def run(engine, rid: str, prompt_ids, tenant: str, max_tokens: int = 12):
    text, last = [], None
    async for d in engine.generate(rid, prompt_ids, GenParams(max_tokens, tenant=tenant, save_pages=True), 0):
        text.append(d.text)
        last = d
    return "".join(text), last


def page_keys(settings, engine, tenant: str, prompt_ids) -> list[str]:
    seed = kv_pages.root(engine.fingerprint, tenant)
    return [kv_pages.key(settings.redis.key_prefix, d)
            for d in kv_pages.chain(seed, prompt_ids, engine.block_size, (len(prompt_ids) - 1) // engine.block_size)]


async def wait_stored(redis, keys, timeout=60):
    for _ in range(int(timeout / 0.2)):
        if all(redis.exists(k) for k in keys):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{sum(bool(redis.exists(k)) for k in keys)} of {len(keys)} pages stored")


async def test_pages_load_on_a_prefix_match_and_never_across_tenants_or_when_corrupt(settings, engine):
    redis = RedisCluster.from_url(settings.redis.url)
    ids = engine.prompt_ids(Request(id="kv", prompt=PROMPT))
    assert len(ids) > 4 * engine.block_size
    keys = page_keys(settings, engine, "acme", ids)

    first, first_done = await run(engine, "kv-a1", ids, "acme")
    await wait_stored(redis, keys)

    # same tenant, local prefix cache forgotten: the prefix comes from Redis, the output is unchanged
    await engine.reset_prefix_cache()
    again, done = await run(engine, "kv-a2", ids, "acme")
    assert again == first
    assert done.kv["loaded_tokens"] == len(keys) * engine.block_size, done.kv
    # the time that moving pages took, by part (sluice_kv_seconds_total): the first run's saves and this
    # load, each counted on the request that moved them or a later one (the writer counts after its SET round);
    # and how long the saved pages waited to be in Redis (sluice_kv_page_lag_seconds_total)
    _, tail = await run(engine, "kv-a2-tail", ids[:8], "acme", max_tokens=1)
    moved_us = {name: sum(d.kv["counts"].get(name, 0) for d in (first_done, done, tail))
                for name in ("us_loaded_redis", "us_loaded_decode", "us_loaded_copy", "us_stored_encode",
                             "us_stored_redis", "page_lag_us")}
    assert all(us > 0 for us in moved_us.values()), moved_us

    # another tenant with the identical prompt: its chain has other keys, nothing loads
    await engine.reset_prefix_cache()
    other, done = await run(engine, "kv-b1", ids, "globex")
    assert other == first
    assert done.kv["loaded_tokens"] == 0, done.kv

    # flip bytes in the middle of the third page: pages 0-1 load, the rest is recomputed, same output
    value = bytearray(redis.get(keys[2]))
    value[len(value) // 2] ^= 0xFF
    redis.set(keys[2], bytes(value))
    await engine.reset_prefix_cache()
    healed, done = await run(engine, "kv-a3", ids, "acme")
    assert healed == first
    assert done.kv["loaded_tokens"] == 2 * engine.block_size, done.kv
    # the miss is counted; the count rides on this or the next finished request
    _, tail = await run(engine, "kv-tail", ids[:8], "acme", max_tokens=1)
    misses = sum(d.kv["counts"].get("load_miss_checksum", 0) for d in (done, tail))
    assert misses == 1, (done.kv, tail.kv)
    redis.close()


async def test_pages_a_full_cluster_refuses_are_counted_failed_and_saved_once_it_has_room(settings, engine):
    """maxmemory reached under noeviction: the connector's page writes are refused. Each is counted
    `save_failed` (`sluice_kv_save_failures_total{reason="failed"}`, which the SluiceKvPagesNotSaved
    alert reads: the worker's own Redis health does not cover the connector's client), nothing is
    stored, the request is answered as usual; once Redis has room, pages are saved again."""
    redis = RedisCluster.from_url(settings.redis.url)
    ids = engine.prompt_ids(Request(id="full", prompt=PROMPT))
    refused_keys = page_keys(settings, engine, "refused", ids)
    first, _ = await run(engine, "kv-room", ids, "room")  # the output with pages saved (another tenant)
    try:
        redis.config_set("maxmemory", "1", target_nodes=RedisCluster.PRIMARIES)
        await engine.reset_prefix_cache()
        text, done = await run(engine, "kv-refused", ids, "refused")
        assert text == first
        counts = [done.kv["counts"]]
        for i in range(20):  # the writer thread counts after the request ends; later requests carry it
            if sum(c.get("save_failed", 0) for c in counts) >= len(refused_keys):
                break
            await asyncio.sleep(0.5)
            counts.append((await run(engine, f"kv-refused-tail{i}", ids[:8], "refused", max_tokens=1))[1].kv["counts"])
        assert sum(c.get("save_failed", 0) for c in counts) >= len(refused_keys), counts
        assert sum(c.get("stored_pages", 0) for c in counts) == 0, counts
    finally:
        redis.config_set("maxmemory", "0", target_nodes=RedisCluster.PRIMARIES)
    assert not any(redis.exists(k) for k in refused_keys)
    await asyncio.sleep(6)  # the connector leaves Redis alone a few seconds after a failure (retry_s)
    await engine.reset_prefix_cache()
    again, _ = await run(engine, "kv-refused-again", ids, "refused")
    assert again == first
    await wait_stored(redis, refused_keys, timeout=30)
    redis.close()
