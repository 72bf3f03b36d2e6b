"""One pipelined round of Lua scripts on a Redis Cluster, sent straight to each primary.

redis-py's cluster pipeline spends much of a streamed request's Redis time in Python per command
(argument encoding, a key slot per key, node lookup, its bookkeeping), and it refuses EVALSHA;
the answer store sends four scripts per streamed request and one per token record. Here each command's slot comes from one key, commands are
grouped by the primary redis-py's own slot map names, packed by hiredis and written per node
in one go, scripts called by SHA. Anything unusual goes back to redis-py:

- a command the server did not run (MOVED, ASK, TRYAGAIN, CLUSTERDOWN, NOSCRIPT) is sent again
  through redis-py's pipeline, as EVAL (which also loads the script), in its original order;
  redis-py follows the redirect and refreshes its slot map;
- a connection error raises, with no retry: part of the round may have run, and the caller treats
  the round as failed (the answer store's degraded mode), never as run twice.

Callers bound each round with a timeout of their own (the answer store's `_call`): a node that
stops in the middle of its replies is cut off there, and its connection is closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass, field

from hiredis import pack_command
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, NoScriptError, ResponseError, TryAgainError

_NOT_RUN = (AskError, TryAgainError, ClusterDownError, NoScriptError)  # MovedError is an AskError
_NOT_RUN_PREFIXES = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "NOSCRIPT")


@dataclass(frozen=True)
class Script:
    body: str
    sha: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "sha", hashlib.sha1(self.body.encode()).hexdigest())


def not_run(result) -> bool:
    """The server refused the command before running it: safe to send again."""
    return isinstance(result, _NOT_RUN) or (isinstance(result, ResponseError)
                                            and str(result).startswith(_NOT_RUN_PREFIXES))


async def _node_round(node, commands: list[tuple]) -> list:
    """Commands (EVALSHA argument tuples) on one node's connection, one write; per command its
    reply or the error reply it got (read in full, so the connection stays in step)."""
    conn = node.acquire_connection()
    try:
        await node.disconnect_if_needed(conn)
        await conn.send_packed_command(b"".join(map(pack_command, commands)), check_health=False)
        out = []
        for k in range(len(commands)):
            try:
                # The first reply waits up to the socket timeout. The others follow it on the same
                # connection: read without a timer each (the callers bound the whole round).
                out.append(await conn.read_response(timeout=None if k == 0 else math.inf))
            except ResponseError as exc:
                out.append(exc)
        return out
    finally:
        try:
            await node.disconnect_if_needed(conn)
        finally:
            node.release(conn)


async def run_scripts(client, calls: list[tuple[Script, list[str], list]]) -> list:
    """(script, keys, args) per call, the keys of one call in one slot; the replies in call order.

    Raises the first error reply that is not a refusal (as redis-py's pipeline does), and any
    connection error."""
    by_node: dict = {}
    for i, (script, keys, args) in enumerate(calls):
        node = client.nodes_manager.get_node_from_slot(key_slot(keys[0].encode()))
        by_node.setdefault(node, []).append(i)
    nodes = list(by_node)
    rounds = [_node_round(node, [("EVALSHA", calls[i][0].sha, len(calls[i][1]), *calls[i][1], *calls[i][2])
                                 for i in by_node[node]]) for node in nodes]
    # one node: its round runs in this task (no task and gathering future per round)
    replies = [await rounds[0]] if len(rounds) == 1 else await asyncio.gather(*rounds)
    results: list = [None] * len(calls)
    for node, out in zip(nodes, replies):
        for i, reply in zip(by_node[node], out):
            results[i] = reply
    again = [i for i, r in enumerate(results) if not_run(r)]
    if again:
        pipe = client.pipeline()
        for i in again:
            script, keys, args = calls[i]
            pipe.eval(script.body, len(keys), *keys, *args)
        for i, reply in zip(again, await pipe.execute()):
            results[i] = reply
    failed = next((r for r in results if isinstance(r, Exception)), None)
    if failed is not None:
        raise failed
    return results
