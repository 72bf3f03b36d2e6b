"""Bounds an operator can tune; checked on every request after decoding (the `limits` settings section)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

Positive = Annotated[int, Meta(ge=1)]


class Limits(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_record_bytes: Positive = 1 << 20
    max_tokens: Positive = 1024  # the setting `max_tokens_limit`: the largest max_tokens a request may ask
    default_max_tokens: Positive = 64
    max_stop: Annotated[int, Meta(ge=0)] = 4
    max_stop_chars: Positive = 64
    max_messages: Positive = 64
    max_prompt_chars: Positive = 256 * 1024
    max_labels: Positive = 16
    max_label_chars: Positive = 64
    # JSON arrays/objects nested deeper than this are refused before decoding
    max_nesting_depth: Positive = 32
    # Prompt tokens are bounded by the model context; None means "the model's".
    max_prompt_tokens: Positive | None = None
