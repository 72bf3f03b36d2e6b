"""Bounds an operator can tune; checked on every request after decoding."""

from __future__ import annotations

from msgspec import Struct


class Limits(Struct, frozen=True, kw_only=True):
    max_record_bytes: int = 1 << 20
    max_tokens: int = 1024
    default_max_tokens: int = 64
    max_stop: int = 4
    max_stop_chars: int = 64
    max_messages: int = 64
    max_prompt_chars: int = 256 * 1024
    max_labels: int = 16
    max_label_chars: int = 64
    # JSON arrays/objects nested deeper than this are refused before decoding
    max_nesting_depth: int = 32
    # Prompt tokens are bounded by the model context; None means "the model's".
    max_prompt_tokens: int | None = None
