"""Signed records (tenancy mode `signed`): how a producer proves which tenant a record is from.

Two headers: `x-sluice-tenant` names the tenant; `x-sluice-signature` is `<key id>:<hex>`, the
HMAC-SHA256 under that tenant's key of

    b"sluice-v1\\n" + tenant + b"\\n" + record key (empty if none) + b"\\n" + record value

so tenant, request id (the key, and the `id` inside the value) and every byte of the value are
covered. A producer in any language needs only HMAC-SHA256; `signed_headers` does it in Python.

The fields are joined by newlines without lengths, so the key of a signed record must hold no
newline byte: otherwise key b"a\\nb" with value V and key b"a" with value b"b\\n" + V would share
one signature. Tenant names hold none (their pattern), so with this rule one signed body is one
record.
"""

from __future__ import annotations

import hashlib
import hmac

TENANT_HEADER = "x-sluice-tenant"
SIGNATURE_HEADER = "x-sluice-signature"
_DOMAIN = b"sluice-v1\n"


class Unsignable(ValueError):
    """A record the signature cannot cover unambiguously (a newline byte in its key)."""


def mac(secret: bytes, tenant: str, key: bytes | None, value: bytes) -> str:
    if key and b"\n" in key:
        raise Unsignable("the record key holds a newline byte, so its signature could not tell where the key "
                         "ends and the value begins: signed records need keys without one")
    body = _DOMAIN + tenant.encode() + b"\n" + (key or b"") + b"\n" + value
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def signed_headers(tenant: str, key_id: str, secret: bytes, key: bytes | None, value: bytes) -> list[tuple[str, bytes]]:
    """The two headers for a record of `tenant` (aiokafka's `headers=` form)."""
    return [(TENANT_HEADER, tenant.encode()),
            (SIGNATURE_HEADER, f"{key_id}:{mac(secret, tenant, key, value)}".encode())]


class Signer:
    """A producer's identity: `tenant`, and (tenancy_mode signed) one of its keys. Without a key it
    signs nothing (single and topic modes); `headers(key, value)` gives each record's headers."""

    def __init__(self, tenant: str | None = None, key_id: str | None = None, secret: bytes | None = None):
        self.tenant, self.key_id, self.secret = tenant, key_id, secret

    @classmethod
    def from_key_file(cls, tenant: str | None, key_file: str | None, key_id: str = "k1") -> "Signer":
        """`key_file` holds the tenant's key in base64 (what the tenants file has for it)."""
        import base64
        from pathlib import Path

        if key_file is None:
            return cls(tenant)
        if tenant is None:
            raise ValueError("a signing key needs --tenant")
        try:
            secret = base64.b64decode(Path(key_file).read_text().strip(), validate=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"signing key file {key_file}: {type(exc).__name__}") from None
        return cls(tenant, key_id, secret)

    def headers(self, key: bytes | None, value: bytes) -> list[tuple[str, bytes]]:
        if self.secret is None:
            return []
        return signed_headers(self.tenant, self.key_id, self.secret, key, value)


def header(headers, name: str) -> bytes | None:
    """The value of the first header called `name` (case-insensitive); odd headers are skipped."""
    for k, v in headers or ():
        if isinstance(k, bytes):
            k = k.decode("latin-1")
        if isinstance(k, str) and k.lower() == name and isinstance(v, (bytes, bytearray)):
            return bytes(v)
    return None
