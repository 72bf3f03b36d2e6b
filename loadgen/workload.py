"""Seeded open-loop workloads: arrival times, class mix, prompt and output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from loadgen.burst import COUNTRIES, MERCHANTS


@dataclass(frozen=True)
class Workload:
    rate: float = 5.0  # requests per second
    seconds: float = 20.0
    arrival: str = "poisson"  # poisson | fixed
    mix: dict[str, float] = field(default_factory=lambda: {"realtime": 0.3, "standard": 0.4, "batch": 0.3})
    max_tokens: tuple[int, int] = (8, 32)  # uniform range
    history_items: tuple[int, int] = (0, 6)  # prompt length: past transactions listed
    seed: int = 7

    def requests(self, prefix: str) -> list[tuple[float, str, dict]]:
        """(seconds after start, class, request body), in arrival order."""
        rng = random.Random(self.seed)
        classes, weights = zip(*self.mix.items())
        out, t, i = [], 0.0, 0
        while True:
            t += rng.expovariate(self.rate) if self.arrival == "poisson" else 1.0 / self.rate
            if t >= self.seconds:
                return out
            cls = rng.choices(classes, weights)[0]
            out.append((t, cls, self._body(rng, f"{prefix}-{i:05d}")))
            i += 1

    def _body(self, rng: random.Random, rid: str) -> dict:
        def tx():
            return (f"{round(rng.lognormvariate(3.5, 1.2), 2)} USD at {rng.choice(MERCHANTS)} in "
                    f"{rng.choice(COUNTRIES)}, card {'present' if rng.random() < 0.6 else 'not present'}")

        history = "; ".join(tx() for _ in range(rng.randint(*self.history_items))) or "none"
        prompt = f"Past transactions: {history}.\nNew transaction: {tx()}.\nIs the new transaction fraudulent?"
        return {"id": rid, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": rng.randint(*self.max_tokens)}


def parse_mix(text: str) -> dict[str, float]:
    """'realtime=0.3,standard=0.4,batch=0.3' -> weights."""
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name.strip() not in ("realtime", "standard", "batch") or not weight:
            raise ValueError(f"bad class mix entry {part!r}: use realtime=W,standard=W,batch=W")
        mix[name.strip()] = float(weight)
    return mix
