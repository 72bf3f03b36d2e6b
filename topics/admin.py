"""`sluice topics apply | check`: create what is missing, report drift."""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from topics import Catalog


@dataclass(frozen=True)
class Drift:
    topic: str
    what: str

    def __str__(self) -> str:
        return f"{self.topic}: {self.what}"


async def _describe(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, tuple[int, int]]:
    """(partition count, fewest replicas of any partition) of the named topics that exist."""
    existing = set(await admin.list_topics())
    wanted = [n for n in names if n in existing]
    if not wanted:
        return {}
    out = {}
    for meta in await admin.describe_topics(wanted):
        if meta.get("error_code", 0) == 0:
            parts = meta["partitions"]
            out[meta["topic"]] = (len(parts), min((len(p["replicas"]) for p in parts), default=0))
    return out


async def diff(admin: AIOKafkaAdminClient, catalog: Catalog) -> tuple[list[str], list[Drift]]:
    """(missing topic names, drift of the ones that exist): a partition count other than the
    catalog's, or fewer replicas than it asks for (more are no loss)."""
    have = await _describe(admin, [t.name for t in catalog.topic])
    missing = [t.name for t in catalog.topic if t.name not in have]
    drift = []
    for t in catalog.topic:
        if t.name not in have:
            continue
        partitions, replicas = have[t.name]
        if partitions != t.partitions:
            drift.append(Drift(t.name, f"{partitions} partitions, catalog says {t.partitions}"))
        if replicas < t.replication_factor:
            drift.append(Drift(t.name, f"{replicas} replicas, catalog says {t.replication_factor}"))
    return missing, drift


async def apply(kafka_opts: dict, catalog: Catalog, create: bool = True) -> tuple[list[str], list[Drift]]:
    """Create missing topics (when `create`); returns (created or missing, drift)."""
    admin = AIOKafkaAdminClient(**kafka_opts)
    await admin.start()
    try:
        missing, drift = await diff(admin, catalog)
        if create and missing:
            await admin.create_topics([
                NewTopic(t.name, t.partitions, t.replication_factor, topic_configs=dict(t.config))
                for t in catalog.topic if t.name in missing
            ])
        return missing, drift
    finally:
        await admin.close()
