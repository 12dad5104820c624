"""The remote tier's redis-py client: how one is made for a url (timeouts, one retry, the packer),
which errors count as a Redis fault, and how a url is shown in logs."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Encoder, PythonRespSerializer
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

FAULTS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
PACK_CUTOFF = 6000  # redis-py's default: larger arguments go out as separate buffers


def make_client(url: str, cluster: bool, timeout_s: float, extra: dict[str, Any]) -> Any:
    """A client of ``url`` (a redis-py url) with socket timeouts of ``timeout_s`` and one immediate
    retry on a connection error; ``extra`` options override these. A cluster client connects now."""
    options: dict[str, Any] = dict(
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)))
    options.update(extra)
    if cluster:
        return RedisCluster.from_url(url, **options)
    # redis-py's own packer sends a large value as is; hiredis's copies it first.
    options.setdefault("command_packer", PythonRespSerializer(
        PACK_CUTOFF, Encoder("utf-8", "strict", False).encode))
    return redis.Redis.from_url(url, health_check_interval=0, **options)


def without_password(url: str) -> str:
    """``url`` with the password of its user info (if any) shown as ``***``."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}"
