"""How start-up names a broker that takes the connection and never answers (stopped, hung, or a
listener that speaks another protocol): the wait, not a bare `TimeoutError`."""

import asyncio

import pytest

from worker import preflight
from worker.settings import load


async def test_a_broker_that_never_answers_is_named_as_such():
    async def accept_and_wait(reader, writer):
        await reader.read()  # takes the request, answers nothing, until the client hangs up
        writer.close()

    server = await asyncio.start_server(accept_and_wait, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        settings = load(environ={"SLUICE_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}"}).kafka
        with pytest.raises(preflight.StartupError) as err:
            await preflight.check_kafka(settings, timeout_s=1)
    finally:
        server.close()
    message = str(err.value)
    assert f"SLUICE_KAFKA_BOOTSTRAP=127.0.0.1:{port}" in message
    assert "(no answer within 1 s)" in message and "is the broker up there" in message, message
