"""The audit trail: one record per finished request on the audit topic (`role = "audit"` in the topics
file), produced before the request's offset is committed, so a committed request always has one.

A request answered again from the store (a repeated id) gets a record with outcome `duplicate`;
one refused at intake gets its error code. Prompt and output text are included only where the
operator enables it (`SLUICE_AUDIT_CONTENT`): by default the trail says who asked what kind of
thing and what came of it, not what was said.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct


class AuditSource(Struct, frozen=True):
    topic: str
    partition: int
    offset: int


class AuditRecord(Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str | None  # None: a record with no readable id (dead-lettered)
    tenant: str | None  # the authenticated tenant; None when it could not be established
    latency_class: str = msgspec.field(name="class")
    outcome: str  # finish reason (stop, length, scored), error code, or `duplicate`
    source: AuditSource
    worker: str  # host:pid:instance of the worker that answered
    model: str = ""  # the model fingerprint (weights, dtype, KV cache dtype)
    kind: str | None = None
    finish_reason: str | None = None
    scores: dict[str, float] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    produced_ms: int = 0  # the request record's timestamp
    answered_ms: int = 0
    resumed: bool = False
    message: str | None = None  # error replies: what was wrong
    prompt: str | None = None  # only with SLUICE_AUDIT_CONTENT
    text: str | None = None  # only with SLUICE_AUDIT_CONTENT


encoder = msgspec.json.Encoder()
decoder = msgspec.json.Decoder(AuditRecord)
