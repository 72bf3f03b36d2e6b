"""Where a new Redis Cluster client starts looking: the configured hosts plus every node seen since.

Clients that failed mid-failover are thrown away and rebuilt. Seeding the new one from the URL alone
would never reconnect when the URL's node is the master that died, so each store remembers the
topology its last client saw. Pure Python, no redis import.
"""

from __future__ import annotations

DEFAULT_PORT = 6379


def redacted(url: str) -> str:
    """The URL fit for a log line: a password in it becomes `***` (the user name stays)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, _password = auth.partition(":")
        auth = f"{user}:***" if colon else "***"  # redis://secret@host puts the password alone
    return f"{scheme}{sep}{auth}{at}{hosts}{slash}{path}"


def split_url(url: str) -> tuple[str, list[tuple[str, int]]]:
    """`redis://[auth@]h1:p1,h2:p2/db` -> (URL of the first host, [(host, port) of the others])."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    first, *others = hosts.split(",")
    extra = []
    for other in others:
        host, colon, port = other.rpartition(":")
        if not colon:
            host, port = other, str(DEFAULT_PORT)
        if not host or not port.isdigit():
            raise ValueError(f"bad Redis seed address {other!r} in {redacted(url)!r}")
        extra.append((host, int(port)))
    return f"{scheme}{sep}{auth}{at}{first}{slash}{path}", extra


class SeedNodes:
    """The configured seeds first, then the nodes of the last topology, without repeats."""

    def __init__(self, url: str):
        self.url, self.configured = split_url(url)
        self.seen: list[tuple[str, int]] = []

    def remember(self, nodes) -> None:
        """`nodes`: a cluster client's `get_nodes()` (anything with .host and .port)."""
        found = [(n.host, int(n.port)) for n in nodes]
        if found:
            self.seen = found

    def addresses(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        for addr in self.configured + self.seen:
            if addr not in out:
                out.append(addr)
        return out

    def startup_nodes(self, node_cls) -> list:
        """`addresses()` as the client's node class (redis-py has one for sync and one for asyncio)."""
        return [node_cls(host, port) for host, port in self.addresses()]
