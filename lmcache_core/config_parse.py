"""The parsers behind config values that are not plain YAML scalars: sizes (``"4GiB"``), uid lists,
the HTTP listener's url and the KV event sockets' urls. Each raises ValueError naming what is wrong;
``lmcache_core.config`` turns that into a ``ConfigError`` naming the source and the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec

from lmcache_core.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 2**10, "ki": 2**10, "m": 1000**2,
          "mb": 1000**2, "mib": 2**20, "mi": 2**20, "g": 1000**3, "gb": 1000**3, "gib": 2**30,
          "gi": 2**30, "t": 1000**4, "tb": 1000**4, "tib": 2**40, "ti": 2**40}
MAX_UID = 2**32 - 2  # (uid_t)-1 means "no uid"
#: The longest any timeout, interval or delay may be (a day): longer ones (or .inf) overflow the
#: waits they feed (zmq polls, sleeps) and are refused at load, naming the key.
MAX_TIMEOUT_S = 86400.0
TimeoutS = Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)]
TimeoutMs = Annotated[int, msgspec.Meta(gt=0, le=int(MAX_TIMEOUT_S * 1000))]
NonNegativeMs = Annotated[int, msgspec.Meta(ge=0, le=int(MAX_TIMEOUT_S * 1000))]
DelayMs = Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMEOUT_S * 1000)]
#: remote.ttl_s at most a year (Redis refuses expiry times that overflow, on every write)
MAX_REMOTE_TTL_S = 365 * 86400
RemoteTtlS = Annotated[int, msgspec.Meta(gt=0, le=MAX_REMOTE_TTL_S)]


def parse_size(value: int | str) -> int:
    """Bytes from ``1073741824``, ``"1GiB"``, ``"512 MiB"`` or ``"2GB"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"not a size: {value!r} (try 4GiB, 512MiB or a byte count)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def size_of(field: str, value: int | str) -> int:
    """``parse_size``, its ValueError naming ``field`` (the loader prefixes its section)."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def parse_uids(value: list[int] | int | str) -> tuple[int, ...]:
    """Uids from ``[1000, 1001]``, ``1000`` or ``"1000,1001"``; ValueError naming the bad one."""
    items = value if isinstance(value, list) else str(value).replace(",", " ").split()
    uids = []
    for item in items:
        text = str(item).strip()
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_UID:
            raise ValueError(f"shm_allowed_uids: {text!r} is not a uid (0-{MAX_UID})")
        uids.append(int(text))
    return tuple(uids)


def parse_http_url(value: str | bool) -> tuple[str, int] | None:
    """``(host, port)`` from ``http://127.0.0.1:9464`` (``[::1]`` for IPv6), None for ``off``;
    ValueError naming ``http_url`` for anything else."""
    if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    hint = "expected http://HOST:PORT (e.g. http://127.0.0.1:9464) or off"
    if not isinstance(value, str):
        raise ValueError(f"http_url: {hint}, got {value!r}")
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"http_url: {value!r}: {exc}; {hint}") from None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(f"http_url: {hint}, got {value!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"http_url: only a scheme, host and port, got {value!r} (the paths are "
                         f"/metrics, /healthz and /readyz)")
    return parts.hostname, port


def parse_events_urls(url: str | bool | None, replay_url: str | None) -> tuple[str, str] | None:
    """``(url, replay url)`` for ``events_url``/``events_replay_url``, None when events are off
    (None, "", "off", YAML's bare off); ValueError naming the key for anything else."""
    if url is None or url is False or (isinstance(url, str) and url.strip().lower() in ("", "off")):
        if replay_url:
            raise ValueError("events_replay_url: set events_url too (events are off)")
        return None
    hint = "expected tcp://HOST:PORT or ipc://PATH"
    if not isinstance(url, str) or not url.startswith(("tcp://", "ipc://")):
        raise ValueError(f"events_url: {hint} (or off), got {url!r}")
    if replay_url is None:
        replay_url = _replay_default(url)
    elif not replay_url.startswith(("tcp://", "ipc://")):
        raise ValueError(f"events_replay_url: {hint}, got {replay_url!r}")
    if replay_url == url and not url.endswith(":0"):  # port 0: two free ports are picked
        raise ValueError("events_replay_url: must differ from events_url")
    return url, replay_url


def _replay_default(url: str) -> str:
    """The events port + 1 (as vLLM's 5557 and 5558), or the ipc path + ".replay"."""
    if url.startswith("ipc://"):
        return url + ".replay"
    host, _, port = url.rpartition(":")
    if not port.isdigit() or int(port) > 65534 or host == "tcp":
        raise ValueError(f"events_url: {url!r} needs a port below 65535 (tcp://HOST:PORT), or set "
                         f"events_replay_url")
    return f"{host}:{int(port) + 1 if int(port) else 0}"


def check_tenant_quotas(tenants: Mapping[str, Any]) -> None:
    """``server.tenant_quotas`` (``{label: TenantQuota}``): labels and salts non-empty and
    distinct; sizes parsed in place (errors name the label)."""
    salts: dict[str, str] = {}
    for label, quota in tenants.items():
        where = f"tenant_quotas.{label}" if label else "tenant_quotas"
        if not label:
            raise ValueError(f"{where}: a tenant's label must not be empty")
        if not quota.salt:
            raise ValueError(f"{where}: salt must be a non-empty cache_salt")
        if quota.salt in salts:
            raise ValueError(f"{where}: the same salt as tenant_quotas.{salts[quota.salt]}")
        salts[quota.salt] = label
        try:
            quota.size = parse_size(quota.size)
        except ValueError as exc:
            raise ValueError(f"{where}.size: {exc}") from None


def named_sizes(field: str, sizes: dict[str, int | str]) -> dict[str, int | str]:
    """``{name: size}`` in bytes; a bad size is a ValueError naming ``field``."""
    try:
        return {str(name): parse_size(size) for name, size in sizes.items()}
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


# The remote tier's url (remote.url): checked as the config loads, without importing redis or
# mooncake. Its scheme chooses the store: Redis/Valkey, or Mooncake Store (mooncake://MASTER).
_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss",
            "unix": "unix"}
MOONCAKE_SCHEME = "mooncake"


def remote_kind(url: str) -> str:
    """``"mooncake"`` for a mooncake:// url, else ``"redis"`` (``parse_remote_url`` checks it)."""
    return "mooncake" if url.lower().startswith(f"{MOONCAKE_SCHEME}://") else "redis"


def parse_remote_url(url: str) -> tuple[str, bool]:
    """``(redis-py url, cluster)`` from a redis://, rediss://, valkey://, valkeys://, unix:// url;
    ``redis+cluster://`` (or ``valkey+cluster://``...) names a cluster."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(f"remote.url: {url!r} is not a url (try redis://host:6379)")
    base, plus, flavour = scheme.lower().partition("+")
    if base not in _SCHEMES or (plus and flavour != "cluster") or (plus and base == "unix"):
        raise ConfigError(
            f"remote.url: scheme {scheme!r} is not one of redis://, rediss://, valkey://, valkeys://, "
            "unix:// (add +cluster, e.g. redis+cluster://, for a cluster), or mooncake://")
    return f"{_SCHEMES[base]}://{rest}", bool(plus)


def parse_mooncake_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of the Mooncake master from ``mooncake://HOST:PORT``."""
    hint = "expected mooncake://HOST:PORT (the master's RPC address, e.g. mooncake://10.0.0.1:50051)"
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"remote.url: {url!r}: {exc}; {hint}") from None
    if parts.scheme.lower() != MOONCAKE_SCHEME or not parts.hostname or port is None or (
            parts.path not in ("", "/") or parts.query or parts.fragment or parts.username):
        raise ConfigError(f"remote.url: {hint}, got {url!r}")
    return parts.hostname, port
