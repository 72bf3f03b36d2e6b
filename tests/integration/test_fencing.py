"""Claims and fencing in the real Redis Cluster (the Lua write-if-owner script and the claim pipeline)."""

import uuid

import pytest

from worker.answers import AnswerStore

pytestmark = pytest.mark.integration


async def test_a_later_claim_fences_the_earlier_attempt(settings):
    store = AnswerStore(settings.redis.url, f"fence-{uuid.uuid4().hex[:6]}", 60, settings.redis.timeout_ms)
    await store.start()
    try:
        assert await store.lookup_many(["r1"], [True], ["A#1"]) == [(None, None)]
        assert await store.append_chunks("r1", [(0, [1, 2], "hi")], {"fraud": 0.5}, owner="A#1") is True
        # the group moved the partition: B reads the record, finds A's progress, claims the request
        (answer, progress), = await store.lookup_many(["r1"], [True], ["B#7"])
        assert answer is None and progress.chunks == [([1, 2], "hi")] and progress.scores == {"fraud": 0.5}
        assert await store.append_chunks("r1", [(1, [3], "A's")], owner="A#1") is False  # A is fenced
        assert await store.put_later("r1", b'{"type":"done","by":"A"}', "A#1") is False  # and cannot answer
        assert await store.append_chunks("r1", [(1, [4], "B's")], owner="B#7") is True
        assert await store.put_later("r1", b'{"type":"done"}', "B#7") is True
        (answer, progress), = await store.lookup_many(["r1"], [True], ["C#1"])
        assert answer == b'{"type":"done"}' and progress is None  # answered: progress and claim are gone
        assert await store.append_chunks("r1", [(0, [5], "late")], owner="B#7") is False
    finally:
        await store.stop()


async def test_a_claim_lost_in_redis_is_taken_again_not_counted_as_a_takeover(settings):
    """A Redis node that failed over or restarted before it had a request's claim loses the key. No
    other run took the request, so the run goes on and takes its claim again; it is fenced only when
    another run holds the claim or has stored the answer. (Counted fenced, the run's record was
    finished with nobody left to answer it: a request lost and its offset committed, found by the
    chaos harness with a Redis master killed beside a paused worker.)"""
    from redis.asyncio.cluster import RedisCluster

    from worker import metrics

    store = AnswerStore(settings.redis.url, f"fence-{uuid.uuid4().hex[:6]}", 60, settings.redis.timeout_ms)
    redis = RedisCluster.from_url(settings.redis.url)
    retaken = lambda: metrics.REGISTRY.get_sample_value("sluice_claims_retaken_total") or 0.0  # noqa: E731
    await store.start()
    try:
        before = retaken()
        assert await store.lookup_many(["r1"], [True], ["A#1"]) == [(None, None)]
        await redis.delete(store.owner_key("r1"))  # the claim lost with a Redis node
        assert await store.append_chunks("r1", [(0, [1], "a")], owner="A#1") is True
        assert await redis.get(store.owner_key("r1")) == b"A#1"  # taken again
        assert retaken() == before + 1
        await redis.delete(store.owner_key("r1"))
        assert await store.put_later("r1", b'{"type":"done","by":"A"}', "A#1") is True  # answered over the loss
        assert retaken() == before + 2
        (answer, progress), = await store.lookup_many(["r1"], [True], ["C#1"])
        assert answer == b'{"type":"done","by":"A"}' and progress is None

        # gone because another run answered: fenced, and nothing of this run is stored
        assert await store.lookup_many(["r2"], [True], ["A#1"]) == [(None, None)]
        assert await store.lookup_many(["r2"], [True], ["B#7"]) == [(None, None)]
        assert await store.put_later("r2", b'{"type":"done","by":"B"}', "B#7") is True  # deletes the claim
        assert await store.append_chunks("r2", [(0, [2], "late")], owner="A#1") is False
        assert await store.put_later("r2", b'{"type":"done","by":"A"}', "A#1") is False
        assert await redis.get(store.owner_key("r2")) is None
        (answer, _), = await store.lookup_many(["r2"], [True], [""])
        assert answer == b'{"type":"done","by":"B"}'
        assert retaken() == before + 2
    finally:
        await store.stop()
        await redis.aclose()


async def test_concurrent_appends_share_rounds_and_keep_their_own_results(settings):
    """Appends made meanwhile are pipelined together: each still gets its own verdict."""
    import asyncio

    store = AnswerStore(settings.redis.url, f"fence-{uuid.uuid4().hex[:6]}", 60, settings.redis.timeout_ms)
    await store.start()
    try:
        ids = [f"r{i}" for i in range(40)]
        await store.lookup_many(ids, [True] * 40, [f"A#{i}" for i in range(40)])
        await store.lookup_many(ids[:10], [True] * 10, ["B#1"] * 10)  # B took over the first ten
        rounds, call = [], store._call
        store._call = lambda fn: rounds.append(fn) or call(fn)
        verdicts = await asyncio.gather(*(store.append_chunks(rid, [(0, [i], f"t{i}")], owner=f"A#{i}")
                                          for i, rid in enumerate(ids)))
        assert verdicts == [False] * 10 + [True] * 30
        assert len(rounds) < 5  # not a round trip per append
        store._call = call
        found = await store.lookup_many(ids[10:], [True] * 30, ["C#1"] * 30)
        assert [p.chunks for _, p in found] == [[([i], f"t{i}")] for i in range(10, 40)]
    finally:
        await store.stop()


async def test_intake_reads_answers_and_progress_and_claims_in_one_round(settings):
    store = AnswerStore(settings.redis.url, f"fence-{uuid.uuid4().hex[:6]}", 60, settings.redis.timeout_ms)
    await store.start()
    try:
        await store.lookup_many(["done", "half"], [True, True], ["A#1", "A#2"])
        assert await store.append_chunks("half", [(0, [7], "x")], owner="A#2") is True
        assert await store.put_later("done", b'{"type":"done"}', "A#1") is True
        rounds, call = [], store._call
        store._call = lambda fn: rounds.append(fn) or call(fn)
        found = await store.lookup_many(["done", "half", "new", "quiet"], [True, True, True, False],
                                        ["B#1", "B#2", "B#3", "B#4"])
        store._call = call
        assert len(rounds) == 1
        assert found[0] == (b'{"type":"done"}', None)  # answered: re-sent, nothing claimed
        assert found[1][0] is None and found[1][1].chunks == [([7], "x")]
        assert found[2] == (None, None) and found[3] == (None, None)
        # the claims were made in that round: the earlier owner is fenced, the new ones write
        assert await store.append_chunks("half", [(1, [8], "a")], owner="A#2") is False
        assert await store.append_chunks("half", [(1, [8], "b")], owner="B#2") is True
        assert await store.append_chunks("new", [(0, [9], "c")], owner="B#3") is True
        assert await store.append_chunks("done", [(0, [9], "late")], owner="B#1") is False  # never claimed
    finally:
        await store.stop()


async def test_a_handed_over_request_is_adopted_only_from_the_dead_run_and_by_one_survivor(settings):
    """The handoff's claim (worker/handoff.py, `AnswerStore.adopt`) in the real cluster: taken only
    while the dead run holds it, by one of two survivors trying at once, with the dead run's progress;
    an answered request, or one another run claimed, is left alone; the dead run is fenced."""
    import asyncio

    from worker.answers import ADOPTED, ANSWERED, TAKEN

    store = AnswerStore(settings.redis.url, f"adopt-{uuid.uuid4().hex[:6]}", 60, settings.redis.timeout_ms)
    await store.start()
    try:
        await store.lookup_many(["r1", "r2", "r3"], [True, True, False], ["dead#1", "dead#2", "dead#3"])  # the dead runs claim
        assert await store.append_chunks("r1", [(0, [1, 2], "so far")], owner="dead#1") is True
        # two survivors read the same handoff entry
        first, second = await asyncio.gather(store.adopt("r1", True, "dead#1", "S#1"),
                                             store.adopt("r1", True, "dead#1", "T#1"))
        assert sorted([first[0], second[0]]) == [ADOPTED, TAKEN], (first, second)
        winner, progress = ("S#1", first[1]) if first[0] == ADOPTED else ("T#1", second[1])
        assert progress.chunks == [([1, 2], "so far")]
        assert await store.append_chunks("r1", [(1, [3], "dead")], owner="dead#1") is False  # the dead run is fenced
        assert await store.append_chunks("r1", [(1, [4], " more")], owner=winner) is True
        # answered before anyone adopted it: left alone, and nothing claimed
        assert await store.put_later("r2", b'{"type":"done"}', "dead#2") is True
        assert await store.adopt("r2", True, "dead#2", "S#2") == (ANSWERED, None)
        # the rebalance's new owner claimed it first: left alone
        assert await store.lookup_many(["r3"], [False], ["N#1"]) == [(None, None)]
        assert await store.adopt("r3", False, "dead#3", "S#3") == (TAKEN, None)
        assert await store.append_chunks("r3", [(0, [9], "n")], owner="N#1") is True  # still the new owner's
    finally:
        await store.stop()
