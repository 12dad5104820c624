"""The remote tier's url check, apart from ``remote`` so that loading a config does not import redis."""

from __future__ import annotations

from lmcache_core.errors import ConfigError

_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss",
            "unix": "unix"}


def parse_url(url: str) -> tuple[str, bool]:
    """``(redis-py url, cluster)`` from a redis://, rediss://, valkey://, valkeys://, unix:// url;
    ``redis+cluster://`` (or ``valkey+cluster://``...) names a cluster."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(f"remote.url: {url!r} is not a url (try redis://host:6379)")
    base, plus, flavour = scheme.lower().partition("+")
    if base not in _SCHEMES or (plus and flavour != "cluster") or (plus and base == "unix"):
        raise ConfigError(
            f"remote.url: scheme {scheme!r} is not one of redis://, rediss://, valkey://, valkeys://, "
            "unix:// (add +cluster, e.g. redis+cluster://, for a cluster)")
    return f"{_SCHEMES[base]}://{rest}", bool(plus)
