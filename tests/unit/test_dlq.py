"""Dead-letter copies (schemas/dlq.py)."""

from schemas import dlq


def test_a_records_own_headers_under_the_dead_letters_names_are_not_copied():
    """A producer may put `x-sluice-source-offset: 0` (or any dead-letter header) on its record. The
    copy carries each dead-letter header once, the worker's, so a reader that takes the first header
    of a name reads where the record really came from; the record's other headers travel along."""
    spoofed = [(dlq.SOURCE_OFFSET, b"0"), (dlq.SOURCE_TOPIC, b"elsewhere"), (dlq.ERROR_CODE, b"none"),
               (dlq.TRUNCATED, b"value=1"), ("trace-id", b"abc")]
    ours = dlq.headers("invalid_request", "not JSON", "sluice.requests.batch", 3, 17)
    key, value, headers = dlq.fit(None, b"{", spoofed, ours, 1_000_000)
    names = [k for k, _ in headers]
    assert value == b"{" and ("trace-id", b"abc") in headers
    assert all(names.count(n) == 1 for n in names) and dlq.TRUNCATED not in names
    first = {}
    for k, v in headers:
        first.setdefault(k, v)
    assert first[dlq.SOURCE_OFFSET] == b"17" and first[dlq.SOURCE_TOPIC] == b"sluice.requests.batch"
    assert dlq.parse(headers)[dlq.ERROR_CODE] == "invalid_request"


def test_dead_letter_headers_that_are_not_utf8_are_read_replaced_not_raised():
    """`sluice dlq show` and a backfill's dead-letter watch read every record of the topic."""
    fields = dlq.parse([(dlq.ERROR_CODE, b"\xff\xfeoops"), (dlq.SOURCE_PARTITION, b"3"), ("x-own", b"\xff")])
    assert fields == {dlq.ERROR_CODE: "\ufffd\ufffdoops", dlq.SOURCE_PARTITION: "3"}
