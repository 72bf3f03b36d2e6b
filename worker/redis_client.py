"""A Redis Cluster client built from the settings: the URL's seed nodes, credentials and TLS.

For the short-lived clients of start-up checks and the backfill's lease; the answer store and the
KV connector build their own, since they also reseed from the topology they last saw.
"""

from __future__ import annotations


def cluster_client(redis_settings, timeout_s: float):
    """An asyncio `RedisCluster`, not yet connected (`initialize()` connects)."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    from worker.redis_seeds import SeedNodes

    seeds = SeedNodes(redis_settings.client_url())
    return RedisCluster.from_url(seeds.url, startup_nodes=seeds.startup_nodes(ClusterNode), socket_timeout=timeout_s,
                                 socket_connect_timeout=timeout_s, **redis_settings.client_options())
