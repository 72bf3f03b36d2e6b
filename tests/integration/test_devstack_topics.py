"""`sluice dev` and `sluice topics` as an operator runs them."""

import os
import subprocess
import sys
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

import topics

pytestmark = pytest.mark.integration


def sluice(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120, **kw)


def test_dev_up_is_idempotent_and_status_ok(stack):
    r = sluice("dev", "up")
    assert r.returncode == 0, r.stderr
    assert "already running" in r.stdout and "redis cluster: ok" in r.stdout
    st = sluice("dev", "status")
    assert st.returncode == 0 and st.stdout.count(" up (pid") == 7


def test_taken_port_names_the_fix(stack, tmp_path):
    # Another state directory did not start the running stack: its ports are taken.
    r = sluice("dev", "up", "--state-dir", str(tmp_path))
    assert r.returncode == 1
    assert "port 19092 is taken" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    st = sluice("dev", "status", "--state-dir", str(tmp_path))
    assert st.returncode == 1 and "not started by sluice" in st.stdout
    # `down` from there must not stop what it did not start.
    assert sluice("dev", "down", "--state-dir", str(tmp_path)).returncode == 0
    assert sluice("dev", "status").returncode == 0


def test_missing_broker_binary(tmp_path):
    r = sluice("dev", "up", "--state-dir", str(tmp_path), env={"SLUICE_TANSU_BIN": "/nonexistent/tansu"})
    assert r.returncode == 1 and "SLUICE_TANSU_BIN" in r.stderr


def _topics_file(tmp_path, prefix):
    from importlib import resources

    text = resources.files("topics").joinpath("default.toml").read_text()
    path = tmp_path / "topics.toml"
    path.write_text(text.replace('name = "sluice.', f'name = "{prefix}sluice.'))
    return path


async def test_topics_apply_then_check_reports_drift(stack, settings, tmp_path):
    prefix = f"tp{uuid.uuid4().hex[:6]}."
    path = _topics_file(tmp_path, prefix)
    env = {"SLUICE_TOPICS_FILE": str(path)}
    # Pre-create one topic with the wrong partition count: drift.
    admin = AIOKafkaAdminClient(**settings.kafka.options())
    await admin.start()
    await admin.create_topics([NewTopic(f"{prefix}sluice.dlq", 3, 1)])
    await admin.close()

    check = sluice("topics", "check", env=env)
    others = len(topics.load().topic) - 1  # every topic of the catalog but the pre-created one
    assert check.returncode == 1 and check.stdout.count("missing:") == others
    applied = sluice("topics", "apply", env=env)
    assert applied.stdout.count("created:") == others
    assert f"drift: {prefix}sluice.dlq: 3 partitions, catalog says 1" in applied.stdout
    again = sluice("topics", "check", env=env)
    assert again.returncode == 1 and "missing" not in again.stdout and "drift" in again.stdout
    # the production profile asks for 3 replicas: every topic of this one-node broker has 1
    production = sluice("topics", "check", "--profile", "production", env=env)
    assert production.returncode == 1 and production.stdout.count("1 replicas, catalog says 3") == others + 1, \
        production.stdout


async def test_a_worker_started_before_its_topics_exist_refuses_to_start_and_creates_none(stack, settings, tmp_path):
    """A worker never creates its topics: it names the missing ones and the fix, and exits 1 before
    loading its engine. (This broker creates a topic on a client's first metadata request for it: a
    worker started before `sluice topics apply` used to make its request topics with the broker's
    partition count, and on a broker that creates nothing it answered no one.)"""
    prefix = f"tw{uuid.uuid4().hex[:6]}."
    path = _topics_file(tmp_path, prefix)
    env = {"SLUICE_TOPICS_FILE": str(path), "SLUICE_ENGINE_KIND": "fake", "SLUICE_METRICS_PORT": "0",
           "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_CLASSES": "realtime"}
    r = sluice("worker", env=env)
    assert r.returncode == 1
    assert "topics missing on the broker" in r.stderr and "sluice topics apply" in r.stderr, r.stderr
    assert f"{prefix}sluice.requests.realtime" in r.stderr and f"{prefix}sluice.replies" in r.stderr
    assert f"{prefix}sluice.requests.batch" not in r.stderr  # a realtime-only worker needs only its own
    check = sluice("topics", "check", env=env)
    assert check.stdout.count("missing:") == len(topics.load().topic), check.stdout  # none was created
