"""The KV-page save budget on the real engine: over budget, a request keeps its leading pages and
saves no more; a resume loads what was saved and computes the rest, with the same output."""

import asyncio
import uuid

import pytest
from redis.cluster import RedisCluster

from schemas import Request
from tests.integration.test_kv_pages import PROMPT, page_keys, run, wait_stored

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def budget_settings(settings):
    # about 1 KB a second: the bucket holds one page (its floor) and refills one in minutes
    return settings.override(kv_save_budget_mib_s=0.001, cpu_kvcache_gib=1,
                             redis_key_prefix=f"budget-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
async def budget_engine(budget_settings):
    from worker.engine import VllmEngine

    eng = await asyncio.to_thread(VllmEngine, budget_settings)
    yield eng
    eng.shutdown()


def over_budget(*dones) -> int:
    return sum(d.kv["counts"].get("save_over_budget", 0) for d in dones)


async def test_over_budget_a_request_keeps_its_leading_pages_and_a_resume_loads_them(budget_settings, budget_engine):
    eng, redis = budget_engine, RedisCluster.from_url(budget_settings.redis.url)
    ids = eng.prompt_ids(Request(id="budget", prompt=PROMPT))
    keys = page_keys(budget_settings, eng, "acme", ids)
    assert len(keys) >= 3
    # pages a 12-token request completes: the prompt's and the decoded ones' (the last token's KV is never computed)
    full_pages = (len(ids) + 11) // eng.block_size

    first, done = await run(eng, "b-a1", ids, "acme")
    _, tail = await run(eng, "b-tail", ids[:8], "acme", max_tokens=1)  # carries counts reported after `done`
    await wait_stored(redis, keys[:1])
    await asyncio.sleep(1)  # the writer had its chance at anything else that was planned
    assert [bool(redis.exists(k)) for k in keys] == [True] + [False] * (len(keys) - 1)
    assert over_budget(done, tail) == full_pages - 1, (done.kv, tail.kv)

    # the bucket is empty: another tenant's request saves nothing and says so
    _, other = await run(eng, "b-b1", ids, "globex")
    _, tail = await run(eng, "b-tail2", ids[:8], "globex", max_tokens=1)
    assert not any(redis.exists(k) for k in page_keys(budget_settings, eng, "globex", ids))
    assert over_budget(other, tail) == full_pages

    # the saved leading page spares a resume its prefill; the rest is computed; the output is unchanged
    await eng.reset_prefix_cache()
    again, done = await run(eng, "b-a2", ids, "acme")
    assert again == first
    assert done.kv["loaded_tokens"] == eng.block_size, done.kv
    redis.close()
