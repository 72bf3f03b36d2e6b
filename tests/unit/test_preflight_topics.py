"""How start-up checks the worker's own topics: one metadata request naming them, with auto-creation
off, and each kind of broker answer named (the missing ones with the command that creates them)."""

import re

import pytest
from aiokafka.protocol.metadata import MetadataRequest_v5, MetadataResponse_v5

from worker import preflight
from worker.settings import load


def broker_saying(monkeypatch, codes: dict[str, int]) -> list:
    """An admin client whose metadata answer gives each topic its error code; returns the requests."""
    asked = []

    class Admin:
        def __init__(self, **_):
            pass

        async def start(self):
            pass

        async def close(self):
            pass

        async def _send_request(self, request):
            asked.append(request.build(MetadataRequest_v5))
            return MetadataResponse_v5(0, [], "c", 1, [(codes.get(t, 0), t, False, []) for t in asked[-1].topics])

    monkeypatch.setattr("aiokafka.admin.AIOKafkaAdminClient", Admin)
    return asked


@pytest.mark.parametrize("codes,message", [
    ({}, None),
    ({"s.replies": 3, "s.dlq": 3, "s.audit": 29}, "topics missing on the broker: s.replies, s.dlq; create them with "
                                                  "`sluice topics apply`"),
    ({"s.audit": 29}, "topics the workers cannot use: s.audit is not authorized for the workers' credentials"),
    ({"s.dlq": 5}, None),  # a leader being elected passes; the worker's clients retry it
])
async def test_each_answer_is_named(monkeypatch, codes, message):
    asked = broker_saying(monkeypatch, codes)
    topics = ["s.requests.realtime", "s.replies", "s.dlq", "s.audit"]
    if message is None:
        await preflight.check_kafka(load(environ={}).kafka, topics)
    else:
        with pytest.raises(preflight.StartupError, match=re.escape(message)):
            await preflight.check_kafka(load(environ={}).kafka, topics)
    [request] = asked
    assert request.topics == topics and request.allow_auto_topic_creation is False
