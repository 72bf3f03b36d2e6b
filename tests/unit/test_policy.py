"""Admission policy, as a table of cases."""

import pytest

from worker.policy import ClassPolicy, Scheduler

RT = ClassPolicy("realtime", 0, max_in_engine=8, contended_in_engine=8)
ST = ClassPolicy("standard", 5, max_in_engine=8, contended_in_engine=4)
BA = ClassPolicy("batch", 10, max_in_engine=8, contended_in_engine=2, min_in_engine=1)


def sched(total=16):
    return Scheduler([BA, RT, ST], max_in_engine=total)


# (name, running before, waiting (class, id, arrived, deadline), engine cap, expected admitted ids, expired ids)
CASES = [
    ("realtime first", {}, [("batch", "b1", 0, None), ("realtime", "r1", 5, None)], 16, ["r1", "b1"], []),
    ("batch alone uses its full cap", {}, [("batch", f"b{i}", i, None) for i in range(10)], 16,
     [f"b{i}" for i in range(8)], []),
    ("batch held to contended cap while realtime waits", {"realtime": 8},
     [("realtime", "r9", 0, None)] + [("batch", f"b{i}", i, None) for i in range(5)], 16, ["b0", "b1"], []),
    ("batch floor even when the engine is full", {"realtime": 8, "standard": 8},
     [("batch", "b0", 0, None), ("batch", "b1", 1, None)], 16, ["b0"], []),
    ("earliest deadline first within a class", {},
     [("standard", "late", 0, 9_000), ("standard", "soon", 5, 2_000), ("standard", "none", 1, None)], 16,
     ["soon", "late", "none"], []),
    ("oldest first without deadlines", {}, [("standard", "n2", 20, None), ("standard", "n1", 10, None)], 16,
     ["n1", "n2"], []),
    ("expired never admitted", {}, [("realtime", "dead", 0, 999), ("realtime", "alive", 0, 5_000)], 16,
     ["alive"], ["dead"]),
    ("every passed deadline expires, earliest first, none of the rest", {},
     [("standard", "later", 0, 800), ("standard", "keep", 1, 1_001), ("standard", "first", 2, 100),
      ("standard", "none", 3, None), ("standard", "edge", 4, 1_000)], 16, ["keep", "none"],
     ["first", "later", "edge"]),
    ("engine total respected", {"standard": 3}, [("realtime", f"r{i}", i, None) for i in range(6)], 6,
     ["r0", "r1", "r2"], []),
    ("standard contended by realtime", {"realtime": 1}, [("standard", f"s{i}", i, None) for i in range(6)], 16,
     ["s0", "s1", "s2", "s3"], []),
]


@pytest.mark.parametrize("name,running,waiting,total,admitted,expired", CASES, ids=[c[0] for c in CASES])
def test_admission(name, running, waiting, total, admitted, expired):
    s = sched(total)
    for cls, n in running.items():
        s._running[cls] = n
    for cls, rid, arrived, deadline in waiting:
        s.add(cls, rid, arrived, deadline)
    got, gone = s.admit(now_ms=1_000)
    assert [item for _, item in got] == admitted
    assert [item for _, item in gone] == expired


def test_release_frees_a_slot():
    s = sched()
    for i in range(10):
        s.add("batch", i, i)
    first, _ = s.admit(0)
    assert len(first) == 8 and s.admit(0) == ([], [])
    s.release("batch")
    assert s.admit(0) == ([("batch", 8)], [])


def test_batch_progresses_under_continuous_realtime():
    s = sched()
    done_batch = 0
    for tick in range(200):
        s.add("realtime", f"r{tick}", tick)
        s.add("batch", f"b{tick}", tick)
        admitted, _ = s.admit(tick)
        for cls, _ in admitted:  # everything admitted finishes within the tick
            s.release(cls)
            done_batch += cls == "batch"
    assert done_batch >= 200 * BA.min_in_engine * 0.9


def test_lower_class_stays_contended_for_the_hold_period():
    s = Scheduler([RT, BA], max_in_engine=64, hold_ms=1000)
    s.add("realtime", "r", 0)
    s.admit(0)
    s.release("realtime")  # realtime idle from t=0
    for i in range(20):
        s.add("batch", i, i)
    got, _ = s.admit(500)  # within the hold: contended cap
    assert len(got) == BA.contended_in_engine
    got, _ = s.admit(1500)  # after the hold: the full cap
    assert len(got) == BA.max_in_engine - BA.contended_in_engine


@pytest.mark.parametrize("running,waiting,total,expected", [
    ({"batch": 8}, ["realtime"], 64, {"batch": 6}),  # back to the contended cap (2)
    ({"batch": 8}, [], 64, {}),  # nobody higher has work: keep running
    ({"batch": 8, "realtime": 1}, [], 64, {"batch": 6}),  # realtime running beside a full batch
    ({"batch": 2}, ["realtime"], 64, {}),  # already at the contended cap
    ({"standard": 8, "batch": 2}, ["realtime"], 64, {"standard": 4}),
    ({"batch": 1, "realtime": 64}, ["realtime"], 64, {}),  # the floor is never preempted
])
def test_overcommitted(running, waiting, total, expected):
    s = sched(total)
    s._running.update(running)
    for cls in waiting:
        s.add(cls, "x", 0)
    assert s.overcommitted() == expected


def test_pause_and_resume_thresholds():
    small = ClassPolicy("batch", 10, 2, 1, max_waiting=4)
    s = Scheduler([small], 16)
    for i in range(4):
        s.add("batch", i, i)
    assert s.should_pause("batch") and not s.should_resume("batch")
    s.admit(0)
    assert not s.should_pause("batch") and s.should_resume("batch")


def test_invalid_policy():
    with pytest.raises(ValueError):
        ClassPolicy("x", 0, max_in_engine=2, contended_in_engine=3)


def _r(name, cls, generated, suspending=False):
    from worker.policy import Running

    return Running(name, cls, generated, suspending)


@pytest.mark.parametrize("name,excess,running,chosen", [
    ("fewest generated go first", {"batch": 2},
     [_r("a", "batch", 30), _r("b", "batch", 2), _r("c", "batch", 9), _r("d", "batch", 40)], ["b", "c"]),
    ("already suspending counts", {"batch": 2},
     [_r("a", "batch", 30), _r("b", "batch", 2, True), _r("c", "batch", 9)], ["c"]),
    ("enough already leaving", {"batch": 1}, [_r("a", "batch", 3, True), _r("b", "batch", 1)], []),
    ("other classes untouched", {"standard": 1},
     [_r("a", "batch", 0), _r("b", "standard", 5), _r("c", "standard", 4)], ["c"]),
    ("more excess than running", {"batch": 5}, [_r("a", "batch", 1)], ["a"]),
    ("nothing over", {}, [_r("a", "batch", 1)], []),
])
def test_choose_suspensions(name, excess, running, chosen):
    from worker.policy import choose_suspensions

    assert choose_suspensions(excess, running) == chosen


# SloCap: (name, start value, observations (latency_ms, now_ms, at_cap), expected value); objective 1000 ms,
# floor 1, ceiling 8
@pytest.mark.parametrize("name,start,observations,expected", [
    ("on time and using its cap: one more", 2, [(500, 0, True)], 3),
    ("on time but not using its cap: unchanged", 2, [(500, 0, False)], 2),
    ("inside the objective but not the headroom: unchanged", 2, [(900, 0, True)], 2),
    ("late: halved", 6, [(1500, 0, True)], 3),
    ("late twice within one objective: halved once", 6, [(1500, 0, True), (1600, 500, True)], 3),
    ("late again after an objective: halved again", 6, [(1500, 0, True), (1600, 1000, True)], 1),
    ("never below the floor", 1, [(5000, 0, True)], 1),
    ("never above the ceiling", 8, [(100, 0, True), (100, 1, True)], 8),
    ("grows back one at a time", 2, [(1500, 0, True)] + [(100, t, True) for t in range(1, 4)], 4),
])
def test_slo_cap(name, start, observations, expected):
    from worker.policy import SloCap

    cap = SloCap(floor=1, ceiling=8, value=start)
    for latency_ms, now_ms, at_cap in observations:
        cap.observe(latency_ms, 1000, now_ms, at_cap)
    assert cap.value == expected


def test_slo_admission_steers_batch_by_realtime_latency():
    rt = ClassPolicy("realtime", 0, max_in_engine=8, contended_in_engine=8, target_ms=1000)
    s = Scheduler([rt, BA], max_in_engine=64, admission="slo")
    assert set(s.slo_caps) == {"batch"}  # realtime has nothing above it
    s.add("realtime", "r0", 0)
    for i in range(20):
        s.add("batch", f"b{i}", i)
    admitted, _ = s.admit(0)
    assert [i for _, i in admitted] == ["r0", "b0", "b1"]  # the contended cap to start with
    s.observe("realtime", 400, 100)  # on time, batch at its cap: one more
    admitted, _ = s.admit(100)
    assert [i for _, i in admitted] == ["b2"]
    s.observe("realtime", 3000, 200)  # late: batch cap 3 -> 1, the excess is suspended
    assert s.cap("batch") == 1 and s.overcommitted() == {"batch": 2}
    s.observe("batch", 10, 300)  # a class without an objective steers nothing
    assert s.cap("batch") == 1


def test_fixed_admission_ignores_latency():
    rt = ClassPolicy("realtime", 0, max_in_engine=8, contended_in_engine=8, target_ms=1000)
    s = Scheduler([rt, BA], max_in_engine=64)
    s.add("realtime", "r0", 0)
    s.admit(0)
    s.observe("realtime", 9000, 100)
    assert s.slo_caps == {} and s.cap("batch") == BA.contended_in_engine


def test_expiry_matches_a_scan_of_every_waiting_request():
    """Only the heap's top is looked at for passed deadlines: over random queues the same requests
    expire as a scan of the whole queue finds, and none of them is admitted or left waiting."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        s = sched(total=1)
        waiting = [(f"r{i}", rng.randrange(100), rng.choice([None, rng.randrange(2_000)])) for i in range(30)]
        for rid, arrived, deadline in waiting:
            s.add("standard", rid, arrived, deadline)
        now = rng.randrange(2_000)
        expected = {rid for rid, _, deadline in waiting if deadline is not None and deadline <= now}
        admitted, expired = s.admit(now_ms=now)
        assert {item for _, item in expired} == expected
        assert len(admitted) == (1 if len(expected) < len(waiting) else 0)
        left = {e.item for e in s._waiting["standard"]}
        assert not expected & ({item for _, item in admitted} | left)
