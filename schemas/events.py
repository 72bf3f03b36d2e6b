"""Transaction events (what payments producers publish) and backfill results.

A score request carries an `event`; the template it names says which schema the
event must satisfy (`transaction` here) before it is rendered into a prompt.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

Currency = Annotated[str, Meta(pattern=r"^[A-Z]{3}$")]
Country = Annotated[str, Meta(pattern=r"^[A-Z]{2}$")]
Mcc = Annotated[str, Meta(pattern=r"^[0-9]{4}$")]
# Identifiers reach the model's prompt: no spaces, no markup, so a field can name a merchant but
# cannot carry sentences written to sway the model (tokenization alone does not stop that).
Identifier = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]


class Transaction(Struct, frozen=True, kw_only=True):
    """One card transaction as a payments team publishes it. Unknown fields are ignored."""

    id: Annotated[str, Meta(min_length=1, max_length=128)]
    timestamp: datetime
    amount: Annotated[float, Meta(ge=0)]
    currency: Currency
    merchant_id: Identifier
    mcc: Mcc  # merchant category code (ISO 18245)
    country: Country  # where the merchant is (ISO 3166-1 alpha-2)
    channel: Literal["pos", "ecommerce", "atm", "moto", "contactless"]
    card_present: bool
    customer_id: Identifier
    # history features, computed upstream over the customer's last 24 h
    txn_count_24h: Annotated[int, Meta(ge=0)] = 0
    txn_sum_24h: Annotated[float, Meta(ge=0)] = 0.0
    distinct_countries_24h: Annotated[int, Meta(ge=0)] = 0
    home_country: Country | None = None


EVENT_SCHEMAS: dict[str, type[Struct]] = {"transaction": Transaction}


class BackfillResult(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One record per source event in a backfill's output topic, keyed by the event id."""

    event_id: str
    topic: str
    partition: int
    offset: int
    template: str
    scores: dict[str, float] | None = None
    label: str | None = None  # the most probable label
    text: str = ""  # generated rationale, when asked for
    error_code: str | None = None
    error: str | None = None


def event_schema(name: str):
    return msgspec.json.schema(EVENT_SCHEMAS[name])
