"""`sluice backfill` against the real stack: ranges by time, and a SIGKILL midway that loses and repeats nothing,
with the checkpoint kept or lost."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from loadgen.burst import produce, read_topic
from loadgen.events import transactions
from schemas.events import BackfillResult
from tests.integration.helpers import prefixed_topics_file, running_worker
from worker.backfill import JOB_HEADER, SOURCE_HEADER
from worker.backfill_range import resolve

pytestmark = pytest.mark.integration


async def create_topic(settings, name: str, partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(**settings.kafka.options())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


async def events_topic(settings, catalog, name: str, n: int, seed: int) -> tuple[str, str, list[dict]]:
    """(source, out, events): a one-partition source of this test's prefix holding `n` transaction
    events, and the name of an output topic beside it."""
    prefix = catalog.replies.name[: -len("sluice.replies")]
    source, out = f"{prefix}{name}-src", f"{prefix}{name}-out"
    await create_topic(settings, source, 1)
    events = transactions(n, seed=seed)
    await produce(settings.kafka.options(), [(source, e["id"].encode(), msgspec.json.encode(e), []) for e in events])
    return source, out, events


async def read_all(settings, topic: str) -> list:
    return await read_topic(settings.kafka.options(), topic)


async def test_time_bounds_resolve_by_record_timestamp(settings, catalog):
    topic = f"{catalog.replies.name}.times"
    await create_topic(settings, topic, 1)
    base = int(datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp() * 1000)
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(**settings.kafka.options())
    await producer.start()
    for i in range(40):  # one record a minute
        await producer.send(topic, b"{}", partition=0, timestamp_ms=base + i * 60_000)
    await producer.flush()
    await producer.stop()
    consumer = AIOKafkaConsumer(**settings.kafka.options(), enable_auto_commit=False, fetch_max_wait_ms=50)
    await consumer.start()
    try:
        cases = [
            (None, None, [0, 40]),
            ("5", "12", [5, 12]),
            ("2026-11-01T00:10:00Z", "2026-11-01T00:20:00Z", [10, 20]),
            ("2026-11-01T00:09:30Z", "2026-11-01T00:20:30+00:00", [10, 21]),
            ("2026-10-01T00:00:00Z", "2026-12-01T00:00:00Z", [0, 40]),
            ("2026-12-01T00:00:00Z", None, [40, 40]),
            ("100", None, [40, 40]),
        ]
        for start, stop, want in cases:
            assert (await resolve(consumer, topic, start, stop))[0] == want, (start, stop)
    finally:
        await consumer.stop()


def backfill_cmd(source, out, state_dir, max_in_flight=16):
    return [sys.executable, "-m", "worker.cli", "backfill", "--source", source, "--out", out, "--template", "fraud",
            "--state-dir", str(state_dir), "--max-in-flight", str(max_in_flight),
            "--lease-s", "5"]  # the killed run's lease ends soon; the run after it waits for that


async def run_backfill(source, out, state_dir, env, timeout_s: float) -> bytes:
    """One `sluice backfill` run to its end; its output."""
    proc = await asyncio.create_subprocess_exec(*backfill_cmd(source, out, state_dir), env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode == 0, output.decode()[-3000:]
    return output


async def wait_for_results(settings, topic: str, want: int, proc, log_path, timeout_s: float = 300) -> None:
    """Follow `topic` live until `want` records are there; the backfill must still be running."""
    consumer = AIOKafkaConsumer(**settings.kafka.options(), enable_auto_commit=False, fetch_max_wait_ms=50)
    await consumer.start()
    try:
        deadline, seen, assigned = time.monotonic() + timeout_s, 0, False
        while seen < want:
            assert time.monotonic() < deadline, f"only {seen} results after {timeout_s}s"
            assert proc.poll() is None, log_path.read_text()[-3000:]
            if not assigned:
                await consumer._client.force_metadata_update()
                parts = consumer.partitions_for_topic(topic)
                if not parts:
                    await asyncio.sleep(0.2)
                    continue
                consumer.assign([TopicPartition(topic, p) for p in parts])
                await consumer.seek_to_beginning()
                assigned = True
            batch = await consumer.getmany(timeout_ms=100)
            seen += sum(len(recs) for recs in batch.values())
    finally:
        await consumer.stop()


async def test_the_output_is_found_after_the_probe_read_the_source(settings, catalog):
    """The job's first checkpoint holds every output partition: the probe, assigned to the source
    while the range was resolved, still finds the output's partitions (a metadata refresh covered the
    source alone, so none were found, and results written before the first save were written again
    after a restart)."""
    from worker.backfill import Backfill, Job
    from worker.consumer_stop import stop_consumer

    prefix = catalog.replies.name[: -len("sluice.replies")]
    source, out = f"{prefix}probe-source", f"{prefix}probe-out"
    await create_topic(settings, source, 2)
    await create_topic(settings, out, 3)
    await produce(settings.kafka.options(), [(out, b"k", b"{}", [])])
    probe = AIOKafkaConsumer(**settings.kafka.options(), enable_auto_commit=False)
    await probe.start()
    try:
        await resolve(probe, source, None, None)
        begins, ends = await Backfill(settings, catalog, Job(source=source, out=out, template="fraud"))._out_span(probe)
    finally:
        await stop_consumer(probe)
    assert set(ends) == {0, 1, 2} and sum(ends.values()) == 1
    assert begins == {0: 0, 1: 0, 2: 0}


@pytest.mark.slow
async def test_backfill_killed_midway_resumes_with_one_result_per_event(settings, catalog, engine, group_id,
                                                                        tmp_path):
    prefix = catalog.replies.name[: -len("sluice.replies")]
    topics_file = prefixed_topics_file(catalog, tmp_path / "topics.toml")
    source, out = f"{prefix}events", f"{prefix}scored"
    await create_topic(settings, source, 3)
    events = transactions(150, seed=3)
    records = [(source, e["id"].encode(), msgspec.json.encode(e), []) for e in events]
    no_mcc = {k: v for k, v in events[0].items() if k != "mcc"} | {"id": "tx-no-mcc"}
    records.append((source, b"tx-no-mcc", msgspec.json.encode(no_mcc), []))
    records.append((source, b"tx-garbage", b"{not json", []))
    await produce(settings.kafka.options(), records)
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(topics_file), "SLUICE_KAFKA_IDEMPOTENCE": "false",
           "SLUICE_LOG_LEVEL": "warning"}
    state = tmp_path / "state"

    async with running_worker(settings, catalog, engine, group_id=group_id):
        log_path = tmp_path / "backfill-1.log"
        log = open(log_path, "wb")
        # few in flight, so that the kill lands midway on a fast machine too
        first = subprocess.Popen(backfill_cmd(source, out, state, max_in_flight=4), env=env, stdout=log, stderr=log)
        try:
            # wait until part of the output is written, then kill without warning
            await wait_for_results(settings, out, 40, first, log_path)
        finally:
            first.send_signal(signal.SIGKILL)  # also when the wait above fails: never leave it running
            first.wait()
        partial = len(await read_all(settings, out))
        assert 40 <= partial < len(records), partial

        # the second run has no checkpoint (as on another machine): it finds the first run's results in
        # the output by their job header and writes none of them again
        output = await run_backfill(source, out, tmp_path / "elsewhere", env, 400)
        assert b"already in" in output and b"histogram" in output, output.decode()[-3000:]
        # its output is a pipe, not a terminal: progress in whole lines, not a bar redrawn with \r
        assert b"\r" not in output and b" ev/s, " in output, output.decode()[-3000:]
        assert len(await read_all(settings, out)) == len(records)

        # the first run's own checkpoint, still unfinished, resumes and writes nothing more
        output = await run_backfill(source, out, state, env, 400)
        assert b"resuming" in output, output.decode()[-3000:]
        # a finished job run again, with or without its checkpoint, writes nothing more
        await run_backfill(source, out, state, env, 120)
        await run_backfill(source, out, tmp_path / "third-place", env, 120)

    results = await read_all(settings, out)
    sources = [dict(r.headers)[SOURCE_HEADER] for r in results]
    assert len(sources) == len(set(sources)) == len(records), (len(sources), len(set(sources)), len(records))
    assert all(dict(r.headers)[JOB_HEADER] for r in results)
    dec = msgspec.json.Decoder(BackfillResult)
    by_id = {}
    for r in results:
        res = dec.decode(r.value)
        assert r.key.decode() == res.event_id
        by_id[res.event_id] = res
    assert set(by_id) == {e["id"] for e in events} | {"tx-no-mcc", "tx-garbage"}
    assert by_id["tx-no-mcc"].error_code == "invalid_request" and "`mcc`" in by_id["tx-no-mcc"].error
    assert by_id["tx-garbage"].error_code == "invalid_request"
    for e in events:
        res = by_id[e["id"]]
        assert res.error_code is None and set(res.scores) == {"legit", "fraud"}, res
        assert abs(sum(res.scores.values()) - 1) < 1e-6 and res.label in res.scores


async def test_a_source_record_the_client_cannot_read_gets_an_error_result_and_the_job_goes_on(
        settings, catalog, engine, group_id, tmp_path):
    """One record in the source that aiokafka cannot parse (a header key that is not UTF-8, written
    by a plain client) used to end every run of the job with a traceback at the same offset, and no
    event of the fetch it was in got a result. Now it gets an error result of its own, keyed by its
    partition:offset, and every event around it is scored."""
    from tests.integration.test_bad_records import HOSTILE_PRODUCER

    prefix = catalog.replies.name[: -len("sluice.replies")]
    topics_file = prefixed_topics_file(catalog, tmp_path / "topics.toml")
    source, out = f"{prefix}events", f"{prefix}scored"
    await create_topic(settings, source, 1)
    events = transactions(6, seed=5)
    await produce(settings.kafka.options(), [(source, e["id"].encode(), msgspec.json.encode(e), []) for e in events[:3]])
    subprocess.run([sys.executable, "-c", HOSTILE_PRODUCER, settings.kafka.bootstrap, source],
                   env={**os.environ, "AIOKAFKA_NO_EXTENSIONS": "1"}, check=True, timeout=60)
    await produce(settings.kafka.options(), [(source, e["id"].encode(), msgspec.json.encode(e), []) for e in events[3:]])
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(topics_file), "SLUICE_KAFKA_IDEMPOTENCE": "false",
           "SLUICE_LOG_LEVEL": "warning"}
    async with running_worker(settings, catalog, engine, group_id=group_id):
        run = await asyncio.create_subprocess_exec(*backfill_cmd(source, out, tmp_path / "state"), env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output, _ = await asyncio.wait_for(run.communicate(), 300)
    assert run.returncode == 0, output.decode()[-3000:]
    dec = msgspec.json.Decoder(BackfillResult)
    results = {r.key.decode(): dec.decode(r.value) for r in await read_all(settings, out)}
    assert set(results) == {e["id"] for e in events} | {"0:3"}
    bad = results["0:3"]
    assert bad.offset == 3 and bad.error_code == "invalid_request" and "could not read" in bad.error
    assert all(results[e["id"]].error_code is None and results[e["id"]].scores for e in events)


async def test_requests_answered_overloaded_are_published_again_and_never_written_as_results(settings, catalog, engine,
                                                                                           group_id, tmp_path):
    """A tenant's in-flight limit answers most of a burst `overloaded` (not run, not stored): the backfill
    publishes each again after the hint, and every event ends with its score."""
    from worker.backfill import Backfill, Job

    source, out, events = await events_topic(settings, catalog, "limited", 24, 8)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[tenant.default]\nmax_in_flight = 2\nretry_after_ms = 200\n")
    said = []
    async with running_worker(settings, catalog, engine, group_id=group_id, tenancy_tenants_file=str(tenants)):
        bf = Backfill(settings, catalog, Job(source=source, out=out, template="fraud"), state_dir=tmp_path / "state",
                      max_in_flight=16, log=said.append)
        cp = await asyncio.wait_for(bf.run(), 300)
    results = [msgspec.json.decode(r.value, type=BackfillResult) for r in await read_all(settings, out)]
    assert not [r for r in results if r.error_code], [r.error_code for r in results if r.error_code]
    assert cp.complete and cp.errors == 0 and len(results) == len(events)
    assert {r.event_id for r in results} == {e["id"] for e in events}
    assert bf.republished > 0, "the limit was never reached: this test shows nothing"
    assert any("answered overloaded" in line for line in said), said


async def test_a_job_whose_requests_are_dead_lettered_fails_at_once_naming_why(settings, catalog, engine, group_id,
                                                                             tmp_path):
    """Signed with a key the workers do not hold: each request is dead-lettered and never answered.
    The job stops with the dead letter's reason instead of waiting for replies that will not come."""
    import base64

    from schemas.signing import Signer
    from worker.backfill import Backfill, DeadLettered, Job

    source, out, events = await events_topic(settings, catalog, "unsigned", 5, 9)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenant.acme]\nsigning_keys = {{ k1 = "{base64.b64encode(b"the-right-key" * 3).decode()}" }}\n')
    async with running_worker(settings, catalog, engine, group_id=group_id, tenancy_mode="signed",
                              tenancy_tenants_file=str(tenants)):
        bf = Backfill(settings, catalog, Job(source=source, out=out, template="fraud"), state_dir=tmp_path / "state",
                      signer=Signer("acme", "k1", b"a-wrong-key" * 3), log=lambda *_: None)
        with pytest.raises(DeadLettered, match="does not verify"):
            await asyncio.wait_for(bf.run(), 120)
    assert await read_all(settings, out) == []


async def test_a_job_nobody_answers_stops_naming_why_and_the_same_command_continues_it(settings, catalog, engine,
                                                                                       group_id, tmp_path):
    """No worker reads the batch topic: the job stops once its requests have waited `--stall-s` without a
    reply (exit 1, one line, checkpoint kept) instead of waiting for ever; with a worker back, the same
    command continues and finishes it."""
    source, out, events = await events_topic(settings, catalog, "unread", 5, 10)
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(prefixed_topics_file(catalog, tmp_path / "topics.toml")),
           "SLUICE_KAFKA_IDEMPOTENCE": "false", "SLUICE_LOG_LEVEL": "warning"}
    state = tmp_path / "state"
    t0 = time.monotonic()
    stalled = await asyncio.create_subprocess_exec(*backfill_cmd(source, out, state), "--stall-s", "3", env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(stalled.communicate(), 120)
    said = stderr.decode()
    assert stalled.returncode == 1, stdout.decode()[-2000:] + said[-2000:]
    assert re.search(r"no reply for \d+ s to any of the 5 requests", said) and "Are workers running" in said, said[-2000:]
    assert "Traceback" not in said and time.monotonic() - t0 < 60
    assert list(state.glob("*.json")) and await read_all(settings, out) == []

    async with running_worker(settings, catalog, engine, group_id=group_id):
        output = await run_backfill(source, out, state, env, 300)
    assert b"resuming" in output, output.decode()[-3000:]
    results = [msgspec.json.decode(r.value, type=BackfillResult) for r in await read_all(settings, out)]
    assert sorted(r.event_id for r in results) == sorted(e["id"] for e in events)


async def test_hostile_events_get_a_result_each_and_the_job_goes_on(settings, catalog, engine, group_id, tmp_path):
    """Events that used to stop the job at every run: one larger than a request may be (the source topic
    allowed it; the Kafka client refused its request) and one nested 5,000 deep (the decoder's
    recursion; objects as well as arrays), and one with a lone surrogate escape and no key (named by its own id). Each gets an error
    result; an event with a byte-order mark is read as the workers read requests."""
    from aiokafka import AIOKafkaProducer

    from worker.backfill import Backfill, Job

    source, out, events = await events_topic(settings, catalog, "large", 3, 11)
    huge = {**events[0], "id": "tx-huge", "note": "x" * 1_200_000}
    deep = b'{"id": "tx-deep", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    deep_objects = b'{"id": "tx-deep-objects", "x": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
    bom = b"\xef\xbb\xbf" + msgspec.json.encode({**events[1], "id": "tx-bom"})
    # a merchant name cut inside an emoji by a UTF-16 writer, published without a key: its result
    # still carries its id
    cut = msgspec.json.encode({**events[2], "id": "tx-cut", "merchant": "MARKER"}).replace(b"MARKER", b"Caf\\ud83d")
    producer = AIOKafkaProducer(**settings.kafka.options(), max_request_size=4 << 20)
    await producer.start()
    try:
        await producer.send_and_wait(source, msgspec.json.encode(huge), key=b"tx-huge")
        await producer.send_and_wait(source, deep, key=b"tx-deep")
        await producer.send_and_wait(source, deep_objects, key=b"tx-deep-objects")
        await producer.send_and_wait(source, bom, key=b"tx-bom")
        await producer.send_and_wait(source, cut)
    finally:
        await producer.stop()
    async with running_worker(settings, catalog, engine, group_id=group_id):
        bf = Backfill(settings, catalog, Job(source=source, out=out, template="fraud"), state_dir=tmp_path / "state",
                      log=lambda *_: None)
        cp = await asyncio.wait_for(bf.run(), 300)
    results = {r.event_id: r for r in (msgspec.json.decode(rec.value, type=BackfillResult)
                                       for rec in await read_all(settings, out))}
    assert cp.complete and set(results) == {e["id"] for e in events} | {"tx-huge", "tx-deep", "tx-deep-objects", "tx-bom",
                                                                 "tx-cut"}
    assert results["tx-huge"].error_code == "payload_too_large" and "SLUICE_MAX_PRODUCE_BYTES" in results["tx-huge"].error
    assert results["tx-deep"].error_code == "invalid_request" and "nests deeper" in results["tx-deep"].error
    assert results["tx-deep-objects"].error_code == "invalid_request" and "nests deeper" in results["tx-deep-objects"].error
    assert results["tx-cut"].error_code == "invalid_request" and "(\\ud83d)" in results["tx-cut"].error
    assert all(results[e["id"]].error_code is None for e in events) and results["tx-bom"].error_code is None


async def test_a_request_the_broker_refuses_after_sending_stops_the_job_naming_why(settings, catalog, tmp_path,
                                                                                  monkeypatch):
    """A delivery the broker refuses (a topic's own record limit, a permission) used to leave its event
    waiting for a reply that could not come. The refusal is made here by the producer: the embedded
    broker takes any size and has no ACLs."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import RecordTooLargeError

    from worker import backfill
    from worker.backfill import Backfill, Job, RequestRefused

    request_topic = catalog.request_topic("batch").name

    class Refusing(AIOKafkaProducer):
        async def send(self, topic, *args, **kwargs):
            if topic != request_topic:
                return await super().send(topic, *args, **kwargs)
            refused = asyncio.get_running_loop().create_future()
            refused.set_exception(RecordTooLargeError("over the topic's max.message.bytes"))
            return refused

    monkeypatch.setattr(backfill, "AIOKafkaProducer", Refusing)
    source, out, _ = await events_topic(settings, catalog, "refused", 3, 12)
    bf = Backfill(settings, catalog, Job(source=source, out=out, template="fraud"), state_dir=tmp_path / "state",
                  log=lambda *_: None)
    with pytest.raises(RequestRefused, match="RecordTooLargeError"):
        await asyncio.wait_for(bf.run(), 60)
    assert await read_all(settings, out) == []


async def test_a_source_created_again_below_where_the_job_stood_stops_it_instead_of_waiting(settings, catalog,
                                                                                            tmp_path):
    """The checkpoint says the job read partition 0 to offset 15; the source now ends at 5 (deleted and
    created again). The consumer's default reset would have moved to the end and waited for offsets
    5-19 for ever; the job stops, naming why."""
    from worker.backfill import Backfill, Checkpoint, Job
    from worker.backfill_range import SourceChanged

    source, out, _ = await events_topic(settings, catalog, "recreated", 5, 13)
    await create_topic(settings, out, 1)
    job = Job(source=source, out=out, template="fraud")
    state = tmp_path / "state"
    state.mkdir()
    Checkpoint(job.id, ranges={0: [0, 20]}, done={0: 15}, scan_from={0: 0}).save(state / f"{job.id}.json")
    said = []
    bf = Backfill(settings, catalog, job, state_dir=state, log=said.append)
    with pytest.raises(SourceChanged, match="created again"):
        await asyncio.wait_for(bf.run(), 60)
    assert await read_all(settings, out) == []
