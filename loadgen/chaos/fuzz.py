"""Hostile and malformed request records, generated structure-aware with hypothesis.

Shared by the intake property test and `sluice chaos`. A generated `reply_to` is either the
reply topic under test or not a usable topic name, so every reply lands where an auditor reads.
"""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

CLASSES = ["realtime", "standard", "batch"]
FIELDS = ["id", "tenant", "kind", "prompt", "messages", "event", "template", "labels", "max_tokens", "temperature",
          "top_p", "seed", "stop", "stream", "deadline_ms", "z"]


def records(reply_topic: str = "sluice.replies"):
    """Strategy for (class, key, value, headers): random bytes, truncated and over-nested JSON and
    msgpack, wrong types, boundary numbers, odd headers, non-UTF-8 keys, unknown fields, and some
    valid requests among them."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=12), st.sampled_from(["generate", "score", "fraud", ""]))
    values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                          max_leaves=8)
    reply_tos = st.one_of(st.just(reply_topic), st.sampled_from(["", "no spaces allowed", "x" * 300, "a/b"]),
                          st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2))
    valid = st.fixed_dictionaries(
        {"id": st.text(min_size=1, max_size=12), "prompt": st.text(min_size=1, max_size=30),
         "max_tokens": st.integers(1, 4)},
        optional={"stream": st.booleans(), "temperature": st.floats(0, 2), "tenant": st.text(min_size=1, max_size=8)})
    requestish = st.builds(lambda d, r: {**d, **r}, st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
                           st.dictionaries(st.just("reply_to"), reply_tos, max_size=1))
    bodies = st.one_of(valid, requestish, st.fixed_dictionaries({"id": st.text(max_size=12)}, optional={
        "prompt": values, "max_tokens": values, "messages": values, "stop": values, "reply_to": reply_tos}))

    @st.composite
    def record(draw):
        body = draw(bodies)
        encoding = draw(st.sampled_from(["json", "json", "msgpack", "raw", "truncated", "deep", "none"]))
        headers = []
        if encoding in ("json", "truncated"):
            value = msgspec.json.encode(body)
            if encoding == "truncated":
                value = value[:draw(st.integers(0, max(0, len(value) - 1)))]
        elif encoding == "msgpack":
            try:
                value = msgspec.msgpack.encode(body)
                headers.append(("content-type", b"application/msgpack"))
            except OverflowError:  # msgpack has no integers past 64 bits; JSON carries them
                value = msgspec.json.encode(body)
        elif encoding == "raw":
            value = draw(st.binary(max_size=64))
        elif encoding == "deep":
            n = draw(st.integers(30, 3000))
            value = b'{"id":"deep","z":' + b"[" * n + b"]" * draw(st.sampled_from([n, n - 1, 0])) + b"}"
        else:
            value = None
        headers += draw(st.lists(st.tuples(st.sampled_from(["content-type", "x-a", "Content-Type", "x-" + "h" * 200]),
                                           st.one_of(st.none(), st.binary(max_size=24),
                                                     st.just(b"application/msgpack"))), max_size=2))
        key = draw(st.one_of(st.none(), st.binary(max_size=16), st.text(max_size=12).map(str.encode)))
        return draw(st.sampled_from(CLASSES)), key, value, headers

    return record()


def generate(n: int, seed_value: int, reply_topic: str) -> list[tuple[str, bytes | None, bytes | None, list]]:
    """`n` records, the same ones for the same seed."""
    out: list = []
    batch = 10

    def run_once(s: int) -> None:
        @settings(max_examples=max(1, (n - len(out) + batch - 1) // batch), database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @seed(s)
        @given(st.lists(records(reply_topic), min_size=batch, max_size=batch))
        def collect(recs):
            out.extend(recs)

        collect()

    s = seed_value
    while len(out) < n:
        run_once(s)
        s += 1
    return out[:n]
