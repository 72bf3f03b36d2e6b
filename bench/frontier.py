"""How far isolation can go on an engine, from its measured step times (pure: no I/O, no torch).

A decode step of a continuously batched engine takes `fixed + per_token * tokens` (the weights
pass, then the work per sequence in the step). In steady state every request in flight gets one
token per step, so with `rate` tokens/s arriving the step lasts `s = fixed / (1 - per_token * rate)`:
what realtime latency follows, since a streamed realtime request is a fixed number of steps.

Realtime alone at `R` tokens/s uses the share `f = per_token * R` of the engine's compute; batch
alone at `B` tokens/s uses `g = per_token * B`. Keeping a fraction `k` of batch's throughput while
realtime runs stretches every step, and so realtime's end-to-end latency, by

    ratio(k) = (1 - f) / (1 - f - k * g)

whatever the fixed cost. On an engine whose batch alone is bound by compute (g near 1: a CPU)
isolation is paid in batch throughput; where batch alone is bound by the sequence cap or memory
bandwidth (g small: a GPU step costs little more per added sequence) both can be had.
"""

from __future__ import annotations


def fit_steps(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (fixed_ms, per_token_ms) from (tokens per step, step ms) of measured runs."""
    if len(points) < 2:
        raise ValueError("a step-time fit needs at least two runs")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("a step-time fit needs runs with different tokens per step")
    per_token = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - per_token * mx, per_token


def shares(per_token_ms: float, rt_tok_s: float, batch_tok_s: float) -> tuple[float, float]:
    """(f, g): the engine compute realtime alone and batch alone take, as fractions."""
    return per_token_ms * rt_tok_s / 1000, per_token_ms * batch_tok_s / 1000


def ratio_at(kept: float, f: float, g: float) -> float:
    """Realtime latency loaded/alone when batch keeps `kept` of its solo throughput (inf: the engine saturates)."""
    room = 1 - f - kept * g
    return float("inf") if room <= 0 else (1 - f) / room


def kept_at(ratio: float, f: float, g: float) -> float:
    """The batch throughput fraction that keeps realtime latency within `ratio` of alone (capped at 1)."""
    if ratio < 1:
        raise ValueError("a latency ratio below 1 cannot be kept with any batch load")
    return min(1.0, (1 - f) * (1 - 1 / ratio) / g) if g > 0 else 1.0
