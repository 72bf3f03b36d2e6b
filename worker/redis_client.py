"""A Redis Cluster client built from the settings: the URL's seed nodes, credentials and TLS.

For the short-lived clients of start-up checks and the backfill's lease; the answer store and the
KV connector build their own, since they also reseed from the topology they last saw, with the
retry policy of `retry_once`.
"""

from __future__ import annotations


def cluster_client(redis_settings, timeout_s: float):
    """An asyncio `RedisCluster`, not yet connected (`initialize()` connects)."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    from worker.redis_seeds import SeedNodes

    seeds = SeedNodes(redis_settings.client_url())
    return RedisCluster.from_url(seeds.url, startup_nodes=seeds.startup_nodes(ClusterNode), socket_timeout=timeout_s,
                                 socket_connect_timeout=timeout_s, **redis_settings.client_options())


def retry_once(asynchronous: bool):
    """The answer store's and KV connector's clients: one more try after a cluster error (a MOVED or a
    dropped connection during a failover), then the caller degrades rather than hold a request. What
    `cluster_error_retry_attempts=1` gave, which redis-py 6 deprecated for this object, with the
    client's own default backoff."""
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.cluster import DEFAULT_RETRY_BASE, DEFAULT_RETRY_CAP

    if asynchronous:
        from redis.asyncio.retry import Retry
    else:
        from redis.retry import Retry
    return Retry(ExponentialWithJitterBackoff(base=DEFAULT_RETRY_BASE, cap=DEFAULT_RETRY_CAP), 1)
