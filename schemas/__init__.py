"""Wire contract v1: the records outside producers and consumers rely on."""

from schemas.wire import (
    CONTRACT_VERSION,
    DoneReply,
    ErrorCode,
    ErrorReply,
    Message,
    Reply,
    Request,
    TokenReply,
    Usage,
)
from schemas.limits import Limits
from schemas.codec import BadRequest, RequestCodec, ReplyCodec
from schemas import dlq

__all__ = [
    "CONTRACT_VERSION",
    "BadRequest",
    "DoneReply",
    "ErrorCode",
    "ErrorReply",
    "Limits",
    "Message",
    "Reply",
    "ReplyCodec",
    "Request",
    "RequestCodec",
    "TokenReply",
    "Usage",
    "dlq",
]
