"""Joining the consumer group while the engine loads, when no other member serves its partitions.

A worker is ready once its engine has loaded and the group has assigned it partitions. One after
the other, the two waits add up: the coordinator holds a new group's first join (Kafka's
`group.initial.rebalance.delay.ms`, 3 s by default; the embedded broker about half the session
timeout), and a restarted engine loads for tens of seconds. While the group has no live member,
no one serves its partitions whatever this worker does, so it joins at once and the coordinator's
hold passes during the load. While the group has members, they serve the partitions meanwhile:
the worker asks again every second, and if they are still there when its engine is ready it
joins then, as before, so that a share of the partitions never waits on a loading engine (a
rolling update, a scale-out).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

import structlog

log = structlog.get_logger("sluice.worker")

POLL_S = 1.0
# States in which the coordinator holds no member (Kafka's names)
EMPTY_STATES = frozenset({"Empty", "Dead"})


def live_members(response) -> int | None:
    """Members of the one group a DescribeGroups response describes; None when the coordinator
    answered with an error (the group is not ours to describe, the coordinator is moving)."""
    (group,) = response.groups
    error_code, _name, state, _protocol_type, _protocol, members = group[:6]
    if error_code:
        return None
    return 0 if state in EMPTY_STATES else len(members)


async def when_alone(kafka_options: dict, group_id: str, join: Callable[[], None], poll_s: float = POLL_S,
                     timeout_s: float = 5.0) -> None:
    """Call `join()` as soon as `group_id` has no live member; runs until then or until cancelled (the
    engine is ready first: the worker joins then). A coordinator that cannot say (no DescribeGroups for
    these credentials, an error) ends it without a call: the worker joins once loaded."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**kafka_options, request_timeout_ms=int(timeout_s * 1000))
    told = False
    try:
        await admin.start()
        while True:
            (response,) = await admin.describe_consumer_groups([group_id])
            members = live_members(response)
            if members is None:
                log.info("group_join_after_loading", group=group_id, reason="the coordinator did not describe the group")
                return
            if members == 0:
                log.info("group_joining_while_loading", group=group_id,
                         note="no other member serves the partitions: the join's hold passes during the load")
                join()
                return
            if not told:
                log.info("group_join_after_loading", group=group_id, members=members,
                         note="its members serve the partitions while this worker's engine loads")
                told = True
            await asyncio.sleep(poll_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - an optimisation: without it the worker joins once loaded
        log.info("group_join_after_loading", group=group_id, reason=f"describing the group failed: {exc!r}"[:300])
    finally:
        with contextlib.suppress(Exception):
            await admin.close()
