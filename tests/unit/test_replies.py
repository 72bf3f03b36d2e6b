"""A request's last records: token records whose delivery failed are sent again before the `done`,
and a `done`'s audit record, queued with it, is acknowledged before the offset is committed."""

import asyncio

import msgspec
from aiokafka.errors import KafkaTimeoutError

from schemas import DoneReply, TokenReply
from tests.unit.harness import CATALOG, J, Memory, running, until
from worker import metrics
from worker.fake_engine import FakeEngine


async def test_an_audit_record_whose_queued_delivery_failed_is_sent_again_before_the_commit():
    """The done's audit record is queued before the done and waited for after it; a failed first
    delivery is retried like any audit record, and the offset is committed only after both."""
    mem = Memory(partitions=1)
    failed: list[str] = []

    def fail_first_audit(topic, value):
        if topic == CATALOG.audit.name and not failed:
            failed.append(topic)
            return KafkaTimeoutError()  # through the queued record's future
        return None

    mem.producer.fail = fail_first_audit
    mem.send("standard", J({"id": "a1", "prompt": "hello", "max_tokens": 2}))
    async with running(mem):
        assert await until(lambda: "a1" in mem.finals() and mem.all_committed())
        assert failed == [CATALOG.audit.name]
        assert [(a.id, a.outcome) for a in mem.audit()] == [("a1", "length")]  # sent again, once


async def test_a_queued_audit_record_nobody_waits_for_leaves_no_unretrieved_failure():
    from worker.emitter import Emitter

    mem = Memory(partitions=1)
    mem.producer.fail = lambda topic, value: KafkaTimeoutError()
    emitter = Emitter(mem.producer, CATALOG.dlq.name)
    loop = asyncio.get_running_loop()
    seen: list = []
    loop.set_exception_handler(lambda loop, context: seen.append(context))
    try:
        queued = await emitter.queue_audit(CATALOG.audit.name, b"k", b"{}")
        assert queued.done() and not queued.cancelled()  # failed (its exception is not read here)
        await asyncio.sleep(0)  # its done-callbacks run
        del queued
        import gc

        gc.collect()
        assert seen == []
        # without the retrieval a dropped failed future is reported (the check above can fail)
        fut = await mem.producer.send(CATALOG.audit.name, b"{}", key=b"k")
        await asyncio.sleep(0)
        del fut
        gc.collect()
        assert [c["message"] for c in seen] == ["Future exception was never retrieved"]
    finally:
        loop.set_exception_handler(None)


async def test_a_token_record_whose_delivery_failed_is_sent_again_before_the_done():
    mem = Memory(partitions=1, engine=FakeEngine(token_delay_s=0.01))
    failed: list[int] = []

    def fail_first_delivery_of_seq1(topic, value):
        reply = msgspec.json.decode(value) if topic == CATALOG.replies.name else {}
        if reply.get("type") == "token" and reply.get("seq") == 1 and not failed:
            failed.append(1)
            return KafkaTimeoutError()  # through the send's future, as aiokafka reports a lost delivery
        return None

    mem.producer.fail = fail_first_delivery_of_seq1
    resends = metrics.token_resends._value.get()
    mem.send("standard", J({"id": "r1", "prompt": "hello", "max_tokens": 4, "stream": True}))
    async with running(mem):
        assert await until(lambda: "r1" in mem.finals())
    replies = [r for r in mem.replies() if r.id == "r1"]
    assert failed == [1]
    assert isinstance(replies[-1], DoneReply) and replies[-1].finish_reason == "length"
    tokens = [r.seq for r in replies if isinstance(r, TokenReply)]
    # seq 1 was lost, so it and everything after it went again, in order, before the done
    assert tokens[:1] == [0] and tokens[-3:] == [1, 2, 3] and set(tokens) == {0, 1, 2, 3}
    assert metrics.token_resends._value.get() - resends == 3
    assert replies[0].text + "".join(r.text for r in replies[-4:-1]) == replies[-1].text  # seq 0, then 1-3 again
