"""Script rounds sent straight to each primary (worker/redis_rounds.py), on the real Redis Cluster:
the same replies as redis-py's pipeline, and the refusals (NOSCRIPT, MOVED) taken back to it."""

import uuid

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from worker.redis_rounds import Script, run_scripts

pytestmark = pytest.mark.integration

ECHO_AND_COUNT = Script("redis.call('INCR', KEYS[1]) return {KEYS[1], ARGV[1], redis.call('GET', KEYS[1])}")


@pytest.fixture
async def cluster(settings):
    client = RedisCluster.from_url(settings.redis.url)
    await client.initialize()
    yield client
    await client.aclose()


def calls(n: int, tag: str) -> list:
    # ids spread over every primary; each call's keys share a hash tag
    return [(ECHO_AND_COUNT, [f"rounds:{{{tag}-{i}}}:n"], [f"v{i}".encode()]) for i in range(n)]


async def test_replies_come_back_in_call_order_from_every_primary(cluster):
    tag = uuid.uuid4().hex[:6]
    first = await run_scripts(cluster, calls(60, tag))
    assert len({cluster.nodes_manager.get_node_from_slot(key_slot(f"rounds:{{{tag}-{i}}}:n".encode())).name
                for i in range(60)}) == 3  # the round touched all three primaries
    assert first == [[f"rounds:{{{tag}-{i}}}:n".encode(), f"v{i}".encode(), b"1"] for i in range(60)]
    # the same as redis-py's own pipeline gives
    pipe = cluster.pipeline()
    for script, keys, args in calls(60, tag):
        pipe.eval(script.body, len(keys), *keys, *args)
    assert await pipe.execute() == [[f"rounds:{{{tag}-{i}}}:n".encode(), f"v{i}".encode(), b"2"] for i in range(60)]


async def test_an_unloaded_script_runs_once_through_eval(cluster):
    tag = uuid.uuid4().hex[:6]
    for node in cluster.get_primaries():  # as after a failover to a primary that never loaded it
        await cluster.execute_command("SCRIPT", "FLUSH", target_nodes=node)
    assert await run_scripts(cluster, calls(10, tag)) == [
        [f"rounds:{{{tag}-{i}}}:n".encode(), f"v{i}".encode(), b"1"] for i in range(10)]  # each ran once
    assert (await run_scripts(cluster, calls(10, tag)))[0][2] == b"2"  # loaded now: by SHA


async def test_a_stale_slot_map_is_redirected_and_each_command_runs_once(cluster):
    tag = uuid.uuid4().hex[:6]
    key = f"rounds:{{{tag}-0}}:n"
    slot = key_slot(key.encode())
    owner = cluster.nodes_manager.slots_cache[slot][0]
    wrong = next(n for n in cluster.get_primaries() if n.name != owner.name)
    cluster.nodes_manager.slots_cache[slot] = [wrong]  # as if the slot had moved since the map was read
    assert await run_scripts(cluster, calls(1, tag)) == [[key.encode(), b"v0", b"1"]]  # MOVED, then sent once
    assert await cluster.get(key) == b"1"


async def test_a_script_error_is_raised(cluster):
    failing = Script("return redis.error_reply('no such thing')")
    with pytest.raises(Exception, match="no such thing"):
        await run_scripts(cluster, [(failing, [f"rounds:{{{uuid.uuid4().hex}}}:x"], [])])


SLOW = Script("local t = redis.call('TIME') local until_us = t[1] * 1e6 + t[2] + tonumber(ARGV[1]) * 1000 "
              "while true do t = redis.call('TIME') if t[1] * 1e6 + t[2] >= until_us then break end end return 1")


async def test_a_round_cut_off_between_its_replies_leaves_no_reply_for_the_next_round(cluster):
    """The replies after a round's first are read without a timer each: the caller's timeout bounds the
    round, and a round it cuts off closes its connection, so the next round reads only its own replies."""
    import asyncio
    import time

    tag = uuid.uuid4().hex[:6]
    key = f"rounds:{{{tag}}}:n"
    fast, slow = (ECHO_AND_COUNT, [key], [b"a"]), (SLOW, [key], [b"1200"])
    await run_scripts(cluster, [fast, fast])  # loaded by SHA, and the node's connection is made
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.4):  # the first reply comes at once, the second after 1.2 s
            await run_scripts(cluster, [fast, slow, fast])
    assert time.monotonic() - started < 1.0  # cut off by the caller's bound, not left waiting for the script
    await asyncio.sleep(1.0)  # the script ends on the node
    # the next round on the same client: its own replies, not the cut-off round's leftovers
    (reply,) = await run_scripts(cluster, [fast])
    assert reply[:2] == [key.encode(), b"a"] and reply[2] == await cluster.get(key)  # this round's count


BOTH_KEYS = Script("redis.call('INCR', KEYS[1]) redis.call('INCR', KEYS[2]) return 1")


async def test_a_slot_being_resharded_answers_each_call_once_on_the_node_that_holds_its_key(cluster):
    """A reshard in progress (what `redis-cli --cluster reshard` does, caught half-way): one key of
    the slot already moved to the importing primary, one not yet. The migrating primary answers ASK
    for the moved key; the round sends that call again through redis-py, which follows the ASK, and
    every call runs once. The reshard is then undone: the moved keys go back, both nodes stable."""
    import asyncio

    tag = uuid.uuid4().hex[:6]
    moved, stayed = f"rounds:{{{tag}}}:moved", f"rounds:{{{tag}}}:stayed"
    slot = key_slot(moved.encode())
    source = cluster.nodes_manager.get_node_from_slot(slot)
    target = next(n for n in cluster.get_primaries() if n.name != source.name)

    async def on(node, *command):
        return await cluster.execute_command(*command, target_nodes=node)

    async def undo():
        """The source still owns the slot: once stable it takes the moved keys back. (Only with nothing
        writing to the slot: a call reaching the source between the two steps would make a new key.)"""
        await on(source, "CLUSTER", "SETSLOT", slot, "STABLE")
        for key in await on(target, "CLUSTER", "GETKEYSINSLOT", slot, 100):
            await on(target, "MIGRATE", source.host, source.port, "", 0, 5000, "KEYS", key)
        await on(target, "CLUSTER", "SETSLOT", slot, "STABLE")

    both = [(ECHO_AND_COUNT, [moved], [b"a"]), (ECHO_AND_COUNT, [stayed], [b"b"])]
    await run_scripts(cluster, both)
    source_id, target_id = [(await on(n, "CLUSTER", "MYID")).decode() for n in (source, target)]
    await on(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    await on(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    split = None
    try:
        await on(source, "MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", moved)
        assert await run_scripts(cluster, both) == [[moved.encode(), b"a", b"2"], [stayed.encode(), b"b", b"2"]]
        # one call over both keys, split between the nodes in this moment: refused (TRYAGAIN, retried by
        # redis-py until its redirects run out) and run nowhere; the answer store counts that round
        # as a Redis failure (its degraded mode)
        with pytest.raises(Exception, match="TTL exhausted|TRYAGAIN"):
            await run_scripts(cluster, [(BOTH_KEYS, [moved, stayed], [])])
        # a split that ends while redis-py is still retrying (the slot's other key moves too, as a
        # reshard moves a slot's keys a batch at a time) is ridden out: the call runs once, on the node
        # that now holds both keys
        split = asyncio.create_task(run_scripts(cluster, [(BOTH_KEYS, [moved, stayed], [])]))
        await asyncio.sleep(0.05)  # redis-py retries for about 0.4 s
        await on(source, "MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", stayed)
        assert await split == [1]
    finally:
        if split is not None and not split.done():  # nothing may write to the slot while it moves back
            split.cancel()
            await asyncio.gather(split, return_exceptions=True)
        await undo()
    assert await on(target, "CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert [await cluster.get(moved), await cluster.get(stayed)] == [b"3", b"3"]  # each call ran once
