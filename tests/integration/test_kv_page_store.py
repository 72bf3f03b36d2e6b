"""KV pages sent to Redis as their pieces lie in memory (`_Redis.set_pieces`), on the real Redis
Cluster: what is stored is the joined value, on every primary, with its TTL, one after another
in order (each SET's acknowledgement time comes back); a moved slot is followed through redis-py's
pipeline."""

import os
import time
import uuid

import pytest

from worker import kv_pages
from worker.kv_connector import _Redis

pytestmark = pytest.mark.integration


@pytest.fixture
def store(settings):
    r = _Redis(settings.redis.client_url(), settings.redis.timeout_ms / 1000, 5.0, settings.redis.client_options())
    yield r
    r.client().close()


def pieces(n: int) -> list:
    # a prefix and layer pieces as the connector hands them: memoryviews into larger buffers
    layers = [memoryview(os.urandom(70_000))[5:65_005] for _ in range(3)]
    return [f"head-{n}".encode(), *layers]


def test_every_value_is_stored_whole_with_its_ttl_on_every_primary(store):
    tag = uuid.uuid4().hex[:6]
    items = [(kv_pages.key(f"pieces-{tag}", bytes([i]) * 32), pieces(i)) for i in range(24)]
    sent = time.perf_counter()
    acknowledged = store.set_pieces(items, 120)
    assert len(acknowledged) == len(items)
    assert sent < acknowledged[0] and acknowledged == sorted(acknowledged) and acknowledged[-1] <= time.perf_counter()
    client = store.client()
    assert len({client.get_node_from_key(k).name for k, _ in items}) == 3
    for key, parts in items:
        assert client.get(key) == b"".join(bytes(p) for p in parts)
        assert 0 < client.ttl(key) <= 120


def test_a_moved_slot_is_followed(store, monkeypatch):
    client = store.client()
    key = kv_pages.key(f"moved-{uuid.uuid4().hex[:6]}", bytes(32))
    owner = client.get_node_from_key(key)
    other = next(n for n in client.get_primaries() if n.name != owner.name)
    monkeypatch.setattr(client, "get_node_from_key", lambda k, replica=False: other)  # a stale slot map
    parts = pieces(0)
    assert len(store.set_pieces([(key, parts)], 60)) == 1
    monkeypatch.undo()
    assert client.get(key) == b"".join(bytes(p) for p in parts)


def test_an_unreachable_cluster_is_none_not_an_error():
    r = _Redis("redis://127.0.0.1:1", 0.2, 5.0, {})
    assert r.set_pieces([("k", [b"v"])], 60) is None
