"""Dead-letter records: the original bytes as the value, headers naming the error and the source.

A copy must always fit the broker's largest record, or the DLQ write itself would fail
and take the worker with it: `fit` drops the original headers and cuts the value when
needed, and says so in `x-sluice-truncated`.
"""

from __future__ import annotations

from schemas.wire import ErrorCode

ERROR_CODE = "x-sluice-error-code"
ERROR_MESSAGE = "x-sluice-error-message"
SOURCE_TOPIC = "x-sluice-source-topic"
SOURCE_PARTITION = "x-sluice-source-partition"
SOURCE_OFFSET = "x-sluice-source-offset"
TRUNCATED = "x-sluice-truncated"
_NAMES = {ERROR_CODE, ERROR_MESSAGE, SOURCE_TOPIC, SOURCE_PARTITION, SOURCE_OFFSET, TRUNCATED}
# For consumers of the DLQ in other languages (sluice schemas export, the AsyncAPI document).
HEADERS_SCHEMA = {
    "type": "object",
    "description": "Headers of a dead letter: why the record could not be answered and where it came from. "
                   "The value is the original record's bytes (cut, with x-sluice-truncated, only when it would "
                   "not fit the broker's largest record).",
    "properties": {
        ERROR_CODE: {"type": "string", "enum": [c.value for c in ErrorCode], "description": "The contract's error code"},
        ERROR_MESSAGE: {"type": "string", "maxLength": 1000, "description": "What is wrong, for a person"},
        SOURCE_TOPIC: {"type": "string"},
        SOURCE_PARTITION: {"type": "string", "pattern": "^[0-9]+$"},
        SOURCE_OFFSET: {"type": "string", "pattern": "^[0-9]+$"},
        TRUNCATED: {"type": "string", "description": "Original key and value sizes, when cut"},
    },
    "required": [ERROR_CODE, ERROR_MESSAGE, SOURCE_TOPIC, SOURCE_PARTITION, SOURCE_OFFSET],
}

_RECORD_OVERHEAD = 512  # record and batch framing, generously


def headers(code: str, message: str, topic: str, partition: int, offset: int) -> list[tuple[str, bytes]]:
    return [
        (ERROR_CODE, code.encode()),
        (ERROR_MESSAGE, message[:1000].encode()),
        (SOURCE_TOPIC, topic.encode()),
        (SOURCE_PARTITION, str(partition).encode()),
        (SOURCE_OFFSET, str(offset).encode()),
    ]


def _size(key, value, hdrs) -> int:
    return (len(key or b"") + len(value or b"") + _RECORD_OVERHEAD
            + sum(len(k.encode() if isinstance(k, str) else k) + len(v or b"") + 8 for k, v in hdrs))


def fit(key: bytes | None, value: bytes | None, original_headers, dlq_headers: list, max_bytes: int):
    """(key, value, headers) of a dead letter no larger than `max_bytes`.

    Original headers travel along when they fit (with keys that are not text made safe), except
    any under the dead letter's own header names;
    otherwise they are dropped, then the key and value are cut, and `x-sluice-truncated`
    gives the original sizes so an operator knows to read the source record itself.
    """
    if key is None and value is None:
        value = b""  # a record needs a key or a value (a keyless tombstone, or one that could not be read)
    kept = [(k if isinstance(k, str) else bytes(k).decode("latin-1"), v) for k, v in original_headers or ()]
    # a producer's own headers under the dead letter's names would stand beside the real ones, and a
    # reader taking the first of a name would believe them (the source record still has them)
    kept = [(k, v) for k, v in kept if k not in _NAMES]
    hdrs = kept + dlq_headers
    if _size(key, value, hdrs) <= max_bytes:
        return key, value, hdrs
    note = (f"value={len(value or b'')},key={len(key or b'')},"
            f"headers={len(kept)}:{sum(len(v or b'') for _, v in kept)}").encode()
    hdrs = dlq_headers + [(TRUNCATED, note)]
    room = max(0, max_bytes - _size(None, None, hdrs))
    key = None if key is None else key[: min(len(key), 1024, room)]
    room -= len(key or b"")
    value = None if value is None else value[: max(0, room)]
    return key, value, hdrs


def own_headers(headers_in) -> list[tuple[str, bytes]]:
    """The headers a dead letter's record carried itself: its headers without the dead letter's."""
    return [(k, v) for k, v in (headers_in or ()) if k not in _NAMES]


def parse(headers_in) -> dict[str, str]:
    """Header list (as aiokafka returns it) to a dict of the DLQ fields. Bytes that are not UTF-8 (a record
    some other writer put on the topic) are shown replaced, never raised: a reader of the topic goes on."""
    return {k: v.decode("utf-8", "replace") for k, v in (headers_in or ()) if k in _NAMES and v is not None}
