import io

from worker.progress_lines import LineProgress


def test_a_line_at_each_interval_with_the_rate_since_the_last_and_one_at_the_end():
    now = [0.0]
    out = io.StringIO()
    bar = LineProgress(1000, initial=100, desc="backfill j", every_s=30, out=out, clock=lambda: now[0])
    for _ in range(50):  # 10 events a second for 50 s
        now[0] += 1
        bar.update(10)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2
    assert lines[0] == "backfill j: 400/1000 ev (40%), 10.0 ev/s, 0m30s elapsed, ETA 1m00s"
    assert lines[1] == "backfill j: 600/1000 ev (60%), 10.0 ev/s, 0m50s elapsed, ETA 0m40s"


def test_a_run_that_stands_still_keeps_printing_and_shows_no_rate():
    now = [0.0]
    out = io.StringIO()
    bar = LineProgress(100, desc="d", every_s=30, out=out, clock=lambda: now[0])
    now[0] = 10
    bar.update(50)
    for _ in range(70):  # a timer's update(0) every second; nothing moves
        now[0] += 1
        bar.update(0)
    lines = out.getvalue().splitlines()
    assert lines == ["d: 50/100 ev (50%), 1.7 ev/s, 0m30s elapsed, ETA 0m30s",
                     "d: 50/100 ev (50%), 0.0 ev/s, 1m00s elapsed, ETA unknown"]


def test_a_finished_run_needs_no_more_time():
    out = io.StringIO()
    LineProgress(5, initial=5, desc="d", out=out, clock=lambda: 0.0).close()
    assert out.getvalue() == "d: 5/5 ev (100%), 0.0 ev/s, 0m00s elapsed, ETA 0m00s\n"
    out = io.StringIO()
    now = [0.0]
    bar = LineProgress(4000, desc="d", every_s=1, out=out, clock=lambda: now[0])
    now[0] = 2
    bar.update(1)
    assert out.getvalue().endswith("ETA 2h13m\n")
