"""Every Kafka client sluice starts (worker, backfill, loadgen, demo, topics admin, benches) connects
with the worker's connection settings, not a bare bootstrap address."""

import ast
from pathlib import Path

import pytest

from loadgen.burst import ReplyReader
from worker.settings import load

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = {"AIOKafkaConsumer", "AIOKafkaProducer", "AIOKafkaAdminClient"}


def client_calls():
    for path in [*ROOT.glob("worker/**/*.py"), *ROOT.glob("loadgen/**/*.py"), *ROOT.glob("topics/**/*.py"),
                 *ROOT.glob("bench/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in CLIENTS:
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node


def test_no_client_is_built_from_a_bare_bootstrap_address():
    calls = list(client_calls())
    assert len(calls) >= 10  # the scan finds the clients it is meant to check
    bare = [where for where, call in calls if any(k.arg == "bootstrap_servers" for k in call.keywords)]
    unpacked = [where for where, call in calls if not any(k.arg is None for k in call.keywords)]
    assert bare == [] and unpacked == [], (bare, unpacked)  # each takes **<settings>.kafka.options() or kafka_opts


async def test_the_reply_reader_speaks_sasl_over_tls_when_configured():
    s = load(environ={"SLUICE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "SLUICE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                      "SLUICE_KAFKA_SASL_USERNAME": "scorer", "SLUICE_KAFKA_SASL_PASSWORD": "s3cret"})
    client = ReplyReader(s.kafka.options(), "replies").consumer._client
    assert client._security_protocol == "SASL_SSL" and client._sasl_mechanism == "SCRAM-SHA-512"
    assert client._sasl_plain_username == "scorer" and client._ssl_context is not None


def test_a_redis_password_file_is_read_by_each_client_and_never_put_in_the_engine_config(tmp_path):
    from worker.engine import kv_connector_config
    from worker.settings import load

    secret = "pw-from-file-93ad"
    path = tmp_path / "redis-password"
    path.write_text(secret + "\n")
    s = load(environ={}, redis_username="sluice", redis_password_file=str(path), redis_tls=True,
             redis_tls_ca_file="/ca.crt")
    opts = s.redis.client_options()
    assert opts["password"] == secret and opts["username"] == "sluice" and opts["ssl_ca_certs"] == "/ca.crt"
    assert s.redis.client_url().startswith("rediss://")
    assert secret not in repr(kv_connector_config(s, "fingerprint"))  # the connector reads the file itself


async def test_request_readers_read_committed_records_unless_told_otherwise():
    """The worker's request consumer and the backfill's source readers skip records of aborted or
    open transactions (Kafka's read_committed) by default; the setting can turn that off."""
    from worker.settings import SettingsError
    from worker.worker import kafka_consumer

    s = load(environ={})
    assert s.kafka.isolation_level == "read_committed"
    assert kafka_consumer(s)._isolation_level == "read_committed"
    s = load(environ={"SLUICE_KAFKA_ISOLATION_LEVEL": "read_uncommitted"})
    assert kafka_consumer(s)._isolation_level == "read_uncommitted"
    with pytest.raises(SettingsError, match="ISOLATION_LEVEL"):
        load(environ={"SLUICE_KAFKA_ISOLATION_LEVEL": "dirty"})
    backfill = [where for where, call in client_calls() if where.startswith("worker/backfill.py")
                and call.func.id == "AIOKafkaConsumer"]
    assert len(backfill) == 2 and all(any(k.arg == "isolation_level" for k in call.keywords)
                                      for where, call in client_calls() if where in backfill)


async def test_the_request_consumer_refreshes_its_metadata_every_30_s_so_added_partitions_are_read():
    """aiokafka refreshes a consumer's metadata every 5 minutes by default; the group leader notices
    partitions added to a request topic only then, and records keyed into them wait that long."""
    from worker.worker import kafka_consumer

    consumer = kafka_consumer(load(environ={}))
    assert consumer._client._metadata_max_age_ms == 30000
    consumer = kafka_consumer(load(environ={"SLUICE_KAFKA_METADATA_MAX_AGE_MS": "5000"}))
    assert consumer._client._metadata_max_age_ms == 5000


async def test_the_request_consumer_heartbeats_every_second_so_survivors_learn_of_a_dead_worker_soon():
    """A dead worker's guard takes it out of the group at once; the survivors learn of the rebalance at
    their next heartbeat, which at a third of the 10 s session timeout was up to 3.3 s of every failover."""
    from worker.worker import kafka_consumer

    consumer = kafka_consumer(load(environ={}))
    assert (consumer._session_timeout_ms, consumer._heartbeat_interval_ms) == (10000, 1000)
    consumer = kafka_consumer(load(environ={"SLUICE_GROUP_SESSION_TIMEOUT_MS": "1500"}))
    assert consumer._heartbeat_interval_ms == 500
    consumer = kafka_consumer(load(environ={"SLUICE_GROUP_HEARTBEAT_INTERVAL_MS": "3000"}))
    assert consumer._heartbeat_interval_ms == 3000


async def test_the_request_consumer_reports_a_position_the_broker_no_longer_holds():
    """With aiokafka's `earliest`, an offset below the log start (records retention removed unread) would
    be moved past in silence; the worker chooses the position itself and counts them
    (worker/read_position.py, tests/unit/test_read_position.py)."""
    from worker.worker import kafka_consumer

    assert kafka_consumer(load(environ={}))._auto_offset_reset == "none"


def test_every_reader_of_the_worker_reports_a_position_out_of_range():
    """Every consumer the worker package builds (the request consumer, the backfill's source reader and
    output probe, the dead-letter listing, the handoff's record reader) runs with `auto_offset_reset="none"`:
    aiokafka's `latest` jumps to a partition's end and `earliest` to its first record left, without a
    word, when retention passed the position. Each handles the error itself (worker/read_position.py,
    worker/backfill.py, worker/dead_letters.py; worker/handoff.py leaves the request to the rebalance)."""
    readers = [(where, call) for where, call in client_calls()
               if where.startswith("worker/") and getattr(call.func, "id", "") == "AIOKafkaConsumer"]
    assert len(readers) == 5  # the scan finds them all
    for where, call in readers:
        reset = [k.value.value for k in call.keywords if k.arg == "auto_offset_reset"]
        assert reset == ["none"], where
