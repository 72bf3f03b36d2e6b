"""Topic catalog: the one place topic names, classes and partition counts come from."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec
from msgspec import Meta, Struct
from typing import Annotated

TopicName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,249}$")]
CLASSES = ("realtime", "standard", "batch")


class Topic(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: TopicName
    role: Literal["requests", "replies", "dlq", "audit"]
    partitions: Annotated[int, Meta(ge=1)]
    replication_factor: Annotated[int, Meta(ge=1)] = 1
    config: dict[str, str] = {}
    # request topics only
    # `class` is a keyword in Python; TOML spells it `class`.
    latency_class: Literal["realtime", "standard", "batch"] | None = msgspec.field(default=None, name="class")
    priority: int = 0
    slo_ms: int | None = None
    # tenancy_mode topic: records of this topic belong to this tenant (a tenant-dedicated topic);
    # none: a shared topic, whose records belong to SLUICE_TENANCY_TENANT
    tenant: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")] | None = None
    # admission and intake policy (request topics; see worker/policy.py)
    max_in_engine: Annotated[int, Meta(ge=1)] = 32
    contended_in_engine: Annotated[int, Meta(ge=1)] = 32
    min_in_engine: Annotated[int, Meta(ge=1)] = 1
    max_waiting: Annotated[int, Meta(ge=1)] = 256
    window_ms: Annotated[int, Meta(ge=0)] = 0
    batch_size: Annotated[int, Meta(ge=1)] = 64

    @property
    def retention_ms(self) -> int | None:
        """How long the broker keeps the topic's records (`retention.ms`); None when unbounded or unset."""
        try:
            ms = int(self.config.get("retention.ms", ""))
        except ValueError:
            return None
        return ms if ms > 0 else None


class Catalog(Struct, frozen=True):
    topic: list[Topic]

    def __post_init__(self):
        roles = [t.role for t in self.topic]
        if roles.count("replies") != 1 or roles.count("dlq") != 1:
            raise ValueError("topics file needs exactly one `replies` and one `dlq` topic")
        if roles.count("audit") > 1:
            raise ValueError("topics file may have one `audit` topic")
        keys = [(t.latency_class, t.tenant) for t in self.topic if t.role == "requests"]
        if not keys or any(cls is None for cls, _ in keys):
            raise ValueError("each request topic needs a `class` (realtime | standard | batch)")
        if len(set(keys)) != len(keys):
            raise ValueError("request topics need a distinct `class` (and `tenant`, for tenant-dedicated topics)")
        if any(t.tenant is not None for t in self.topic if t.role != "requests"):
            raise ValueError("only request topics name a `tenant`")

    @property
    def requests(self) -> list[Topic]:
        return [t for t in self.topic if t.role == "requests"]

    @property
    def replies(self) -> Topic:
        return next(t for t in self.topic if t.role == "replies")

    @property
    def dlq(self) -> Topic:
        return next(t for t in self.topic if t.role == "dlq")

    @property
    def audit(self) -> Topic | None:
        """Where workers record every finished request (no audit trail without one)."""
        return next((t for t in self.topic if t.role == "audit"), None)

    def by_name(self, name: str) -> Topic | None:
        return next((t for t in self.topic if t.name == name), None)

    def request_topic(self, latency_class: str, tenant: str | None = None) -> Topic:
        """The class's shared request topic, or the topic dedicated to `tenant` (falls back to the shared one)."""
        mine = [t for t in self.requests if t.latency_class == latency_class]
        own = next((t for t in mine if tenant is not None and t.tenant == tenant), None)
        return own or next((t for t in mine if t.tenant is None), mine[0])

    def topic_tenants(self) -> dict[str, str]:
        """Tenant-dedicated request topics: topic name -> tenant."""
        return {t.name: t.tenant for t in self.requests if t.tenant is not None}

    def serving(self, classes) -> "Catalog":
        """The catalog a worker of a class-dedicated pool consumes: these request topics, the same replies and DLQ."""
        wanted = set(classes)
        unknown = wanted - {t.latency_class for t in self.requests}
        if unknown:
            raise ValueError(f"no request topic for class {', '.join(sorted(unknown))} in the topics file")
        return Catalog([t for t in self.topic if t.role != "requests" or t.latency_class in wanted])

    def renamed(self, prefix: str) -> "Catalog":
        """The same catalog with every name prefixed (isolated test and demo runs)."""
        return Catalog([msgspec.structs.replace(t, name=f"{prefix}{t.name}") for t in self.topic])


def write_renamed(prefix: str, path: str | Path) -> Path:
    """The bundled topics file with every name prefixed, for worker processes of an isolated run."""
    path = Path(path)
    path.write_text(resources.files(__name__).joinpath("default.toml").read_text()
                    .replace('name = "sluice.', f'name = "{prefix}sluice.'))
    return path


def load(path: str | Path | None = None) -> Catalog:
    text = Path(path).read_text() if path else resources.files(__name__).joinpath("default.toml").read_text()
    try:
        return msgspec.convert(tomllib.loads(text), Catalog)
    except (msgspec.ValidationError, tomllib.TOMLDecodeError, ValueError) as exc:
        raise ValueError(f"topics file {path or 'topics/default.toml'}: {exc}") from None
