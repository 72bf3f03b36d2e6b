"""Seeded transaction events that fit `schemas.events.Transaction`, with a little fraud in them."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

# (mcc, merchant kind, typical amount): ISO 18245 category codes
MERCHANT_KINDS = [("5411", "grocery", 45), ("5732", "electronics", 380), ("4511", "airline", 620),
                  ("5541", "fuel", 60), ("5812", "restaurant", 55), ("7995", "gambling", 250),
                  ("5912", "pharmacy", 30), ("5999", "misc-retail", 90)]
COUNTRIES = ["US", "GB", "DE", "BR", "IN", "NG", "JP", "FR"]
CHANNELS = ["pos", "ecommerce", "atm", "moto", "contactless"]


def transactions(n: int, seed: int = 7, start: datetime | None = None, fraud_rate: float = 0.05) -> list[dict]:
    """n events in time order, one every ~2 s from `start`; about `fraud_rate` of them look risky."""
    rng = random.Random(seed)
    t = start or datetime(2026, 11, 1, tzinfo=timezone.utc)
    out = []
    for i in range(n):
        t += timedelta(seconds=rng.expovariate(0.5))
        mcc, kind, typical = rng.choice(MERCHANT_KINDS)
        home = rng.choice(COUNTRIES[:5])
        risky = rng.random() < fraud_rate
        country = rng.choice(COUNTRIES) if risky else home
        amount = round(rng.lognormvariate(0, 0.6) * typical * (6 if risky else 1), 2)
        count = rng.randint(8, 30) if risky else rng.randint(0, 6)
        channel = rng.choice(["ecommerce", "moto"]) if risky else rng.choice(CHANNELS)
        out.append({
            "id": f"tx-{seed}-{i:07d}", "timestamp": t.isoformat().replace("+00:00", "Z"), "amount": amount,
            "currency": "USD", "merchant_id": f"m-{kind}-{rng.randint(1, 400)}", "mcc": mcc, "country": country,
            "channel": channel, "card_present": channel in ("pos", "atm", "contactless"),
            "customer_id": f"c-{rng.randint(1, 5000)}", "txn_count_24h": count,
            "txn_sum_24h": round(amount * count * rng.uniform(0.5, 1.5), 2),
            "distinct_countries_24h": rng.randint(2, 5) if risky else 1, "home_country": home,
        })
    return out
