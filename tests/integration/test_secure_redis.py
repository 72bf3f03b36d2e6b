"""Redis over TLS with an ACL user: a TLS-only Redis Cluster (client certificates required, the
`default` user off) started by the test; the worker keeps its answers there on the real engine,
the KV connector's client reaches it with the same settings, and settings that cannot work stop
start-up with a message naming them and never the password."""

from __future__ import annotations

import asyncio

import pytest

from loadgen.burst import run_burst
from schemas import DoneReply
from tests.integration.helpers import prefixed_topics_file, running_worker
from tests.integration.secure_stack import TlsRedisCluster, make_pki
from worker import preflight

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_redis(pki, tmp_path_factory):
    cluster = TlsRedisCluster(tmp_path_factory.mktemp("tls-redis"), pki).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def secure_settings(settings, pki, tls_redis, tmp_path_factory):
    password = tmp_path_factory.mktemp("secret") / "redis-password"
    password.write_text(TlsRedisCluster.PASSWORD + "\n")  # as a Secret file often ends
    return settings.override(redis_url=tls_redis.url, redis_username="sluice", redis_password_file=str(password),
                             redis_tls_ca_file=str(pki.ca), redis_tls_cert_file=str(pki.client_cert),
                             redis_tls_key_file=str(pki.client_key), redis_lookup_wait_s=0)


async def test_settings_that_cannot_work_stop_start_up_naming_them(secure_settings, pki):
    assert await preflight.check_redis(secure_settings.redis) == "ok"
    cases = [
        ({"redis_password_file": None, "redis_password": "wrong-pw-0d9c"}, "refused the credentials"),
        ({"redis_username": "readonly", "redis_password_file": None,
          "redis_password": TlsRedisCluster.READONLY_PASSWORD}, "lacks a permission"),
        ({"redis_tls_cert_file": None, "redis_tls_key_file": None}, "client certificate may be required"),
    ]
    for change, message in cases:
        broken = secure_settings.override(**change).redis
        with pytest.raises(preflight.StartupError, match=message) as err:
            await preflight.check_redis(broken)
        text = str(err.value)
        assert "SLUICE_REDIS_" in text, text
        assert TlsRedisCluster.PASSWORD not in text and "wrong-pw-0d9c" not in text
        assert TlsRedisCluster.READONLY_PASSWORD not in text


async def test_a_worker_keeps_its_answers_in_a_tls_cluster_as_an_acl_user(secure_settings, engine, catalog, group_id):
    from redis.asyncio.cluster import RedisCluster

    s = secure_settings
    body = {"id": f"tls-{group_id}", "prompt": "Name a fruit.", "max_tokens": 6}
    async with running_worker(s, catalog, engine, group_id=group_id) as w:
        first = (await run_burst(s.kafka.options(), catalog, [("realtime", body)], timeout_s=120))[body["id"]].final
        assert isinstance(first, DoneReply) and w.answers.available
        # the same id again: answered from the TLS cluster, not run again
        again = (await run_burst(s.kafka.options(), catalog, [("realtime", body)], timeout_s=120))[body["id"]].final
        assert again == first
    client = RedisCluster.from_url(s.redis.url, **s.redis.client_options())
    try:
        assert await client.exists(f"{s.redis.key_prefix}:req:{{default:{body['id']}}}:answer") == 1
    finally:
        await client.aclose()


def test_the_kv_connectors_client_reaches_the_tls_cluster_with_the_same_settings(secure_settings):
    from worker.kv_connector import _Redis

    redis = _Redis(secure_settings.redis.url, 2.0, 1.0, secure_settings.redis.client_options())
    key = f"{secure_settings.redis.key_prefix}:kv:probe"
    assert redis.pipeline_run([("set", key, b"page", 60), ("get", key)]) == [True, b"page"]
    plain = _Redis(secure_settings.redis.url, 2.0, 1.0, {})  # no credentials, no certificate: refused
    assert plain.pipeline_run([("get", key)]) is None


async def test_a_worker_process_with_a_wrong_password_exits_at_once_naming_the_setting(secure_settings, catalog,
                                                                                         tmp_path):
    import os
    import sys

    env = {**os.environ, "SLUICE_TOPICS_FILE": str(prefixed_topics_file(catalog, tmp_path / "topics.toml")),
           "SLUICE_REDIS_URL": secure_settings.redis.url, "SLUICE_REDIS_USERNAME": "sluice",
           "SLUICE_REDIS_PASSWORD": "wrong-pw-0d9c", "SLUICE_REDIS_TLS_CA_FILE": secure_settings.redis.tls_ca_file,
           "SLUICE_REDIS_TLS_CERT_FILE": secure_settings.redis.tls_cert_file,
           "SLUICE_REDIS_TLS_KEY_FILE": secure_settings.redis.tls_key_file, "SLUICE_METRICS_PORT": "0",
           "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_MODEL": secure_settings.engine.model}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "worker.cli", "worker", env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode(errors="replace")
    assert proc.returncode == 1, text[-2000:]
    assert "refused the credentials" in text and "SLUICE_REDIS_PASSWORD" in text
    assert "wrong-pw-0d9c" not in text
    assert "engine_loading" not in text  # refused before minutes of engine loading
