"""The step-time model behind the isolation frontier (bench/frontier.py)."""

import pytest

from bench import frontier


def test_step_fit_recovers_a_linear_step_time():
    points = [(n, 70.0 + 6.5 * n) for n in (2, 4, 30, 38)]
    fixed, per_token = frontier.fit_steps(points)
    assert (round(fixed, 6), round(per_token, 6)) == (70.0, 6.5)


@pytest.mark.parametrize("points", [[(3, 100.0)], [(3, 100.0), (3, 120.0)]])
def test_step_fit_refuses_what_it_cannot_fit(points):
    with pytest.raises(ValueError):
        frontier.fit_steps(points)


@pytest.mark.parametrize("kept,f,g,ratio", [
    (0.0, 0.2, 0.9, 1.0),            # no batch: realtime as alone
    (0.5, 0.2, 0.0, 1.0),            # batch that costs the engine nothing (sequence-capped, a GPU)
    (0.5, 0.2, 1.0, 0.8 / 0.3),      # compute-bound batch on a CPU: half of it stretches steps 2.67x
    (0.8, 0.2, 1.0, float("inf")),   # realtime + batch need the whole engine: steps grow without bound
])
def test_latency_ratio_at_a_batch_share(kept, f, g, ratio):
    assert frontier.ratio_at(kept, f, g) == pytest.approx(ratio)


@pytest.mark.parametrize("ratio,f,g,kept", [
    (1.2, 0.2, 1.0, 0.8 / 6),   # the case on 2 cores: batch keeps at most 0.13
    (1.2, 0.2, 0.1, 1.0),       # a step that costs little per sequence: batch keeps all of it
    (1.0, 0.2, 1.0, 0.0),
])
def test_batch_share_at_a_latency_ratio(ratio, f, g, kept):
    assert frontier.kept_at(ratio, f, g) == pytest.approx(kept)
    if kept < 1:  # the two functions invert each other on the frontier
        assert frontier.ratio_at(kept, f, g) == pytest.approx(ratio)
