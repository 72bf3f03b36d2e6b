"""loadgen: seeded workloads and percentiles checked against known injected latencies."""

import json

import pytest

from loadgen.report import Timing, summarize, write_json, write_markdown, write_png
from loadgen.workload import Workload, parse_mix


def test_workload_is_seeded_and_open_loop():
    w = Workload(rate=10, seconds=30, seed=3)
    a, b = w.requests("x"), w.requests("x")
    assert a == b and 200 < len(a) < 400  # Poisson around 300
    times = [t for t, _, _ in a]
    assert times == sorted(times) and times[-1] < 30
    classes = {c for _, c, _ in a}
    assert classes == {"realtime", "standard", "batch"}
    assert all(8 <= body["max_tokens"] <= 32 for _, _, body in a)
    fixed = Workload(rate=4, seconds=5, arrival="fixed").requests("f")
    assert [round(t, 6) for t, _, _ in fixed] == [round(0.25 * k, 6) for k in range(1, 20)]


def test_parse_mix():
    assert parse_mix("realtime=1,batch=3") == {"realtime": 1.0, "batch": 3.0}
    with pytest.raises(ValueError):
        parse_mix("urgent=1")


def _known_run():
    """100 realtime requests with e2e = k/100 s (k=1..100), TTFT = e2e/2, 11 tokens each."""
    out = []
    for k in range(1, 101):
        e2e = k / 100
        out.append(Timing("realtime", sent=k, first_token=k + e2e / 2, last_token=k + e2e, done=k + e2e,
                          completion_tokens=11))
    out.append(Timing("batch", sent=0.5, first_token=None, last_token=None, done=1.0, error="deadline_exceeded"))
    out.append(Timing("batch", sent=0.5, first_token=None, last_token=None, done=None))
    return out


def test_percentiles_match_injected_latencies():
    s = summarize(_known_run())
    rt = s["realtime"]
    assert rt["e2e_s"] == pytest.approx({"p50": 0.50, "p90": 0.90, "p99": 0.99}, abs=0.011)
    assert rt["ttft_s"] == pytest.approx({"p50": 0.25, "p90": 0.45, "p99": 0.495}, abs=0.006)
    assert rt["itl_s"]["p50"] == pytest.approx(0.025, abs=0.001)  # (e2e/2) / 10 gaps at the median
    assert s["batch"] == {**s["batch"], "requests": 2, "completed": 0, "errors": 1, "unanswered": 1}
    assert s["all"]["requests"] == 102
    assert rt["requests_per_s"] == pytest.approx(100 / (101.0 - 0.5), rel=1e-6)


def test_reports_are_written(tmp_path):
    timings = _known_run()
    s = summarize(timings)
    write_json(s, {"requests": 102}, tmp_path / "r.json")
    write_markdown(s, {"requests": 102, "rate": 1, "arrival": "fixed"}, tmp_path / "r.md")
    write_png(timings, tmp_path / "r.png")
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["realtime"]["requests"] == 100
    assert "| realtime | 100 |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
