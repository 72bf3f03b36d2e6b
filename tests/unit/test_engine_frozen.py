"""Telling a frozen engine (no output, no CPU) from one that computes a long step: `FrozenWatch`."""

import pytest

from worker.engine_frozen import FrozenWatch

CORE = 1.0  # CPU seconds per second: one core busy


def run(samples, window_s=10.0, progress_at=0.0, tick_s=0.5):
    """Feed `samples` (a function of t giving {pid: cpu seconds} or None) every tick up to the last
    one; return `frozen` at the end."""
    watch = FrozenWatch(window_s)
    t = 0.0
    end = samples.end
    while t <= end + 1e-9:
        watch.sample(t, samples(t))
        t += tick_s
    return watch.frozen(end, progress_at)


class Trace:
    def __init__(self, end, fn):
        self.end, self.fn = end, fn

    def __call__(self, t):
        return self.fn(t)


@pytest.mark.parametrize("name, trace, progress_at, frozen", [
    ("stopped engine, whole window", Trace(12, lambda t: {7: 3.0}), 0.0, 0.0),
    ("a long step computing on one core", Trace(12, lambda t: {7: 3.0 + CORE * t}), 0.0, None),
    ("a long step on two processes, the core waiting on its runner",
     Trace(12, lambda t: {7: 1.0, 8: 2.0 + 1.9 * t}), 0.0, None),
    ("stopped after computing inside the window", Trace(12, lambda t: {7: min(t, 5.0)}), 0.0, None),
    ("stopped, but output came inside the window", Trace(12, lambda t: {7: 3.0}), 5.0, None),
    ("stopped, not yet a window of samples", Trace(8, lambda t: {7: 3.0}), 0.0, None),
    ("idle engine in the middle starts the window over",
     Trace(12, lambda t: None if 4 <= t < 5 else {7: 3.0}), 0.0, None),
    ("a trickle under 2% of a core is frozen", Trace(12, lambda t: {7: 3.0 + 0.01 * t}), 0.0, pytest.approx(0.1)),
    ("the engine process gone: the health check's to report", Trace(12, lambda t: {7: 3.0} if t < 6 else {}), 0.0, None),
    ("a process that ended is left out, the one left is judged",
     Trace(12, lambda t: {7: 3.0, 9: 1.0} if t < 6 else {7: 3.0}), 0.0, 0.0),
])
def test_frozen(name, trace, progress_at, frozen):
    assert run(trace, progress_at=progress_at) == frozen, name


def test_a_gap_in_the_samples_starts_the_window_over():
    """A worker that was itself stopped (or whose loop was held) has no samples for the gap: it does
    not judge the engine by them, and judges again once a whole window is sampled."""
    watch = FrozenWatch(10.0)
    for t in (0.0, 0.5, 1.0):
        watch.sample(t, {7: 3.0})
    watch.sample(11.5, {7: 3.0})  # 10.5 s later
    assert watch.frozen(11.5, 0.0) is None
    t = 11.5
    while t < 21.5:
        t += 0.5
        watch.sample(t, {7: 3.0})
    assert watch.frozen(t, 0.0) == 0.0


def test_off():
    watch = FrozenWatch(0.0)
    for t in range(30):
        watch.sample(float(t), {7: 3.0})
    assert watch.frozen(30.0, 0.0) is None
