"""Tenants and stored state on the real parts: a worker in `tenancy_mode signed` with every Redis value
sealed (AES-256-GCM), on the embedded broker, the Redis Cluster and its own vLLM engine (its KV
connector seals pages too). Forged, moved and clear values in Redis are refused and counted; pages
sealed under a key load after that key is rotated out of the active slot."""

from __future__ import annotations

import asyncio
import base64
import os
import uuid

import msgspec
import pytest
from redis.cluster import RedisCluster

from loadgen.burst import run_burst
from schemas import DoneReply, ErrorCode, ErrorReply, Request
from schemas.signing import signed_headers
from tests.integration.helpers import running_worker
from tests.integration.test_kv_pages import PROMPT, page_keys, run, wait_stored
from worker import metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]
K1, K2 = base64.b64encode(os.urandom(32)).decode(), base64.b64encode(os.urandom(32)).decode()
SECRETS = {"acme": os.urandom(32), "globex": os.urandom(32)}


def write_keys(path, active: str, **keys) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:  # replaced at once, as a Secret volume does
        f.write(f'cipher = "aes-256-gcm"\nactive = "{active}"\n[keys]\n' +
                "".join(f'{k} = "{v}"\n' for k, v in keys.items()))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "state-keys.toml"
    write_keys(path, "k1", k1=K1)
    return path


@pytest.fixture(scope="module")
def sealed_settings(settings, keys_file, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text("".join(f'[tenant.{t}]\nsigning_keys = {{ s1 = "{base64.b64encode(s).decode()}" }}\n'
                               for t, s in SECRETS.items()))
    return settings.override(redis_encryption_keys_file=str(keys_file), tenancy_mode="signed",
                             tenancy_tenants_file=str(tenants), redis_key_prefix=f"sealed-{uuid.uuid4().hex[:8]}",
                             cpu_kvcache_gib=1)


@pytest.fixture(scope="module")
async def sealed_engine(sealed_settings):
    from worker.engine import VllmEngine

    eng = await asyncio.to_thread(VllmEngine, sealed_settings)
    yield eng
    eng.shutdown()


def signer(tenant: str):
    return lambda key, value: signed_headers(tenant, "s1", SECRETS[tenant], key, value)


async def test_sealed_pages_load_after_a_key_rotation_and_moved_pages_are_recomputed(sealed_settings, sealed_engine,
                                                                                  keys_file):
    engine, redis = sealed_engine, RedisCluster.from_url(sealed_settings.redis.url)
    ids = engine.prompt_ids(Request(id="kv", prompt=PROMPT))
    keys = page_keys(sealed_settings, engine, "acme", ids)
    first, _ = await run(engine, "s-a1", ids, "acme")
    await wait_stored(redis, keys)
    assert all(redis.get(k).startswith(b"SLS1\x01\x02k1") for k in keys)  # AES-256-GCM under k1

    # rotation: k2 becomes active, k1 still decrypts; the connector reads the file again by itself
    write_keys(keys_file, "k2", k1=K1, k2=K2)
    await asyncio.sleep(1.5)
    await engine.reset_prefix_cache()
    again, done = await run(engine, "s-a2", ids, "acme")
    assert again == first and done.kv["loaded_tokens"] == len(keys) * engine.block_size, done.kv
    longer = engine.prompt_ids(Request(id="kv", prompt=PROMPT + " Then the next ledger, for customer 5512:"
                                       + " card present, 12.50 USD, grocery." * 4))
    new_keys = [k for k in page_keys(sealed_settings, engine, "acme", longer) if k not in keys]
    assert new_keys
    await run(engine, "s-a3", longer, "acme", max_tokens=2)
    await wait_stored(redis, new_keys)
    assert all(redis.get(k).startswith(b"SLS1\x01\x02k2") for k in new_keys)  # new writes use k2

    # a valid sealed page moved under another key fails authentication: pages 0-1 load, the rest recompute
    redis.set(keys[2], redis.get(keys[3]))
    await engine.reset_prefix_cache()
    healed, done = await run(engine, "s-a4", ids, "acme")
    assert healed == first and done.kv["loaded_tokens"] == 2 * engine.block_size, done.kv
    _, tail = await run(engine, "s-tail", ids[:8], "acme", max_tokens=1)
    assert sum(d.kv["counts"].get("load_miss_forged", 0) for d in (done, tail)) == 1, (done.kv, tail.kv)
    redis.close()


def rejected(kind: str, reason: str) -> float:
    return metrics.state_rejected.labels(kind, reason)._value.get()


async def test_ids_are_per_tenant_and_forged_or_clear_answers_and_progress_are_never_used(
        sealed_settings, sealed_engine, catalog, group_id):
    s, redis = sealed_settings, RedisCluster.from_url(sealed_settings.redis.url)
    opts = s.kafka.options()
    rid = f"same-{group_id}"

    def answer_key(tenant, request_id=rid):
        return f"{s.redis.key_prefix}:req:{{{tenant}:{request_id}}}:answer"

    async with running_worker(s, catalog, sealed_engine, group_id=group_id):
        async def ask(tenant, body, **kw):
            out = await run_burst(opts, catalog, [("realtime", {"id": rid, "max_tokens": 8, **body})], timeout_s=180,
                                  sign=signer(tenant), **kw)
            return out[body.get("id", rid)].final

        acme = await ask("acme", {"prompt": "Name a color."})
        globex = await ask("globex", {"prompt": "Write the word banana twice.", "max_tokens": 12})
        assert isinstance(acme, DoneReply) and isinstance(globex, DoneReply)
        assert acme.text != globex.text, "another tenant's id answered with the first tenant's answer"
        stored = redis.get(answer_key("acme"))
        assert stored.startswith(b"SLS1") and acme.text.encode() not in stored  # sealed, not in clear
        assert (await ask("globex", {"prompt": "anything"})).text == globex.text  # its own stored answer

        # a clear forged answer, and globex's sealed answer moved under acme's key: both refused, the id runs again
        for forged, reason in [(msgspec.json.encode({"type": "done", "id": rid, "seq": 0, "text": "FORGED",
                                                     "finish_reason": "stop", "usage": {"prompt_tokens": 1,
                                                                                        "completion_tokens": 1}}),
                                "not_sealed"),
                               (redis.get(answer_key("globex")), "forged")]:
            before = rejected("answer", reason)
            redis.set(answer_key("acme"), forged)
            again = await ask("acme", {"prompt": "Name a color."})
            assert isinstance(again, DoneReply) and again.text == acme.text and "FORGED" not in again.text
            assert rejected("answer", reason) == before + 1

        # forged progress (a chunk that would be re-sent as the request's first tokens): ignored, counted
        pid = f"prog-{group_id}"
        progress_key = f"{s.redis.key_prefix}:req:{{acme:{pid}}}:progress"
        redis.hset(progress_key, "c0", msgspec.msgpack.encode(([1, 2], "FORGED")))
        before = rejected("progress", "not_sealed")
        done = await ask("acme", {"id": pid, "prompt": "Name a color."})
        assert isinstance(done, DoneReply) and not done.resumed and not done.text.startswith("FORGED")
        assert rejected("progress", "not_sealed") == before + 1

        # reply_to outside the tenant's allow-list: refused on the default reply topic
        refused = await ask("acme", {"id": f"rt-{group_id}", "prompt": "x", "reply_to": "globex.replies"})
        assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.INVALID_REQUEST
        assert "not allowed" in refused.message
    redis.close()
