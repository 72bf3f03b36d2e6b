import pytest

from schemas import dlq
from worker.dead_letters import DeadLetter

REQUESTS = {"sluice.requests.standard"}


def letter(key=b"k", value=b"{}", source=("sluice.requests.standard", 0, 7), extra=()):
    hdrs = [("x-sluice-signature", b"k1:abc")] + dlq.headers("invalid_request", "why", *source) + list(extra)
    return DeadLetter(0, 3, 1_764_892_800_000, key, value, tuple(hdrs))


@pytest.mark.parametrize("what,dead,why", [
    ("whole", letter(), None),
    ("keyless, with a value", letter(key=None), None),
    ("cut to fit", letter(extra=[(dlq.TRUNCATED, b"value=2000000,key=1,headers=0:0")]), "cut to fit"),
    ("unreadable by the client", letter(key=None, value=b""), "could not read it"),
    ("from a topic not the workers'", letter(source=("sluice.replies", 0, 1)), "not a request topic"),
    ("no source", DeadLetter(0, 1, 0, b"k", b"{}", (("x-sluice-error-code", b"invalid_request"),)), "no source"),
])
def test_only_a_whole_dead_letter_of_a_request_topic_is_published_again(what, dead, why):
    found = dead.why_not_replayable(REQUESTS)
    assert (found is None) if why is None else (why in found), (what, found)


def test_a_replay_carries_the_records_own_headers_and_none_of_the_dead_letters():
    assert dlq.own_headers(letter().headers) == [("x-sluice-signature", b"k1:abc")]


def test_a_line_names_when_where_why_and_the_start_of_the_bytes():
    line = letter(value=b'{"prompt": "x"}').line()
    assert line.startswith("2025-12-05T00:00:00Z  sluice.requests.standard:0:7  invalid_request: why")
    assert "key='k'" in line and "value=b'{\"prompt\": \"x\"}'" in line
