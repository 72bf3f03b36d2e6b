"""Score requests on the real model: label probabilities, rationale, and bad events."""

import math

import pytest

from loadgen.burst import run_burst
from schemas import DoneReply, ErrorCode, ErrorReply
from schemas.templates import Templates
from tests.integration.helpers import running_worker
from tests.unit.test_templates import EVENT

pytestmark = pytest.mark.integration


async def direct_label_logprobs(engine, prompt_ids: list[int], first_tokens: list[int]) -> list[float]:
    """log P(token | prompt) for each token, from vLLM's prompt log-probabilities of prompt + token.

    A different path through the engine than the worker's (sampler-side logprobs of
    the first generated position): here each label token is appended to the prompt
    and its own prefill row scores it.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = []
    for i, tok in enumerate(first_tokens):
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        final = None
        async for o in engine._llm.generate(TokensPrompt(prompt_token_ids=prompt_ids + [tok]), sp, f"direct-{i}-{tok}"):
            final = o
        out.append(final.prompt_logprobs[-1][tok].logprob)
    return out


async def test_label_probabilities_match_a_direct_logprob_computation(settings, catalog, engine, group_id):
    events = [EVENT, {**EVENT, "id": "t2", "amount": 4.2, "currency": "USD", "country": "US", "channel": "pos",
                      "card_present": True, "txn_count_24h": 1, "txn_sum_24h": 4.2, "distinct_countries_24h": 1}]
    reqs = [("realtime", {"id": f"score-{e['id']}", "kind": "score", "template": "fraud", "event": e})
            for e in events]
    reqs.append(("standard", {"id": "score-3way", "kind": "score", "template": "fraud", "event": EVENT,
                              "labels": ["legit", "fraud", "unsure"]}))
    async with running_worker(settings, catalog, engine, group_id=group_id):
        out = await run_burst(settings.kafka.options(), catalog, reqs, timeout_s=120)
    template = Templates().get("fraud")
    for (_, body), event in zip(reqs, events + [EVENT]):
        done = out[body["id"]].final
        assert isinstance(done, DoneReply), done
        labels = body.get("labels", list(template.labels))
        assert list(done.scores) == labels
        assert math.isclose(sum(done.scores.values()), 1.0, abs_tol=1e-6)
        assert done.finish_reason == "scored" and done.text == "" and out[body["id"]].tokens == {}
        prompt_ids = engine.render_ids(template.render(event), template.chat, template.system)
        firsts = [ids[0] for ids in engine.label_ids(labels, template.chat)]
        lps = await direct_label_logprobs(engine, prompt_ids, firsts)
        z = sum(math.exp(lp) for lp in lps)
        for label, lp in zip(labels, lps):
            assert abs(done.scores[label] - math.exp(lp) / z) < 1e-3, (label, done.scores, lps)
        assert done.usage.prompt_tokens == len(prompt_ids)
    # the two events are different transactions: the model must not score them identically
    assert out["score-t1"].final.scores != out["score-t2"].final.scores


async def test_score_with_a_streamed_rationale(settings, catalog, engine, group_id):
    reqs = [("standard", {"id": "why", "kind": "score", "template": "fraud", "event": EVENT, "max_tokens": 12}),
            ("standard", {"id": "only", "kind": "score", "template": "fraud", "event": EVENT})]
    async with running_worker(settings, catalog, engine, group_id=group_id):
        out = await run_burst(settings.kafka.options(), catalog, reqs, timeout_s=120)
    why, only = out["why"], out["only"]
    assert not why.problems and why.tokens and why.text == why.final.text
    assert why.final.usage.completion_tokens > 0
    # the rationale does not change the scores: both come from the same first position
    for label in ("legit", "fraud"):
        assert abs(why.final.scores[label] - only.final.scores[label]) < 1e-3


async def test_bad_score_requests_are_answered_with_an_error(settings, catalog, engine, group_id):
    cases = {
        "unknown-template": ({"template": "no-such-template", "event": EVENT}, "unknown template `no-such-template`"),
        "missing-field": ({"template": "fraud", "event": {k: v for k, v in EVENT.items() if k != "amount"}},
                          "`amount`"),
        "no-event": ({"template": "fraud"}, "`event`"),
    }
    reqs = [("realtime", {"id": rid, "kind": "score", **body}) for rid, (body, _) in cases.items()]
    async with running_worker(settings, catalog, engine, group_id=group_id):
        out = await run_burst(settings.kafka.options(), catalog, reqs, timeout_s=60)
    for rid, (_, needle) in cases.items():
        final = out[rid].final
        assert isinstance(final, ErrorReply) and final.code == ErrorCode.INVALID_REQUEST, final
        assert needle in final.message, final
