"""Token-rate quotas (worker/quotas.py): a table over a fake clock, then a worker over the doubles."""

from __future__ import annotations

import base64

import pytest

from schemas import DoneReply, ErrorCode, ErrorReply
from tests.unit.harness import Memory, running, until
from tests.unit.test_tenancy import SECRET_A, SECRET_B, signed
from worker.quotas import TenantRates, TokenBucket

# (steps, expected allows/retry after each step) on a bucket of 10 tokens/s, 2 s burst (20 tokens)
STEPS = [
    ("starts full", [("allows", 0.0, True)]),
    ("a charge within the balance", [("charge", 0.0, 15), ("allows", 0.0, True)]),
    ("debt refuses until refilled", [("charge", 0.0, 30), ("allows", 0.0, False), ("retry", 0.0, 1001),
                                     ("allows", 0.9, False), ("allows", 1.01, True)]),
    ("idle time saves at most the burst", [("charge", 0.0, 20), ("allows", 100.0, True), ("charge", 100.0, 25),
                                          ("allows", 100.0, False), ("retry", 100.0, 501)]),
]


@pytest.mark.parametrize("what,steps", STEPS, ids=[s[0] for s in STEPS])
def test_token_bucket(what, steps):
    bucket = TokenBucket(10, burst_s=2, now=0.0)
    for op, now, arg in steps:
        if op == "charge":
            bucket.charge(arg, now)
        elif op == "allows":
            assert bucket.allows(now) is arg, (op, now)
        else:
            assert bucket.retry_after_ms(now) == arg


def test_tenants_without_a_rate_are_not_limited():
    rates = TenantRates({"acme": 1.0, "globex": 0}, burst_s=1, clock=lambda: 0.0)
    rates.charge("acme", 5)
    rates.charge("globex", 10**9)
    assert rates.retry_after_ms("acme") > 0 and rates.retry_after_ms("globex") == 0
    assert rates.retry_after_ms("initech") == 0


async def test_a_tenant_past_its_token_rate_gets_overloaded_with_a_hint_while_another_is_served(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(f"""
[tenant.acme]
signing_keys = {{ k1 = "{base64.b64encode(SECRET_A).decode()}" }}
tokens_per_s = 5
[tenant.globex]
signing_keys = {{ k1 = "{base64.b64encode(SECRET_B).decode()}" }}
""")
    mem = Memory(partitions=1, tenancy_mode="signed", tenancy_tenants_file=str(path))
    for i in range(3):  # one intake batch: all start (the cost is known when they end), then the bucket is in debt
        mem.send("standard", *signed("acme", SECRET_A, {"id": f"a{i}", "prompt": "x", "max_tokens": 40}))
    async with running(mem):
        assert await until(mem.all_committed)
        mem.send("standard", *signed("acme", SECRET_A, {"id": "a3", "prompt": "x", "max_tokens": 40}))
        mem.send("standard", *signed("globex", SECRET_B, {"id": "g0", "prompt": "x", "max_tokens": 40}))
        assert await until(mem.all_committed)
    finals = mem.finals()
    assert all(isinstance(finals[f"a{i}"][0], DoneReply) for i in range(3))
    [over] = finals["a3"]
    used = sum(finals[f"a{i}"][0].usage.prompt_tokens + finals[f"a{i}"][0].usage.completion_tokens for i in range(3))
    assert isinstance(over, ErrorReply) and over.code == ErrorCode.OVERLOADED and "token rate" in over.message
    # the debt (what was used beyond the 10 s burst of 50 tokens) takes this long to refill at 5 tokens/s
    assert abs(over.retry_after_ms - (used - 50) / 5 * 1000) < 1000, (over.retry_after_ms, used)
    assert isinstance(finals["g0"][0], DoneReply)
