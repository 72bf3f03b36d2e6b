"""`sluice dlq show | replay` on the real broker, with workers on the real engine: a record signed with a
key the workers lack is dead-lettered, shown, and once the key is added, published again and answered."""

import base64
import os
import subprocess
import sys

import msgspec
import pytest

from loadgen.burst import produce
from schemas import DoneReply, dlq
from schemas.codec import ReplyCodec
from schemas.signing import SIGNATURE_HEADER, signed_headers
from tests.integration.helpers import prefixed_topics_file, read_topic, running_worker

pytestmark = pytest.mark.integration

K1, K2 = b"the-first-key-of-acme" * 2, b"a-key-added-later" * 2


def sluice(*args, env):
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


async def test_a_dead_letter_is_shown_and_once_its_cause_is_fixed_replayed_and_answered(settings, catalog, engine,
                                                                                       group_id, tmp_path):
    env = {"SLUICE_TOPICS_FILE": str(prefixed_topics_file(catalog, tmp_path / "topics.toml")),
           "SLUICE_KAFKA_IDEMPOTENCE": "false"}
    tenants = tmp_path / "tenants.toml"

    def keys(**named):
        tenants.write_text("[tenant.acme]\nsigning_keys = { "
                           + ", ".join(f'{k} = "{base64.b64encode(v).decode()}"' for k, v in named.items()) + " }\n")

    request = msgspec.json.encode({"id": "late-key-1", "prompt": "Say yes.", "max_tokens": 4})
    topic = catalog.request_topic("standard").name
    items = [(topic, b"late-key-1", request, signed_headers("acme", "k2", K2, b"late-key-1", request)),
             (topic, None, b"\x00 not a request", [])]
    keys(k1=K1)
    async with running_worker(settings, catalog, engine, group_id=group_id, tenancy_mode="signed",
                              tenancy_tenants_file=str(tenants)):
        await produce(settings.kafka.options(), items)
        dead = await read_topic(settings.kafka.options(), catalog.dlq.name, 2, timeout_s=60)
    assert len(dead) == 2

    shown = sluice("dlq", "show", env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"{topic}:" in shown.stdout and "no signing key 'k2'" in shown.stdout and "late-key-1" in shown.stdout
    assert "2 dead letters in" in shown.stdout
    newest = sluice("dlq", "show", "--limit", "1", env=env)
    assert "2 dead letters in" in newest.stdout and "the last 1 shown" in newest.stdout
    assert newest.stdout.count("key=") == 1
    assert sluice("dlq", "show", "--code", "payload_too_large", env=env).stdout.startswith("0 dead letters in")

    dry = sluice("dlq", "replay", "--dry-run", env=env)
    assert dry.returncode == 0 and "would publish 2 dead letters again" in dry.stdout, dry.stdout + dry.stderr
    keys(k1=K1, k2=K2)  # the cause fixed: the workers now hold the producer's new key
    async with running_worker(settings, catalog, engine, group_id=group_id, tenancy_mode="signed",
                              tenancy_tenants_file=str(tenants)):
        replayed = sluice("dlq", "replay", env=env)
        assert replayed.returncode == 0 and "published 2 dead letters again" in replayed.stdout, replayed.stderr
        codec = ReplyCodec()
        replies = await read_topic(settings.kafka.options(), catalog.replies.name, 1, timeout_s=120,
                                   until=lambda recs: any(isinstance(codec.decode(r.value), DoneReply) for r in recs))
        # the record that is not a request is dead-lettered again, with the same reason
        again = await read_topic(settings.kafka.options(), catalog.dlq.name, 3, timeout_s=60)
    done = [codec.decode(r.value) for r in replies]
    assert [r.id for r in done if isinstance(r, DoneReply)] == ["late-key-1"]
    assert len(again) == 3 and all(dlq.parse(r.headers)[dlq.SOURCE_TOPIC] == topic for r in again)
    # the original headers went back with it (its signature verified), the dead letter's did not
    sent = await read_topic(settings.kafka.options(), topic, 4, timeout_s=30)
    assert len(sent) == 4 and not any(dlq.ERROR_CODE in dict(r.headers or ()) for r in sent)
    assert sum(SIGNATURE_HEADER in dict(r.headers or ()) for r in sent) == 2
