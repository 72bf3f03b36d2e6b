"""bench/soak.py's verdict: growth over the second half of the rounds, per 100,000 requests."""

import pytest

from bench.soak import growth_per_100k


@pytest.mark.parametrize("points, expected", [
    ([(0, 70), (100_000, 80), (200_000, 80), (300_000, 80), (400_000, 80)], 0.0),   # warm-up, then flat
    ([(0, 70), (100_000, 72), (200_000, 74), (300_000, 76), (400_000, 78)], 2.0),   # 2 MiB per 100k throughout
    ([(0, 70), (20_000, 90), (40_000, 91), (60_000, 92)], 5.0),                    # 1 MiB per 20k once warm
    ([(0, 70)], 0.0),                                                               # nothing to fit
])
def test_growth_is_fitted_over_the_second_half(points, expected):
    assert growth_per_100k(points) == pytest.approx(expected)
