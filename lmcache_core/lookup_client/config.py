"""What the async lookup client and servers are built from, and where their sockets live.

``LMCacheEngineConfig`` is the cache's side (chunk size, lookup timeout, free-form extras);
``LMCacheMetadata`` is the deployment's (model, world size, this worker, the engine instance, the
runtime directory, MLA, which workers run lookup servers). Both are typed msgspec structs that
validate on construction; ``from_config`` builds them from the toolkit's ``LMCacheConfig``.

Sockets: ``<runtime_dir>/<engine_id>.lookup-w<worker_id>.sock`` (each lookup server binds its PULL
there) and ``<runtime_dir>/<engine_id>.lookup-sched.<instance>.sock`` (each client instance binds its
own PULL there and names it in its requests). The runtime directory is private (mode 0700): nobody
else on the host can connect to these sockets.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Annotated, Any

import msgspec

from lmcache_core.config import LMCacheConfig
from lmcache_core.errors import ConfigError

Positive = Annotated[int, msgspec.Meta(gt=0)]
#: Linux's sun_path holds 108 bytes including the NUL.
MAX_IPC_PATH = 107
_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class LMCacheEngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The cache settings the lookup client needs.

    ``lookup_timeout_ms``: a lookup still unanswered this long after ``lookup()`` reports 0 hit tokens
    (vLLM recomputes) and is cancelled. ``extra_config``: free-form settings, kept for LMCache
    compatibility (nothing here reads LMCache's ``lookup_backoff_time``: we never back off).
    """

    chunk_size: Positive = 256
    lookup_timeout_ms: Positive = 2000
    extra_config: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:  # constraints are checked on decode only; check them here too
        if self.chunk_size <= 0:
            raise ConfigError(f"lookup config: chunk_size must be positive, got {self.chunk_size}")
        if self.lookup_timeout_ms <= 0:
            raise ConfigError(
                f"lookup config: lookup_timeout_ms must be positive, got {self.lookup_timeout_ms}")

    @classmethod
    def from_config(cls, config: LMCacheConfig, **extra: Any) -> LMCacheEngineConfig:
        return cls(chunk_size=config.chunk_size, lookup_timeout_ms=config.timeouts.lookup_ms,
                   extra_config=dict(extra))


class LMCacheMetadata(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Who this process is in the deployment and where the lookup sockets live.

    ``world_size``/``worker_id`` are the KV world size and this worker's rank (the client ignores
    ``worker_id``). ``engine_id`` names one vLLM instance, so several share a runtime directory.
    ``runtime_dir``: None means ``$XDG_RUNTIME_DIR/lmcache`` when that exists, else
    ``<tmp>/lmcache-<uid>``. ``lookup_server_worker_ids``: the workers that run lookup servers, which
    are all the client waits for; None means every worker, or worker 0 alone when ``use_mla`` (MLA KV
    caches are the same on every rank).
    """

    model_name: str
    world_size: Positive = 1
    worker_id: Annotated[int, msgspec.Meta(ge=0)] = 0
    engine_id: str = "default"
    runtime_dir: str | None = None
    use_mla: bool = False
    lookup_server_worker_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("lookup metadata: model_name must not be empty")
        if self.world_size <= 0:
            raise ConfigError(f"lookup metadata: world_size must be positive, got {self.world_size}")
        if not 0 <= self.worker_id < self.world_size:
            raise ConfigError(f"lookup metadata: worker_id {self.worker_id} must be in "
                              f"[0, world_size={self.world_size})")
        if not _ENGINE_ID_RE.match(self.engine_id):
            raise ConfigError(f"lookup metadata: engine_id {self.engine_id!r} must be 1-64 of "
                              "A-Z a-z 0-9 _ . - (it names socket files)")
        ids = self.lookup_server_worker_ids
        if ids is not None:
            if not ids:
                raise ConfigError("lookup metadata: lookup_server_worker_ids must not be empty")
            bad = [i for i in ids if not 0 <= i < self.world_size]
            if bad or len(set(ids)) != len(ids):
                raise ConfigError(f"lookup metadata: lookup_server_worker_ids {list(ids)} must be "
                                  f"distinct ranks in [0, {self.world_size})")

    @classmethod
    def from_config(cls, config: LMCacheConfig, **fields: Any) -> LMCacheMetadata:
        """Model name, world size and MLA from ``config``; the rest (worker_id, ...) from ``fields``."""
        fields.setdefault("model_name", config.model.name)
        fields.setdefault("world_size", config.world_size)
        fields.setdefault("use_mla", config.model.use_mla)
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ConfigError(f"lookup metadata: {exc}") from None

    @property
    def server_worker_ids(self) -> tuple[int, ...]:
        """The workers that run a lookup server, in rank order."""
        if self.lookup_server_worker_ids is not None:
            return tuple(sorted(self.lookup_server_worker_ids))
        return (0,) if self.use_mla else tuple(range(self.world_size))

    @property
    def runs_lookup_server(self) -> bool:
        """Whether worker ``worker_id`` is one of the lookup-server workers."""
        return self.worker_id in self.server_worker_ids

    def runtime_path(self) -> Path:
        return Path(self.runtime_dir) if self.runtime_dir else default_runtime_dir()

    def scheduler_socket(self, instance: str) -> Path:
        """The answer socket of client instance ``instance`` (e.g. ``<pid>-<n>``)."""
        return _checked(self.runtime_path() / f"{self.engine_id}.lookup-sched.{instance}.sock")

    def scheduler_sockets(self) -> list[Path]:
        """Every client instance's answer socket file present now (live or left behind)."""
        return sorted(self.runtime_path().glob(f"{self.engine_id}.lookup-sched.*.sock"))

    def worker_socket(self, worker_id: int) -> Path:
        return _checked(self.runtime_path() / f"{self.engine_id}.lookup-w{worker_id}.sock")


def default_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "lmcache"
    return Path(tempfile.gettempdir()) / f"lmcache-{os.getuid()}"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700, or check that an existing one is ours and private."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"lookup runtime dir {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"lookup runtime dir {path}: not a directory (or a symlink)")
    if info.st_uid != os.getuid():
        raise ConfigError(f"lookup runtime dir {path}: owned by uid {info.st_uid}, not by us "
                          f"({os.getuid()}); choose another runtime_dir")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours: make it private rather than refuse
    return path


def _checked(path: Path) -> Path:
    if len(os.fsencode(path)) > MAX_IPC_PATH:
        raise ConfigError(f"lookup socket path {str(path)!r} is longer than {MAX_IPC_PATH} bytes "
                          "(the Unix socket limit): use a shorter runtime_dir or engine_id")
    return path
