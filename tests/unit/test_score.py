"""Score requests through the runner with the deterministic fake engine.

The real-engine check (scores equal a direct log-probability computation) is in
tests/integration/test_score.py.
"""

import asyncio
import math

import pytest

from schemas import DoneReply, ErrorCode, ErrorReply, Limits, Request, TokenReply
from worker.fake_engine import FakeEngine
from worker.runner import Job, Runner

from tests.unit.test_templates import EVENT


class Collect:
    def __init__(self):
        self.tokens: list[TokenReply] = []
        self.answer = None

    async def token(self, topic, reply):
        self.tokens.append(reply)
        delivered = asyncio.get_running_loop().create_future()
        delivered.set_result(None)
        return delivered

    def encode_final(self, reply):
        return reply, b""

    async def final(self, topic, reply, running):
        self.answer = reply
        return b""


class NoAnswers:
    def put_later(self, rid, payload, owner=""):
        pass

    async def append_chunks(self, *args, owner=None, tokenizer=None):
        return True


async def serve(**fields):
    engine, out = FakeEngine(), Collect()
    runner = Runner(engine, out, NoAnswers(), Limits(), running=lambda: True)
    req = Request(id="s1", kind="score", template="fraud", event=EVENT, **fields)
    await runner.serve(Job(req, "realtime", 0, "replies", None, 0, 0))
    return engine, out


async def test_scores_are_the_label_distribution_renormalised():
    engine, out = await serve()
    done = out.answer
    assert isinstance(done, DoneReply) and done.finish_reason == "scored"
    assert set(done.scores) == {"legit", "fraud"}
    assert math.isclose(sum(done.scores.values()), 1.0, abs_tol=1e-9)
    # the fake's logprob of token t is -1 - (sum(prompt) + t) % 7
    from schemas.templates import Templates

    t = Templates().get("fraud")
    base = sum(engine.render_ids(t.render(EVENT), t.chat, t.system))
    lp = {label: -1.0 - (base + ids[0]) % 7 for label, ids in zip(t.labels, engine.label_ids(list(t.labels), True))}
    z = sum(math.exp(v) for v in lp.values())
    assert done.scores == pytest.approx({k: math.exp(v) / z for k, v in lp.items()})
    assert out.tokens == [] and done.text == "" and done.usage.completion_tokens == 0


async def test_custom_labels_and_a_streamed_rationale():
    _, out = await serve(labels=["approve", "review", "decline"], max_tokens=5)
    done = out.answer
    assert list(done.scores) == ["approve", "review", "decline"]
    assert done.usage.completion_tokens == 5
    assert "".join(t.text for t in out.tokens) == done.text and done.text


@pytest.mark.parametrize("fields,needle", [
    ({"template": "nope"}, "unknown template `nope`"),
    ({"event": {k: v for k, v in EVENT.items() if k != "mcc"}}, "`mcc`"),
    ({"labels": ["fraud", "fraudulent"]}, "begin with the same token"),
])
async def test_bad_score_requests_get_an_error_naming_the_problem(fields, needle):
    engine, out = FakeEngine(), Collect()
    runner = Runner(engine, out, NoAnswers(), Limits(), running=lambda: True)
    base = {"id": "s2", "kind": "score", "template": "fraud", "event": EVENT}
    await runner.serve(Job(Request(**{**base, **fields}), "standard", 5, "replies", None, 0, 0))
    assert isinstance(out.answer, ErrorReply) and out.answer.code == ErrorCode.INVALID_REQUEST
    assert needle in out.answer.message
    assert not engine.started


class RecordingEngine(FakeEngine):
    """Keeps the parameters each generation got."""

    def __init__(self):
        super().__init__()
        self.params = []

    async def generate(self, request_id, prompt_ids, params, priority):
        self.params.append(params)
        async for d in super().generate(request_id, prompt_ids, params, priority):
            yield d


@pytest.mark.parametrize("save_min_tokens, max_tokens, saved", [
    (0, 4, True),  # the default: every request's pages
    (64, 4, False),  # a short request is recomputed on resume instead
    (64, 200, True),  # prompt + max_tokens reaches the threshold
])
async def test_pages_are_saved_for_requests_long_enough_to_be_worth_it(save_min_tokens, max_tokens, saved):
    engine = RecordingEngine()
    runner = Runner(engine, Collect(), NoAnswers(), Limits(), running=lambda: True, save_min_tokens=save_min_tokens)
    req = Request(id="p1", prompt="twelve bytes", max_tokens=max_tokens)
    await runner.serve(Job(req, "standard", 5, "replies", None, 0, 0))
    assert [p.save_pages for p in engine.params] == [saved]


class NoSystemRole(FakeEngine):
    """A model whose chat template refuses a system turn (as Gemma's and Mistral's first ones do)."""

    def render_ids(self, text, chat, system):
        from worker.prompt_tokens import ChatRefused
        if chat and system:
            raise ChatRefused("System role not supported")
        return super().render_ids(text, chat, system)


async def test_a_template_whose_system_prompt_the_model_refuses_is_a_bad_request_named_at_start():
    """The request is answered `invalid_request` naming the template and the model's reason (it was
    `internal`, with a traceback), and the worker names the template when it starts."""
    engine, out = NoSystemRole(), Collect()
    runner = Runner(engine, out, NoAnswers(), Limits(), running=lambda: True)
    assert set(runner.unusable_templates()) == {"fraud"}
    assert "System role not supported" in runner.unusable_templates()["fraud"]
    await runner.serve(Job(Request(id="s9", kind="score", template="fraud", event=EVENT), "realtime", 0, "replies",
                           None, 0, 0))
    assert isinstance(out.answer, ErrorReply) and out.answer.code == ErrorCode.INVALID_REQUEST
    assert "template `fraud`" in out.answer.message and "System role not supported" in out.answer.message
    assert Runner(FakeEngine(), out, NoAnswers(), Limits(), running=lambda: True).unusable_templates() == {}


async def test_labels_a_request_names_itself_add_no_metric_series():
    """`sluice_score` is labelled by template and label. Labels come from the record, so a producer
    sending random ones would add a histogram per label for the life of the process (memory, and a
    scrape that grows without end on the worker's event loop). Only the template's own labels are
    recorded; the reply still carries every score."""
    from worker import metrics

    def series():
        return {key for key in metrics.scores._metrics}

    before = series()
    for i in range(20):
        _, out = await serve(labels=[f"approve{i}", f"decline{i}", "fraud"])
        assert set(out.answer.scores) == {f"approve{i}", f"decline{i}", "fraud"}
    _, out = await serve()
    assert set(out.answer.scores) == {"legit", "fraud"}
    assert series() - before <= {("fraud", "fraud"), ("fraud", "legit")}
    assert ("fraud", "legit") in series() and not any(label.startswith(("approve", "decline")) for _, label in series())
