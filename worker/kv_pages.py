"""KV page keys and values: pure Python, no torch and no I/O, so every rule is tested with tables.

A page is `block_size` tokens of KV for every layer. Its key is a hash chain:
the root binds the model fingerprint and the tenant, and each page's digest
binds the previous digest and the page's token ids, so a key names one exact
prefix of one model for one tenant, and two tenants never share a key.

A value is `MAGIC | u32 header length | msgpack header | payload`; the header
names dtype, per-layer shape and layer count, and carries a CRC-32 over the page
key and the payload. A value that is short, malformed, of another layout, or
fails its check (flipped bytes, a value stored under the wrong key) is a miss:
the page is recomputed, never used.

The check is against corruption, not forgery (Kafka guards its record batches
the same way): its inputs are all public, so a keyed hash would stop no one who
can write to Redis. Forgery is what sealing (`worker/sealing.py`) is for. Pages
are megabytes, hashed on the cores the engine computes on, and CRC-32 costs a
fraction of a cryptographic hash (`bench/sealing.py` prints both).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from array import array

import msgspec

MAGIC = b"SLKV2"  # SLKV1 values (BLAKE2b check) read as corrupt: recomputed
_CHECK = struct.Struct(">I")
_LEN = struct.Struct("<I")


class PageError(ValueError):
    """A stored page that must not be used; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class PageHeader(msgspec.Struct, frozen=True, array_like=True):
    dtype: str
    shape: tuple[int, ...]  # one layer's page
    layers: int
    digest: bytes


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(PageHeader)


def root(fingerprint: str, tenant: str) -> bytes:
    return hashlib.sha256(b"sluice-kv-root\0" + fingerprint.encode() + b"\0" + tenant.encode()).digest()


def chain(seed: bytes, token_ids, block_size: int, pages: int | None = None) -> list[bytes]:
    """Digests of the first `pages` full pages of `token_ids` (all full pages if None)."""
    full = len(token_ids) // block_size
    n = full if pages is None else min(pages, full)
    out, prev = [], seed
    for i in range(n):
        page = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        prev = hashlib.sha256(prev + page).digest()
        out.append(prev)
    return out


def key(prefix: str, digest: bytes) -> str:
    return f"{prefix}:kv:{digest.hex()}"


def key_pattern(prefix: str) -> str:
    """A Redis SCAN pattern that matches every page under `prefix` (tests and benches count or clear them)."""
    return f"{prefix}:kv:*"


def _check(digest: bytes, parts) -> bytes:
    crc = zlib.crc32(digest)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return _CHECK.pack(crc)


def _prefix(dtype: str, shape: tuple[int, ...], layers: int, check: bytes) -> bytes:
    """Everything a stored page holds before its payload: magic, header length, header."""
    header = _enc.encode(PageHeader(dtype, tuple(shape), layers, check))
    return MAGIC + _LEN.pack(len(header)) + header


def encode(digest: bytes, dtype: str, shape: tuple[int, ...], layers: int, payload: bytes) -> bytes:
    return _prefix(dtype, shape, layers, _check(digest, (payload,))) + payload


def encode_pieces(digest: bytes, dtype: str, shape: tuple[int, ...], layers: int, parts: list) -> list:
    """`encode` of the payload `b"".join(parts)` as pieces: the prefix, then `parts` themselves,
    uncopied (pages are megabytes: the connector's writer sends each layer's piece of a page as it
    lies in memory)."""
    return [_prefix(dtype, shape, layers, _check(digest, parts)), *parts]


def encode_parts(digest: bytes, dtype: str, shape: tuple[int, ...], layers: int, parts: list) -> memoryview:
    """`encode` of the payload `b"".join(parts)`, byte for byte, with the payload copied once (for
    a value that must be whole, such as one to seal)."""
    prefix, *parts = encode_pieces(digest, dtype, shape, layers, parts)
    sizes = [memoryview(part).nbytes for part in parts]
    out = bytearray(len(prefix) + sum(sizes))
    out[:len(prefix)] = prefix
    at = len(prefix)
    for part, size in zip(parts, sizes):
        out[at:at + size] = part
        at += size
    return memoryview(out)


def set_command(key: bytes, pieces: list, ttl_s: int) -> list:
    """`SET key value EX ttl_s` in RESP with the value left as `pieces` (sent one after another, the
    server reads one value): nothing of the value is copied to build the command."""
    size = sum(memoryview(piece).nbytes for piece in pieces)
    ttl = b"%d" % ttl_s
    head = b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, size)
    return [head, *pieces, b"\r\n$2\r\nEX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl)]


def decode(digest: bytes, value: bytes | None, dtype: str, shape: tuple[int, ...], layers: int,
           itemsize: int) -> memoryview:
    """The payload of a value stored for `digest` (a view, not a copy), or `PageError` naming why it is unusable."""
    if value is None:
        raise PageError("missing")
    if len(value) < len(MAGIC) + _LEN.size or not value.startswith(MAGIC):
        raise PageError("corrupt", "bad magic")
    (n,) = _LEN.unpack_from(value, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        header = _dec.decode(value[start:start + n])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PageError("corrupt", f"header: {exc}") from None
    if header.dtype != dtype or tuple(header.shape) != tuple(shape) or header.layers != layers:
        raise PageError("layout", f"{header.dtype}{list(header.shape)}x{header.layers}")
    payload = memoryview(value)[start + n:]
    expected = itemsize * layers
    for d in shape:
        expected *= d
    if len(payload) != expected:
        raise PageError("corrupt", f"payload {len(payload)} bytes, expected {expected}")
    if _check(digest, (payload,)) != header.digest:
        raise PageError("checksum")
    return payload
