"""No secret in any output of a whole run: `sluice worker` as a process, at debug level (vLLM's too),
with every secret sluice handles set: a Redis ACL password in the URL, an encryption key file and
tenant signing keys. It serves signed requests, refuses a forged and an unsigned record, is
scraped, probed and stopped; then its log, its metrics, its health answers, every reply, dead
letter and audit record of the run are searched for each secret (as text, base64 and hex)."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
import time
import uuid

import msgspec
import pytest
import redis

from loadgen.burst import run_burst
from schemas import DoneReply
from schemas.signing import SIGNATURE_HEADER, TENANT_HEADER, signed_headers
from tests.integration.helpers import free_port, http_get, prefixed_topics_file, read_topic
from worker import devstack

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REDIS_USER, REDIS_PASSWORD = "sluice-secrets-test", f"rp-{uuid.uuid4().hex}"
STATE_KEY, SIGNING_KEY = os.urandom(32), os.urandom(32)


def forms(secret: bytes | str) -> list[str]:
    raw = secret.encode() if isinstance(secret, str) else secret
    out = [base64.b64encode(raw).decode(), raw.hex()]
    if isinstance(secret, str):
        out.append(secret)
    return out


@pytest.fixture(scope="module")
def redis_user(stack):
    for port in devstack.REDIS_PORTS:
        node = redis.Redis(host=devstack.HOST, port=port)
        node.execute_command("ACL", "SETUSER", REDIS_USER, "on", f">{REDIS_PASSWORD}", "~*", "&*", "+@all")
        node.close()
    yield
    for port in devstack.REDIS_PORTS:
        node = redis.Redis(host=devstack.HOST, port=port)
        node.execute_command("ACL", "DELUSER", REDIS_USER)
        node.close()


async def test_no_secret_reaches_any_log_line_metric_health_answer_or_record(settings, catalog, model_dir, tmp_path,
                                                                             redis_user):
    keys = tmp_path / "keys.toml"
    keys.write_text(f'active = "k1"\n[keys]\nk1 = "{base64.b64encode(STATE_KEY).decode()}"\n')
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenant.acme]\nsigning_keys = {{ s1 = "{base64.b64encode(SIGNING_KEY).decode()}" }}\n')
    port = free_port()
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(prefixed_topics_file(catalog, tmp_path / "topics.toml")),
           "SLUICE_METRICS_PORT": str(port), "SLUICE_GROUP_ID": f"g-{uuid.uuid4().hex[:6]}",
           "SLUICE_MODEL": str(model_dir), "SLUICE_KAFKA_IDEMPOTENCE": "false",
           "SLUICE_REDIS_KEY_PREFIX": f"sec{uuid.uuid4().hex[:6]}", "SLUICE_LOG_LEVEL": "debug",
           "VLLM_LOGGING_LEVEL": "DEBUG",
           "SLUICE_REDIS_URL": f"redis://{REDIS_USER}:{REDIS_PASSWORD}@{devstack.HOST}:{devstack.REDIS_PORTS[0]}",
           "SLUICE_REDIS_ENCRYPTION_KEYS_FILE": str(keys), "SLUICE_TENANCY_MODE": "signed",
           "SLUICE_TENANCY_TENANTS_FILE": str(tenants)}
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "worker"], env=env, stdout=log, stderr=log)
    seen: list[str] = []
    try:
        end = time.monotonic() + 400
        while (probe := http_get(port, "/readyz"))[0] != 200:
            assert proc.poll() is None and time.monotonic() < end, log_path.read_text()[-3000:]
            await asyncio.sleep(0.5)
        seen.append(probe[1])

        def sign(key, value):
            return signed_headers("acme", "s1", SIGNING_KEY, key, value)

        opts = settings.kafka.options()
        requests = [("realtime", {"id": f"sec-{i}", "prompt": f"Say {i}.", "max_tokens": 4}) for i in range(3)]
        out = await run_burst(opts, catalog, requests, timeout_s=180, sign=sign)
        assert all(isinstance(o.final, DoneReply) for o in out.values())
        from loadgen.burst import produce

        await produce(opts, [(catalog.request_topic("realtime").name, b"forged",
                              msgspec.json.encode({"id": "forged", "prompt": "x"}),
                              [(TENANT_HEADER, b"acme"), (SIGNATURE_HEADER, b"s1:" + b"0" * 64)]),
                             (catalog.request_topic("realtime").name, b"plain",
                              msgspec.json.encode({"id": "plain", "prompt": "x"}), [])])
        dead = await read_topic(opts, catalog.dlq.name, 2, timeout_s=60)
        audit = await read_topic(opts, catalog.audit.name, 5, timeout_s=60)
        replies = await read_topic(opts, catalog.replies.name, 6, timeout_s=30)
        assert len(dead) == 2 and len(audit) >= 5
        from schemas.audit import decoder

        trail = [decoder.decode(r.value) for r in audit]
        # every record of the run has its audit record: three answered, two dead-lettered without an id
        assert sorted((a.id or "", a.outcome) for a in trail) == [
            ("", "invalid_request"), ("", "invalid_request"), ("sec-0", "length"), ("sec-1", "length"),
            ("sec-2", "length")]
        assert all(a.tenant == "acme" and a.model for a in trail if a.id)
        for path in ("/metrics", "/healthz", "/readyz"):
            seen.append(http_get(port, path)[1])
        seen += [repr((r.key, r.value, r.headers)) for r in dead + audit + replies]
        cli = subprocess.run([sys.executable, "-m", "worker.cli", "dev", "status"], env=env, capture_output=True,
                             text=True, timeout=60)
        seen.append(cli.stdout + cli.stderr)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
    seen.append(log_path.read_text(errors="replace"))
    everything = "\n".join(seen)
    assert "redis_available" in everything and "request_answered" in everything  # the log is the run's
    for name, secret in [("redis password", REDIS_PASSWORD), ("state key", STATE_KEY), ("signing key", SIGNING_KEY)]:
        for form in forms(secret):
            assert form not in everything, f"the {name} appears in the run's output"
