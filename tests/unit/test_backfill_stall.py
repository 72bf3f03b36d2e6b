"""A backfill's wait for replies: how long requests have been out without a final reply (`ReplyClock`)."""

import pytest

from worker.backfill_stall import ReplyClock

# each step: (seconds, "tick" with the requests in flight, or "reply"), and what `waited` says at a tick
CASES = {
    "nothing out never waits": [(0, "tick", 0, 0.0), (500, "tick", 0, 0.0), (2000, "tick", 0, 0.0)],
    "requests out from the first tick that sees them": [(10, "tick", 0, 0.0), (20, "tick", 5, 0.0),
                                                         (920, "tick", 5, 900.0)],
    "a reply starts the wait again": [(0, "tick", 5, 0.0), (600, "reply", None, None), (1000, "tick", 4, 400.0)],
    "replies that keep coming keep it short": [(0, "tick", 3, 0.0), (100, "reply", None, None),
                                               (200, "reply", None, None), (250, "tick", 1, 50.0)],
    "all answered, then more out: counted from the new ones": [(0, "tick", 2, 0.0), (50, "tick", 0, 0.0),
                                                               (700, "tick", 2, 0.0), (1000, "tick", 2, 300.0)],
}


@pytest.mark.parametrize("steps", CASES.values(), ids=CASES.keys())
def test_the_wait_counts_from_the_last_final_reply_while_requests_are_out(steps):
    clock = ReplyClock()
    for now, what, in_flight, want in steps:
        if what == "reply":
            clock.replied(now)
        else:
            assert clock.waited(in_flight, now) == want, (now, in_flight)
