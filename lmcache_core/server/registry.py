"""Registered KV caches: which worker shared which tensors, and reaping the ones that went away.

A registration maps a worker's shared tensors into this process. It is used by store/retrieve on
worker threads while the housekeeping thread may reap it, so each use holds a lease and the mapping is
closed only when the last lease ends: a reaped worker never pulls memory out from under a copy.

Reaping checks each registration on its own: a pid that cannot be checked (of another host, another
pid namespace, or no possible process) only makes that one registration "not local" (reaped when
silent, its shared memory never unlinked); it never stops the reaping of the others. A reaped
worker whose process is gone (a zombie included) gets its segments unlinked (:mod:`.segments`).

GPU registrations hold the worker's GPU memory while mapped (CUDA IPC keeps an allocation alive
while any process has it open), so a restarted vLLM would fail its free-memory check: they are
reaped after ``gpu_silence_s`` without a ping (the adapter pings every few seconds), not the long
``reap_timeout_s``, and ``DISCONNECT_GRACE_S`` after the transport saw their client's connection
close, unless a request of theirs arrived since (connection numbers are reused, so a report alone
is no proof). Their pid is trusted only if that process exists here when they register (a
worker in another pid namespace names no process here, or some other one); closing a GPU mapping
also empties the server's CUDA cache.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lmcache_core.config import LMCacheConfig
from lmcache_core.errors import IncompatibleError, NotRegisteredError
from lmcache_core.keys import LayoutGroup, group_piece, opaque_layout, rank_heads
from lmcache_core.kv.cuda_events import CopyStream
from lmcache_core.kv.cuda_ipc import release_cached_cuda_memory
from lmcache_core.kv.mapped import MappedKVCache
from lmcache_core.kv.shm import SegmentFile, parse_segment_name
from lmcache_core.protocol.messages import KVGroup, RegisterKVCacheRequest
from lmcache_core.server.segments import (
    owner_in_this_namespace,
    process_gone,
    unlink_dead_owner_segments,
)
from lmcache_core.stats import WorkerStats
from lmcache_core.storage.pool import MemoryPool

logger = logging.getLogger(__name__)
HOSTNAME = socket.gethostname()
#: How long a GPU registration may go without a ping: three of the adapter's 5 s heartbeats.
GPU_SILENCE_S = 15.0
#: A GPU worker whose connection closed is reaped this long after, unless it was heard from since.
DISCONNECT_GRACE_S = 2.0


class Registration:
    """One worker's KV cache as this server sees it."""

    def __init__(self, request: RegisterKVCacheRequest, mapped: Any, now: float,
                 client: bytes = b"") -> None:
        self.instance_id = request.instance_id
        self.model_name = request.model_name
        self.world_size = request.world_size
        self.kv_rank = request.kv_rank
        self.block_size = request.block_size
        self.kv_layout = request.layout  # vLLM's tensor layout name (flash_attn, ...)
        # The fingerprint its chunks are filed under, and the heads of the model this rank holds.
        self.group = request.group  # the KV-cache group of a hybrid model it holds (or None)
        fingerprint = getattr(mapped, "fingerprint", None)
        self.layout = (fingerprint(request.world_size, layout_group_of(request, mapped))
                       if fingerprint is not None else opaque_layout(request.world_size))
        self.heads = rank_heads(self.layout, request.world_size, request.kv_rank)
        self.pid = request.pid
        self.hostname = request.hostname
        cuda = [d.device_uuid for d in request.layers if d.kind == "cuda"]
        self.device_uuid = cuda[0] if cuda else ""  # "" for shared memory (CPU)
        self.local = _is_local(request)
        self.mapped = mapped
        self.shm_files: list[SegmentFile] = list(getattr(mapped, "shm_files", []))
        self.copy_stream = CopyStream(getattr(mapped, "device", None))
        self.last_seen = now
        self.client = client  # the transport identity it registered (or last pinged) from
        self.disconnected_at: float | None = None  # when that client's connection closed
        self.leases = 0
        self.retired = False

    def owned_by_another(self, request: RegisterKVCacheRequest) -> bool:
        """Whether ``request``, for this registration's id, comes from another process than
        this registration's, one that is not known to be gone (a pid of 0 says nothing)."""
        if not self.pid or not request.pid:
            return False
        same = request.pid == self.pid and request.hostname == self.hostname
        return not same and not self.process_gone()

    def process_gone(self) -> bool:
        """True when the worker ran here and its process no longer exists (or is a zombie).

        A pid that cannot be checked makes this registration not local, logged once: it is then
        reaped only when silent, and never stops the reaping of others."""
        if not self.local:
            return False
        try:
            return process_gone(self.pid)
        except Exception as exc:
            self.local = False
            logger.warning("cannot check process %r of KV cache instance %d (%s); it will be "
                           "reaped only when silent", self.pid, self.instance_id, exc)
            return False

    def release_segments(self) -> None:
        """Unlink the shared memory of a reaped worker whose process is gone (it cannot)."""
        if not self.local:
            return
        try:
            names = unlink_dead_owner_segments(self.pid, self.shm_files)
        except Exception:
            logger.exception("removing the shared memory of instance %d failed", self.instance_id)
            return
        for name in names:
            logger.info("unlinked shared memory %s of exited worker %d", name, self.pid)


def layout_group_of(request: RegisterKVCacheRequest, mapped: Any) -> LayoutGroup | None:
    """The group tag of a registration's fingerprint: its index, count and, for a sliding
    window, the tokens its pieces hold (the mapping's copier was opened for one piece), for
    Mamba state its world size, for chunked-local attention its attention chunk size; None for
    a single-group model, whose fingerprints stay as they always were."""
    group = request.group
    if group is None:
        return None
    tokens = int(mapped.chunk_size) if group.kind == "sliding" else 0
    world = request.world_size if group.kind == "mamba" else 0
    local = group.window_tokens if group.kind == "local" else 0
    return LayoutGroup(group.index, group.count, tokens, world, local)


def _is_local(request: RegisterKVCacheRequest) -> bool:
    """Whether this server can tell if the worker's process lives: same host, and for shared
    memory the same pid namespace (in another one, the pid names some other process)."""
    if not request.pid or request.hostname != HOSTNAME:
        return False
    names = {d.shm_name for d in request.layers if d.kind == "shm"}
    if not names:  # CUDA: no name tells the namespace; a pid that names no process here is foreign
        return _pid_exists(request.pid)
    return all(owner_in_this_namespace(parse_segment_name(name)) for name in names)


def _pid_exists(pid: int) -> bool:
    """True when a live process ``pid`` exists in this pid namespace now."""
    try:
        return not process_gone(pid)
    except Exception:  # not a possible pid, or unreadable: cannot be checked
        return False


class MappingOpener:
    """What a registration maps on this server (``KVRegistry``'s ``open_mapping``): a worker's
    tensors, as pieces of this server's chunk size (``config.chunk_size``), checked to fit its
    pool and to divide among the worker's world size."""

    def __init__(self, config: LMCacheConfig, pool: MemoryPool) -> None:
        self.config = config
        self.pool = pool

    def open(self, request: RegisterKVCacheRequest) -> MappedKVCache:
        """Map a worker's tensors; check its chunk pieces fit the pool and its heads
        divide among its world size."""
        mapped = MappedKVCache.open(request.layers, request.layout, request.block_size,
                                    self.piece_tokens(request), owner_pid=request.pid,
                                    allowed_uids=self.config.server.allowed_uids)
        try:
            if not self.pool.fits(mapped.chunk_bytes):
                raise IncompatibleError(
                    f"a chunk of this KV cache is {mapped.chunk_bytes} bytes per rank but the "
                    f"pool holds {self.pool.max_alloc_bytes} (raise server.pool_size)")
            try:
                rank_heads(mapped.fingerprint(request.world_size), request.world_size,
                           request.kv_rank)
            except ValueError as exc:
                raise IncompatibleError(str(exc)) from None
        except BaseException:
            mapped.close()
            raise
        return mapped

    def piece_tokens(self, request: RegisterKVCacheRequest) -> int:
        """The tokens of each chunk this registration's pieces hold: the chunk's, or for a
        sliding-window group its last ``piece_blocks`` blocks' (``keys.group_piece``).
        IncompatibleError naming the sizes when the chunk size is no multiple of the group's
        block size. A Mamba group's piece is one state row (the state at the chunk's end)."""
        chunk_size, group = self.config.chunk_size, request.group
        if group is None:
            return chunk_size
        if chunk_size % group.block_size:
            raise IncompatibleError(
                f"the lmcache chunk size {chunk_size} is not a multiple of KV cache group "
                f"{group.index}'s ({group.kind}) block size {group.block_size}: every group's "
                f"block size must divide the chunk size")
        if group.kind == "mamba":
            return request.block_size  # one block of state rows
        piece = group_piece(chunk_size, group.block_size, group.kind, group.window_tokens)
        return piece.piece_blocks * group.block_size


class KVRegistry:
    """instance_id -> Registration, with leases so unmapping waits for copies in progress.
    ``open_mapping``: maps a registration's tensors (the server's: ``MappingOpener.open``)."""

    def __init__(self, open_mapping: Callable[[RegisterKVCacheRequest], Any],
                 reap_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 gpu_silence_s: float = GPU_SILENCE_S) -> None:
        self._open_mapping = open_mapping
        self._reap_timeout_s = reap_timeout_s
        self._gpu_silence_s = min(gpu_silence_s, reap_timeout_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[int, Registration] = {}
        # (model, world size) -> layouts registered: every lookup asks; any change clears it.
        self._layouts: dict[tuple[str, int], list[str]] = {}
        self._groups: dict[tuple[str, int | None], list[tuple[str, KVGroup]]] = {}  # the same, of groups
        self.reaped = 0

    def register(self, request: RegisterKVCacheRequest, client: bytes = b"") -> Registration:
        """Map a worker's tensors; its process registering the same instance again replaces its
        mapping (after a reconnect, a server restart). An id held by another process that still
        runs is refused (``IncompatibleError``): taking it over would send that worker's stores
        and loads to this one's KV cache."""
        mapped = self._open_mapping(request)  # slow (mmap), outside the lock
        registration = Registration(request, mapped, self._clock(), client)
        with self._lock:
            old = self._by_id.get(request.instance_id)
            taken = old is not None and old.owned_by_another(request)
            if not taken:
                self._by_id[request.instance_id] = registration
                self._forget_layouts()
        if taken:
            assert old is not None
            mapped.close()
            raise IncompatibleError(
                f"KV cache instance {request.instance_id} is registered by process {old.pid} "
                f"on {old.hostname or 'an unknown host'}, which still runs: each worker needs "
                "an id of its own (the worker client draws one from the OS's random source)")
        if old is not None:
            self._retire(old)
        return registration

    def unregister(self, instance_id: int) -> bool:
        with self._lock:
            registration = self._by_id.pop(instance_id, None)
            self._forget_layouts()
        if registration is None:
            return False
        self._retire(registration)
        return True

    def touch(self, instance_id: int, client: bytes | None = None) -> bool:
        """A ping of ``instance_id`` (from ``client``): it lives; False if it is not registered."""
        with self._lock:
            registration = self._by_id.get(instance_id)
            if registration is not None:
                registration.last_seen = self._clock()
                if client is not None and client != registration.client:
                    registration.client = client  # it reconnected (a new identity)
                    registration.disconnected_at = None
        return registration is not None

    def disconnected(self, client: bytes) -> None:
        """The transport saw ``client``'s connection close: its GPU registrations are reaped
        after ``DISCONNECT_GRACE_S`` unless heard from before."""
        now = self._clock()
        with self._lock:
            for registration in self._by_id.values():
                if registration.device_uuid and registration.client == client:
                    registration.disconnected_at = now

    @contextmanager
    def lease(self, instance_id: int) -> Iterator[Registration]:
        """Use a registration for one copy; it stays mapped until the lease ends."""
        with self._lock:
            registration = self._by_id.get(instance_id)
            if registration is None:
                raise NotRegisteredError(
                    f"KV cache instance {instance_id} is not registered (or was reaped); "
                    f"register_kv_caches first")
            registration.leases += 1
            registration.last_seen = self._clock()
        try:
            yield registration
        finally:
            with self._lock:
                registration.leases -= 1
                close_now = registration.retired and registration.leases == 0
            if close_now:
                self._close(registration)

    def reap(self) -> list[int]:
        """Drop registrations whose process is gone or that were silent past the reap timeout."""
        now = self._clock()
        with self._lock:
            dead = [(r, why) for r in self._by_id.values() if (why := self._why_dead(r, now))]
            for registration, _ in dead:
                del self._by_id[registration.instance_id]
            self._forget_layouts()
        for registration, why in dead:
            logger.warning("reaped KV cache instance %d (%s rank %d): worker %s",
                           registration.instance_id, registration.model_name, registration.kv_rank,
                           why)
            self._retire(registration)
            # A killed worker never unlinked its shared memory; a silent one may have died since.
            registration.release_segments()
        self.reaped += len(dead)
        return [r.instance_id for r, _ in dead]

    def _why_dead(self, registration: Registration, now: float) -> str:
        """Why ``registration`` should be reaped now ("" if it should not)."""
        if registration.process_gone():
            return "process exited"
        gone_at = registration.disconnected_at
        if (gone_at is not None and registration.last_seen <= gone_at
                and now - gone_at >= DISCONNECT_GRACE_S):
            return "disconnected"
        limit = self._gpu_silence_s if registration.device_uuid else self._reap_timeout_s
        if now - registration.last_seen > limit:
            return f"silent for over {limit:g}s"
        return ""

    def cuda_device(self, instance_id: int) -> Any:
        """The CUDA device of a registered GPU KV cache; None for CPU or unknown instances."""
        with self._lock:
            registration = self._by_id.get(instance_id)
            if registration is None or not registration.device_uuid:
                return None
            return registration.mapped.device

    def stats(self) -> WorkerStats:
        """Its section of SERVER_INFO, read at one moment."""
        with self._lock:
            registrations = list(self._by_id.values())
        return WorkerStats(registered_instances=len(registrations),
                           registered_models=len({r.model_name for r in registrations}),
                           gpu_instances=sum(1 for r in registrations if r.device_uuid),
                           reaped_instances=self.reaped)

    def gpu_count(self) -> int:
        """How many distinct GPUs the registered KV caches are on."""
        with self._lock:
            return len({r.device_uuid for r in self._by_id.values() if r.device_uuid})

    def close_all(self) -> None:
        with self._lock:
            registrations = list(self._by_id.values())
            self._by_id.clear()
            self._forget_layouts()
        for registration in registrations:
            self._retire(registration)

    def __len__(self) -> int:
        return len(self._by_id)

    def layouts(self, model_name: str, world_size: int) -> list[str]:
        """The layout fingerprints of the workers registered for this model and world size."""
        with self._lock:
            found = self._layouts.get((model_name, world_size))
            if found is None:
                found = self._layouts[(model_name, world_size)] = list(dict.fromkeys(
                    r.layout for r in self._by_id.values()
                    if r.model_name == model_name and r.world_size == world_size))
            return list(found)

    def groups(self, model_name: str, world_size: int | None) -> list[tuple[str, KVGroup]]:
        """The KV-cache groups (each layout once, with its descriptor) of the workers registered
        with groups (a hybrid model) for this model and world size (None: any); [] for none."""
        with self._lock:
            found = self._groups.get((model_name, world_size))
            if found is None:
                found = self._groups[(model_name, world_size)] = list({
                    r.layout: (r.layout, r.group) for r in self._by_id.values()
                    if r.group is not None and r.model_name == model_name
                    and world_size in (None, r.world_size)}.values())
            return list(found)

    def models(self) -> dict[str, int]:
        """Registered KV caches (workers) per model name."""
        counts: dict[str, int] = {}
        with self._lock:
            for registration in self._by_id.values():
                counts[registration.model_name] = counts.get(registration.model_name, 0) + 1
        return counts

    def shapes(self) -> dict[tuple[str, str, int], int]:
        """Registered KV caches (workers) per (model, layout, world size)."""
        counts: dict[tuple[str, str, int], int] = {}
        with self._lock:
            for r in self._by_id.values():
                shape = (r.model_name, r.layout, r.world_size)
                counts[shape] = counts.get(shape, 0) + 1
        return counts

    def _forget_layouts(self) -> None:
        """Registrations changed: what ``layouts`` and ``groups`` keep is stale (under the lock)."""
        self._layouts.clear()
        self._groups.clear()

    def _retire(self, registration: Registration) -> None:
        with self._lock:
            registration.retired = True
            close_now = registration.leases == 0
        if close_now:
            self._close(registration)

    @staticmethod
    def _close(registration: Registration) -> None:
        try:
            registration.mapped.close()
        except Exception:
            logger.exception("closing the mapping of instance %d failed", registration.instance_id)
        if registration.device_uuid:
            release_cached_cuda_memory()  # the staging buffers of its copies
