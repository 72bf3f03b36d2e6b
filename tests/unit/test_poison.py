"""Poison records through the whole worker (in-memory broker, fake engine): each one ends as an
`error` reply or a dead letter, the valid requests around it are answered, the partition's
watermark passes it, and the worker stays healthy."""

import time

import pytest

from schemas import DoneReply, ErrorReply, dlq
from tests.unit.harness import CATALOG, J, M, MSGPACK, Memory, request_id_of, running, until
from worker.fake_engine import FakeEngine

DEEP = b"[" * 5000 + b"]" * 5000
LIMIT = 64 * 1024  # the harness's max_record_bytes

# (name, key, value, headers, expected): expected is ("reply", code), ("dlq", code) or ("done", None)
POISON = [
    ("bad json, id from key", b"p01", b"{not json", [], ("reply", "invalid_request")),
    ("garbage, nothing readable", None, b"\x00\xff garbage", [], ("dlq", "invalid_request")),
    ("no id", None, J({"prompt": "no id"}), [], ("dlq", "invalid_request")),
    ("wrong type", None, J({"id": "p04", "prompt": 5}), [], ("reply", "invalid_request")),
    ("unknown kind", None, J({"id": "p05", "kind": "translate", "prompt": "x"}), [], ("reply", "invalid_request")),
    ("no prompt", None, J({"id": "p06"}), [], ("reply", "invalid_request")),
    ("max_tokens too big", None, J({"id": "p07", "prompt": "x", "max_tokens": 10**6}), [], ("reply", "invalid_request")),
    ("too many stops", None, J({"id": "p08", "prompt": "x", "stop": ["a"] * 50}), [], ("reply", "invalid_request")),
    ("oversized", None, J({"id": "p09", "prompt": "x" * (LIMIT + 10)}), [], ("reply", "payload_too_large")),
    ("bad reply_to", None, J({"id": "p10", "prompt": "x", "reply_to": "bad topic!"}), [], ("dlq", "invalid_request")),
    ("unknown content-type", None, J({"id": "p11", "prompt": "x"}), [("content-type", b"text/xml")],
     ("reply", "invalid_request")),
    ("invalid msgpack", None, b"\xc1", MSGPACK, ("dlq", "invalid_request")),
    ("expired deadline", None, J({"id": "p13", "prompt": "x", "deadline_ms": 1}), [], ("reply", "deadline_exceeded")),
    ("tombstone", b"p14", None, [], ("reply", "invalid_request")),
    ("nested 5000 deep, id from key", b"p15", b'{"id":"p15","prompt":"x","z":' + DEEP + b"}", [],
     ("reply", "invalid_request")),
    ("nested 5000 deep, no key", None, b'{"id":"p16","prompt":"x","z":' + DEEP + b"}", [], ("dlq", "invalid_request")),
    ("bare array 5000 deep", None, DEEP, [], ("dlq", "invalid_request")),
    ("msgpack nested 5000 deep", b"p18", b"\x91" * 5000 + b"\x01", MSGPACK, ("reply", "invalid_request")),
    ("header with null value", None, J({"id": "p19", "prompt": "x", "max_tokens": 2}), [("x-trace", None)],
     ("done", None)),
    ("content-type header with null value", None, J({"id": "p20", "prompt": "x", "max_tokens": 2}),
     [("content-type", None)], ("done", None)),
    ("1 MB content-type header", None, J({"id": "p21", "prompt": "x"}), [("content-type", b"x" * 100_000)],
     ("reply", "invalid_request")),
    ("near-limit record, big headers, no id", None, b"\x00" * (LIMIT - 10), [("h", b"y" * 60_000)],
     ("dlq", "invalid_request")),
    ("empty prompt", None, J({"id": "p23", "prompt": ""}), [], ("reply", "invalid_request")),
    ("NaN temperature", None, M({"id": "p24", "prompt": "x", "temperature": float("nan")}), MSGPACK,
     ("reply", "invalid_request")),
    ("non-UTF-8 key, bad JSON", b"\xff\xfe", b"{", [], ("dlq", "invalid_request")),
    ("id of 200 chars", None, J({"id": "i" * 200, "prompt": "x"}), [], ("dlq", "invalid_request")),
    ("empty value", b"p27", b"", [], ("reply", "invalid_request")),
    ("tombstone without a key", None, None, [], ("dlq", "invalid_request")),
    ("score, unknown template", None, J({"id": "p28", "kind": "score", "template": "nope", "event": {}}), [],
     ("reply", "invalid_request")),
    ("engine raises for this prompt", None, J({"id": "p29", "prompt": "BOOM"}), [], ("reply", "internal")),
    ("error message from a huge path", None, J({"id": "p30", "prompt": "x", "event": {"k" * 30_000: [[[1]]]},
                                                "max_tokens": "x"}), [], ("reply", "invalid_request")),
    # a string cut inside an emoji, as JavaScript's JSON.stringify writes it: well-formed JSON, not text
    ("lone surrogate escape, no key", None, b'{"id":"p31","prompt":"cut \\ud83d"}', [], ("reply", "invalid_request")),
    ("Latin-1 byte, no key", None, b'{"id":"p32","prompt":"caf\xe9"}', [], ("reply", "invalid_request")),
    ("objects nested 40 deep (the limit is 32)", None,
     b'{"id":"p33","prompt":"x","max_tokens":2,"z":' + b'{"a":' * 40 + b"1" + b"}" * 40 + b"}", [],
     ("reply", "invalid_request")),
]


class BoomEngine(FakeEngine):
    def prompt_ids(self, request):
        if request.prompt == "BOOM":
            raise RuntimeError("the tokenizer broke on this one")
        return super().prompt_ids(request)


@pytest.mark.parametrize("cls", ["realtime", "standard", "batch"])
async def test_every_poison_kind_is_answered_and_never_blocks(cls):
    mem = Memory(engine=BoomEngine())
    for i, (_, key, value, headers, _) in enumerate(POISON):
        mem.send(cls, value, key, headers)
        mem.send(cls, J({"id": f"good-{i}", "prompt": f"count {i}", "max_tokens": 3}), f"good-{i}".encode())
    async with running(mem) as w:
        assert await until(mem.all_committed), mem.broker.committed
        assert w.ready and w.supervisor.failure is None
    finals = mem.finals()
    for i in range(len(POISON)):
        assert [type(f) for f in finals[f"good-{i}"]] == [DoneReply], finals[f"good-{i}"]
    for name, key, value, _, (route, code) in POISON:
        if route == "dlq":
            continue
        got = finals.get(request_id_of(key, value))
        assert got is not None and len(got) == 1, name
        if route == "done":
            assert isinstance(got[0], DoneReply), (name, got)
        else:
            assert isinstance(got[0], ErrorReply) and got[0].code.value == code, (name, got)
            assert 0 < len(got[0].message) <= 512, name
    dead = mem.dead_letters()
    assert sorted(dlq.parse(r.headers)[dlq.ERROR_CODE] for r in dead) == \
        sorted(code for *_, (route, code) in POISON if route == "dlq")
    for r in dead:  # every copy fits the broker; a cut copy says so
        size = len(r.value or b"") + len(r.key or b"") + sum(len(k) + len(v or b"") for k, v in r.headers)
        assert size <= mem.settings.worker.max_produce_bytes
        if len(r.value or b"") < LIMIT - 10 and (r.value or b"").startswith(b"\x00" * 100):
            assert dlq.TRUNCATED in dict(r.headers)


async def test_a_record_the_client_cannot_parse_is_dead_lettered_with_its_coordinates():
    mem = Memory(partitions=1)
    topic = CATALOG.request_topic("realtime").name
    for i in range(5):
        mem.send("realtime", J({"id": f"r{i}", "prompt": "x", "max_tokens": 2}), f"r{i}".encode())
    mem.consumer.unreadable.add((next(tp for tp in mem.broker.logs if tp.topic == topic), 2))
    async with running(mem) as w:
        assert await until(mem.all_committed)
        assert w.ready
    assert sorted(mem.finals()) == ["r0", "r1", "r3", "r4"]
    assert mem.dead_letter_sources() == {(topic, 0, 2)}
    (letter,) = mem.dead_letters()
    assert "could not parse" in dlq.parse(letter.headers)[dlq.ERROR_MESSAGE]


async def test_an_unexpected_error_reading_one_record_is_answered_internal():
    mem = Memory(partitions=1)
    mem.send("standard", J({"id": "x1", "prompt": "explode"}), b"x1")
    mem.send("standard", J({"id": "x2", "prompt": "fine", "max_tokens": 2}), b"x2")
    async with running(mem) as w:
        real = w.intake.codec.decode

        def decode(value, headers=(), key=None):
            if b"explode" in (value or b""):
                raise KeyError("a bug in decoding")
            return real(value, headers, key)

        w.intake.codec.decode = decode
        assert await until(mem.all_committed)
        assert w.ready
    finals = mem.finals()
    assert finals["x1"][0].code.value == "internal" and "KeyError" in finals["x1"][0].message
    assert isinstance(finals["x2"][0], DoneReply)


async def test_a_stored_answer_that_does_not_decode_runs_the_request_again():
    mem = Memory(partitions=1)
    mem.answers.answers["default:s1"] = b"\x00 not a reply"
    mem.send("standard", J({"id": "s1", "prompt": "x", "max_tokens": 2}), b"s1")
    async with running(mem):
        assert await until(mem.all_committed)
    assert isinstance(mem.finals()["s1"][0], DoneReply)


async def test_a_reply_the_broker_refuses_becomes_an_internal_error_not_a_dead_worker():
    mem = Memory(partitions=1)
    mem.broker.max_record_bytes = 4096
    mem.send("standard", J({"id": "big", "prompt": "x", "max_tokens": 900, "stream": False}), b"big")
    mem.send("standard", J({"id": "small", "prompt": "x", "max_tokens": 2}), b"small")
    async with running(mem) as w:
        assert await until(mem.all_committed)
        assert w.ready
    finals = mem.finals()
    assert finals["big"][0].code.value == "internal" and "could not be produced" in finals["big"][0].message
    assert isinstance(finals["small"][0], DoneReply)


async def test_intake_isolation_is_cheap_for_hostile_depth():
    mem = Memory()
    codec = mem.worker().intake.codec
    start = time.perf_counter()
    for _ in range(20):
        with pytest.raises(Exception):
            codec.decode(b"[" * (LIMIT - 1))
    assert time.perf_counter() - start < 5  # a bound that only catches a quadratic scan, not a timing test


async def test_an_unparseable_record_loses_nothing_read_in_the_same_fetch():
    """The failed fetch drops what it read before the bad record on every partition (as aiokafka's
    does); intake rewinds to the first offset not taken, so each record still ends exactly once."""
    mem = Memory(partitions=3)
    topic = CATALOG.request_topic("batch").name
    for i in range(30):
        mem.send("batch", J({"id": f"b{i}", "prompt": "x", "max_tokens": 1}), f"b{i}".encode())
    tps = sorted(tp for tp in mem.broker.logs if tp.topic == topic)
    for tp in tps:
        mem.consumer.unreadable.add((tp, len(mem.broker.logs[tp]) - 1))  # the last record of each partition
    async with running(mem) as w:
        assert await until(mem.all_committed)
        assert w.ready
    finals = mem.finals()
    assert sorted(finals) == sorted(r.key.decode() for tp in tps for r in mem.broker.logs[tp][:-1])
    assert all(len(v) == 1 for v in finals.values())
    assert mem.dead_letter_sources() == {(topic, tp.partition, len(mem.broker.logs[tp]) - 1) for tp in tps}


async def test_a_request_that_fails_in_the_engine_is_logged_with_its_id_class_and_coordinates():
    from structlog.testing import capture_logs

    mem = Memory(partitions=1, engine=BoomEngine())
    mem.send("standard", J({"id": "ok1", "prompt": "fine", "max_tokens": 2}), b"ok1")
    mem.send("standard", J({"id": "boom1", "prompt": "BOOM"}), b"boom1")
    with capture_logs() as lines:
        async with running(mem):
            assert await until(mem.all_committed)
    failed = [line for line in lines if line["event"] == "request_failed"]
    assert len(failed) == 1, failed
    assert failed[0]["request_id"] == "boom1" and failed[0]["cls"] == "standard"
    assert (failed[0]["partition"], failed[0]["offset"]) == (0, 1)
    assert failed[0]["log_level"] == "error" and failed[0].get("exc_info")


class StrictChatEngine(FakeEngine):
    """Its chat template refuses two user turns in a row, as many models' templates do."""

    def prompt_ids(self, request):
        from worker.prompt_tokens import ChatRefused

        roles = [m.role for m in request.messages or ()]
        if any(a == b == "user" for a, b in zip(roles, roles[1:])):
            raise ChatRefused("Conversation roles must alternate user/assistant/user/assistant")
        return super().prompt_ids(request)


async def test_messages_the_chat_template_refuses_are_a_bad_request_not_an_internal_error():
    from structlog.testing import capture_logs

    mem = Memory(partitions=1, engine=StrictChatEngine())
    user = {"role": "user", "content": "hi"}
    mem.send("standard", J({"id": "twice", "messages": [user, user], "max_tokens": 2}), b"twice")
    mem.send("standard", J({"id": "once", "messages": [user], "max_tokens": 2}), b"once")
    with capture_logs() as lines:
        async with running(mem):
            assert await until(mem.all_committed)
    (refused,) = mem.finals()["twice"]
    assert isinstance(refused, ErrorReply) and refused.code.value == "invalid_request"
    assert "must alternate" in refused.message
    assert isinstance(mem.finals()["once"][0], DoneReply)
    assert not [line for line in lines if line["event"] == "request_failed"]  # no traceback for a bad request
