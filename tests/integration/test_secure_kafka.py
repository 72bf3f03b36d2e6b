"""Kafka over mutual TLS, every connection: a worker on the real engine, the topic admin and the
burst's producer and reply reader all connect with a client certificate (its key encrypted, with
its password from the settings) to a TLS endpoint that refuses connections without one.

The embedded broker (Tansu 0.6.0) cannot terminate TLS itself: its `--cert` and `--key` flags are
declared as conflicting, and `--cert` alone leaves the listener in plaintext. So the test puts a
mutual-TLS proxy in front of a Tansu broker of its own that advertises the proxy's address; what
is proven is sluice's side (every client's TLS and client-certificate settings), not a broker's.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

import topics
from loadgen.burst import run_burst
from schemas import DoneReply
from tests.integration.helpers import running_worker
from tests.integration.kafka_proxy import start_broker_behind
from tests.integration.secure_stack import HOST, KEY_PASSWORD, MutualTlsProxy, make_pki
from topics.admin import apply
from worker import preflight

pytestmark = pytest.mark.integration
BROKER_PORT, PROXY_PORT = 19292, 19293


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("kafka-pki"))


@pytest.fixture(scope="module")
async def tls_broker(pki):
    proc = await start_broker_behind(BROKER_PORT, PROXY_PORT)
    proxy = await MutualTlsProxy(pki, PROXY_PORT, BROKER_PORT).start()
    yield proxy
    await proxy.stop()
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def tls_settings(settings, pki, tls_broker):
    return settings.override(kafka_bootstrap=f"{HOST}:{PROXY_PORT}", kafka_security_protocol="SSL",
                             kafka_ssl_cafile=str(pki.ca), kafka_ssl_certfile=str(pki.client_cert),
                             kafka_ssl_keyfile=str(pki.client_key_encrypted), kafka_ssl_password=KEY_PASSWORD)


async def test_connection_settings_that_cannot_work_stop_start_up_naming_them(tls_settings, tls_broker):
    await preflight.check_kafka(tls_settings.kafka)
    accepted = len(tls_broker.verified)
    for change, says in [({"kafka_ssl_certfile": None, "kafka_ssl_keyfile": None, "kafka_ssl_password": None},
                          "SLUICE_KAFKA_SSL_"),
                         ({"kafka_ssl_password": "not-the-password"}, "SLUICE_KAFKA_SSL_"),
                         ({"kafka_security_protocol": "PLAINTEXT"}, "SLUICE_KAFKA_SECURITY_PROTOCOL=PLAINTEXT")]:
        with pytest.raises(preflight.StartupError, match=says) as err:
            await preflight.check_kafka(tls_settings.override(**change).kafka, timeout_s=5)
        assert KEY_PASSWORD not in str(err.value) and "not-the-password" not in str(err.value)
    assert len(tls_broker.verified) == accepted  # none of them got a connection through


async def test_the_worker_and_every_client_serve_over_mutual_tls(tls_settings, tls_broker, engine):
    s = tls_settings
    catalog = topics.load().renamed(f"tls{uuid.uuid4().hex[:6]}.")
    await apply(s.kafka.options(), catalog)
    accepted = len(tls_broker.verified)
    requests = [("realtime", {"id": f"tls-{i}", "prompt": f"Say the number {i}.", "max_tokens": 6}) for i in range(3)]
    async with running_worker(s, catalog, engine, group_id=f"g-{uuid.uuid4().hex[:6]}"):
        out = await run_burst(s.kafka.options(), catalog, requests, timeout_s=180)
    assert all(isinstance(o.final, DoneReply) for o in out.values()), {k: o.final for k, o in out.items()}
    assert all(o.text == o.final.text for o in out.values())  # streamed tokens arrived over TLS too
    assert len(tls_broker.verified) - accepted >= 4  # admin, worker consumer and producer, burst clients
    assert set(tls_broker.verified) == {"sluice-worker"}


async def test_the_group_guard_takes_a_member_out_over_mutual_tls(tls_settings, tls_broker, tmp_path):
    """The guard gets the TLS settings (key password included) over its pipe and connects with them."""
    from aiokafka import AIOKafkaConsumer

    from worker.group_guard import GroupGuard

    s = tls_settings
    catalog = topics.load().renamed(f"tlsg{uuid.uuid4().hex[:6]}.")
    await apply(s.kafka.options(), catalog)
    group = f"g-{uuid.uuid4().hex[:6]}"
    consumer = AIOKafkaConsumer(catalog.request_topic("standard").name, **s.kafka.options(), group_id=group)
    await consumer.start()
    guard = GroupGuard()
    try:
        while not consumer.assignment():
            await consumer.getmany(timeout_ms=100)
        with open(tmp_path / "guard.log", "wb") as log:
            guard.start(s.kafka, group, timeout_s=20, stderr=log)
        guard.joined(consumer._coordinator.member_id)
        guard._proc.stdin.close()  # the pipe closes without a stand-down, as when the worker dies
        await asyncio.to_thread(guard._proc.wait, 60)
    finally:
        await consumer.stop()
    line = json.loads((tmp_path / "guard.log").read_text().strip().splitlines()[-1])
    assert line["event"] == "group_left_for_dead_worker" and line["error_code"] == 0, line
    assert KEY_PASSWORD not in (tmp_path / "guard.log").read_text()
