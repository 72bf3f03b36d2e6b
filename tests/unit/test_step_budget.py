"""Admission by step budget: the step clock, the online step model and the caps, as tables of cases."""

import random

import pytest

from worker.policy import ClassPolicy, Scheduler
from worker.step_budget import StepBudget, StepClock, StepModel, tokens_allowed

RT = ClassPolicy("realtime", 0, max_in_engine=8, contended_in_engine=8)
ST = ClassPolicy("standard", 5, max_in_engine=16, contended_in_engine=4)
BA = ClassPolicy("batch", 10, max_in_engine=32, contended_in_engine=2, min_in_engine=1)


# (name, outputs as (time s, tokens, prompt tokens), steps reported as (seconds, tokens, prompt tokens))
CLOCK_CASES = [
    ("one burst per step: each step reported once the next begins",
     [(0.0, 1, 0), (0.0005, 1, 0), (0.1, 1, 0), (0.1005, 1, 0), (0.2, 1, 0), (0.3, 1, 0)],
     [(0.1, 2, 0), (0.1, 1, 0)]),
    ("the first burst only starts the clock", [(0.0, 5, 0)], []),
    ("outputs within the gap are one burst, however long it runs",
     [(0.0, 1, 0), (0.05, 1, 0), (0.052, 1, 0), (0.054, 1, 0), (0.154, 3, 0)],
     [(0.05, 3, 0)]),
    ("a prefill counts its prompt in its step", [(0.0, 1, 0), (0.1, 1, 128), (0.1001, 1, 0), (0.5, 1, 0), (0.6, 1, 0)],
     [(0.1, 2, 128), (0.4, 1, 0)]),
    ("a pause past max_step_s is not a step", [(0.0, 1, 0), (0.1, 1, 0), (20.0, 1, 0), (20.1, 1, 0), (20.2, 1, 0)],
     [(0.1, 1, 0), (0.1, 1, 0)]),
]


@pytest.mark.parametrize("name,outputs,steps", CLOCK_CASES, ids=[c[0] for c in CLOCK_CASES])
def test_step_clock(name, outputs, steps):
    seen = []
    clock = StepClock(lambda s, t, p: seen.append((round(s, 6), t, p)), gap_s=0.003, max_step_s=10.0)
    for now, tokens, prompt in outputs:
        clock.output(now, tokens, prompt)
    assert seen == steps


def test_an_idle_engine_does_not_make_a_step():
    seen = []
    clock = StepClock(lambda s, t, p: seen.append((round(s, 6), t)))
    for now in (0.0, 0.1):
        clock.output(now, 1)
    clock.idle()  # nothing in the engine from 0.1 to 5.0
    for now in (5.0, 5.1, 5.2):
        clock.output(now, 1)
    assert seen == [(0.1, 1)]  # the 0.1 step ended at 5.0 is lost, not reported as 4.9 s


def _samples(fixed, per_token, tokens, noise=0.0, seed=1, per_prompt=None, prompts=None):
    """(seconds, decoded tokens, prompt tokens) of steps on an engine with these parts."""
    rng = random.Random(seed)
    prompts = prompts or [0] * len(tokens)
    return [(fixed + per_token * t + (per_prompt or 0.0) * q + rng.uniform(-noise, noise), t, q)
            for t, q in zip(tokens, prompts)]


DECODE = [2, 3, 2, 8, 3, 2, 12, 2] * 10
PREFILL = [0, 0, 0, 120, 0, 0, 0, 64] * 10

# (name, samples, expected (fixed, per token, per prompt token) or None)
MODEL_CASES = [
    ("decode steps of several sizes: fixed and per token; prompts priced alike",
     _samples(0.05, 0.004, DECODE), (0.05, 0.004, 0.004)),
    ("prefill steps price prompt tokens apart (cheaper than decoded ones)",
     _samples(0.05, 0.004, DECODE, per_prompt=0.001, prompts=PREFILL), (0.05, 0.004, 0.001)),
    ("noise averages out", _samples(0.1, 0.006, list(range(1, 30)) * 6, noise=0.02), (0.1, 0.006, 0.006)),
    ("too few samples", _samples(0.05, 0.004, [2, 40] * 10), None),
    ("no spread in decoded tokens: fixed and per token cannot be told apart, however many prompts",
     _samples(0.05, 0.004, [4] * 80, per_prompt=0.001, prompts=PREFILL), None),
    ("a step that shrinks with tokens is not a model", [(0.2 - 0.001 * t, t, 0) for t in [1, 50] * 40], None),
    ("prompts that seem to cost less than nothing are priced like decoded tokens",
     _samples(0.05, 0.004, DECODE, per_prompt=-0.0001, prompts=PREFILL), (0.05, 0.004, 0.004)),
]


@pytest.mark.parametrize("name,samples,expected", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_step_model(name, samples, expected):
    model = StepModel()
    for seconds, tokens, prompt in samples:
        model.add(seconds, tokens, prompt)
    fit = model.fit()
    if expected is None:
        assert fit is None
    else:
        assert (fit.fixed, fit.per_token, fit.per_prompt_token) == pytest.approx(expected, rel=0.1)


def test_the_model_forgets_an_old_engine():
    model = StepModel(decay=0.98)
    for sample in _samples(0.05, 0.004, [2, 40] * 200):
        model.add(*sample)
    for sample in _samples(0.2, 0.01, [2, 40] * 200):  # a slower engine from here on
        model.add(*sample)
    fit = model.fit()
    assert (fit.fixed, fit.per_token) == pytest.approx((0.2, 0.01), rel=0.05)


# (fixed s, per token s, tokens of the classes above, stretch, tokens allowed below)
ALLOWED_CASES = [
    (0.100, 0.005, 0, 1.2, 4.0),  # 20 tokens cost as much as the fixed part: a fifth of that
    (0.100, 0.005, 10, 1.2, 6.0),  # the busy class's own tokens lengthen its step too
    (0.100, 0.005, 10, 1.5, 15.0),
    (0.020, 0.0001, 4, 1.2, 40.8),  # an engine whose step hardly grows with tokens (a GPU's decode)
]


@pytest.mark.parametrize("fixed,per_token,above,stretch,allowed", ALLOWED_CASES)
def test_tokens_allowed_keep_the_stretch(fixed, per_token, above, stretch, allowed):
    assert tokens_allowed(fixed, per_token, above, stretch) == pytest.approx(allowed)
    # the step with those tokens added is `stretch` times the step without them
    assert (fixed + per_token * (above + allowed)) / (fixed + per_token * above) == pytest.approx(stretch)


def _ready_budget(fixed, per_token, stretch=1.2, per_prompt=None):
    budget = StepBudget(stretch)
    for sample in _samples(fixed, per_token, DECODE, per_prompt=per_prompt, prompts=PREFILL if per_prompt else None):
        budget.model.add(*sample)
    return budget


def test_budget_caps_share_one_budget_in_priority_order():
    budget = _ready_budget(0.1, 0.005)  # 20 tokens' worth of fixed cost
    # realtime puts 10 tokens in each step: 6 tokens below it; standard runs 4 of them
    assert budget.caps(10, [("standard", 4), ("batch", 0)]) == {"standard": 6, "batch": 2}
    budget.finished("batch", prompt_tokens=64, completion_tokens=64)  # its prompt costs a token per step too
    assert budget.caps(10, [("standard", 0), ("batch", 0)]) == {"standard": 6, "batch": 3}
    assert budget.caps(10, [("standard", 8), ("batch", 0)]) == {"standard": 6, "batch": 0}


def test_a_prompt_costs_what_the_engine_charges_for_it():
    """Prompt tokens priced at a quarter of a decoded one: a request with a prompt as long as its
    output costs 1.25 decoded tokens per step, not 2."""
    budget = _ready_budget(0.1, 0.004, per_prompt=0.001)  # 25 tokens' worth of fixed cost
    budget.finished("batch", prompt_tokens=64, completion_tokens=64)
    fit = budget.model.fit()
    assert budget.cost("batch", fit) == pytest.approx(1.25, rel=0.05)
    # 0.2 * (25 + 2) = 5.4 tokens: 5.4 / 1.25 = 4.3 requests (prompts priced like decoded tokens: 2.7)
    assert budget.caps(2, [("batch", 0)]) == {"batch": 4}


def test_budget_says_nothing_before_the_model_is_fitted():
    assert StepBudget(1.2).caps(4, [("batch", 0)]) is None
    with pytest.raises(ValueError):
        StepBudget(1.0)


def test_step_admission_fills_a_fast_engine_and_holds_a_slow_one():
    """The same two classes on two engines: where a step hardly grows with tokens, batch fills beside
    realtime; where it grows fast, batch stays near its floor. A fixed cap would be one number for both."""
    caps = {}
    for name, (fixed, per_token) in {"fast": (0.02, 0.0001), "slow": (0.1, 0.006)}.items():
        s = Scheduler([RT, BA], max_in_engine=64, admission="step")
        for sample in _samples(fixed, per_token, DECODE):
            s.step_budget.model.add(*sample)
        s.add("realtime", "r0", 0)
        s.admit(0)
        caps[name] = s.cap("batch")
    assert caps == {"fast": 32, "slow": 3}  # fast: 0.2 * (200 + 1) = 40 tokens, held to batch's max of 32


def test_step_admission_keeps_the_fixed_cap_until_fitted_and_paces_admissions():
    s = Scheduler([RT, BA], max_in_engine=64, admission="step")
    s.add("realtime", "r0", 0)
    for i in range(10):
        s.add("batch", f"b{i}", i)
    admitted, _ = s.admit(0)
    assert [i for _, i in admitted] == ["r0", "b0", "b1"]  # not fitted: batch's contended cap (2)
    for sample in _samples(0.1, 0.002, DECODE):  # 50 tokens' worth: 0.2 * 51 = 10 allowed
        s.step_budget.model.add(*sample)
    assert s.cap("batch") == 10
    admitted, _ = s.admit(10)
    assert [i for _, i in admitted] == ["b2"]  # one per engine step
    assert s.admit(20)[0] == []  # the same step: none
    s.step_budget.clock.output(1.0, 3, 0)  # a new step
    assert [i for _, i in s.admit(30)[0]] == ["b3"]


def test_step_admission_suspends_past_one_request_of_slack():
    s = Scheduler([RT, BA], max_in_engine=64, admission="step")
    for sample in _samples(0.1, 0.005, DECODE):  # 0.2 * (20 + 1) = 4.2 tokens beside 1 realtime
        s.step_budget.model.add(*sample)
    for i in range(6):
        s.add("batch", f"b{i}", i)
    assert len(s.admit(0)[0]) == 6  # realtime idle: batch up to its max
    s.add("realtime", "r0", 100)
    s.admit(100)
    assert s.cap("batch") == 4
    assert s.overcommitted() == {"batch": 1}  # 6 running, cap 4, one of slack
