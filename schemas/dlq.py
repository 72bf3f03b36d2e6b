"""Dead-letter record headers: the original bytes travel unchanged as the value."""

from __future__ import annotations

ERROR_CODE = "x-sluice-error-code"
ERROR_MESSAGE = "x-sluice-error-message"
SOURCE_TOPIC = "x-sluice-source-topic"
SOURCE_PARTITION = "x-sluice-source-partition"
SOURCE_OFFSET = "x-sluice-source-offset"


def headers(code: str, message: str, topic: str, partition: int, offset: int) -> list[tuple[str, bytes]]:
    return [
        (ERROR_CODE, code.encode()),
        (ERROR_MESSAGE, message[:1000].encode()),
        (SOURCE_TOPIC, topic.encode()),
        (SOURCE_PARTITION, str(partition).encode()),
        (SOURCE_OFFSET, str(offset).encode()),
    ]


def parse(headers_in) -> dict[str, str]:
    """Header list (as aiokafka returns it) to a dict of the DLQ fields."""
    names = {ERROR_CODE, ERROR_MESSAGE, SOURCE_TOPIC, SOURCE_PARTITION, SOURCE_OFFSET}
    return {k: v.decode() for k, v in (headers_in or ()) if k in names}
