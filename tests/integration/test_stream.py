"""Requests across the three classes stream gapless tokens whose text joins to done.text."""

import pytest

from loadgen.burst import make_requests, run_burst
from schemas import DoneReply
from tests.integration.helpers import running_worker

pytestmark = pytest.mark.integration


async def test_concurrent_requests_across_classes(settings, catalog, engine, group_id):
    requests = make_requests(24, seed=1, prefix="c", max_tokens=16)
    async with running_worker(settings, catalog, engine, group_id=group_id):
        outcomes = await run_burst(settings.kafka.options(), catalog, requests, timeout_s=300)
    assert {o.latency_class for o in outcomes.values()} == {"realtime", "standard", "batch"}
    for rid, o in outcomes.items():
        assert not o.problems, (rid, o.problems)
        assert isinstance(o.final, DoneReply), (rid, o.final)
        assert o.tokens, rid
        assert o.final.usage.completion_tokens == 16 or o.final.finish_reason == "stop"
        assert o.final.usage.prompt_tokens > 5
        assert o.text == o.final.text and o.final.text.strip()


async def test_stream_false_sends_only_done(settings, catalog, engine, group_id):
    reqs = [("standard", {"id": "quiet", "prompt": "Once upon a time", "max_tokens": 8, "stream": False}),
            ("realtime", {"id": "loud", "prompt": "Once upon a time", "max_tokens": 8})]
    async with running_worker(settings, catalog, engine, group_id=group_id):
        out = await run_burst(settings.kafka.options(), catalog, reqs, timeout_s=120)
    quiet, loud = out["quiet"], out["loud"]
    assert quiet.tokens == {} and isinstance(quiet.final, DoneReply) and quiet.final.seq == 0
    assert quiet.final.usage.completion_tokens == 8
    # Greedy decoding: the same prompt gives the same text streamed or not.
    assert loud.text == loud.final.text == quiet.final.text


async def test_chat_messages_use_the_chat_template(settings, catalog, engine, group_id):
    from schemas import Message, Request

    chat = Request(id="m", messages=[Message("user", "Hello")])
    ids = engine.prompt_ids(chat)
    plain = engine.prompt_ids(Request(id="p", prompt="Hello"))
    assert len(ids) > len(plain)  # role markers and the generation prompt were added
    text = engine._tokenizer.decode(ids)
    assert "user" in text and "Hello" in text and "assistant" in text
