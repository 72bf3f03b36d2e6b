"""A request's last records: token records whose delivery failed are sent again before the `done`,
and the `done` and its audit record both end before either's failure is raised."""

import asyncio

import msgspec
import pytest
from aiokafka.errors import KafkaTimeoutError

from schemas import DoneReply, TokenReply
from tests.unit.harness import CATALOG, J, Memory, running, until
from worker import metrics
from worker.fake_engine import FakeEngine
from worker.replies import _both


async def _ends_after(delay: float, log: list, name: str, exc: BaseException | None = None):
    try:
        await asyncio.sleep(delay)
    except asyncio.CancelledError:
        log.append(f"{name} cancelled")
        raise
    log.append(f"{name} ended")
    if exc is not None:
        raise exc


@pytest.mark.parametrize("failing, slow", [("first", "second"), ("second", "first"), ("first", "first")])
async def test_both_waits_for_both_sends_then_raises_the_failure(failing, slow):
    log: list = []
    delays = {"first": 0.05 if slow == "first" else 0.0, "second": 0.05 if slow == "second" else 0.0}
    boom = RuntimeError(failing)
    sends = {name: _ends_after(delays[name], log, name, boom if name == failing else None) for name in delays}
    with pytest.raises(RuntimeError, match=failing):
        await _both(sends["first"], sends["second"])
    assert sorted(log) == ["first ended", "second ended"]  # nothing is left running when it raises


async def test_both_cancelled_cancels_the_other_send():
    log: list = []
    task = asyncio.ensure_future(_both(_ends_after(5, log, "first"), _ends_after(5, log, "second")))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(log) == ["first cancelled", "second cancelled"]


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
