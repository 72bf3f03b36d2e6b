"""How start-up names a TLS failure to Redis, whichever way the server's refusal reaches the client."""

import pytest
from redis.exceptions import RedisClusterException

from worker import preflight
from worker.settings import load

ALERT = "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required (_ssl.c:2580)"


class Refusing:
    """A cluster client whose start fails as `exc` (raised from `cause`, as redis-py chains them)."""

    def __init__(self, exc, cause=None):
        self.exc, self.cause = exc, cause

    async def initialize(self):
        raise self.exc from self.cause

    async def aclose(self):
        pass


@pytest.mark.parametrize("exc,cause,named", [
    # a server that wants a client certificate: the alert, or the reset after it, whichever comes first
    (RedisClusterException(f"Redis Cluster cannot be connected: {ALERT}"), None, "client certificate may be required"),
    (RedisClusterException("Redis Cluster cannot be connected"), ConnectionResetError(104, "reset"),
     "client certificate may be required"),
    # a server certificate the CA does not vouch for is another TLS failure
    (RedisClusterException("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"), None, "TLS to Redis failed"),
])
async def test_a_refused_tls_connection_names_the_settings_to_check(monkeypatch, exc, cause, named):
    from redis.asyncio import cluster

    monkeypatch.setattr(cluster.RedisCluster, "from_url", classmethod(lambda cls, *a, **k: Refusing(exc, cause)))
    settings = load(environ={"SLUICE_REDIS_URL": "rediss://127.0.0.1:1"}).redis
    with pytest.raises(preflight.StartupError, match=named) as err:
        await preflight.check_redis(settings, timeout_s=1)
    assert "SLUICE_REDIS_TLS" in str(err.value)
