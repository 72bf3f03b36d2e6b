"""The pauses bench's latency join: each request's first token and `done`, from the records' timestamps."""

from collections import namedtuple

import msgspec

from bench.pauses import latencies, summary

Rec = namedtuple("Rec", "key value timestamp")


def _reply(rid: str, at: int, **fields) -> Rec:
    return Rec(rid.encode(), msgspec.json.encode({"id": rid, **fields}), at)


def test_latency_is_from_the_request_to_its_first_token_and_its_first_done():
    requests = [Rec(b"a", b"{}", 1000), Rec(b"b", b"{}", 1010), Rec(b"c", b"{}", 1020)]
    replies = [
        _reply("a", 1040, type="token", seq=1),  # a later token is not the first
        _reply("a", 1030, type="token", seq=0),
        _reply("a", 1050, type="done", seq=2),
        _reply("a", 1900, type="done", seq=2),  # a repeat of the done (a redelivery) is not its latency
        _reply("b", 1015, type="done", seq=0),  # not streamed: no token record
        _reply("z", 1005, type="done", seq=0),  # not one of this run's requests
    ]
    lat = latencies(requests, replies)
    assert lat == {"a": (1000, 30, 50), "b": (1010, None, 5), "c": (1020, None, None)}
    s = summary(lat)
    assert s["requests"] == 3 and s["without_done"] == 1
    assert s["e2e_ms"]["50"] in (5, 50) and s["e2e_ms"]["100"] == 50 and s["ttft_ms"]["100"] == 30
