"""How many KV pages the connector may save now: a byte budget refilled at `kv.save_budget_mib_s`.

Saving a page costs the engine's cores a copy and Redis its bandwidth. Over budget, sluice drops
saves rather than slowing the engine. A page the budget cannot pay for yet waits while its request
runs (its blocks stay put) and is saved, in order, once the budget allows; the pages still waiting
when the request finishes are dropped. Pages go in order because a resume loads them only up to the
first missing one; the leading pages saved still spare a resume their prefill.

Which request's pages the budget pays for first (`save_order`): those of the requests with the most
tokens still to generate. A saved page is insurance against the worker dying during the rest of its
request's run; a request about to finish gains little from it, a long one a lot.

Pure Python (no torch), so its cases are a table (tests/unit/test_save_budget.py).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

MIB = 1 << 20


class SaveBudget:
    """A token bucket of bytes: `bytes_per_s` refills it, it holds at most `burst_s` of refill (and
    never less than one page, or a page larger than a second's budget could never be saved).
    `bytes_per_s` 0 means no budget: every page is granted."""

    def __init__(self, bytes_per_s: float, page_bytes: int, burst_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if bytes_per_s < 0 or page_bytes <= 0 or burst_s <= 0:
            raise ValueError(f"save budget: bytes_per_s={bytes_per_s}, page_bytes={page_bytes}, burst_s={burst_s}")
        self.bytes_per_s = bytes_per_s
        self.page_bytes = page_bytes
        self.capacity = max(bytes_per_s * burst_s, page_bytes)
        self.clock = clock
        self.level = self.capacity
        self.at = clock()

    @classmethod
    def from_settings(cls, mib_per_s: float, page_bytes: int, burst_s: float = 1.0,
                      clock: Callable[[], float] = time.monotonic):
        return cls(mib_per_s * MIB, page_bytes, burst_s, clock=clock)

    def grant(self, pages: int) -> int:
        """How many of the next `pages` pages (the leading ones) may be saved now; their bytes are taken."""
        if self.bytes_per_s == 0 or pages <= 0:
            return max(pages, 0)
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.bytes_per_s)
        self.at = now
        granted = min(pages, int(self.level // self.page_bytes))
        self.level -= granted * self.page_bytes
        return granted


def save_order(candidates: list[tuple[T, int]]) -> list[T]:
    """(item, tokens still to generate) pairs -> the items, the longest still to run first; ties keep
    their order (the scheduler's: running requests before new ones)."""
    return [item for item, _ in sorted(candidates, key=lambda c: -c[1])]
