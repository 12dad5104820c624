"""The LMCache dialect's KV cache registrations, kept in step with the server's registry.

LMCache's ``register_kv_cache`` names no rank and is repeated as a heartbeat, so the dialect keeps
each instance's request (to map it again under another rank, or to tell a heartbeat from a new
cache) and the registry's :class:`Registration` it made. That registration's ``retired`` flag says,
without touching its liveness, when the registry has dropped it (reaped, unregistered, replaced):
such an entry is never trusted, and is pruned on use and at every registration, so reaped
instances do not pile up here.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec

from lmcache_core.kv.shm import parse_lmcache_segment_name
from lmcache_core.protocol import lmcache_wire as w
from lmcache_core.protocol import messages as m
from lmcache_core.server.handlers import CacheHandlers
from lmcache_core.server.lmcache import translate as t
from lmcache_core.server.registry import HOSTNAME, KVRegistry, Registration
from lmcache_core.server.segments import process_gone


class DialectRegistrations:
    """instance id -> (LMCache's request as registered, the registry's registration of it);
    registrations go through ``handlers`` (as our dialect's), and are looked up in ``registry``."""

    def __init__(self, handlers: CacheHandlers, registry: KVRegistry) -> None:
        self.handlers = handlers
        self.registry = registry
        self._lock = threading.Lock()  # registers, stores and retrieves run on worker threads
        self._entries: dict[int, tuple[m.RegisterKVCacheRequest, Registration]] = {}

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def register(self, request: m.RegisterKVCacheRequest, client: bytes) -> None:
        """Map ``request``'s tensors; the same tensors again, while the registry still has them,
        are a heartbeat (LMCache re-registers as liveness): only touched, not mapped again."""
        known = self._live(request.instance_id)
        # touch() last: it says whether the registry still has the instance (a reaped one
        # must be mapped again, or the client is acked with nothing mapped).
        if known is not None and _same_cache(known[0], request) and \
                self.registry.touch(request.instance_id, client):
            return
        self._register(request, client)

    def for_rank(self, instance_id: int, worker_id: int | None,
                 client: bytes) -> m.RegisterKVCacheRequest | None:
        """The instance's registration, mapped for ``worker_id``'s rank (LMCache's register names
        no rank: the first store or retrieve of another rank maps it again under that rank);
        None when there is none to use. Both, and the re-map's LMCacheError, are answered
        in-band as a failure."""
        known = self._live(instance_id)
        if known is None or worker_id is None:
            return None
        request = known[0]
        if request.kv_rank != worker_id:
            if worker_id >= request.world_size:
                return None
            request = msgspec.structs.replace(request, kv_rank=worker_id)
            self._register(request, client)
        return request

    def heads(self, instance_id: int) -> tuple[int, int] | None:
        """The heads of the rank the instance is mapped under; None when it is not."""
        known = self._live(instance_id)
        return None if known is None else (known[1].heads[0], known[1].heads[1])

    def unregister(self, instance_id: int, client: bytes) -> None:
        self.forget(instance_id)
        self.handlers.unregister_kv_cache(m.UnregisterKVCacheRequest(instance_id=instance_id),
                                          client)

    def forget(self, instance_id: int) -> None:
        with self._lock:
            self._entries.pop(instance_id, None)

    def _register(self, request: m.RegisterKVCacheRequest, client: bytes) -> None:
        self.handlers.register_kv_cache(request, client)
        # The registration itself (its ``retired`` flag), fetched by a lease: just registered,
        # so the lease's liveness update changes nothing.
        with self.registry.lease(request.instance_id) as registration:
            pass
        with self._lock:
            self._entries[request.instance_id] = (request, registration)
            # Registrations are rare: drop every entry the registry no longer has.
            for instance_id in [i for i, (_, r) in self._entries.items() if r.retired]:
                del self._entries[instance_id]

    def _live(self, instance_id: int) -> tuple[m.RegisterKVCacheRequest, Registration] | None:
        """The instance's entry while the registry still has it; a dropped one is pruned."""
        with self._lock:
            known = self._entries.get(instance_id)
            if known is not None and known[1].retired:
                del self._entries[instance_id]
                return None
            return known


def registration_request(instance_id: int, layers: list[Any], model_name: str, world_size: int,
                         hints: w.LayoutHints,
                         groups: list[w.EngineGroupInfo]) -> m.RegisterKVCacheRequest:
    """LMCache's ``register_kv_cache`` as our registration of rank 0 (DialectError if unserved)."""
    if len(groups) > 1:
        raise w.DialectError(f"{len(groups)} engine KV groups: one plain group is served")
    if hints.kv_layout not in (None, "NHD", "HND"):
        raise w.DialectError(f"kv_layout {hints.kv_layout!r}: NHD and HND are served")
    descs = [t.tensor_descriptor(layer) for layer in layers]
    if hints.kv_layout == "HND":  # as our connector registers it (GPU: NHD views; CPU: cpu_attn)
        descs = [t.view_hnd(d) for d in descs]
    pid = _owner_pid(descs)
    from lmcache_core.kv.layout import detect_layout, kv_geometry
    layout = detect_layout(descs[0].shape)
    return m.RegisterKVCacheRequest(
        instance_id=instance_id, model_name=model_name, world_size=world_size, kv_rank=0,
        block_size=kv_geometry(descs[0].shape, layout).block_size, layout=layout,
        layers=descs, pid=pid, hostname=HOSTNAME)


def _owner_pid(descs: list[m.TensorDescriptor]) -> int:
    """The one live process all layers name: by their LMCache segment names (``cpu_shm``), or by
    the names of torch's reference-counter files their CUDA IPC handles carry (``cuda``; the
    registry then checks those handles as our own workers', ``kv.cuda_ipc.check_ipc_handle``)."""
    kinds = {d.kind for d in descs}
    if kinds == {"cuda"}:
        from lmcache_core.kv.cuda_ipc import ref_counter_pid  # torch: a GPU registration only
        pids = {ref_counter_pid(d.cuda.ref_counter_handle) if d.cuda else None for d in descs}
        named = "CUDA IPC handles must all come of one process's torch (/torch_<pid>_...)"
    elif kinds == {"shm"}:
        pids = {parse_lmcache_segment_name(d.shm_name) for d in descs}
        named = "KV segments must all be named lmcache_kv_<pid>_<n> by one pid"
    else:
        raise w.DialectError("KV layers of one registration are all cpu_shm or all cuda")
    if len(pids) != 1 or None in pids:
        raise w.DialectError(named)
    pid = pids.pop()
    assert pid is not None
    if process_gone(pid):
        raise w.DialectError(f"process {pid} that shared the KV cache is not running")
    return pid


def _same_cache(a: m.RegisterKVCacheRequest, b: m.RegisterKVCacheRequest) -> bool:
    """The same tensors (a re-register after a server recovery or a heartbeat)."""
    return (a.model_name, a.world_size, a.layers) == (b.model_name, b.world_size, b.layers)
