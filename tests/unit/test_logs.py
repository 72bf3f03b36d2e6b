"""The worker's JSON log lines: what structlog's own JSON renderer and ISO timestamper write."""

import io
import json
import time
from datetime import datetime, timezone

import structlog

from worker.logs import _UtcTimestamp, configure, render_json


class Opaque:
    def __repr__(self):
        return "<opaque 7>"

    def __str__(self):
        return "opaque"


def test_rendered_like_structlogs_json_renderer():
    event = {"event": "request_answered", "request_id": "r-1", "cls": "standard", "segments": 2, "ok": True,
             "ratio": 0.25, "none": None, "nested": {"a": [1, "b"]}, "thing": Opaque(), "text": "é\n\"q\""}
    ours = render_json(None, "info", dict(event))
    theirs = structlog.processors.JSONRenderer()(None, "info", dict(event))
    assert json.loads(ours) == json.loads(theirs)
    assert json.loads(ours)["thing"] == "<opaque 7>"


def test_a_line_msgspec_refuses_is_still_written(monkeypatch):
    import worker.logs

    class Refusing:
        def encode(self, obj):
            raise TypeError("refused")

    monkeypatch.setattr(worker.logs, "_json", Refusing())
    line = render_json(None, "info", {"event": "odd", "n": 1})
    assert json.loads(line) == {"event": "odd", "n": 1}


def test_timestamp_is_iso_utc_with_microseconds_and_z_as_structlog_writes_it(monkeypatch):
    monkeypatch.setenv("TZ", "America/New_York")  # a local time that is not UTC would show
    time.tzset()
    monkeypatch.undo()
    ours = _UtcTimestamp()
    theirs = structlog.processors.TimeStamper(fmt="iso", utc=True)
    before = datetime.now(timezone.utc)
    stamps = [ours(None, "info", {})["timestamp"] for _ in range(2000)]
    after = datetime.now(timezone.utc)
    reference = theirs(None, "info", {})["timestamp"]
    assert all(len(s) == len(reference) and s.endswith("Z") and s[10] == "T" for s in stamps)
    parsed = [datetime.fromisoformat(s.replace("Z", "+00:00")) for s in stamps]
    assert before.replace(microsecond=before.microsecond // 1000 * 1000) <= parsed[0]
    assert parsed == sorted(parsed) and parsed[-1] <= after
    time.tzset()


def test_configured_worker_writes_one_json_line_per_event():
    out = io.StringIO()
    configure("info", "json", file=out)
    try:
        log = structlog.get_logger("sluice.test")
        log.debug("hidden")
        log.info("request_answered", request_id="r-9", segments=1)
        [line] = out.getvalue().splitlines()
        record = json.loads(line)
        assert record["event"] == "request_answered" and record["level"] == "info" and record["request_id"] == "r-9"
        assert datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).tzinfo is not None
    finally:
        structlog.reset_defaults()
