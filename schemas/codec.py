"""Decoding requests and encoding replies; encoders and decoders are built once."""

from __future__ import annotations

import functools
import json
import re

import msgspec

from schemas.limits import Limits
from schemas.wire import Envelope, ErrorCode, Reply, Request, RequestId, TopicName

CONTENT_TYPE = "content-type"
JSON = "application/json"
MSGPACK = "application/msgpack"

_id_ok = msgspec.json.Decoder(RequestId)
_topic_ok = msgspec.json.Decoder(TopicName)
# Error texts travel in replies and DLQ headers; anything taken from a record is cut to this.
MAX_MESSAGE_CHARS = 512
_DEPTH_ONLY = bytes.maketrans(b"{}", b"[]")
# a JSON string, as the "unrolled loop" (runs of plain bytes between escapes): the same matches as
# `"(?:[^"\\]|\\.)*"`, which steps once per byte: 11 ms against 1.2 ms for a 256 KiB chat of source
# code (bench/decode.py)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# deleted before `_DEPTH_ONLY` maps what is left (bytes.translate deletes first): braces must stay
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# half of a UTF-16 surrogate pair without its other half: a high one not followed by a low one, or a
# low one not preceded by a high one; an escape only after an even run of backslashes (the JSON text
# `\\ud800` is an escaped backslash, then the letters "ud800")
_LONE_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*(?:(?P<high>\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u[dD][c-fC-F])"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})(?P<low>\\u[dD][c-fC-F][0-9a-fA-F]{2}))")


def cap(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A message of at most `limit` chars, marked where it was cut."""
    return text if len(text) <= limit else text[: limit - 14] + "... (truncated)"


def json_depth_exceeds(value: bytes, limit: int) -> bool:
    """True when JSON `value` nests arrays/objects deeper than `limit` (or its brackets do not balance).

    Decoders recurse per level; a record nested thousands deep must be refused before one does.
    Fast path: fewer brackets than the limit cannot nest deeper. Otherwise strings are blanked,
    and each pass removes the innermost `[]` pairs (C-speed `bytes.replace`), at most `limit` passes.
    """
    if value.count(b"[") + value.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", value).translate(_DEPTH_ONLY, _NOT_BRACKETS)
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"")
        if shorter == brackets:
            break
        brackets = shorter
    return bool(brackets)


class BadRequest(Exception):
    """A record that cannot be served. `id`/`reply_to` are set when readable."""

    def __init__(self, code: ErrorCode, message: str, id: str | None = None, reply_to: str | None = None,
                 tenant: str | None = None):
        message = cap(message)
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id
        self.reply_to = reply_to
        self.tenant = tenant  # when known (the audit trail names it)


UTF8_BOM = b"\xef\xbb\xbf"


def without_bom(value: bytes) -> bytes:
    """JSON text without a leading UTF-8 byte-order mark: some writers start with one, and RFC 8259
    lets a parser skip it."""
    return value[3:] if value[:3] == UTF8_BOM else value


def _valid(decoder: msgspec.json.Decoder, value) -> str | None:
    if not isinstance(value, str):
        return None
    try:
        return decoder.decode(msgspec.json.encode(value))
    except msgspec.ValidationError:
        return None


def not_unicode_at(value: bytes) -> str | None:
    """Where JSON `value` stops being Unicode text: a byte that is not UTF-8 (Latin-1 from an older
    writer) or a lone surrogate escape (a string cut inside an emoji by a UTF-16 language: JSON syntax
    allows it, msgspec and the tokenizer do not); None when it is text. Read off the bytes, unparsed."""
    try:
        bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte {exc.start} is not UTF-8 (0x{value[exc.start]:02x})"
    lone = _LONE_SURROGATE.search(value)
    if lone is None:
        return None
    which = "high" if lone.group("high") else "low"
    return f"a lone UTF-16 surrogate escape ({lone.group(which).decode()}) at byte {lone.start(which)}"


# msgpack headers by first byte: (bytes of length that follow, or the fixed size of the item)
_MSGPACK_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}  # bin 8-32, str 8-32: length bytes
_MSGPACK_EXT = {0xc7: 1, 0xc8: 2, 0xc9: 4}  # ext 8-32: length bytes, then a type byte
_MSGPACK_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2,
                  0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
_MSGPACK_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # array/map 16-32: (length bytes, items each)


def msgpack_not_utf8_at(value: bytes) -> str | None:
    """Where msgpack `value` has a string that is not UTF-8, as `not_unicode_at` says it for JSON;
    None when every string it could read is UTF-8. One pass over the bytes, no recursion, so any
    depth is safe; a declared length past the end stops the walk."""
    data = bytes(value)
    end, at, items = len(data), 0, 1
    while items and at < end:
        items -= 1
        b = data[at]
        at += 1
        length = None
        if b <= 0x7f or b >= 0xe0:
            continue  # fixint
        if 0x80 <= b <= 0x8f:
            items += 2 * (b & 0x0f)
        elif 0x90 <= b <= 0x9f:
            items += b & 0x0f
        elif 0xa0 <= b <= 0xbf:
            length, text = b & 0x1f, True
        elif b in _MSGPACK_SIZED:
            n = _MSGPACK_SIZED[b]
            length, text = int.from_bytes(data[at:at + n], "big"), b >= 0xd9
            at += n
        elif b in _MSGPACK_EXT:
            n = _MSGPACK_EXT[b]
            length, text = int.from_bytes(data[at:at + n], "big") + 1, False
            at += n
        elif b in _MSGPACK_FIXED:
            at += _MSGPACK_FIXED[b]
        elif b in _MSGPACK_CONTAINERS:
            n, each = _MSGPACK_CONTAINERS[b]
            items += each * int.from_bytes(data[at:at + n], "big")
            at += n
        else:
            return None  # 0xc1: never used; the decoder's own message says so
        if length is not None:
            if text:
                try:
                    data[at:at + length].decode("utf-8")
                except UnicodeDecodeError as exc:
                    where = at + exc.start
                    return f"byte {where} is not UTF-8 (0x{data[where]:02x})"
            at += length
    return None


@functools.lru_cache(maxsize=1)  # the id and the reply topic of one record: parsed once
def _lenient(value: bytes):
    """JSON that is well formed but not Unicode text, parsed with every bad byte replaced (U+FFFD)
    and lone surrogates kept: only to find out whom to answer. None when it is not JSON either."""
    try:
        return json.loads(bytes(value).decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None


def salvaged_field(value: bytes, name: str) -> str | None:
    """String field `name` of a JSON object that is well formed but not Unicode text, exactly as its
    writer wrote it; None when it cannot be read so (absent, not a string, or itself not text)."""
    doc = _lenient(bytes(value))
    return _unicode_or_none(doc.get(name)) if isinstance(doc, dict) else None


def _unicode_or_none(text):
    """A salvaged string only as the producer wrote it: one with a replaced byte or a lone surrogate
    is not the producer's id (or topic), so it addresses nothing."""
    if not isinstance(text, str) or "\ufffd" in text:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return text


def _content_type(headers) -> str:
    """The record's content type; a header with no value, or any odd key, is skipped, never an error."""
    for key, value in headers or ():
        if isinstance(key, bytes):
            key = key.decode("latin-1")
        if isinstance(key, str) and key.lower() == CONTENT_TYPE and isinstance(value, (bytes, bytearray)):
            return bytes(value[:256]).decode("latin-1").split(";")[0].strip().lower()
    return JSON


class RequestCodec:
    """Bytes + headers -> a validated `Request`, or `BadRequest` naming what is wrong."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._json = msgspec.json.Decoder(Request)
        self._msgpack = msgspec.msgpack.Decoder(Request)
        self._json_envelope = msgspec.json.Decoder(Envelope)
        self._msgpack_envelope = msgspec.msgpack.Decoder(Envelope)

    def decode(self, value: bytes | None, headers=(), key: bytes | None = None) -> Request:
        content_type = _content_type(headers)
        if value is None:
            raise self._bad(ErrorCode.INVALID_REQUEST, "record has no value", None, content_type, key)
        if len(value) > self.limits.max_record_bytes:
            raise self._bad(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"record is {len(value)} bytes; the limit is {self.limits.max_record_bytes}",
                value, content_type, key,
            )
        if content_type == JSON:
            decoder = self._json
            value = without_bom(value)
            if json_depth_exceeds(value, self.limits.max_nesting_depth):
                raise self._bad(ErrorCode.INVALID_REQUEST,
                                f"JSON nests deeper than {self.limits.max_nesting_depth} levels (or is unbalanced)",
                                value, content_type, key)
        elif content_type == MSGPACK:
            decoder = self._msgpack
        else:
            raise self._bad(ErrorCode.INVALID_REQUEST, f"unsupported content-type {cap(repr(content_type), 80)}",
                            value, JSON, key)
        try:
            request = decoder.decode(value)
        except msgspec.ValidationError as exc:
            raise self._bad(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}", value, content_type, key) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            where = not_unicode_at(value) if content_type == JSON else msgpack_not_utf8_at(value)
            reason = f"not Unicode text: {where}" if where else str(exc)
            raise self._bad(ErrorCode.INVALID_REQUEST, f"undecodable {content_type}: {reason}", value, content_type,
                            key) from None
        except RecursionError:  # msgpack has no brackets to count first
            raise self._bad(ErrorCode.INVALID_REQUEST, f"{content_type} nests too deep", value, content_type, key) from None
        problem = self.check(request)
        if problem is not None:
            code, message = problem
            raise BadRequest(code, message, request.id, request.reply_to)
        return request

    def check(self, r: Request) -> tuple[ErrorCode, str] | None:
        """Semantic rules and tunable limits, in the order a producer would fix them."""
        lim = self.limits
        bad = ErrorCode.INVALID_REQUEST
        if r.kind == "generate":
            if (r.prompt is None) == (r.messages is None):
                return bad, "generate needs exactly one of `prompt` or `messages`"
            if r.prompt is not None and not r.prompt:
                return bad, "`prompt` is empty"
            if r.messages is not None and not r.messages:
                return bad, "`messages` is empty"
            if r.event is not None or r.template is not None or r.labels is not None:
                # most likely a score request that left out `kind`: text instead of scores would be a silent surprise
                return bad, "`event`, `template` and `labels` belong to score requests (`\"kind\": \"score\"`)"
        elif r.kind == "score":
            if r.prompt is not None or r.messages is not None:
                return bad, "score takes `event` and `template`, not `prompt` or `messages`"
            if r.template is None:
                return bad, "score needs `template` (the name of a prompt template)"
            if r.event is None:
                return bad, "score needs `event` (the object the template renders)"
            if r.labels is not None:
                if not 2 <= len(r.labels) <= lim.max_labels:
                    return bad, f"`labels` must have 2..{lim.max_labels} entries, got {len(r.labels)}"
                if len(set(r.labels)) != len(r.labels):
                    return bad, "`labels` must be distinct"
                if any(not label or len(label) > lim.max_label_chars for label in r.labels):
                    return bad, f"each label must be 1..{lim.max_label_chars} chars"
        # A score request may ask for no generated text at all (max_tokens 0: scores only).
        low = 0 if r.kind == "score" else 1
        if r.max_tokens is not None and (r.max_tokens < low or r.max_tokens > lim.max_tokens):
            return bad, f"`max_tokens` must be {low}..{lim.max_tokens}, got {r.max_tokens}"
        if r.stop is not None:
            if len(r.stop) > lim.max_stop:
                return bad, f"`stop` has {len(r.stop)} strings; the limit is {lim.max_stop}"
            for s in r.stop:
                if not s or len(s) > lim.max_stop_chars:
                    return bad, f"each `stop` string must be 1..{lim.max_stop_chars} chars"
        if r.messages is not None and len(r.messages) > lim.max_messages:
            return ErrorCode.PAYLOAD_TOO_LARGE, f"`messages` has {len(r.messages)} entries; the limit is {lim.max_messages}"
        chars = len(r.prompt or "") + sum(len(m.content) for m in r.messages or ())
        if chars > lim.max_prompt_chars:
            return ErrorCode.PAYLOAD_TOO_LARGE, f"prompt is {chars} chars; the limit is {lim.max_prompt_chars}"
        return None

    def bad_request(self, code: ErrorCode, message: str, value, headers=(), key=None) -> BadRequest:
        """A `BadRequest` addressed to the record's id and reply topic where they can be read."""
        return self._bad(code, message, value, _content_type(headers), key)

    def _bad(self, code, message, value, content_type, key) -> BadRequest:
        """Recover id and reply topic from a record that failed, so the producer hears back."""
        rid = reply_to = None
        envelope = None
        if value is not None and len(value) <= 4 * self.limits.max_record_bytes:
            try:
                dec = self._msgpack_envelope if content_type == MSGPACK else self._json_envelope
                envelope = dec.decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
                envelope = None
        if envelope is None and content_type == JSON and value is not None and len(value) <= self.limits.max_record_bytes \
                and not_unicode_at(value):
            # Well-formed JSON whose text is not Unicode still names its id: answer it there rather than
            # dead-letter it (a producer that sent no key would otherwise never hear back). The lenient
            # parse is safe at any depth: Python's parser raises RecursionError, caught there.
            envelope = Envelope(salvaged_field(value, "id"), salvaged_field(value, "reply_to"))
        if envelope is not None:
            rid = _valid(_id_ok, envelope.id)
            reply_to = envelope.reply_to
        if rid is None and key:
            try:
                rid = _valid(_id_ok, bytes(key[:512]).decode("utf-8"))
            except UnicodeDecodeError:
                rid = None
        if reply_to is not None and _valid(_topic_ok, reply_to) is None:
            # An unusable reply topic means nobody can be answered: dead-letter it.
            return BadRequest(code, message + "; `reply_to` is not a valid topic name", None, None)
        return BadRequest(code, message, rid, reply_to)


class ReplyCodec:
    """Encode replies as JSON; decode them for consumers and tests."""

    def __init__(self):
        self._enc = msgspec.json.Encoder()
        self._dec = msgspec.json.Decoder(Reply)

    def encode(self, reply) -> bytes:
        return self._enc.encode(reply)

    def decode(self, data: bytes):
        return self._dec.decode(data)
