"""The depth count that refuses nesting before any decoder recurses: the nesting of generated JSON
documents (strings full of brackets, quotes and backslashes included), counted exactly."""

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import json_depth_exceeds

TRICKY = st.text(alphabet=st.sampled_from(list('ab"\\[]{}/\n\u00e9\U0001F600')), max_size=12)
DOCS = st.recursive(st.none() | st.booleans() | st.integers() | TRICKY,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
                    max_leaves=30)


def depth(doc) -> int:
    if isinstance(doc, list):
        return 1 + max(map(depth, doc), default=0)
    if isinstance(doc, dict):
        return 1 + max(map(depth, doc.values()), default=0)
    return 0


@settings(max_examples=2000, deadline=None)
@given(DOCS, st.integers(min_value=0, max_value=6))
def test_a_document_exceeds_the_limit_exactly_when_it_nests_deeper(doc, limit):
    assert json_depth_exceeds(msgspec.json.encode(doc), limit) == (depth(doc) > limit)


def test_brackets_inside_strings_do_not_count_and_objects_do():
    code = msgspec.json.encode({"id": "x", "prompt": "def f(a): return [[[{'k': \"[\\\\\"}]]]" * 50})
    assert not json_depth_exceeds(code, 2)
    assert json_depth_exceeds(b'{"a": [[[', 2)  # openers that never close
    objects = b'{"a":' * 5000 + b"1" + b"}" * 5000  # counted before: only arrays were
    assert json_depth_exceeds(objects, 32) and not json_depth_exceeds(b'{"a":' * 32 + b"1" + b"}" * 32, 32)
