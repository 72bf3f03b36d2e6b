"""Reply routing when a requester's own reply topic cannot be written."""

from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError

from schemas import DoneReply, Usage
from worker.emitter import Emitter


class StubProducer:
    """Fails for the topics it is told to; records what it sent."""

    def __init__(self, failures: dict):
        self.failures = failures  # topic -> exception class
        self.sent: list[tuple[str, bytes, list]] = []
        self.calls: dict[str, int] = {}

    async def send_and_wait(self, topic, value, key=None, headers=None):
        self.calls[topic] = self.calls.get(topic, 0) + 1
        if topic in self.failures:
            raise self.failures[topic]()
        self.sent.append((topic, value, headers))


def _emitter(failures):
    return Emitter(StubProducer(failures), "dlq", default_reply_topic="replies", reply_attempts=3)


DONE = DoneReply("r1", 0, "hi", "stop", Usage(1, 1))


async def test_unwritable_reply_to_falls_back_to_default():
    em = _emitter({"team.replies": KafkaTimeoutError})
    await em.final("team.replies", DONE, retry_until=lambda: True)
    (topic, value, headers), = em._producer.sent
    assert topic == "replies" and em.codec.decode(value) == DONE
    assert ("x-sluice-reply-to-failed", b"team.replies") in headers
    assert em._producer.calls["team.replies"] == 1  # not retriable: no retries


async def test_retriable_failures_are_bounded_for_own_topics(monkeypatch):
    import asyncio

    async def no_sleep(_):
        return None

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    em = _emitter({"team.replies": KafkaConnectionError})
    await em.final("team.replies", DONE, retry_until=lambda: True)
    assert em._producer.calls["team.replies"] == 3
    assert em._producer.sent[0][0] == "replies"


async def test_a_delivery_timeout_on_the_default_topic_is_an_outage_retried_within_the_bound(monkeypatch):
    import asyncio

    from worker.emitter import ReplyOutage

    async def no_sleep(_):
        return None

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    em = _emitter({"replies": KafkaTimeoutError})
    em.outage_s = 0.2
    try:
        await em.final("replies", DONE, retry_until=lambda: True)
    except ReplyOutage:
        assert em._producer.calls["replies"] > 3 and em._producer.sent == []
        return
    raise AssertionError("an outage past the bound must raise ReplyOutage")


async def test_default_topic_refusal_is_raised_not_rerouted():
    from aiokafka.errors import TopicAuthorizationFailedError

    em = _emitter({"replies": TopicAuthorizationFailedError})
    try:
        await em.final("replies", DONE, retry_until=lambda: True)
    except TopicAuthorizationFailedError:
        assert em._producer.sent == []
        return
    raise AssertionError("a failure on the default reply topic must surface")


async def test_reply_batches_are_larger_than_aiokafkas_default_and_never_above_the_request_limit():
    from worker.emitter import kafka_producer

    big = kafka_producer({"bootstrap_servers": "localhost:1"}, False, "t", 4 << 20)
    small = kafka_producer({"bootstrap_servers": "localhost:1"}, False, "t", 100_000)
    try:
        assert big._inner._message_accumulator._batch_size == 256 << 10  # a full 16 KiB batch held every send under load
        assert small._inner._message_accumulator._batch_size == 100_000  # never above what one request may carry
    finally:
        await big.stop()
        await small.stop()


async def test_a_requesters_topic_failing_longer_than_the_outage_bound_is_no_outage_of_the_worker(monkeypatch):
    """Each try at a requester's missing topic can take the producer's whole metadata timeout (40 s);
    five of them outlast `SLUICE_REPLY_OUTAGE_S`. That is the requester's topic failing, not the
    worker's replies: the reply falls back to the default topic and the worker stays up."""
    import asyncio
    import time

    from aiokafka.errors import UnknownTopicOrPartitionError

    class SlowMissing(StubProducer):
        async def send_and_wait(self, topic, value, key=None, headers=None):
            if topic in self.failures:
                time.sleep(0.05)  # the metadata wait, shortened
            return await super().send_and_wait(topic, value, key, headers)

    async def no_sleep(_):
        return None

    monkeypatch.setattr(asyncio, "sleep", no_sleep)

    em = Emitter(SlowMissing({"team.gone": UnknownTopicOrPartitionError}), "dlq", default_reply_topic="replies",
                 reply_attempts=5, outage_s=0.1)
    await em.final("team.gone", DONE, retry_until=lambda: True)
    assert em._producer.calls["team.gone"] == 5
    (topic, value, headers), = em._producer.sent
    assert topic == "replies" and em.codec.decode(value) == DONE and em.outage_for() == 0.0
