"""KV page keys and values: every way a stored page can be unusable is a miss, never a wrong page."""

import pytest

from worker import kv_pages
from worker.kv_pages import PageError

SHAPE, LAYERS, ITEM = (2, 4, 8), 3, 4  # per-layer page shape, layers, float32
PAYLOAD = bytes(range(256)) * (2 * 4 * 8 * 3 * 4 // 256)
SEED = kv_pages.root("model-a", "tenant-a")
D0, D1 = kv_pages.chain(SEED, list(range(32)), 16)
GOOD = kv_pages.encode(D0, "float32", SHAPE, LAYERS, PAYLOAD)


def flip(data: bytes, i: int) -> bytes:
    b = bytearray(data)
    b[i] ^= 0x01
    return bytes(b)


def test_a_good_page_round_trips():
    assert kv_pages.decode(D0, GOOD, "float32", SHAPE, LAYERS, ITEM) == PAYLOAD


@pytest.mark.parametrize("cuts", [(), (256,), (1, 2, 3), tuple(range(256, len(PAYLOAD), 256))])
def test_a_page_written_from_pieces_is_the_same_value(cuts):
    # the connector's writer hands each layer's piece of a page as it lies in memory
    bounds = (0, *cuts, len(PAYLOAD))
    parts = [memoryview(PAYLOAD)[a:b] for a, b in zip(bounds, bounds[1:])]
    value = kv_pages.encode_parts(D0, "float32", SHAPE, LAYERS, parts)
    assert bytes(value) == GOOD  # and so it decodes as GOOD does


@pytest.mark.parametrize("name,digest,value,dtype,shape,layers,reason", [
    ("missing", D0, None, "float32", SHAPE, LAYERS, "missing"),
    ("empty", D0, b"", "float32", SHAPE, LAYERS, "corrupt"),
    ("not a page", D0, b"hello world, not a page", "float32", SHAPE, LAYERS, "corrupt"),
    ("payload bit flipped", D0, flip(GOOD, len(GOOD) - 100), "float32", SHAPE, LAYERS, "checksum"),
    ("truncated", D0, GOOD[:-4], "float32", SHAPE, LAYERS, "corrupt"),
    ("stored under another key", D1, GOOD, "float32", SHAPE, LAYERS, "checksum"),
    ("other dtype", D0, GOOD, "bfloat16", SHAPE, LAYERS, "layout"),
    ("other shape", D0, GOOD, "float32", (2, 4, 4), LAYERS, "layout"),
    ("other layer count", D0, GOOD, "float32", SHAPE, 4, "layout"),
    ("header garbled", D0, GOOD[:9] + b"\xc1" + GOOD[10:], "float32", SHAPE, LAYERS, "corrupt"),
])
def test_unusable_pages_are_misses(name, digest, value, dtype, shape, layers, reason):
    with pytest.raises(PageError) as info:
        kv_pages.decode(digest, value, dtype, shape, layers, ITEM)
    assert info.value.reason == reason


def test_keys_bind_model_tenant_and_the_whole_prefix():
    ids = list(range(48))
    base = kv_pages.chain(SEED, ids, 16)
    assert len(base) == 3 and len(set(base)) == 3
    assert kv_pages.chain(kv_pages.root("model-a", "tenant-b"), ids, 16)[0] != base[0]  # tenant
    assert kv_pages.chain(kv_pages.root("model-b", "tenant-a"), ids, 16)[0] != base[0]  # model
    changed = ids[:]
    changed[3] = 999  # a token in the first page changes every later key too
    assert all(a != b for a, b in zip(kv_pages.chain(SEED, changed, 16), base))
    assert kv_pages.chain(SEED, ids[:47], 16) == base[:2]  # only full pages
    assert kv_pages.chain(SEED, ids, 16, pages=1) == base[:1]
    assert kv_pages.key("p", base[0]).startswith("p:kv:")


def test_a_page_as_pieces_is_the_same_value_with_the_payload_uncopied():
    parts = [memoryview(PAYLOAD)[:256], memoryview(PAYLOAD)[256:]]
    pieces = kv_pages.encode_pieces(D0, "float32", SHAPE, LAYERS, parts)
    assert b"".join(pieces) == GOOD
    assert pieces[1:] == parts and all(a is b for a, b in zip(pieces[1:], parts))


@pytest.mark.parametrize("key,pieces,ttl", [
    (b"k", [b"v"], 60),
    (b"sluice:kv:" + bytes(64), [b"a" * 7000, memoryview(b"b" * 3)], 3600),
    (b"x", [b""], 1),
])
def test_a_set_in_pieces_is_the_set_redis_py_would_send(key, pieces, ttl):
    from redis.connection import PythonRespSerializer

    value = b"".join(bytes(p) for p in pieces)
    expected = b"".join(PythonRespSerializer(6000, lambda v: v if isinstance(v, bytes) else str(v).encode())
                        .pack("SET", key, value, "EX", ttl))
    assert b"".join(bytes(p) for p in kv_pages.set_command(key, pieces, ttl)) == expected
