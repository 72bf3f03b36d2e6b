"""A request continued by a worker whose tokenizer differs from the one that wrote its progress
(a rolling upgrade to another model) goes on from the emitted text, never from foreign token ids."""

import pytest

from schemas import DoneReply, Request
from tests.unit.harness import J, Memory, running, until
from worker.answers import MIXED
from worker.fake_engine import FakeEngine

STORED = {0: ([5, 6], "<t5><t6>"), 1: ([7], "<t7>")}  # two token records an earlier owner sent
STORED_IDS = [5, 6, 7]


class Retrained(FakeEngine):
    """Another tokenizer: its ids for a text are the text's characters. Records each prefix it is given."""

    tokenizer_id = "new-tokenizer"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.prefixes: dict[str, list[int]] = {}

    def text_ids(self, text):
        return [2000 + ord(c) for c in text]

    async def generate(self, request_id, prompt_ids, params, priority):
        self.prefixes[request_id.split("@")[0]] = list(prompt_ids)
        async for d in super().generate(request_id, prompt_ids, params, priority):
            yield d


@pytest.mark.parametrize("stored_tokenizer, continued_from", [
    (None, "ids"),  # progress written before sluice named its tokenizer: its ids are trusted, as before
    ("new-tokenizer", "ids"),  # the same tokenizer: the ids are right (and what its pages are keyed by)
    ("old-tokenizer", "text"),  # another tokenizer's ids would be other tokens here
    (MIXED, "text"),  # a run already went on from another tokenizer's: only the text is whole
])
async def test_progress_of_another_tokenizer_is_continued_from_its_text(stored_tokenizer, continued_from):
    mem = Memory(partitions=1, engine=Retrained())
    mem.answers.progress["default:r1"] = dict(STORED)
    if stored_tokenizer is not None:
        mem.answers.tokenizers["default:r1"] = stored_tokenizer
    mem.send("standard", J({"id": "r1", "prompt": "x", "max_tokens": 6, "stream": True}), b"r1")
    async with running(mem):
        assert await until(mem.all_committed)
    engine = mem.engine
    emitted = STORED_IDS if continued_from == "ids" else engine.text_ids("<t5><t6><t7>")
    assert engine.prefixes["r1"] == engine.prompt_ids(Request(id="r1", prompt="x")) + emitted
    (done,) = mem.finals()["r1"]
    assert isinstance(done, DoneReply) and done.resumed and done.text.startswith("<t5><t6><t7>")
    # max_tokens and usage count tokens generated (3 before, 3 here), not the emitted text's length when re-read
    assert done.usage.completion_tokens == 6 and done.finish_reason == "length"
    tokens = sorted((t.seq, t.text, t.token_ids) for t in mem.tokens())
    # what readers already had goes out again unchanged, then the stream goes on after it
    assert tokens[:2] == [(0, "<t5><t6>", [5, 6]), (1, "<t7>", [7])]
    assert [s for s, _, _ in tokens] == list(range(done.seq))


async def test_a_run_names_its_tokenizer_with_its_progress_and_a_retokenized_run_marks_it_mixed():
    mem = Memory(partitions=1, engine=Retrained(token_delay_s=0.05))
    mem.answers.progress["default:old"] = dict(STORED)
    mem.answers.tokenizers["default:old"] = "old-tokenizer"
    mem.send("standard", J({"id": "fresh", "prompt": "x", "max_tokens": 40, "stream": True}), b"fresh")
    mem.send("standard", J({"id": "old", "prompt": "x", "max_tokens": 40, "stream": True}), b"old")
    async with running(mem):
        # read while both still run (answering a request deletes its progress)
        assert await until(lambda: mem.answers.tokenizers.get("default:fresh") == "new-tokenizer"
                           and mem.answers.tokenizers.get("default:old") == MIXED
                           and len(mem.answers.progress.get("default:old", {})) > 2)
        assert await until(mem.all_committed, timeout=20)
    assert {rid for rid, (final,) in mem.finals().items() if isinstance(final, DoneReply)} == {"fresh", "old"}
