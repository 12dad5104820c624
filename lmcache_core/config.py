"""Typed configuration: a YAML file mapped onto msgspec structs, then env vars, then flags.

Every leaf has a dotted name (``server.url``, ``timeouts.lookup_ms``) and an environment variable
(``LMCACHE_SERVER_URL``, ``LMCACHE_TIMEOUTS_LOOKUP_MS``); ``LMCACHE_URL`` is a short alias for the
server url. Precedence: defaults < file < environment < command-line flags. Any problem raises one
``ConfigError`` whose message names the source and the key. Values that are not plain scalars
(sizes, uid lists, urls) are parsed by ``lmcache_core.config_parse``.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from lmcache_core.config_parse import MAX_UID as MAX_UID
from lmcache_core.config_parse import (
    DelayMs,
    NonNegativeMs,
    RemoteTtlS,
    TimeoutMs,
    TimeoutS,
    check_tenant_quotas,
    named_sizes,
    parse_events_urls,
    parse_http_url,
    parse_mooncake_url,
    parse_remote_url,
    parse_size,
    parse_uids,
    remote_kind,
    size_of,
)
from lmcache_core.errors import ConfigError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "uint8": 1}
DTypeName = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8"]
Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
#: At most 100 ms: the scheduler waits this long per step at worst.
LookupWaitUs = Annotated[int, msgspec.Meta(ge=0, le=100_000)]
ENV_PREFIX = "LMCACHE_"
URL_ENV = "LMCACHE_URL"
DEFAULT_HTTP_URL = "http://127.0.0.1:9464"


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class TenantQuota(_Section):
    """One ``server.tenant_quotas`` entry: the tenant's ``cache_salt`` (kept out of every figure:
    the label names the tenant there) and its memory quota."""

    salt: str
    size: int | str


class ModelConfig(_Section):
    """The model the CLI commands (lookup, store-bench, ...) assume unless told otherwise. The
    server needs none: it learns each worker's KV shape when it registers."""

    name: str = "meta-llama/Llama-3.1-8B"
    num_layers: Positive = 32
    num_kv_heads: Positive = 8
    head_dim: Positive = 128
    dtype: DTypeName = "bfloat16"
    use_mla: bool = False

    def chunk_bytes(self, chunk_size: int, world_size: int = 1) -> int:
        """Bytes of one rank's chunk: all layers, K and V (one latent for MLA)."""
        kv = 1 if self.use_mla else 2
        heads = 1 if self.use_mla else max(1, self.num_kv_heads // world_size)
        return kv * self.num_layers * chunk_size * heads * self.head_dim * DTYPE_BYTES[self.dtype]


class ServerConfig(_Section):
    url: str = "tcp://127.0.0.1:5555"
    # The HTTP listener for operators (/metrics, /healthz, /readyz): http://HOST:PORT, port 0 picks
    # a free one; "off" (or YAML's bare off/false) disables it. No auth: keep it on loopback.
    http_url: str | bool = DEFAULT_HTTP_URL
    pool_size: int | str = "4GiB"
    # The most bytes of pieces that may be pinned at once (stores with lmcache.pin, lmcache pin):
    # a pin past it is refused (a store's pieces are then stored unpinned and counted in
    # store_pin_refused; PIN answers the error pin_limit). None: a quarter of the pool.
    max_pinned: int | str | None = None
    # The pool is one byte budget for every model and TP size, cut into allocation units ("slabs")
    # of this size (none: 2 MiB, a huge page; the pool if it is smaller). A piece up to a unit
    # shares units of its size class, a larger one takes consecutive units; a store of a new piece
    # size evicts about its bytes plus one unit. The largest piece is the whole pool: a
    # registration whose chunks are bigger is refused.
    slab_size: int | str | None = None
    # Optional per-model memory quotas: {model name: size}; a model at its quota evicts its own
    # oldest pieces first (or skips the store when all are held). Models not named share the rest.
    quotas: dict[str, int | str] = msgspec.field(default_factory=dict)
    # Optional per-tenant memory quotas: {label: {salt: cache_salt, size: size}}. A tenant is the
    # cache_salt of vLLM requests (workers send a tag of it, never the salt: keys.tenant_tag); at
    # its quota it evicts its own oldest pieces first (or skips the store). A piece under a model
    # quota too fits both. Figures name a tenant by its label: a salt is never shown.
    tenant_quotas: dict[str, TenantQuota] = msgspec.field(default_factory=dict)
    eviction: Literal["lru"] = "lru"
    workers: Positive = 2
    max_request_bytes: Positive = 16 * 2**20
    max_keys_per_request: Positive = 65536
    reap_timeout_s: TimeoutS = 60.0
    # Populate every pool page on a background thread right after the server is ready (~0.4 s
    # per GiB here; then transparent huge pages where offered), so first stores into fresh slots
    # do not pay page faults (~30x slower per byte on first touch); the pool is then resident.
    # false: pages are mapped as stores first write them.
    prefault: bool = True
    # KV events for cache-aware routers (server/events.py): a ZMQ PUB socket, tcp:// or ipc://, of the
    # chunks stored and removed, in vLLM's KV-event format; off by default. Replay requests go to
    # events_replay_url (default: the events port + 1, or the ipc path + ".replay"). events_format:
    # "map" as vLLM publishes since mid 2026 (0.32), "array" for routers that expect older vLLM's.
    events_url: str | bool | None = None
    events_replay_url: str | None = None
    events_format: Literal["map", "array"] = "map"
    # Users besides the server's own whose shared-memory KV caches workers may register (the server
    # maps them read-write and removes them when their creator dies); a list, or "1000,1001".
    shm_allowed_uids: list[int] | int | str = msgspec.field(default_factory=list)
    # TEST ONLY (fault injection, off by default): sleep this long before each chunk a retrieve
    # copies, to make loads slow on purpose (tests of the load deadline). Never set in production.
    test_copy_delay_ms: DelayMs = 0.0

    def __post_init__(self) -> None:
        self.pool_size = size_of("pool_size", self.pool_size)
        if self.max_pinned is not None:
            self.max_pinned = size_of("max_pinned", self.max_pinned)
        if self.slab_size is not None:
            self.slab_size = size_of("slab_size", self.slab_size)
            if self.slab_size <= 0 or self.slab_size % 64:
                raise ValueError("slab_size: must be a positive multiple of 64 bytes")
        self.quotas = named_sizes("quotas", self.quotas)
        check_tenant_quotas(self.tenant_quotas)
        if not self.url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"url: must start with tcp:// or ipc://, got {self.url!r}")
        self.events_url, self.events_replay_url = (
            parse_events_urls(self.events_url, self.events_replay_url) or (None, None))
        if parse_http_url(self.http_url) is None:
            self.http_url = "off"
        self.shm_allowed_uids = list(parse_uids(self.shm_allowed_uids))

    @property
    def pool_bytes(self) -> int:
        return parse_size(self.pool_size)

    @property
    def max_pinned_bytes(self) -> int:
        """``max_pinned`` in bytes (a quarter of the pool when not set)."""
        if self.max_pinned is None:
            return self.pool_bytes // 4
        return parse_size(self.max_pinned)

    @property
    def slab_bytes(self) -> int | None:
        return None if self.slab_size is None else parse_size(self.slab_size)

    @property
    def quota_bytes(self) -> dict[str, int]:
        return {name: int(size) for name, size in self.quotas.items()}  # parsed at load

    @property
    def tenant_quota_bytes(self) -> dict[str, tuple[str, int]]:
        """``tenant_quotas`` as ``{label: (cache_salt, bytes)}``."""
        return {label: (quota.salt, int(quota.size)) for label, quota in self.tenant_quotas.items()}

    @property
    def events_urls(self) -> tuple[str, str] | None:
        """``(events url, replay url)`` of the KV event sockets, or None when events are off."""
        return parse_events_urls(self.events_url, self.events_replay_url)

    @property
    def http_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the HTTP listener, or None when ``http_url`` is off."""
        return parse_http_url(self.http_url)

    @property
    def allowed_uids(self) -> tuple[int, ...]:
        """``shm_allowed_uids`` as uids."""
        return parse_uids(self.shm_allowed_uids)


class TimeoutConfig(_Section):
    connect_s: TimeoutS = 5.0
    request_s: TimeoutS = 30.0
    lookup_ms: TimeoutMs = 2000
    # How long vLLM's scheduler may wait, in the step that sends a request's lookup, for the
    # answer (all lookups of one step share it). Answered in time, the request's load starts
    # in that step instead of the next one; otherwise it is asked again next step, as with 0
    # (never wait). A lookup to a local server is answered in 0.1-0.5 ms on an idle host, 0.9-1.3
    # ms inside a vLLM engine on a 2-core VM (scripts/profile_hit.py): a 1 ms budget missed 1 in 8
    # there, and each miss cost the request a whole engine step.
    lookup_wait_us: LookupWaitUs = 2000
    lock_ttl_s: TimeoutS = 300.0
    # A retrieve's deadline (server side, from when a copy thread takes it up; a request's
    # deadline_ms overrides it): chunks not reached in time are not copied and are answered
    # missing, so vLLM recomputes them. 0: no deadline (one batched copy, the fastest path).
    load_ms: NonNegativeMs = 2000


class DiskConfig(_Section):
    """The L2 disk tier (optional): chunk files in ``path``, at most ``max_size`` bytes of them."""

    path: str
    max_size: int | str = "16GiB"
    write_through: bool = False  # write every stored chunk behind, not only those near eviction
    queue_size: Positive = 1024  # chunk writes waiting for the writer; beyond it they are dropped

    def __post_init__(self) -> None:
        if not self.path.strip():
            raise ValueError("path: must name a directory")
        try:
            self.max_size = parse_size(self.max_size)
        except ValueError as exc:
            raise ValueError(f"max_size: {exc}") from None
        if self.max_size <= 0:
            raise ValueError("max_size: must be positive")

    @property
    def max_bytes(self) -> int:
        return parse_size(self.max_size)


class MooncakeConfig(_Section):
    """``remote.mooncake``: this server as a node of a Mooncake Store pool (``remote.url`` is
    ``mooncake://MASTER_HOST:PORT``). The pool is the nodes' own memory: each server mounts
    ``segment_size`` bytes of its host's RAM into it (beside ``server.pool_size``), and reads and
    writes the pool through Mooncake's transfer engine straight from and into its memory pool."""

    # The master's HTTP metadata server (mooncake_master --enable_http_metadata_server), or an
    # etcd url (etcd://host:2379); None: http://<the master's host>:8080/metadata.
    metadata_server: str | None = None
    # The address other nodes reach this one at (its transfer engine's segment); on one host
    # 127.0.0.1, on a cluster this host's address on the transfer network.
    local_hostname: str = "127.0.0.1"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = ""  # RDMA devices (e.g. "mlx5_0,mlx5_1"); "" for tcp
    segment_size: int | str = "1GiB"  # this host's memory mounted into the pool
    replicas: Annotated[int, msgspec.Meta(ge=1, le=8)] = 1  # copies of each chunk, on distinct nodes
    # The first copy of each chunk in this node's own segment while it has room (a write is then
    # a local copy, and the node that stored a prefix is the likeliest to ask for it again; other
    # nodes read it over the transfer network); false: the master places every copy at random,
    # each write crossing the network, memory use even across nodes.
    prefer_local: bool = True

    def __post_init__(self) -> None:
        self.segment_size = size_of("segment_size", self.segment_size)
        if self.segment_size <= 0:
            raise ValueError("segment_size: must be positive (this node's share of the pool)")
        if not self.local_hostname.strip():
            raise ValueError("local_hostname: must name this host (127.0.0.1 on one host)")

    @property
    def segment_bytes(self) -> int:
        return parse_size(self.segment_size)


class RemoteConfig(_Section):
    """The L3 tier (optional), shared by every server that names the same url: Redis/Valkey, or
    a Mooncake Store pool (``mooncake://`` url, settings in ``mooncake``)."""

    # redis://, rediss://, valkey://, valkeys://, unix://; redis+cluster:// for a cluster;
    # mooncake://HOST:PORT for a Mooncake Store master
    url: str
    queue_size: Positive = 256  # chunk writes waiting for the writer; beyond it they are dropped
    timeout_ms: TimeoutMs = 500  # socket connect/read timeout of every Redis call
    key_prefix: str = "lmcache"
    ttl_s: RemoteTtlS | None = None  # expire chunks in Redis after this long (None: Redis decides)
    cluster: bool = False
    retry_interval_s: TimeoutS = 1.0  # how often a down Redis or Mooncake master is probed
    mooncake: MooncakeConfig | None = None  # mooncake:// only (None there: the defaults)

    def __post_init__(self) -> None:
        try:
            if self.kind == "mooncake":
                parse_mooncake_url(self.url)
            else:
                parse_remote_url(self.url)
        except ConfigError as exc:
            raise ValueError(str(exc).replace("remote.url: ", "url: ", 1)) from None
        if not self.key_prefix or ":" in self.key_prefix:
            raise ValueError("key_prefix: must be non-empty and hold no ':'")
        if self.kind == "redis" and self.mooncake is not None:
            raise ValueError("mooncake: only with a mooncake:// url")
        if self.kind == "mooncake":
            if self.ttl_s is not None or self.cluster:
                raise ValueError(f"{'ttl_s' if self.ttl_s is not None else 'cluster'}: Redis "
                                 f"only (Mooncake Store evicts by its own watermarks)")
            if self.mooncake is None:
                self.mooncake = MooncakeConfig()

    @property
    def kind(self) -> str:
        """``"redis"`` or ``"mooncake"``: which store ``url`` names."""
        return remote_kind(self.url)


class IntegrityConfig(_Section):
    """Chunk checksums (xxh3-64, taken right after a store's copy, off its reply path; kept with the
    piece and in its tier records; always checked before a tier write and after a tier read)."""

    # Also check each piece against its checksum before a retrieve copies it out (a corrupt one is
    # dropped and its chunk answered missing: vLLM recomputes it). Costs a hash of every byte read.
    verify_on_retrieve: bool = False


class LMCacheConfig(_Section):
    """Everything one server or client needs; ``configs/*.yaml`` map onto it."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    world_size: Positive = 1
    chunk_size: Positive = 256
    # Clients (the scheduler adapter, the vLLM connector): a lookup whose load would bring fewer
    # tokens than this (beyond what vLLM already computed) is declined: 0 hits, its locks released
    # at once, vLLM computes those tokens. 0: every hit is loaded. Not read by the server.
    min_hit_tokens: NonNegative = 0
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    timeouts: TimeoutConfig = msgspec.field(default_factory=TimeoutConfig)
    disk: DiskConfig | None = None
    remote: RemoteConfig | None = None
    integrity: IntegrityConfig = msgspec.field(default_factory=IntegrityConfig)

    @property
    def chunk_bytes(self) -> int:
        return self.model.chunk_bytes(self.chunk_size, self.world_size)


def leaf_keys(cls: type[msgspec.Struct] = LMCacheConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config, in declaration order."""
    keys: list[str] = []
    for field in msgspec.structs.fields(cls):
        section = _section_type(field.type)
        if section is not None:
            keys += leaf_keys(section, f"{prefix}{field.name}.")
        else:
            keys.append(prefix + field.name)
    return keys


def _section_type(annotation: Any) -> type[msgspec.Struct] | None:
    """The struct of a section field (``X`` or an optional ``X | None``), else None."""
    if isinstance(annotation, type):
        return annotation if issubclass(annotation, msgspec.Struct) else None
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None  # a mapping or list of structs (tenant_quotas) is one key, not a section
    structs = [a for a in typing.get_args(annotation)
               if isinstance(a, type) and issubclass(a, msgspec.Struct)]
    return structs[0] if len(structs) == 1 else None


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper().replace(".", "_")


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> LMCacheConfig:
    """Defaults, then the YAML file at ``path``, then ``LMCACHE_*`` variables, then ``overrides``."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "defaults"
    env = os.environ if environ is None else environ
    for key in leaf_keys():
        if env_name(key) in env:
            _set(raw, key, _parse_scalar(env[env_name(key)]))
            source = f"{source} + ${env_name(key)}"
    if URL_ENV in env:
        _set(raw, "server.url", env[URL_ENV])
    for key, value in (overrides or {}).items():
        if value is not None:
            _set(raw, key, value)
    config = _convert(raw, source)
    _check_pool(config, source)
    _check_tiers(config, source)
    return config


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a UTF-8 text file (YAML is text)"
        raise ConfigError(f"{path}: cannot read: {why}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: YAML syntax error{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``dotted``; a section that is not a mapping (``server: 5``) is kept, for the load to report."""
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            return
        node = child
    node[leaf] = value


def _convert(raw: dict[str, Any], source: str) -> LMCacheConfig:
    try:
        return msgspec.convert(raw, LMCacheConfig)
    except msgspec.ValidationError as exc:
        message = str(exc)
        key = ""
        if " - at `$." in message:
            message, _, where = message.rpartition(" - at `$.")
            key = where.rstrip("`")
        if message.startswith("Object contains unknown field"):
            field = message.split("`")[1]
            key, message = (f"{key}.{field}" if key else field), "unknown key"
        if message.startswith("Object missing required field"):
            field = message.split("`")[1]
            key, message = (f"{key}.{field}" if key else field), "missing required key"
        field, sep, rest = message.partition(": ")
        # A section's check naming its field (or a path inside it: tenant_quotas.a.size)
        if key and sep and f"{key}.{field.split('.')[0]}" in leaf_keys():
            key, message = f"{key}.{field}", rest
        raise ConfigError(f"{source}: {key or '<top level>'}: {message}") from None


def _check_pool(config: LMCacheConfig, source: str) -> None:
    server = config.server
    slab = server.slab_bytes
    if slab is not None and server.pool_bytes < slab:
        raise ConfigError(
            f"{source}: server.pool_size: {server.pool_bytes} bytes is smaller than one slab "
            f"(server.slab_size {slab} bytes)")
    if server.pool_bytes < 64:
        raise ConfigError(f"{source}: server.pool_size: {server.pool_bytes} bytes is too small")


def _check_tiers(config: LMCacheConfig, source: str) -> None:
    remote = config.remote
    if remote is not None and remote.timeout_ms >= config.timeouts.lookup_ms:
        raise ConfigError(
            f"{source}: remote.timeout_ms: {remote.timeout_ms} ms must be shorter than "
            f"timeouts.lookup_ms ({config.timeouts.lookup_ms} ms), or a slow Redis eats whole lookups")
