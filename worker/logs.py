"""structlog set-up: JSON lines (or console) with context bound once at intake.

A worker writes a line per answered request at the default level, so the JSON path is kept
cheap: msgspec renders the line (anything it cannot encode is written as its repr, as structlog's
JSON renderer does) and the timestamp's date and time are formatted once a second.
"""

from __future__ import annotations

import logging
import sys
import time

import msgspec
import structlog

_json = msgspec.json.Encoder(enc_hook=repr)
_json_fallback = structlog.processors.JSONRenderer()


def partition_name(tp) -> str:
    """A topic partition as log lines and failure reasons write it: `topic[partition]`."""
    return f"{tp.topic}[{tp.partition}]"


def render_json(logger, name, event_dict: dict) -> str:
    try:
        return _json.encode(event_dict).decode()
    except Exception:  # noqa: BLE001 - a line msgspec refuses is still written, by structlog's renderer
        return _json_fallback(logger, name, event_dict)


class _UtcTimestamp:
    """`timestamp`: ISO 8601 in UTC with microseconds and a `Z`, as structlog's
    `TimeStamper(fmt="iso", utc=True)` writes it."""

    def __init__(self):
        self._second, self._prefix = -1, ""

    def __call__(self, _logger, _name, event_dict: dict) -> dict:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._prefix = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        event_dict["timestamp"] = f"{self._prefix}.{int((now - second) * 1e6):06d}Z"
        return event_dict


def configure(level: str = "info", fmt: str = "json", file=None) -> None:
    """`file`: where lines go (stderr by default)."""
    renderer = render_json if fmt == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            _UtcTimestamp(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file or sys.stderr),
        cache_logger_on_first_use=True,
    )
