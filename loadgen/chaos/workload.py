"""The valid requests of a chaos run: generate and score, streamed and not, across the classes."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadgen.events import transactions

CLASSES = ("realtime", "standard", "batch")


@dataclass(frozen=True)
class Planned:
    at_s: float  # when to send, seconds after the run starts
    latency_class: str
    body: dict

    @property
    def id(self) -> str:
        return self.body["id"]

    @property
    def streamed(self) -> bool:
        return self.body.get("stream", True)


def plan(n: int, rate: float, seed: int, prefix: str, max_tokens: tuple[int, int] = (4, 24),
         score_share: float = 0.25, stream_share: float = 0.7) -> list[Planned]:
    """`n` requests at `rate` per second (Poisson arrivals), the same ones for the same seed."""
    rng = random.Random(seed)
    events = transactions(max(1, int(n * score_share) + 1), seed=seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        rid = f"{prefix}-{i:06d}"
        stream = rng.random() < stream_share
        if rng.random() < score_share:
            event = {**events[i % len(events)], "id": f"tx-{rid}"}
            # scores only, or scores with a short rationale streamed before them
            body = {"id": rid, "kind": "score", "template": "fraud", "event": event,
                    "max_tokens": rng.choice([0, 0, rng.randint(*max_tokens)])}
        else:
            body = {"id": rid, "max_tokens": rng.randint(*max_tokens)}
            if rng.random() < 0.5:
                body["prompt"] = f"Request {i}: summarise the account activity in one line."
            else:
                body["messages"] = [{"role": "user", "content": f"Request {i}: is a {rng.randint(5, 900)} USD "
                                                                f"charge abroad unusual for this card?"}]
        if not stream:
            body["stream"] = False
        out.append(Planned(t, rng.choice(CLASSES), body))
    return out
