"""Progress left by a worker with another tokenizer, continued by the real engine: from the emitted
text, as this tokenizer writes it, not from ids that mean other tokens here (a rolling upgrade to
another model). Real Redis Cluster, broker, vLLM and model."""

import uuid

import pytest

from loadgen.burst import run_burst
from schemas import DoneReply, Request
from tests.integration.helpers import running_worker
from worker.answers import AnswerStore
from worker.prompt_tokens import tokenizer_fingerprint

pytestmark = pytest.mark.integration
PROMPT = "List the days of the week, in order:"


async def test_progress_of_another_tokenizer_is_continued_from_its_text(settings, catalog, engine, group_id,
                                                                       monkeypatch):
    prefixes = {}  # request id -> the token ids the engine was asked to continue after
    generate = engine.generate

    def recorded(request_id, prompt_ids, params, priority):
        prefixes[request_id.split("@")[0]] = list(prompt_ids)
        return generate(request_id, prompt_ids, params, priority)

    monkeypatch.setattr(engine, "generate", recorded)
    assert engine.tokenizer_id == tokenizer_fingerprint(engine._tokenizer) != "another-model"
    opts = settings.kafka.options()
    store = AnswerStore(settings.redis.url, settings.redis.key_prefix, 60, settings.redis.timeout_ms)
    await store.start()
    try:
        async with running_worker(settings, catalog, engine, group_id=group_id):
            async def ask(rid):
                out = await run_burst(opts, catalog, [("standard", {"id": rid, "prompt": PROMPT, "max_tokens": 24,
                                                                    "stream": True})], timeout_s=180)
                return out[rid]

            whole = await ask(f"whole-{group_id}")
            assert isinstance(whole.final, DoneReply) and len(whole.tokens) >= 6
            emitted = [whole.tokens[seq] for seq in range(3)]  # what an earlier owner sent readers
            foreign = engine.text_ids(" zebra zebra")  # its ids: other tokens in this vocabulary

            async def continued(tokenizer):
                rid = f"{tokenizer[:7]}-{uuid.uuid4().hex[:6]}"
                chunks = [(seq, foreign, text) for seq, text in enumerate(emitted)]
                assert await store.append_chunks(f"default:{rid}", chunks, owner="", tokenizer=tokenizer) is True
                ((_, progress),) = await store.lookup_many([f"default:{rid}"], [True])
                assert progress.tokenizer == tokenizer and [t for _, t in progress.chunks] == emitted
                return await ask(rid), rid

            prompt = engine.prompt_ids(Request(id="p", prompt=PROMPT))
            other, rid = await continued("another-model")
            assert isinstance(other.final, DoneReply) and other.final.resumed
            assert [other.tokens[seq] for seq in range(3)] == emitted  # re-sent unchanged
            assert other.final.text.startswith("".join(emitted))
            # the engine went on from prompt + the emitted text as this tokenizer writes it
            assert prefixes[rid] == prompt + engine.text_ids("".join(emitted))
            # max_tokens counts what each owner generated (the stored chunks' ids), not the re-read text
            assert other.final.usage.completion_tokens == 24 or other.final.finish_reason == "stop"

            # the same foreign ids named as this tokenizer's are taken as they are (what every resume
            # did before tokenizers were named): the engine continues after " zebra zebra" three times
            trusted, rid = await continued(engine.tokenizer_id)
            assert isinstance(trusted.final, DoneReply) and trusted.final.resumed
            assert prefixes[rid] == prompt + foreign * 3
    finally:
        await store.stop()
