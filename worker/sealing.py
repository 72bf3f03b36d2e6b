"""Authenticated encryption of what sluice stores in Redis (answers, progress, KV pages).

A sealed value is `MAGIC | cipher id (1 byte) | key id length (1 byte) | key id | nonce (12 bytes) |
ciphertext | tag (16 bytes)`. The associated data binds the header and the name the value is
stored under (the Redis key, plus the field for hash fields), so a value copied to another key,
another request or another tenant fails authentication like a forged or altered one.

Keys come from a TOML file (`SLUICE_REDIS_ENCRYPTION_KEYS_FILE`, e.g. a mounted Secret):

    cipher = "aes-256-gcm"        # or "sm4-gcm" where regulation asks for SM4
    active = "2026-12"            # new writes use this key
    [keys]                        # every key that may still decrypt: rotation keeps the old ones
    "2026-11" = "base64 of 32 bytes (16 for sm4-gcm)"
    "2026-12" = "..."

Each value names its key and cipher, so a rotation needs no downtime: add the new key, make it
active, and drop the old one after the longest TTL of what it sealed. Workers (and the engine's
KV connector) read the file again when it changes, without a restart. A value that fails to
open raises `Unsealable` with a short reason (the metric label); callers treat it as a miss.
"""

from __future__ import annotations

import base64
import os
import struct
import time
import tomllib
from pathlib import Path

MAGIC = b"SLS1"
NONCE = 12
TAG = 16
CIPHERS = {"aes-256-gcm": (1, 32), "sm4-gcm": (2, 16)}  # name -> (id in the value, key bytes)
_BY_ID = {cid: name for name, (cid, _) in CIPHERS.items()}


class Unsealable(ValueError):
    """A stored value that must not be used; `reason` is a metric label."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class KeyFileError(ValueError):
    """The keys file is unusable; the message names the file and the problem (never a key)."""


def _cipher(name: str, key: bytes, nonce: bytes, tag: bytes | None = None):
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    algorithm = algorithms.AES(key) if name == "aes-256-gcm" else algorithms.SM4(key)
    return Cipher(algorithm, modes.GCM(nonce, tag))


class Sealer:
    def __init__(self, keys: dict[str, bytes], active: str, cipher: str = "aes-256-gcm"):
        if cipher not in CIPHERS:
            raise KeyFileError(f"cipher {cipher!r} is not one of {', '.join(CIPHERS)}")
        if active not in keys:
            raise KeyFileError(f"the active key {active!r} is not among the keys")
        size = CIPHERS[cipher][1]
        for key_id, key in keys.items():
            if not 1 <= len(key_id.encode()) <= 255:
                raise KeyFileError(f"key id {key_id!r} must be 1-255 bytes")
            if len(key) != size:
                raise KeyFileError(f"key {key_id!r} is {len(key)} bytes; {cipher} needs {size}")
        self.keys, self.active, self.cipher = dict(keys), active, cipher
        self._header = MAGIC + bytes([CIPHERS[cipher][0], len(active.encode())]) + active.encode()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Sealer":
        try:
            doc = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise KeyFileError(f"encryption keys file {path} not found") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"encryption keys file {path} is not valid TOML ({type(exc).__name__})") from None
        raw = doc.get("keys")
        if not isinstance(raw, dict) or not raw:
            raise KeyFileError(f"encryption keys file {path}: needs a [keys] table with at least one key")
        keys = {}
        for key_id, text in raw.items():
            try:
                keys[key_id] = base64.b64decode(str(text), validate=True)
            except ValueError:
                raise KeyFileError(f"encryption keys file {path}: key {key_id!r} is not base64") from None
        try:
            return cls(keys, str(doc.get("active", "")), str(doc.get("cipher", "aes-256-gcm")))
        except KeyFileError as exc:
            raise KeyFileError(f"encryption keys file {path}: {exc}") from None

    def seal(self, value: bytes | memoryview, bound_to: bytes | str) -> bytes:
        nonce = os.urandom(NONCE)
        aad = self._header + _bound(bound_to)
        if self.cipher == "aes-256-gcm":  # one call into OpenSSL: pages are megabytes
            return self._header + nonce + _aesgcm(self.keys[self.active]).encrypt(nonce, bytes(value), aad)
        enc = _cipher(self.cipher, self.keys[self.active], nonce).encryptor()
        enc.authenticate_additional_data(aad)
        body = enc.update(value) + enc.finalize()
        return self._header + nonce + body + enc.tag

    def open(self, sealed: bytes | memoryview | None, bound_to: bytes | str) -> bytes:
        if sealed is None:
            raise Unsealable("missing")
        sealed = bytes(sealed)
        if not sealed.startswith(MAGIC) or len(sealed) < len(MAGIC) + 2:
            raise Unsealable("not_sealed")
        cipher_id, id_len = sealed[len(MAGIC)], sealed[len(MAGIC) + 1]
        start = len(MAGIC) + 2 + id_len
        if len(sealed) < start + NONCE + TAG:
            raise Unsealable("corrupt")
        key = self.keys.get(sealed[len(MAGIC) + 2:start].decode("utf-8", "replace"))
        name = _BY_ID.get(cipher_id)
        if key is None or name is None or len(key) != CIPHERS[name][1]:
            raise Unsealable("unknown_key")
        nonce, aad = sealed[start:start + NONCE], sealed[:start] + _bound(bound_to)
        try:
            if name == "aes-256-gcm":
                return _aesgcm(key).decrypt(nonce, sealed[start + NONCE:], aad)
            dec = _cipher(name, key, nonce, sealed[-TAG:]).decryptor()
            dec.authenticate_additional_data(aad)
            return dec.update(sealed[start + NONCE:-TAG]) + dec.finalize()
        except Exception:  # cryptography's InvalidTag: forged, altered, or stored under another name
            raise Unsealable("forged") from None


_AES: dict[bytes, object] = {}


def _aesgcm(key: bytes):
    aes = _AES.get(key)
    if aes is None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        aes = _AES[key] = AESGCM(key)
    return aes


def _bound(name: bytes | str) -> bytes:
    name = name.encode() if isinstance(name, str) else bytes(name)
    return struct.pack("<I", len(name)) + name


class KeyRing:
    """The sealer of a keys file, read again when the file changes (a rotated Kubernetes Secret is
    rewritten in place), checked at most every `check_s`. A file that cannot be read now keeps the
    keys last read: a half-written file never drops the keys in use."""

    def __init__(self, path: str | os.PathLike, check_s: float = 1.0):
        self.path, self.check_s = str(path), check_s
        self._sealer = Sealer.from_file(path)  # unusable at start-up: start-up fails, naming the file
        self._stamp = self._file_stamp()
        self._next_check = time.monotonic() + check_s
        self.reload_failures = 0

    def _file_stamp(self):
        try:
            st = os.stat(self.path)
            return st.st_mtime_ns, st.st_size, st.st_ino
        except OSError:
            return None

    def current(self) -> Sealer:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.check_s
            stamp = self._file_stamp()
            if stamp is not None and stamp != self._stamp:
                try:
                    self._sealer = Sealer.from_file(self.path)
                    self._stamp = stamp
                except KeyFileError:
                    self.reload_failures += 1
        return self._sealer

    def seal(self, value, bound_to) -> bytes:
        return self.current().seal(value, bound_to)

    def open(self, sealed, bound_to) -> bytes:
        return self.current().open(sealed, bound_to)


def load(path: str | None) -> KeyRing | None:
    """The key ring of a keys file, or None when values are stored in clear (no file configured)."""
    return KeyRing(path) if path else None


def new_key(cipher: str = "aes-256-gcm") -> str:
    """A fresh random key for `cipher`, base64 (what `sluice keys new` prints)."""
    return base64.b64encode(os.urandom(CIPHERS[cipher][1])).decode()
