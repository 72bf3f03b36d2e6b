"""Who a request belongs to, and what that tenant may do: an operator's decision, never the record's.

Modes (`SLUICE_TENANCY_MODE`):
- `single`: every request belongs to `SLUICE_TENANCY_TENANT`; the record's `tenant` field is ignored.
- `topic`: a record belongs to the tenant its request topic is dedicated to (`tenant = "..."` on a
  topic in the topics file; the broker's ACLs decide who may write it); records of a shared topic
  belong to `SLUICE_TENANCY_TENANT`. The record's `tenant` field is ignored.
- `signed`: each record carries `x-sluice-tenant` and `x-sluice-signature` (`schemas/signing.py`),
  an HMAC under one of that tenant's keys from the tenants file. A record without them, naming an
  unknown tenant or key, or whose MAC does not verify, is dead-lettered: its `reply_to` is not
  trusted, so no reply is addressed from it. A `tenant` field that names another tenant is refused.

The authenticated tenant scopes the request's answer, progress and KV-page keys and vLLM's prefix
cache (`cache_salt`), labels its metrics, and picks its limits from the tenants file (TOML):

    [tenant.payments]
    reply_to = "payments\\.replies(\\..+)?"   # full match; absent: `SLUICE_TENANCY_REPLY_TO`
    max_in_flight = 64                        # waiting + running in one worker; 0: no limit
    retry_after_ms = 1000                     # over the limit: `overloaded`, retry after this
    tokens_per_s = 2000                       # prompt + completion tokens per second on one worker; 0: no limit
    signing_keys = { "2026-12" = "base64 secret" }

A `reply_to` outside the tenant's pattern is refused with an `error` on the default reply topic.
"""

from __future__ import annotations

import base64
import hmac
import re
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from schemas.signing import SIGNATURE_HEADER, TENANT_HEADER, Unsignable, header, mac
from worker.quotas import TenantRates

TenantName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class TenantPolicy(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    reply_to: str | None = None
    max_in_flight: Annotated[int, Meta(ge=0)] = 0
    retry_after_ms: Annotated[int, Meta(ge=0)] = 1000  # the hint on an `overloaded` reply
    tokens_per_s: Annotated[float, Meta(ge=0)] = 0  # prompt + completion tokens per second; 0: no limit
    signing_keys: dict[str, str] = {}


class TenantsFile(Struct, frozen=True, forbid_unknown_fields=True):
    tenant: dict[TenantName, TenantPolicy] = {}


class TenancyError(ValueError):
    """An unusable tenancy setting or tenants file (raised at start-up)."""


class Unauthenticated(ValueError):
    """A record whose tenant cannot be established (signed mode): dead-lettered, never answered."""


class Tenancy:
    def __init__(self, mode: str, tenant: str, tenants: dict[str, TenantPolicy], default_reply_topic: str,
                 reply_to: str = "", closed: frozenset[str] = frozenset()):
        self.mode, self.single = mode, tenant
        self.default_reply_topic = default_reply_topic
        # the workers' own request, dead-letter and audit topics: no pattern opens them to replies
        self.closed = closed
        self.policies = dict(tenants)
        self._reply_to: dict[str, re.Pattern | None] = {}
        self._keys: dict[str, dict[str, bytes]] = {}
        for name, policy in {**self.policies, tenant: self.policies.get(tenant, TenantPolicy())}.items():
            pattern = policy.reply_to if policy.reply_to is not None else reply_to
            try:
                self._reply_to[name] = re.compile(pattern) if pattern else None
            except re.error as exc:
                raise TenancyError(f"tenant {name}: reply_to {pattern!r} is not a regular expression ({exc})") from None
            try:
                self._keys[name] = {kid: base64.b64decode(s, validate=True) for kid, s in policy.signing_keys.items()}
            except ValueError:
                raise TenancyError(f"tenant {name}: a signing key is not base64") from None
        try:
            self._default_pattern = re.compile(reply_to) if reply_to else None
        except re.error as exc:
            raise TenancyError(f"tenancy_reply_to {reply_to!r} is not a regular expression ({exc})") from None
        self.rates = TenantRates({name: policy.tokens_per_s for name, policy in self.policies.items()})
        if mode == "signed" and not any(self._keys.values()):
            raise TenancyError("tenancy_mode signed needs signing_keys for at least one tenant in the tenants file")

    @classmethod
    def from_settings(cls, settings, default_reply_topic: str, closed: frozenset[str] = frozenset()) -> "Tenancy":
        tenants = {}
        if settings.tenants_file:
            path = settings.tenants_file
            try:
                tenants = msgspec.convert(tomllib.loads(Path(path).read_text()), TenantsFile).tenant
            except FileNotFoundError:
                raise TenancyError(f"tenants file {path} not found (SLUICE_TENANCY_TENANTS_FILE)") from None
            except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
                raise TenancyError(f"tenants file {path}: {exc}") from None
        return cls(settings.mode, settings.tenant, tenants, default_reply_topic, settings.reply_to, closed)

    def tenant_of(self, record, request, topic=None) -> str:
        """The authenticated tenant of a decoded record, or `Unauthenticated` naming why not."""
        if self.mode == "single":
            return self.single
        if self.mode == "topic":  # who may write a topic is the broker's ACLs' business
            return getattr(topic, "tenant", None) or self.single
        claimed = header(record.headers, TENANT_HEADER)
        signature = header(record.headers, SIGNATURE_HEADER)
        if claimed is None or signature is None:
            raise Unauthenticated(f"unsigned record: {TENANT_HEADER} and {SIGNATURE_HEADER} headers are required")
        tenant = claimed.decode("utf-8", "replace")
        keys = self._keys.get(tenant)
        if not keys:
            raise Unauthenticated(f"unknown tenant {tenant[:64]!r}")
        key_id, _, given = signature.decode("latin-1").partition(":")
        secret = keys.get(key_id)
        if secret is None:
            raise Unauthenticated(f"tenant {tenant!r} has no signing key {key_id[:64]!r}")
        try:
            expected = mac(secret, tenant, record.key, record.value or b"")
        except Unsignable as exc:
            raise Unauthenticated(str(exc)) from None
        if not hmac.compare_digest(expected, given):
            raise Unauthenticated(f"signature does not verify for tenant {tenant!r}")
        if "tenant" in _fields_set(request) and request.tenant != tenant:
            raise Unauthenticated(f"the record's tenant field {request.tenant[:64]!r} is not its signed tenant {tenant!r}")
        return tenant

    def reply_to_refused(self, tenant: str, reply_to: str | None) -> str | None:
        """Why `reply_to` may not be used by `tenant`, or None when it may."""
        if reply_to is None or reply_to == self.default_reply_topic:
            return None
        if reply_to in self.closed:  # replies there would be read again as requests, or pose as dead letters
            return f"reply_to {reply_to!r} is one of the workers' own request, dead-letter or audit topics"
        pattern = self._reply_to.get(tenant, self._default_pattern)
        if pattern is not None and pattern.fullmatch(reply_to):
            return None
        return f"reply_to {reply_to!r} is not allowed for tenant {tenant!r} (see the tenants file's reply_to)"

    def max_in_flight(self, tenant: str) -> int:
        return self.policies.get(tenant, TenantPolicy()).max_in_flight

    def retry_after_ms(self, tenant: str) -> int:
        return self.policies.get(tenant, TenantPolicy()).retry_after_ms


def _fields_set(request) -> set[str]:
    # `tenant` defaults to "default": a record that did not write it must not be refused for it
    return {"tenant"} if request.tenant != "default" else set()
