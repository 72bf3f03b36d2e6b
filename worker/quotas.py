"""Per-tenant token-rate quotas: pure Python, no I/O, tested with tables.

A request's cost is only known when it ends (prompt tokens after tokenizing, completion tokens
after generating), so the bucket is charged then, and may go into debt; while a tenant's
bucket is in debt its new requests are answered `overloaded`, with a retry hint of how long the
refill takes to clear the debt. The bucket holds at most `burst_s` seconds of tokens, so an
idle tenant cannot save up an unbounded burst.
"""

from __future__ import annotations


class TokenBucket:
    def __init__(self, tokens_per_s: float, burst_s: float = 10.0, now: float = 0.0):
        if tokens_per_s <= 0 or burst_s <= 0:
            raise ValueError("tokens_per_s and burst_s must be positive")
        self.rate, self.capacity = tokens_per_s, tokens_per_s * burst_s
        self.balance, self._at = self.capacity, now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.balance = min(self.capacity, self.balance + (now - self._at) * self.rate)
            self._at = now

    def allows(self, now: float) -> bool:
        self._refill(now)
        return self.balance > 0

    def charge(self, tokens: int, now: float) -> None:
        self._refill(now)
        self.balance -= tokens

    def retry_after_ms(self, now: float) -> int:
        """How long until the bucket is out of debt (0 when it is not)."""
        self._refill(now)
        return 0 if self.balance > 0 else int((-self.balance / self.rate) * 1000) + 1


class TenantRates:
    """One bucket per tenant that has a `tokens_per_s` limit."""

    def __init__(self, limits: dict[str, float], burst_s: float = 10.0, clock=None):
        import time

        self.clock = clock or time.monotonic
        self.buckets = {t: TokenBucket(rate, burst_s, self.clock()) for t, rate in limits.items() if rate}

    def retry_after_ms(self, tenant: str) -> int:
        """0 when the tenant may start a request now; else the hint for its `overloaded` reply."""
        bucket = self.buckets.get(tenant)
        return 0 if bucket is None or bucket.allows(self.clock()) else bucket.retry_after_ms(self.clock())

    def charge(self, tenant: str, tokens: int) -> None:
        bucket = self.buckets.get(tenant)
        if bucket is not None:
            bucket.charge(tokens, self.clock())
