"""Decoding and limits: every bad input gets a clear code, and the id when it is readable."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import BadRequest, DoneReply, ErrorCode, ErrorReply, Limits, ReplyCodec, RequestCodec, TokenReply, Usage
from schemas.codec import msgpack_not_utf8_at

codec = RequestCodec(Limits(max_record_bytes=4096, max_tokens=256, max_stop=2, max_messages=3))
J = msgspec.json.encode
MSGPACK = [("content-type", b"application/msgpack")]

CASES = [
    # (name, value, headers, key, code, id readable)
    ("not json", b"{nope", [], None, ErrorCode.INVALID_REQUEST, None),
    ("not json, key has id", b"\xff\xfe", [], b"k-1", ErrorCode.INVALID_REQUEST, "k-1"),
    ("json array", b"[1,2]", [], None, ErrorCode.INVALID_REQUEST, None),
    ("missing id", J({"prompt": "hi"}), [], None, ErrorCode.INVALID_REQUEST, None),
    ("empty id", J({"id": "", "prompt": "hi"}), [], None, ErrorCode.INVALID_REQUEST, None),
    ("id too long", J({"id": "x" * 129, "prompt": "hi"}), [], None, ErrorCode.INVALID_REQUEST, None),
    ("wrong type", J({"id": "a", "prompt": "hi", "max_tokens": "ten"}), [], None, ErrorCode.INVALID_REQUEST, "a"),
    ("unknown kind", J({"id": "a", "kind": "translate", "prompt": "hi"}), [], None, ErrorCode.INVALID_REQUEST, "a"),
    ("no prompt", J({"id": "a"}), [], None, ErrorCode.INVALID_REQUEST, "a"),
    ("prompt and messages", J({"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}), [], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("bad role", J({"id": "a", "messages": [{"role": "robot", "content": "y"}]}), [], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("too many messages", J({"id": "a", "messages": [{"role": "user", "content": "y"}] * 4}), [], None,
     ErrorCode.PAYLOAD_TOO_LARGE, "a"),
    ("max_tokens over limit", J({"id": "a", "prompt": "x", "max_tokens": 257}), [], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("max_tokens zero", J({"id": "a", "prompt": "x", "max_tokens": 0}), [], None, ErrorCode.INVALID_REQUEST, "a"),
    ("temperature out of range", J({"id": "a", "prompt": "x", "temperature": 9}), [], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("too many stops", J({"id": "a", "prompt": "x", "stop": ["a", "b", "c"]}), [], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("record too large", J({"id": "big", "prompt": "x" * 5000}), [], None, ErrorCode.PAYLOAD_TOO_LARGE, "big"),
    ("bad reply_to", J({"id": "a", "prompt": "x", "reply_to": "no spaces allowed"}), [], None,
     ErrorCode.INVALID_REQUEST, None),
    ("unknown content-type", J({"id": "a", "prompt": "x"}), [("content-type", b"text/csv")], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("bad msgpack", b"\xc1\xc1", MSGPACK, None, ErrorCode.INVALID_REQUEST, None),
    ("no value", None, [], b"tomb", ErrorCode.INVALID_REQUEST, "tomb"),
    ("score without template", J({"id": "a", "kind": "score", "event": {}}), [], None, ErrorCode.INVALID_REQUEST, "a"),
    ("score without event", J({"id": "a", "kind": "score", "template": "fraud"}), [], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("generate with labels", J({"id": "a", "prompt": "x", "labels": ["a", "b"]}), [], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("score without kind", J({"id": "a", "template": "fraud", "event": {}}), [], None, ErrorCode.INVALID_REQUEST, "a"),
    ("score with prompt", J({"id": "a", "kind": "score", "template": "fraud", "event": {}, "prompt": "x"}), [], None,
     ErrorCode.INVALID_REQUEST, "a"),
    ("score with one label", J({"id": "a", "kind": "score", "template": "fraud", "event": {}, "labels": ["x"]}), [],
     None, ErrorCode.INVALID_REQUEST, "a"),
    ("score with repeated labels", J({"id": "a", "kind": "score", "template": "fraud", "event": {},
                                      "labels": ["x", "x"]}), [], None, ErrorCode.INVALID_REQUEST, "a"),
    ("score max_tokens negative", J({"id": "a", "kind": "score", "template": "fraud", "event": {},
                                     "max_tokens": -1}), [], None, ErrorCode.INVALID_REQUEST, "a"),
]


def test_score_request_may_ask_for_no_text():
    r = codec.decode(J({"id": "a", "kind": "score", "template": "fraud", "event": {"x": 1}, "max_tokens": 0}))
    assert r.kind == "score" and r.max_tokens == 0


@pytest.mark.parametrize("name,value,headers,key,code,rid", CASES, ids=[c[0] for c in CASES])
def test_bad_records(name, value, headers, key, code, rid):
    with pytest.raises(BadRequest) as info:
        codec.decode(value, headers, key)
    assert info.value.code == code
    assert info.value.id == rid
    assert info.value.message


def test_error_names_the_field():
    with pytest.raises(BadRequest) as info:
        codec.decode(J({"id": "a", "prompt": "hi", "max_tokens": "ten"}))
    assert "max_tokens" in info.value.message


def test_valid_json_and_msgpack_agree():
    body = {"id": "r1", "messages": [{"role": "user", "content": "hi"}], "stop": ["\n"], "future_field": 1}
    a = codec.decode(J(body))
    b = codec.decode(msgspec.msgpack.encode(body), MSGPACK)
    assert a == b
    assert a.tenant == "default" and a.kind == "generate" and a.stream is True


def test_a_json_request_led_by_a_byte_order_mark_is_read_and_a_bad_one_keeps_its_id():
    bom = b"\xef\xbb\xbf"
    assert codec.decode(bom + J({"id": "b1", "prompt": "hi"})).id == "b1"
    with pytest.raises(BadRequest) as info:
        codec.decode(bom + J({"id": "b2", "prompt": "hi", "max_tokens": "ten"}))
    assert info.value.id == "b2" and "max_tokens" in info.value.message
    with pytest.raises(BadRequest):  # only at the start, and only once
        codec.decode(bom + bom + J({"id": "b3", "prompt": "hi"}))
    with pytest.raises(BadRequest):  # msgpack has no byte-order mark
        codec.decode(bom + msgspec.msgpack.encode({"id": "b4", "prompt": "hi"}), MSGPACK)


NOT_TEXT = [
    # (name, value, id the error is addressed to, what the message says): JSON that is well formed but
    # not Unicode text still names whom to answer, unless the id itself is what is broken (the id of a
    # record nested too deep is read as before: its envelope skips what it does not need)
    ("Latin-1 byte in the prompt", b'{"id":"l1","prompt":"caf\xe9"}', "l1", "byte 24 is not UTF-8 (0xe9)"),
    ("lone high surrogate (an emoji cut in two)", b'{"id":"s1","prompt":"ok \\ud83d"}', "s1",
     "lone UTF-16 surrogate escape (\\ud83d) at byte 24"),
    ("lone low surrogate", b'{"id":"s2","prompt":"\\ude00 x"}', "s2", "(\\ude00) at byte 21"),
    ("lone surrogate in a nested list, reply_to kept", b'{"id":"s3","reply_to":"mine","event":{"a":["\\udc00"]}}',
     "s3", "(\\udc00)"),
    ("an escaped backslash, then a lone surrogate", b'{"id":"s4","prompt":"\\\\\\udc00"}', "s4",
     "(\\udc00) at byte 23"),
    ("a pair, then a lone high half", b'{"id":"s5","prompt":"\\ud83d\\ude00\\ud83d"}', "s5",
     "(\\ud83d) at byte 33"),
    ("Latin-1 byte in the id", b'{"id":"l\xe9","prompt":"x"}', None, "byte 8 is not UTF-8"),
    ("lone surrogate in the id", b'{"id":"s\\ud800","prompt":"x"}', None, "(\\ud800) at byte 8"),
    ("not UTF-8 and not JSON either", b'{"id":"l2","prompt":"caf\xe9"', None, "byte 24 is not UTF-8"),
    ("not UTF-8 and nested too deep", b'{"id":"l3","p":"\xe9","z":' + b"[" * 100 + b"]" * 100 + b"}", "l3",
     "nests deeper"),
]


@pytest.mark.parametrize("name,value,rid,says", NOT_TEXT, ids=[c[0] for c in NOT_TEXT])
def test_json_that_is_not_unicode_text_is_answered_where_its_id_is_readable(name, value, rid, says):
    with pytest.raises(BadRequest) as info:
        codec.decode(value)
    assert info.value.code == ErrorCode.INVALID_REQUEST
    assert info.value.id == rid and says in info.value.message, info.value.message
    if rid == "s3":
        assert info.value.reply_to == "mine"


def _latin1(doc, text: bytes) -> bytes:
    """`doc` as msgpack with the last byte of `text` (a string in it) made a Latin-1 0xe9: same length,
    so the structure stays whole and only the string stops being UTF-8."""
    value = msgspec.msgpack.encode(doc)
    assert value.count(text) == 1
    return value.replace(text, text[:-1] + b"\xe9")


MSGPACK_NOT_TEXT = [
    # (name, value, id the error is addressed to): the byte is named as for JSON
    ("in the prompt", _latin1({"id": "m1", "prompt": "cafe"}, b"cafe"), "m1"),
    ("in a message, past a list and a map", _latin1({"id": "m2", "messages": [{"role": "user", "content": "a cafe"}]},
                                                    b"a cafe"), "m2"),
    ("in an event's key (str 8)", _latin1({"id": "m3", "template": "fraud", "event": {"k" * 40: 1}}, b"k" * 40), "m3"),
    # bytes (bin) are not text: their 0xe9 is passed over, the string's after them is named
    ("after every other kind of item", _latin1({"id": "m4", "template": "fraud", "event": {"i": [
        1, -1, 300, -300, 70000, 2 ** 40, -2 ** 40, 1.5, None, True, b"raw\xe9", msgspec.msgpack.Ext(5, b"\xe9" * 20),
        "x" * 300, "x" * 70000, "zq"]}}, b"zq"), "m4"),
    ("in the id", _latin1({"id": "mcafe", "prompt": "x"}, b"mcafe"), None),
]


@pytest.mark.parametrize("name,value,rid", MSGPACK_NOT_TEXT, ids=[c[0] for c in MSGPACK_NOT_TEXT])
def test_msgpack_that_is_not_utf8_names_its_byte(name, value, rid):
    with pytest.raises(BadRequest) as info:
        RequestCodec(Limits()).decode(value, MSGPACK)  # the default record limit: one string is 70,000 bytes
    at = value.rindex(b"\xe9")  # the string's byte is the last 0xe9 in every case
    assert info.value.code == ErrorCode.INVALID_REQUEST and info.value.id == rid
    assert f"not Unicode text: byte {at} is not UTF-8 (0xe9)" in info.value.message, info.value.message


_msgpack_items = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1) | st.floats(allow_nan=False) | st.text(max_size=300)
    | st.binary(max_size=300) | st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=300)),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=40), inner, max_size=20),
    max_leaves=60)


@settings(max_examples=400, deadline=None)
@given(_msgpack_items)
def test_msgpack_walk_finds_nothing_in_utf8_documents(doc):
    assert msgpack_not_utf8_at(msgspec.msgpack.encode(doc)) is None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000))
def test_msgpack_walk_takes_any_bytes(value):
    """It runs on whatever failed to decode: never raises, and names only a byte that is there."""
    found = msgpack_not_utf8_at(value)
    if found is not None:
        at = int(found.split()[1])
        assert f"(0x{value[at]:02x})" in found


def test_a_surrogate_pair_and_an_escaped_backslash_are_text():
    assert codec.decode(b'{"id":"p","prompt":"x\\ud83d\\ude00"}').prompt == "x\U0001F600"
    assert codec.decode(b'{"id":"b","prompt":"\\\\ud800"}').prompt == "\\ud800"  # a backslash, then text


def test_reply_to_is_kept():
    r = codec.decode(J({"id": "x", "prompt": "p", "reply_to": "team.replies"}))
    assert r.reply_to == "team.replies"


def test_reply_union_round_trip():
    rc = ReplyCodec()
    replies = [
        TokenReply("a", 0, "he", [1, 2]),
        DoneReply("a", 1, "he", "stop", Usage(3, 2)),
        ErrorReply("b", ErrorCode.OVERLOADED, "later"),
    ]
    for r in replies:
        data = rc.encode(r)
        assert rc.decode(data) == r
        assert msgspec.json.decode(data)["type"] in ("token", "done", "error")
    assert b"scores" not in rc.encode(replies[1])  # optional fields stay off the wire


def test_json_schema_export(tmp_path):
    from worker.cli import main

    assert main(["schemas", "export", str(tmp_path)]) == 0
    schema = msgspec.json.decode((tmp_path / "request.schema.json").read_bytes())
    assert "Request" in schema["$defs"]
    assert "id" in schema["$defs"]["Request"]["required"]
