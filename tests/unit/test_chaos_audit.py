"""The chaos auditor catches each breach of the contract it checks, and passes a clean run."""

import msgspec
import pytest

from loadgen.chaos.audit import FAILURES, Audit, failed
from loadgen.chaos.faults import FaultError, schedule

T = ("t.requests.standard", 0)


def tok(rid, seq, text, unchecked=False):
    return msgspec.json.encode({"type": "token", "id": rid, "seq": seq, "text": text, "token_ids": [1],
                                "unchecked": unchecked})


def done(rid, seq, text, resumed=False, unchecked=False):
    return msgspec.json.encode({"type": "done", "id": rid, "seq": seq, "text": text, "finish_reason": "length",
                                "usage": {"prompt_tokens": 3, "completion_tokens": seq}, "resumed": resumed,
                                "unchecked": unchecked})


def error(rid, code="internal"):
    return msgspec.json.encode({"type": "error", "id": rid, "code": code, "message": "m"})


def clean(a: Audit) -> None:
    """Two streamed requests and one not, answered in order and committed after."""
    a.sent("a", True, (*T, 0))
    a.sent("b", True, (*T, 1))
    a.sent("c", False, (*T, 2))
    for value, ts in [(tok("a", 0, "x"), 10), (tok("a", 1, "y"), 11), (done("a", 2, "xy"), 12),
                      (tok("b", 0, "p"), 13), (done("b", 1, "p"), 14), (done("c", 5, "hello"), 15)]:
        a.reply(value, ts)
    a.committed(20, {T: 3})
    a.ends({T: 3}, {T: 3})


def test_a_clean_run_passes_and_counts():
    a = Audit()
    clean(a)
    c = a.counts()
    assert failed(c) == [] and c["requests"] == 3 and c["done"] == 3 and a.pending() == 0


def test_repeats_that_are_identical_pass():
    a = Audit()
    clean(a)
    a.reply(tok("a", 1, "y"), 30)  # a failover re-sends what a reader may have seen
    a.reply(done("a", 2, "xy", resumed=True), 31)  # `resumed` is not content
    assert failed(a.counts()) == []


BREACHES = {
    "lost": lambda a: a.sent("d", True, (*T, 3)),
    "seq_conflicts": lambda a: a.reply(tok("a", 1, "z"), 30),
    "torn_streams": lambda a: (a.sent("g", True, (*T, 3)), a.reply(tok("g", 1, "q"), 30), a.reply(done("g", 2, "?q"), 31)),
    "differing_finals": lambda a: a.reply(done("b", 1, "other"), 30),
    "fuzz_unaccounted": lambda a: a.fuzzed((*T, 9), "never-answered"),
    "commit_violations": lambda a: (a.sent("late", True, (*T, 3)), a.committed(25, {T: 4}),
                                    a.reply(done("late", 0, ""), 30)),
    "uncommitted": lambda a: a.ends({T: 2}, {T: 3}),
    "malformed_replies": lambda a: a.reply(b"{not a reply", 30),
}


@pytest.mark.parametrize("column", FAILURES)
def test_each_breach_is_caught(column):
    a = Audit()
    clean(a)
    BREACHES[column](a)
    assert column in failed(a.counts()), a.counts()


def test_an_attempt_marked_unchecked_is_signalled_not_a_breach():
    a = Audit()
    clean(a)
    a.reply(tok("a", 0, "other", unchecked=True), 30)  # a run that could not see the first one
    a.reply(done("a", 1, "other", unchecked=True), 31)
    c = a.counts()
    assert failed(c) == [] and c["signalled_conflicts"] == 2


def test_tokens_for_an_unstreamed_request_are_torn():
    a = Audit()
    clean(a)
    a.reply(tok("c", 0, "he"), 40)
    assert failed(a.counts()) == ["torn_streams"]


def test_a_done_with_seqs_but_no_tokens_is_torn():
    a = Audit()
    a.sent("e", True, (*T, 0))
    a.reply(done("e", 3, "abc"), 5)
    assert failed(a.counts()) == ["torn_streams"]


def test_a_fuzzed_record_is_accounted_by_dead_letter_or_by_its_id():
    a = Audit()
    a.fuzzed((*T, 0), None)
    a.fuzzed((*T, 1), "z1")
    assert a.counts()["fuzz_unaccounted"] == 2
    a.dead_letter((*T, 0), 5)
    a.reply(error("z1", "invalid_request"), 6)
    assert a.counts()["fuzz_unaccounted"] == 0 and a.pending() == 0


def test_a_commit_is_checked_against_when_each_record_was_answered():
    a = Audit()
    a.sent("a", True, (*T, 0))
    a.reply(done("a", 0, ""), 100)
    a.committed(99, {T: 1})  # committed before the answer was produced: a breach
    assert len(a.violations) == 1
    b = Audit()
    b.sent("a", True, (*T, 0))
    b.reply(done("a", 0, ""), 100)
    b.committed(101, {T: 1})
    b.committed(102, {T: 1})
    assert b.violations == []


def test_a_record_taken_over_by_a_later_one_with_its_id_may_be_committed_first():
    a = Audit()
    a.fuzzed((*T, 0), "dup")
    a.fuzzed((*T, 1), "dup")  # fences the first; answers the id
    a.committed(10, {T: 1})  # the first committed before any final: the second still owes it
    a.reply(error("dup", "invalid_request"), 20)
    a.committed(30, {T: 2})
    assert a.violations == []
    b = Audit()
    b.fuzzed((*T, 0), "dup")
    b.fuzzed((*T, 1), "dup")
    b.committed(10, {T: 2})  # both committed, no final yet: lost if the worker dies now
    b.reply(error("dup", "invalid_request"), 20)
    assert len(b.violations) == 2


def test_the_fault_schedule_spreads_over_the_window_and_names_unknown_faults():
    s = schedule("kill,pause,kill", 100)
    assert [f.kind for f in s] == ["kill", "pause", "kill"]
    assert s[0].at_s == 10 and all(a.at_s < b.at_s < 100 for a, b in zip(s, s[1:]))
    with pytest.raises(FaultError, match="unknown fault 'reboot'"):
        schedule("kill,reboot", 100)
