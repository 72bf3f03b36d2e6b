"""The KV-page save budget on the real engine: a page the budget cannot pay for waits while its
request runs and is saved later; pages still waiting at the end are counted, never half-saved out
of order; a resume loads what was saved and computes the rest, with the same output."""

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from redis.cluster import RedisCluster

from schemas import Request
from tests.integration.test_kv_pages import PROMPT, page_keys, run, wait_stored
from worker.engine import resolve_dtype
from worker.save_budget import MIB

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BLOCK = 128  # vLLM's page size on CPU; the test checks the engine agrees
PAGES_PER_S = 2  # the bucket holds 2 pages (a second's budget) and refills one every half second


def page_bytes(settings) -> int:
    """One page of every layer's K and V, as the engine prices it (the model's config, the resolved dtype)."""
    config = json.loads(Path(settings.engine.model, "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    width = 2 if resolve_dtype(settings.engine.dtype, "cpu") in ("bfloat16", "float16") else 4
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * BLOCK * width


@pytest.fixture(scope="module")
def budget_settings(settings):
    return settings.override(kv_save_budget_mib_s=PAGES_PER_S * page_bytes(settings) / MIB, ignore_eos=True,
                             cpu_kvcache_gib=1, redis_key_prefix=f"budget-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
async def budget_engine(budget_settings):
    from worker.engine import VllmEngine

    eng = await asyncio.to_thread(VllmEngine, budget_settings)
    yield eng
    eng.shutdown()


def over_budget(*dones) -> int:
    return sum(d.kv["counts"].get("save_over_budget", 0) for d in dones)


async def test_pages_over_budget_wait_for_it_and_those_it_never_reaches_are_counted(budget_settings, budget_engine):
    eng, redis = budget_engine, RedisCluster.from_url(budget_settings.redis.url)
    assert eng.block_size == BLOCK
    ids = eng.prompt_ids(Request(id="budget", prompt=PROMPT))
    keys = page_keys(budget_settings, eng, "acme", ids)
    assert len(keys) > PAGES_PER_S + 1  # the prefill completes more pages than the bucket holds

    # the prefill's pages exceed the bucket: the rest wait, and are saved while the request decodes
    # (96 tokens, ignore_eos, take over a second on CPU: time for the bucket to pay for them)
    first, done = await run(eng, "b-a1", ids, "acme", max_tokens=96)
    await wait_stored(redis, keys, timeout=30)

    # a one-step request (its prefill) can save only what the bucket holds (full again after a
    # second); the rest is counted, and what was saved is a leading run of pages
    await asyncio.sleep(1.5)
    other_keys = page_keys(budget_settings, eng, "globex", ids)
    _, other = await run(eng, "b-b1", ids, "globex", max_tokens=1)
    _, tail = await run(eng, "b-tail", ids[:8], "globex", max_tokens=1)  # carries counts reported after `other`
    await asyncio.sleep(1)  # the writer has had its chance at every page planned
    stored = [bool(redis.exists(k)) for k in other_keys]
    saved = sum(stored)
    assert saved == PAGES_PER_S and stored == [True] * saved + [False] * (len(other_keys) - saved), stored
    assert over_budget(other, tail) == len(ids) // BLOCK - saved, (other.kv, tail.kv)

    # the first request's saved pages spare a resume its whole prompt; the output is unchanged
    await eng.reset_prefix_cache()
    again, done = await run(eng, "b-a2", ids, "acme", max_tokens=96)
    assert again == first
    assert done.kv["loaded_tokens"] == len(keys) * BLOCK, done.kv
    redis.close()


async def test_the_budget_pays_first_for_the_request_with_most_still_to_generate(budget_settings, budget_engine):
    """A short request and a long one sent together, the short one first: once both are in the engine,
    every page the budget pays for is the long one's, though the short one still has pages waiting.

    On this CPU a prefill step lasts long enough to refill the bucket, so the short request may get
    the bucket's first grant if its prefill is scheduled alone; it never gets more."""
    eng, redis = budget_engine, RedisCluster.from_url(budget_settings.redis.url)
    short_ids = eng.prompt_ids(Request(id="short", prompt=PROMPT))
    long_ids = eng.prompt_ids(Request(id="long", prompt=PROMPT + " Again: " + PROMPT))
    short_keys = page_keys(budget_settings, eng, "initech", short_ids)
    long_keys = page_keys(budget_settings, eng, "umbrella", long_ids)
    assert len(short_keys) > PAGES_PER_S + 1 and len(long_keys) > len(short_keys) + PAGES_PER_S

    await asyncio.sleep(1.5)  # a full bucket
    short = asyncio.create_task(run(eng, "o-short", short_ids, "initech", max_tokens=12))
    long = asyncio.create_task(run(eng, "o-long", long_ids, "umbrella", max_tokens=96))
    await asyncio.gather(short, long)
    await asyncio.sleep(1)  # the writer has had its chance at every page planned
    short_stored = [bool(redis.exists(k)) for k in short_keys]
    long_stored = [bool(redis.exists(k)) for k in long_keys]
    short_saved, long_saved = sum(short_stored), sum(long_stored)
    # the short request had pages waiting for its whole run; all but a first grant went to the long one
    assert short_saved <= PAGES_PER_S and short_stored[:short_saved] == [True] * short_saved, short_stored
    assert long_saved > PAGES_PER_S and long_stored[:long_saved] == [True] * long_saved, long_stored
    redis.close()
