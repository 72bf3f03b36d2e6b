from types import SimpleNamespace as Node

import pytest

from worker.redis_seeds import SeedNodes, redacted, split_url


@pytest.mark.parametrize("url,first,extra", [
    ("redis://127.0.0.1:17001", "redis://127.0.0.1:17001", []),
    ("redis://a:1,b:2,c:3", "redis://a:1", [("b", 2), ("c", 3)]),
    ("rediss://user:pw@a:1,b:2/0?ssl_cert_reqs=none", "rediss://user:pw@a:1/0?ssl_cert_reqs=none", [("b", 2)]),
    ("redis://a:1,b", "redis://a:1", [("b", 6379)]),
    ("redis://a:1,[::1]:7000", "redis://a:1", [("[::1]", 7000)]),
])
def test_split_url(url, first, extra):
    assert split_url(url) == (first, extra)


@pytest.mark.parametrize("url", ["redis://a:1,:2", "redis://a:1,b:x", "redis://a:1,"])
def test_bad_seed_is_named(url):
    with pytest.raises(ValueError, match="seed address"):
        split_url(url)


def test_seeds_keep_the_last_topology_after_the_configured_nodes():
    seeds = SeedNodes("redis://a:1,b:2")
    assert seeds.addresses() == [("b", 2)]  # the URL's own host is passed through the URL
    seeds.remember([Node(host="a", port=1), Node(host="c", port="3"), Node(host="b", port=2)])
    assert seeds.addresses() == [("b", 2), ("a", 1), ("c", 3)]
    seeds.remember([])  # a client that knew nothing does not erase what was seen
    assert seeds.addresses() == [("b", 2), ("a", 1), ("c", 3)]
    seeds.remember([Node(host="d", port=4)])
    assert seeds.addresses() == [("b", 2), ("d", 4)]
    assert [(n.host, n.port) for n in seeds.startup_nodes(lambda h, p: Node(host=h, port=p))] == [("b", 2), ("d", 4)]


@pytest.mark.parametrize("url, shown", [
    ("redis://sluice:s3cret@h1:7000,h2:7001/0", "redis://sluice:***@h1:7000,h2:7001/0"),
    ("rediss://s3cret@h1:7000", "rediss://***@h1:7000"),
    ("redis://h1:7000", "redis://h1:7000"),
    ("redis://:s3cret@h1:7000", "redis://:***@h1:7000"),
])
def test_a_password_never_reaches_a_log_line(url, shown):
    assert redacted(url) == shown


def test_a_bad_seed_error_does_not_repeat_the_password():
    with pytest.raises(ValueError) as err:
        split_url("redis://u:s3cret@h1:7000,h2:notaport")
    assert "s3cret" not in str(err.value)
