"""Failing closed: each supervised task, and each health check, fails the worker visibly.

The worker runs as `sluice worker` does (`service.run_worker`: ops server, worker, exit code) over
the in-memory doubles and the fake engine. For each injected failure: `/readyz` turns 503 within
seconds, with the reason, and `run_worker` returns 1 (the process's exit code) within seconds.
"""

import asyncio
import json
import os
import re
import signal
import time

import pytest
from aiokafka.errors import (GroupAuthorizationFailedError, KafkaConnectionError, NotLeaderForPartitionError,
                             TopicAuthorizationFailedError)

from tests.unit.harness import CATALOG, J, Memory
from worker import service, supervisor
from worker.fake_engine import FakeEngine


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_get(port: int, path: str) -> tuple[int | None, str]:
    """One probe, as a kubelet sends it: (status, body), or (None, "") when nothing answered within 2 s.

    The deadline matters: the poll goes on while the worker shuts its server down, and a connection
    caught in that shutdown (or a TCP self-connect to the freed port) would otherwise wait forever.
    """
    try:
        async with asyncio.timeout(2):
            return await _get(port, path)
    except TimeoutError:
        return None, ""


async def _get(port: int, path: str) -> tuple[int | None, str]:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None, ""
    try:
        if writer.get_extra_info("sockname") == writer.get_extra_info("peername"):
            return None, ""  # connected to itself: nothing listens on the port any more
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        try:
            data = await reader.read()
        except ConnectionError:
            data = b""
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:  # the server closed without answering: it is shutting down
        return None, ""
    return int(head.split()[1]), body.decode()


class Run:
    """`run_worker` as a task, with the worker it built and the times things happened."""

    def __init__(self, monkeypatch, mem: Memory):
        self.mem, self.worker = mem, None
        self.port = free_port()
        self.mem.settings = mem.settings.override(metrics_port=self.port, metrics_host="127.0.0.1")
        outer = self

        class Captured(service.Worker):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                outer.worker = self

        monkeypatch.setattr(service, "Worker", Captured)
        self.task = asyncio.create_task(service.run_worker(mem.settings, CATALOG, mem.engine, **mem.clients()))

    async def ready(self) -> None:
        end = time.monotonic() + 10
        while (await http_get(self.port, "/readyz"))[0] != 200:
            assert time.monotonic() < end and not self.task.done(), "never ready"
            await asyncio.sleep(0.02)

    async def fails_closed(self, since: float, reason: str, drained: bool = True) -> None:
        """/readyz says 503 with `reason` within 5 s of `since`; the exit code is 1 within 10 s.
        `drained=False`: an engine failure, whose shutdown lets its requests go at once: the exit
        comes within 5 s. A 503 that came and went between two looks is read from the worker's health."""
        saw_503 = None
        while not self.task.done():
            status, body = await http_get(self.port, "/readyz")
            if status == 503 and saw_503 is None:
                saw_503 = (time.monotonic() - since, body)
            if time.monotonic() - since > 10:
                import sys
                for t in asyncio.all_tasks():
                    t.print_stack(limit=3, file=sys.stdout)
            assert time.monotonic() - since < 10, f"still running; /readyz {status} {body}"
            await asyncio.sleep(0.02)
        assert self.task.result() == 1
        assert time.monotonic() - since < (10 if drained else 5)
        assert reason in (self.worker.supervisor.failure or "")
        assert self.worker.supervisor.drain == drained
        if saw_503 is None:  # the exit came between two looks (an engine failure's, or under load): what /readyz answers from
            ready, details = self.worker.health()
            assert not ready and reason in details.get("failure", ""), details
            return
        assert saw_503[0] < 5, saw_503
        assert reason in saw_503[1], saw_503[1]


async def answered(mem: Memory, request_id: str, within_s: float = 4.0) -> bool:
    """Whether `request_id`'s final reply reached the reply topic within `within_s`."""
    end = time.monotonic() + within_s
    while request_id not in mem.finals() and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return request_id in mem.finals()


def busy(mem: Memory) -> None:
    """A request that takes a couple of seconds, so the drain (and the 503) lasts that long."""
    mem.send("standard", J({"id": "slow", "prompt": "x", "max_tokens": 40}), b"slow")


def slow_engine() -> FakeEngine:
    return FakeEngine(token_delay_s=0.05)


async def started_busy(monkeypatch, engine=None, **overrides) -> tuple[Memory, Run]:
    """A ready worker with one slow request in flight (so its drain, and its 503, last a while)."""
    mem = Memory(engine=engine or slow_engine(), drain_grace_s=1, **overrides)
    run = Run(monkeypatch, mem)
    await run.ready()
    busy(mem)
    await asyncio.sleep(0.3)
    return mem, run


async def test_intake_loop_failure(monkeypatch):
    mem, run = await started_busy(monkeypatch)
    mem.consumer.fail_next = RuntimeError("client bug")
    await run.fails_closed(time.monotonic(), "intake-")


async def test_a_topic_the_broker_refuses_to_serve_for_good_fails_the_worker(monkeypatch):
    """An error the client calls not retriable (read permission revoked) fails the worker within
    seconds; it used to be retried behind a green /readyz until the intake stall check (300 s)."""
    import io

    import structlog

    from worker.logs import configure

    configure("info", "json", file=io.StringIO())  # as `sluice worker` logs: the dev console's tracebacks
    try:                                            # render every frame's locals, for seconds
        # slow enough that its drain outlasts the limit on refused fetches
        mem, run = await started_busy(monkeypatch, FakeEngine(token_delay_s=0.2))
        since = time.monotonic()
        mem.consumer.failing = TopicAuthorizationFailedError("sluice.requests.standard")
        await run.fails_closed(since, "cannot be read: TopicAuthorizationFailedError")
    finally:
        structlog.reset_defaults()


async def test_a_topic_of_the_worker_deleted_while_it_runs_fails_the_worker(monkeypatch):
    """The Kafka client retries a deleted topic's fetches for ever, and its class would go unserved
    behind a green /readyz: the topic watch fails the worker once the broker has said so twice."""
    mem, run = await started_busy(monkeypatch, topic_check_interval_s=0.3)
    since = time.monotonic()
    mem.broker.delete(CATALOG.request_topic("realtime").name)
    await run.fails_closed(since, f"topics of the worker {CATALOG.request_topic('realtime').name} does not exist")


async def test_an_idle_worker_no_broker_answers_fails_closed(monkeypatch):
    """A broker killed or cut off: the Kafka client retries it for ever and an idle worker has no reply
    or commit to fail, so it stayed ready for as long as the broker was away (seen by hand with the
    embedded broker killed: 200 for 4.5 minutes). Now the topic watch's unanswered asks fail it."""
    mem = Memory(engine=FakeEngine(), topic_check_interval_s=0.2, broker_outage_s=1.5)
    run = Run(monkeypatch, mem)
    await run.ready()
    since = time.monotonic()
    mem.broker.unreachable = True
    assert await asyncio.wait_for(run.task, 10) == 1  # nothing to drain: it exits at once
    assert 1.2 <= time.monotonic() - since < 4  # counted from the last answer, up to one 0.2 s interval before
    assert run.worker.supervisor.failure == ("broker unanswered for 2 s (SLUICE_BROKER_OUTAGE_S=1.5): "
                                             "KafkaConnectionError('connection refused (in-memory broker)')")


async def test_a_busy_worker_no_broker_answers_says_503_naming_it(monkeypatch):
    mem, run = await started_busy(monkeypatch, topic_check_interval_s=0.2, broker_outage_s=1.5)
    since = time.monotonic()
    mem.broker.unreachable = True
    await run.fails_closed(since, "broker unanswered for 2 s (SLUICE_BROKER_OUTAGE_S=1.5)")


async def test_a_broker_away_for_less_than_the_bound_is_ridden_out(monkeypatch):
    """/readyz shows the outage while it lasts, and it ends when a broker answers again."""
    mem = Memory(engine=FakeEngine(), topic_check_interval_s=0.2, broker_outage_s=3)
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.broker.unreachable = True
    await asyncio.sleep(1.5)
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and json.loads(body)["broker_outage_s"] >= 1.0, body
    mem.broker.unreachable = False
    await asyncio.sleep(3)
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and json.loads(body)["broker_outage_s"] == 0.0, body
    assert not run.task.done()
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0


async def test_a_worker_whose_fetches_go_unanswered_fails_closed_naming_them(monkeypatch):
    """A broker that answers metadata but not fetches (a partition's leader cut off from this worker):
    every poll returns empty and the topic watch is answered, so the worker stayed ready with its
    partitions unread (by hand, on the real broker behind a proxy: 3 minutes). Now the fetch watch
    fails it, and its partitions go to the group's other workers."""
    mem = Memory(engine=FakeEngine(), fetch_outage_s=3, topic_check_interval_s=0.2)
    run = Run(monkeypatch, mem)
    await run.ready()
    await asyncio.sleep(4)  # idle past the bound: the idle polls' answers keep it ready
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and json.loads(body)["fetch_wait_s"] < 2, body
    since = time.monotonic()
    mem.broker.fetches_held = True
    assert await asyncio.wait_for(run.task, 10) == 1  # nothing to drain: it exits at once
    assert 2 <= time.monotonic() - since < 6  # counted from the last answer: up to an idle wait (1 s) before
    failure = run.worker.supervisor.failure
    assert failure.startswith("fetches unanswered for ") and "(SLUICE_FETCH_OUTAGE_S=3): " in failure, failure
    # those past the bound when it failed, longest first: 4 named, the rest counted. Which of the 6 they
    # are depends on when each last had an answer (every one of them, on a slow machine, or only some)
    shown, _, more = re.search(r"\): (.*) unread: ", failure).group(1).partition(" and ")
    shown = shown.split(", ")
    assert set(shown) <= {f"sluice.requests.{cls}[{p}]" for cls in ("realtime", "standard", "batch") for p in (0, 1)}
    assert len(shown) == 4 if more else 1 <= len(shown) <= 4, failure
    assert more in ("", "1 more", "2 more"), failure
    assert run.worker.liveness.broker_silence is None  # the topic watch's asks were answered throughout


async def test_a_busy_worker_whose_fetches_go_unanswered_says_503_naming_it(monkeypatch):
    mem, run = await started_busy(monkeypatch, fetch_outage_s=2)
    since = time.monotonic()
    mem.broker.fetches_held = True
    await run.fails_closed(since, "(SLUICE_FETCH_OUTAGE_S=2)")
    assert "slow" in mem.finals()  # the request in flight was answered in the drain


async def test_a_broker_that_answers_nothing_is_named_as_such_not_as_unanswered_fetches(monkeypatch):
    """With no answer to metadata either, the fetch bound (shorter here) waits for the broker outage's."""
    mem = Memory(engine=FakeEngine(), fetch_outage_s=1.5, topic_check_interval_s=0.2, broker_outage_s=3)
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.broker.unreachable = mem.broker.fetches_held = True
    assert await asyncio.wait_for(run.task, 10) == 1
    assert run.worker.supervisor.failure.startswith("broker unanswered for 3 s"), run.worker.supervisor.failure


async def test_fetches_get_their_whole_bound_again_after_a_broker_outage_ridden_out(monkeypatch):
    """A broker away for longer than the fetch bound but less than its own: it answers metadata again
    first, and the fetches that resume a moment later are not taken for an outage of their own."""
    mem = Memory(engine=FakeEngine(), fetch_outage_s=3, topic_check_interval_s=0.2, broker_outage_s=8)
    run = Run(monkeypatch, mem)
    await run.ready()
    await asyncio.sleep(1)  # the watch has seen every partition answered
    mem.broker.unreachable = mem.broker.fetches_held = True
    await asyncio.sleep(4)
    mem.broker.unreachable = False
    await asyncio.sleep(0.5)  # metadata answered again, fetches not yet
    mem.broker.fetches_held = False
    await asyncio.sleep(3)
    assert not run.task.done(), run.worker.supervisor.failure
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and json.loads(body)["fetch_wait_s"] < 1.5, body
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0


async def test_fetches_held_for_less_than_the_bound_are_ridden_out(monkeypatch):
    mem = Memory(engine=FakeEngine(), fetch_outage_s=4)
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.broker.fetches_held = True
    await asyncio.sleep(2.5)
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and json.loads(body)["fetch_wait_s"] >= 1.5, body
    exposition = (await http_get(run.port, "/metrics"))[1]
    assert float(re.search(r"^sluice_fetch_wait_seconds (\S+)$", exposition, re.M).group(1)) >= 1.5
    mem.broker.fetches_held = False
    mem.send("realtime", J({"id": "after", "prompt": "x", "max_tokens": 2}), b"after")
    assert await answered(mem, "after")
    await asyncio.sleep(1)
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and json.loads(body)["fetch_wait_s"] < 1.5, body
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0


async def test_a_worker_that_did_not_run_past_its_bounds_goes_on_when_it_wakes(monkeypatch):
    """The whole worker held past every bound, a request in flight (`time.sleep` holds its event loop,
    and so the in-process engine, as a SIGSTOP or a paused VM holds the process). Before, its first
    tick awake found every wait past its bound and failed it naming a fault it never had (by hand,
    150 s SIGSTOPped: `fetches unanswered`, exit 1). Now it goes on and answers."""
    monkeypatch.setattr(supervisor, "SUSPENDED_S", 2.0)  # 5 s in a worker, well under its bounds there
    mem, run = await started_busy(monkeypatch, fetch_outage_s=1.5, engine_stall_s=1.5, intake_stall_s=1.5,
                                  topic_check_interval_s=0.2, broker_outage_s=1.5)
    assert "slow" not in mem.finals()
    time.sleep(4)
    await asyncio.sleep(3)
    assert not run.task.done(), run.worker.supervisor.failure
    assert "slow" in mem.finals()
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and json.loads(body)["fetch_wait_s"] < 1.5, body
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0


async def test_a_fault_that_outlasts_the_pause_fails_once_its_bound_passes_awake(monkeypatch):
    """What the worker did not see is left out, not forgiven: fetches held from before the pause and
    after it fail the worker once the bound has passed in the time it ran, not at its first tick."""
    monkeypatch.setattr(supervisor, "SUSPENDED_S", 2.0)
    mem = Memory(engine=FakeEngine(), fetch_outage_s=3, topic_check_interval_s=0.2)
    run = Run(monkeypatch, mem)
    await run.ready()
    await asyncio.sleep(1)
    mem.broker.fetches_held = True
    time.sleep(4)
    woke = time.monotonic()
    while run.worker.supervisor.failure is None:
        assert time.monotonic() - woke < 6, "the held fetches were never failed"
        await asyncio.sleep(0.05)
    # the 3 s bound, less the wait before the pause (up to an idle poll and a tick); without the
    # discount, the first tick awake
    assert 1.0 <= time.monotonic() - woke < 3.5
    assert await asyncio.wait_for(run.task, 10) == 1
    assert run.worker.supervisor.failure.startswith("fetches unanswered for "), run.worker.supervisor.failure


async def test_a_broker_outage_counts_from_the_start_at_the_earliest():
    """A worker is built before its start checks and first group join (which may take up to
    SLUICE_GROUP_JOIN_S): an outage that begins at the first ask after the start counts from the
    start, not from the worker's creation."""
    from worker.reply_batches import BrokerUnanswered
    from worker.supervisor import Liveness, Supervisor, watch_topics

    sup, liveness, asked = Supervisor(), Liveness(["realtime"]), []
    liveness.broker_answered_at -= 110  # built before a first group join that took 110 s

    async def unusable(topics):
        asked.append(time.monotonic())
        raise BrokerUnanswered("no answer to a metadata request within 2 s")

    started = time.monotonic()
    task = asyncio.create_task(watch_topics(sup, unusable, ["t.a"], interval_s=0.01, liveness=liveness))
    while not asked:
        await asyncio.sleep(0.005)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert liveness.broker_silence == "no answer to a metadata request within 2 s"
    assert 0 < liveness.broker_outage_for(time.monotonic()) <= time.monotonic() - started


WATCHED = {
    # the broker's answers, one per check, and whether the worker fails
    "fine": ([{}, {}, {}], None),
    "gone, asked twice": ([{}, {"t.a": "does not exist"}, {"t.a": "does not exist"}], "t.a does not exist"),
    "one answer is not enough": ([{"t.a": "does not exist"}, {}, {"t.a": "does not exist"}, {}], None),
    "each topic counted on its own": ([{"t.a": "does not exist"}, {"t.b": "does not exist"},
                                       {"t.a": "does not exist"}], None),
    "credentials withdrawn": ([{"t.b": "is not authorized for the workers' credentials"}] * 2,
                              "t.b is not authorized"),
}


@pytest.mark.parametrize("answers,failure", WATCHED.values(), ids=WATCHED.keys())
async def test_the_topic_watch_fails_on_two_answers_in_a_row_naming_the_topic(answers, failure):
    from worker.supervisor import Supervisor, watch_topics

    sup, asked = Supervisor(), []

    async def unusable(topics):
        asked.append(list(topics))
        if len(asked) > len(answers):
            await asyncio.Event().wait()  # every scripted answer given: wait to be cancelled
        return answers[len(asked) - 1]

    task = asyncio.create_task(watch_topics(sup, unusable, ["t.a", "t.b"], interval_s=0.001))
    for _ in range(200):
        if task.done() or len(asked) > len(answers):
            break
        await asyncio.sleep(0.005)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert asked[0] == ["t.a", "t.b"]
    if failure is None:
        assert sup.failure is None and len(asked) == len(answers) + 1
    else:
        assert failure in sup.failure and "sluice topics apply" in sup.failure


async def test_retriable_fetch_errors_are_ridden_out(monkeypatch):
    """A leader election's errors, for longer than the limit on errors not retriable, fail nothing."""
    mem = Memory(engine=FakeEngine())
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.consumer.failing = NotLeaderForPartitionError()
    await asyncio.sleep(4.5)
    assert (await http_get(run.port, "/readyz"))[0] == 200 and not run.task.done()
    mem.consumer.failing = None
    mem.send("realtime", J({"id": "after", "prompt": "x", "max_tokens": 1}), b"after")
    assert await answered(mem, "after")
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0


async def test_dispatch_failure(monkeypatch):
    mem, run = await started_busy(monkeypatch)

    def broken(now_ms):
        raise ZeroDivisionError("admission bug")

    run.worker.scheduler.admit = broken
    mem.send("realtime", J({"id": "next", "prompt": "x"}), b"next")
    await run.fails_closed(time.monotonic(), "dispatch failed")


async def test_commit_loop_failure(monkeypatch):
    mem, run = await started_busy(monkeypatch)
    mem.consumer.commit_error = RuntimeError("coordinator bug")
    mem.send("realtime", J({"id": "quick", "prompt": "x", "max_tokens": 1}), b"quick")
    await run.fails_closed(time.monotonic(), "commits failed")


async def test_answer_writer_failure(monkeypatch):
    mem, run = await started_busy(monkeypatch)
    mem.answers.fail_writer = RuntimeError("writer bug")
    mem.send("realtime", J({"id": "quick", "prompt": "x", "max_tokens": 1}), b"quick")
    await run.fails_closed(time.monotonic(), "answer-writer failed")


async def test_producer_sender_failure(monkeypatch):
    mem, run = await started_busy(monkeypatch)
    mem.producer.crash(RuntimeError("sender died"))
    await run.fails_closed(time.monotonic(), "producer failed")


async def test_replies_that_cannot_be_produced_past_the_bound(monkeypatch):
    mem = Memory(engine=FakeEngine(), reply_outage_s=1.0, drain_grace_s=1)
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.producer.fail = lambda topic, value: KafkaConnectionError("broker gone")
    since = time.monotonic()
    mem.send("realtime", J({"id": "r1", "prompt": "x", "max_tokens": 1, "stream": False}), b"r1")
    await run.fails_closed(since, "be produced")
    assert mem.broker.committed.get(next(tp for tp in mem.broker.logs if tp.topic.endswith("realtime")), 0) == 0


async def test_a_short_broker_outage_is_ridden_out(monkeypatch):
    mem = Memory(engine=FakeEngine(), reply_outage_s=5.0)
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.producer.fail = lambda topic, value: KafkaConnectionError("broker gone")
    mem.send("realtime", J({"id": "r2", "prompt": "x", "max_tokens": 1, "stream": False}), b"r2")
    await asyncio.sleep(1.0)
    assert not mem.finals() and not any(mem.broker.committed.values())  # nothing answered, nothing committed
    mem.producer.fail = lambda topic, value: None
    for _ in range(200):
        if mem.finals() and mem.all_committed():
            break
        await asyncio.sleep(0.02)
    assert "r2" in mem.finals() and mem.all_committed()
    assert (await http_get(run.port, "/readyz"))[0] == 200 and not run.task.done()
    os.kill(os.getpid(), signal.SIGTERM)  # a clean drain exits 0
    assert await asyncio.wait_for(run.task, 10) == 0


async def test_offsets_that_cannot_be_committed_past_the_bound(monkeypatch):
    """A worker that answers but can never commit (its group permission revoked, say) would look
    healthy while every record it answered waits to be read and answered again."""
    mem = Memory(engine=FakeEngine(token_delay_s=0.01), commit_outage_s=1.0, drain_grace_s=1)
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.consumer.commit_error = GroupAuthorizationFailedError()
    since = time.monotonic()
    mem.send("realtime", J({"id": "c1", "prompt": "x", "max_tokens": 1, "stream": False}), b"c1")
    mem.send("standard", J({"id": "long", "prompt": "x", "max_tokens": 500}), b"long")  # in flight: a drain to see
    await run.fails_closed(since, "offsets could not be committed")
    assert "c1" in mem.finals()  # it answered; committing is what failed
    assert "GroupAuthorizationFailedError" in run.worker.supervisor.failure


async def test_a_commit_that_never_returns_fails_the_worker(monkeypatch):
    mem = Memory(engine=FakeEngine(token_delay_s=0.01), commit_outage_s=1.0, drain_grace_s=1, stop_margin_s=1)
    run = Run(monkeypatch, mem)
    await run.ready()

    async def hangs(offsets):
        await asyncio.Event().wait()

    mem.consumer.commit = hangs
    since = time.monotonic()
    mem.send("realtime", J({"id": "c2", "prompt": "x", "max_tokens": 1, "stream": False}), b"c2")
    mem.send("standard", J({"id": "long", "prompt": "x", "max_tokens": 500}), b"long")
    await run.fails_closed(since, "no answer from the broker")


async def test_a_short_commit_outage_is_ridden_out(monkeypatch):
    mem = Memory(engine=FakeEngine(), commit_outage_s=5.0)
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.consumer.commit_error = KafkaConnectionError("coordinator gone")
    mem.send("realtime", J({"id": "c3", "prompt": "x", "max_tokens": 1, "stream": False}), b"c3")
    await asyncio.sleep(1.5)
    assert "c3" in mem.finals() and not any(mem.broker.committed.values())
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and '"commit_outage_s": 0.0' not in body  # ready, and the outage shows
    mem.consumer.commit_error = None
    for _ in range(200):
        if mem.all_committed():
            break
        await asyncio.sleep(0.02)
    assert mem.all_committed() and not run.task.done()
    assert '"commit_outage_s": 0.0' in (await http_get(run.port, "/readyz"))[1]
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0


async def test_a_health_check_the_worker_stopped_during_is_asked_again(monkeypatch):
    """The worker stopped while it waited for the engine's answer (as a SIGSTOP of the worker and its
    engine core would): the check's bound ran out before the engine could answer. That is asked
    again, not taken for a dead engine; a failure with no pause is."""
    monkeypatch.setattr(supervisor, "SUSPENDED_S", 0.5)

    class StoppedOnce(FakeEngine):
        asked = 0
        dead = False

        async def check_health(self, timeout_s):
            self.asked += 1
            if self.asked == 2:
                time.sleep(1.5)  # the whole worker held, and the check's bound ran out meanwhile
                raise TimeoutError()
            if self.dead:
                raise RuntimeError("EngineCore died")

    mem = Memory(engine=StoppedOnce(), engine_health_interval_s=0.5)
    run = Run(monkeypatch, mem)
    await run.ready()
    end = time.monotonic() + 15
    while mem.engine.asked < 4 and not run.task.done() and time.monotonic() < end:
        await asyncio.sleep(0.1)
    assert not run.task.done() and mem.engine.asked >= 4, run.worker.supervisor.failure
    mem.engine.dead = True
    await run.fails_closed(time.monotonic(), "engine unhealthy", drained=False)


async def test_engine_health_check_failure(monkeypatch):
    class Dying(FakeEngine):
        healthy = True

        async def check_health(self, timeout_s):
            if not self.healthy:
                raise RuntimeError("EngineCore died")

    mem, run = await started_busy(monkeypatch, engine=Dying(token_delay_s=0.05))
    mem.engine.healthy = False
    await run.fails_closed(time.monotonic(), "engine unhealthy", drained=False)


async def test_stalled_engine(monkeypatch):
    mem = Memory(engine=FakeEngine(token_delay_s=3600), engine_stall_s=1.0, drain_grace_s=1)
    run = Run(monkeypatch, mem)
    await run.ready()
    await asyncio.sleep(1.5)  # idle longer than the stall bound: idle is not a stall
    assert (await http_get(run.port, "/readyz"))[0] == 200
    since = time.monotonic()
    busy(mem)
    await run.fails_closed(since, "engine stalled", drained=False)


class StuckEngine(FakeEngine):
    """Holds every request with no output; its one engine process computes (`cpu_per_s` of CPU a
    second) or not, as `cpu_times` says while it holds requests."""

    def __init__(self, cpu_per_s: float):
        super().__init__(token_delay_s=3600)
        self.cpu_per_s, self.since = cpu_per_s, time.monotonic()

    def cpu_times(self):
        return {4242: 10.0 + self.cpu_per_s * (time.monotonic() - self.since)}


@pytest.mark.parametrize("cpu_per_s, stall_s, reason", [
    (0.0, 60.0, "engine frozen"),  # its processes stopped: found long before the stall bound
    (1.0, 3.0, "engine stalled"),  # computing and never outputting: left to the stall bound
])
async def test_a_busy_engine_with_no_output_fails_by_its_cpu(monkeypatch, cpu_per_s, stall_s, reason):
    """Either way its request is let go at once: the exit comes long before the drain's grace would end."""
    mem = Memory(engine=StuckEngine(cpu_per_s), engine_stall_s=stall_s, engine_frozen_s=1.5, drain_grace_s=30)
    run = Run(monkeypatch, mem)
    await run.ready()
    since = time.monotonic()
    busy(mem)
    await run.fails_closed(since, reason, drained=False)


async def test_intake_that_stops_polling(monkeypatch):
    mem, run = await started_busy(monkeypatch, intake_stall_s=1.0)

    async def hang(*tps, timeout_ms=0, max_records=None):
        await asyncio.Event().wait()

    mem.consumer.getmany = hang
    await run.fails_closed(time.monotonic(), "stopped polling")


@pytest.mark.parametrize("stage", ["intake", "dispatch", "commits", "monitor"])
async def test_a_clean_stop_is_not_a_failure(monkeypatch, stage):
    mem = Memory(engine=FakeEngine())
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.send("realtime", J({"id": "c1", "prompt": "x", "max_tokens": 2}), b"c1")
    for _ in range(200):
        if mem.all_committed() and mem.finals():
            break
        await asyncio.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0
    assert run.worker.supervisor.failure is None


# A worker whose shutdown hangs: `sluice worker`'s own wiring (`run_loop`, `run_worker`,
# `exit_after`) in a process of its own, over the doubles, with the answer store's stop hung.
_HUNG_STOP = """
import asyncio, sys
from tests.unit.harness import CATALOG, Memory
from worker import service

mem = Memory(drain_grace_s=0.5, stop_margin_s=1.0, metrics_port=0)

async def hang():
    await asyncio.Event().wait()

mem.answers.stop = hang
mem.consumer.fail_next = RuntimeError("client bug")
watchdog = service.exit_after if sys.argv[1] == "on" else None
sys.exit(service.run_loop(service.run_worker(mem.settings, CATALOG, mem.engine, on_stopping=watchdog, **mem.clients())))
"""


def _hung_stop(watchdog: str):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _HUNG_STOP, watchdog], cwd=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_shutdown_that_hangs_still_ends_the_process_with_status_1():
    t0 = time.monotonic()
    proc = _hung_stop("on")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "shutdown_stuck" in out and "intake-" in out, out
    # drain grace 0.5 s + margin 1 s, after an interpreter start of a few seconds
    assert time.monotonic() - t0 < 30


def test_without_the_deadline_the_same_process_stays_up():
    """The control: the hang above is real, so the deadline is what ends it."""
    proc = _hung_stop("off")
    try:
        with pytest.raises(__import__("subprocess").TimeoutExpired):
            proc.wait(timeout=12)
    finally:
        proc.kill()
        proc.wait()


def test_exit_after_fires_once_with_status_1_unless_cancelled():
    fired: list[int] = []
    service.exit_after(0.05, exit=fired.append)
    cancelled = service.exit_after(0.05, exit=fired.append)
    cancelled.cancel()
    time.sleep(0.3)
    assert fired == [1]


async def test_a_client_that_cannot_start_is_one_clear_line_and_exit_1(capsys):
    from aiokafka.errors import UnknownError

    mem = Memory(kafka_idempotence=True)

    async def refused():
        raise UnknownError("InitProducerId")

    mem.producer.start = refused
    assert await asyncio.wait_for(service.run_worker(mem.settings, CATALOG, mem.engine, **mem.clients()), 10) == 1
    err = capsys.readouterr().err
    assert "could not start" in err and "UnknownError" in err and "SLUICE_KAFKA_IDEMPOTENCE=false" in err


async def test_a_client_that_cannot_start_closes_the_ones_that_did():
    """The consumer cannot reach the broker: the producer and the answer writer already started are
    closed again, not left running behind a failed start."""
    mem = Memory()

    async def refuse():
        raise KafkaConnectionError("broker unreachable")

    mem.consumer.start = refuse
    worker = mem.worker()
    with pytest.raises(KafkaConnectionError):
        await worker.start()
    assert mem.producer._sender.sender_task.done()
    assert mem.answers.writer.done()


async def test_a_client_that_cannot_start_closes_the_consumer_built_with_the_worker():
    """The producer is refused before the consumer starts: the consumer (built with the worker) is
    closed too, so the process does not end with aiokafka's "Unclosed AIOKafkaConsumer"."""
    from aiokafka.errors import UnknownError

    mem = Memory()
    stops = []
    consumer_stop = mem.consumer.stop

    async def refused():
        raise UnknownError("InitProducerId")

    async def stop():
        stops.append("consumer")
        await consumer_stop()

    mem.producer.start, mem.consumer.stop = refused, stop
    with pytest.raises(UnknownError):
        await mem.worker().start()
    assert stops == ["consumer"]


async def test_a_first_group_join_the_coordinator_holds_is_one_clear_line_and_exit_1(monkeypatch, capsys):
    """aiokafka's start returns once the group has assigned partitions. A join the coordinator holds
    (a member that never rejoins, a broker that never answers the join) held the worker there for ever:
    not ready, never exiting, so never restarted."""
    mem = Memory(group_join_s=1.0, kafka_idempotence=True)
    mem.consumer.join_held = asyncio.Event()
    run = Run(monkeypatch, mem)
    since = time.monotonic()
    await asyncio.sleep(0.5)
    status, body = await http_get(run.port, "/readyz")
    assert status == 503 and '"starting": "joining the consumer group"' in body and not run.task.done()
    assert await asyncio.wait_for(run.task, 10) == 1
    assert time.monotonic() - since < 5
    err = capsys.readouterr().err
    assert "consumer group sluice-workers did not take this worker in within 1 s" in err
    assert "SLUICE_KAFKA_IDEMPOTENCE" not in err  # that hint is for a producer the broker refused
    assert mem.producer._sender.sender_task.done() and mem.answers.writer.done()  # closed, not left running


async def test_sigterm_while_the_group_join_is_held_exits_0_at_once(monkeypatch):
    mem = Memory()  # the default bound: minutes
    mem.consumer.join_held = asyncio.Event()
    run = Run(monkeypatch, mem)
    await asyncio.sleep(0.5)
    assert (await http_get(run.port, "/readyz"))[0] == 503 and not run.task.done()
    since = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0
    assert time.monotonic() - since < 3
    assert mem.producer._sender.sender_task.done() and mem.answers.writer.done()


async def _slow_stop():
    await asyncio.sleep(0.5)  # an idle worker's drain is instant: this keeps its 503 long enough to be seen


async def test_a_rejoin_the_coordinator_holds_fails_the_worker(monkeypatch):
    """After a rebalance revoked its partitions, a worker whose rejoin never completes reads nothing;
    its intake loops, with nothing assigned, kept /readyz green."""
    mem = Memory(group_join_s=1.0)
    run = Run(monkeypatch, mem)
    await run.ready()
    mem.consumer.stop = _slow_stop
    since = time.monotonic()
    await mem.consumer.rejoin_held()
    await run.fails_closed(since, "group rejoin not completed")
    assert "SLUICE_GROUP_JOIN_S=1" in run.worker.supervisor.failure


async def test_a_rejoin_within_the_bound_is_ridden_out(monkeypatch):
    mem = Memory(group_join_s=1.5)
    run = Run(monkeypatch, mem)
    await run.ready()
    tps = mem.consumer.assignment()
    await mem.consumer.rejoin_held()
    await asyncio.sleep(0.8)
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and '"out_of_group_s": 0.0' not in body  # ready, and the rejoin shows
    await mem.consumer.assign(tps)
    await asyncio.sleep(1.5)  # past the bound counted from the revoke: the clock stopped at the assignment
    status, body = await http_get(run.port, "/readyz")
    assert status == 200 and '"out_of_group_s": 0.0' in body and not run.task.done()
    mem.send("realtime", J({"id": "back", "prompt": "x", "max_tokens": 1, "stream": False}), b"back")
    assert await answered(mem, "back")
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(run.task, 10) == 0


# `sluice worker`'s own wiring while the engine loads: a load that takes 10 minutes and has started an
# engine-core stand-in that ignores SIGTERM (vLLM's took 20-30 s to end on it mid-compile).
_SLOW_LOAD = """
import subprocess, sys, time
from tests.unit.harness import CATALOG, Memory
from worker import engine, service

class SlowLoad:
    def __init__(self, settings):
        core = subprocess.Popen([sys.executable, "-c", "import os, signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); "
                                 "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        print("core", core.stdout.readline().strip(), flush=True)
        time.sleep(600)

engine.VllmEngine = SlowLoad
mem = Memory(metrics_port=0)
assert mem.settings.engine.engine_kind == "vllm"
sys.exit(service.run_loop(service.run_worker(mem.settings, CATALOG, None, on_stopping=service.exit_after,
                                             **mem.clients())))
"""


def test_sigterm_while_the_engine_loads_ends_its_processes_and_exits_0():
    import subprocess
    import sys

    from worker import engine_guard

    proc = subprocess.Popen([sys.executable, "-c", _SLOW_LOAD], cwd=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("core "):
            line = proc.stdout.readline()
        core = int(line.split()[1])
        started = engine_guard.start_time(core)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
        assert proc.returncode == 0, out
        assert "stopped_while_loading" in out, out
        # SIGTERM to the engine's processes, SIGKILL after the grace for what ignored it: not the load's 10 minutes
        assert service.LOADING_STOP_S <= took < service.LOADING_STOP_S + 5, took
        assert not engine_guard.running(core, started)
    finally:
        proc.kill()
        proc.wait()


def test_an_engine_that_fails_to_load_ends_the_worker_with_one_clear_line():
    import subprocess
    import sys

    script = _SLOW_LOAD.replace('        print("core", core.stdout.readline().strip(), flush=True)\n        time.sleep(600)',
                                '        core.kill()\n        raise RuntimeError("Engine core initialization failed: '
                                '{\'EngineCore\': -9}")')
    assert script != _SLOW_LOAD
    proc = subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # logged with its traceback; not an uncaught exception's traceback on stderr
    assert "engine_load_failed" in proc.stdout and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "sluice: the engine could not load" in proc.stderr and "EngineCore" in proc.stderr, proc.stderr


async def test_an_ops_port_in_use_refuses_the_start_with_one_clear_line(capsys):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        mem = Memory(metrics_port=port, metrics_host="127.0.0.1")
        assert await service.run_worker(mem.settings, CATALOG, mem.engine, **mem.clients()) == 1
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "SLUICE_METRICS_PORT" in err, err
    assert "Traceback" not in err


async def test_an_engine_guard_killed_under_a_running_worker_is_started_again(monkeypatch):
    """The worker's guard watch: a guard process SIGKILLed while the worker serves is started again
    within seconds and counted; the worker stays ready (it can still do its job)."""
    import subprocess
    import sys

    from worker import metrics
    from worker.engine_guard import EngineGuard

    engine = FakeEngine()
    engine.guard = EngineGuard()  # as vLLM's engine has one, watching an engine process
    engine.guard.before()
    engine_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    engine.guard.watch()
    restarts = metrics.guard_restarts.labels("engine")
    before = restarts._value.get()
    try:
        mem = Memory(engine=engine)
        run = Run(monkeypatch, mem)
        await run.ready()
        first = engine.guard.pid
        os.kill(first, signal.SIGKILL)
        end = time.monotonic() + 5
        while engine.guard.pid == first and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert engine.guard.pid != first, "the killed guard was not started again"
        assert restarts._value.get() == before + 1
        assert (await http_get(run.port, "/readyz"))[0] == 200
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(run.task, 10) == 0
    finally:
        assert engine.guard.close(wait_s=0) == [engine_proc.pid]  # the stand-in engine process, ended
        engine_proc.wait()


async def test_sigterm_while_the_start_up_checks_wait_on_a_silent_broker_exits_0_at_once(capsys):
    """A broker that accepts connections and never answers (stopped, a wedged listener) holds the
    start-up check for its 15 s timeout; a stop meanwhile (a terminal's Ctrl-C) does not wait for it."""
    import socket

    silent = socket.socket()  # the kernel accepts connections to it; nobody ever answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        settings = Memory().settings.override(kafka_bootstrap=f"127.0.0.1:{silent.getsockname()[1]}",
                                              engine_kind="fake", metrics_port=free_port(), metrics_host="127.0.0.1")
        task = asyncio.create_task(service.run_worker(settings, CATALOG))
        await asyncio.sleep(1.5)
        assert not task.done(), capsys.readouterr().err
        since = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(task, 10) == 0
        assert time.monotonic() - since < 3
    finally:
        silent.close()
