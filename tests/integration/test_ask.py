"""`sluice ask`: one request through running workers on the real broker, engine and model, its
reply read from the one partition its id hashes to."""

import asyncio
import os
import sys

import pytest

from loadgen.ask import DONE, ask, reply_partition
from schemas import DoneReply
from tests.integration.helpers import prefixed_topics_file, running_worker

pytestmark = pytest.mark.integration


async def sluice_ask(settings, topics_file, *argv, timeout_s=120) -> tuple[int, str, str]:
    """The command in its own process (awaited: the worker under test runs on this event loop)."""
    env = {**os.environ, "SLUICE_TOPICS_FILE": str(topics_file), "SLUICE_KAFKA_IDEMPOTENCE": "false",
           "SLUICE_KAFKA_BOOTSTRAP": settings.kafka.bootstrap}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "worker.cli", "ask", *argv, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    return proc.returncode, out.decode(), err.decode()


async def test_ask_shows_the_reply_and_says_how_it_ended(settings, catalog, engine, group_id, tmp_path):
    topics_file = prefixed_topics_file(catalog, tmp_path / "topics.toml")
    # no broker where the settings say: one line naming it, no traceback
    rc, _, err = await sluice_ask(settings.override(kafka_bootstrap="127.0.0.1:1"), topics_file, "hi")
    assert rc == 3 and "127.0.0.1:1" in err and "Traceback" not in err, err
    # no worker yet: the request waits unread, and the command says where it waits
    rc, _, err = await sluice_ask(settings, topics_file, "Name a color.", "--timeout-s", "2")
    assert rc == 2 and catalog.request_topic("realtime").name in err, err

    async with running_worker(settings, catalog, engine, group_id=group_id):
        partitions = set()
        for i in range(4):  # ids hashing to several of the reply topic's partitions, each read from its own
            rid = f"ask-{group_id}-{i}"
            partitions.add(reply_partition(rid, set(range(catalog.replies.partitions))))
            answer = await ask(settings.kafka.options(), catalog.request_topic("standard").name, catalog.replies.name,
                               {"id": rid, "prompt": "Count to three.", "max_tokens": 12}, timeout_s=120)
            assert answer.status == DONE and isinstance(answer.final, DoneReply)
            assert "".join(answer.tokens[s] for s in sorted(answer.tokens)) == answer.final.text
            assert answer.first_token_s is not None and answer.first_token_s <= answer.final_s
        assert len(partitions) > 1

        rc, out, err = await sluice_ask(settings, topics_file, "Name a color.", "--max-tokens", "8")
        assert rc == 0 and "done in" in err and out.strip(), err
        rc, out, err = await sluice_ask(settings, topics_file, "x", "--max-tokens", "100000")
        assert rc == 1 and "error invalid_request" in err, err
