"""msgspec Structs for wire contract v1.

Every field added later must carry a default so older producers keep working.
Static bounds live here (they never change); bounds an operator can tune live in
`schemas.limits.Limits` and are checked after decoding.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

CONTRACT_VERSION = 1

RequestId = Annotated[str, Meta(min_length=1, max_length=128)]
TopicName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,249}$")]


class ErrorCode(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"


class Message(Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str


class Request(Struct, frozen=True, kw_only=True):
    """One inference request. Unknown fields are ignored (forward compatibility)."""

    id: RequestId
    tenant: Annotated[str, Meta(min_length=1, max_length=64)] = "default"
    kind: Literal["generate", "score"] = "generate"
    prompt: str | None = None
    messages: list[Message] | None = None
    event: dict[str, Any] | None = None
    template: str | None = None
    labels: list[str] | None = None
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: list[str] | None = None
    stream: bool = True
    deadline_ms: Annotated[int, Meta(ge=0)] | None = None
    reply_to: TopicName | None = None


class Usage(Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int


class TokenReply(Struct, frozen=True, tag="token", tag_field="type", omit_defaults=True):
    id: str
    seq: int
    text: str
    token_ids: list[int]
    # This attempt could not consult the request's stored answer and progress (Redis unavailable):
    # records of an earlier attempt for the same id, if any, may differ from it.
    unchecked: bool = False


class DoneReply(Struct, frozen=True, tag="done", tag_field="type", omit_defaults=True):
    id: str
    seq: int
    text: str
    finish_reason: str
    usage: Usage
    scores: dict[str, float] | None = None
    resumed: bool = False
    unchecked: bool = False  # as on TokenReply


class ErrorReply(Struct, frozen=True, tag="error", tag_field="type", omit_defaults=True):
    id: str
    code: ErrorCode
    message: str
    # `overloaded`: publish the request again after this long (it was not run and not stored)
    retry_after_ms: int | None = None


Reply = TokenReply | DoneReply | ErrorReply


class Envelope(Struct, frozen=True):
    """The addressing fields only: read from records that fail full validation."""

    id: Any = None
    reply_to: Any = None
