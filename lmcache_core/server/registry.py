"""Registered KV caches: which worker shared which tensors, and reaping the ones that went away.

A registration maps a worker's shared tensors into this process. It is used by store/retrieve on
worker threads while the housekeeping thread may reap it, so each use holds a lease and the mapping is
closed only when the last lease ends: a reaped worker never pulls memory out from under a copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lmcache_core.errors import NotRegisteredError
from lmcache_core.kv.cuda_events import CopyStream
from lmcache_core.protocol.messages import RegisterKVCacheRequest

logger = logging.getLogger(__name__)
HOSTNAME = socket.gethostname()


class Registration:
    """One worker's KV cache as this server sees it."""

    def __init__(self, request: RegisterKVCacheRequest, mapped: Any, now: float) -> None:
        self.instance_id = request.instance_id
        self.model_name = request.model_name
        self.world_size = request.world_size
        self.kv_rank = request.kv_rank
        self.block_size = request.block_size
        self.layout = request.layout
        self.pid = request.pid
        self.local = bool(request.pid) and request.hostname == HOSTNAME
        self.mapped = mapped
        self.copy_stream = CopyStream(getattr(mapped, "device", None))
        self.last_seen = now
        self.leases = 0
        self.retired = False

    def process_gone(self) -> bool:
        """True when the worker ran on this host and its process no longer exists."""
        if not self.local:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def _unlink_segments(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{name}")
            logger.info("unlinked shared memory %s of a dead worker", name)


class KVRegistry:
    """instance_id -> Registration, with leases so unmapping waits for copies in progress."""

    def __init__(self, open_mapping: Callable[[RegisterKVCacheRequest], Any],
                 reap_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._open_mapping = open_mapping
        self._reap_timeout_s = reap_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[int, Registration] = {}
        self.reaped = 0

    def register(self, request: RegisterKVCacheRequest) -> Registration:
        """Map a worker's tensors; registering the same instance again replaces its mapping."""
        mapped = self._open_mapping(request)  # slow (mmap), outside the lock
        registration = Registration(request, mapped, self._clock())
        with self._lock:
            old = self._by_id.pop(request.instance_id, None)
            self._by_id[request.instance_id] = registration
        if old is not None:
            self._retire(old)
        return registration

    def unregister(self, instance_id: int) -> bool:
        with self._lock:
            registration = self._by_id.pop(instance_id, None)
        if registration is None:
            return False
        self._retire(registration)
        return True

    def touch(self, instance_id: int) -> bool:
        with self._lock:
            registration = self._by_id.get(instance_id)
            if registration is not None:
                registration.last_seen = self._clock()
        return registration is not None

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
            gone = [r for r in self._by_id.values() if r.process_gone()]
            silent = [r for r in self._by_id.values()
                      if r not in gone and now - r.last_seen > self._reap_timeout_s]
            dead = gone + silent
            for registration in dead:
                del self._by_id[registration.instance_id]
        for registration in dead:
            logger.warning("reaped KV cache instance %d (%s rank %d): worker %s",
                           registration.instance_id, registration.model_name, registration.kv_rank,
                           "process exited" if registration in gone else "silent")
            self._retire(registration)
        for registration in gone:  # a killed worker never unlinked its shared memory: do it for it
            _unlink_segments(getattr(registration.mapped, "shm_names", []))
        self.reaped += len(dead)
        return [r.instance_id for r in dead]

    def close_all(self) -> None:
        with self._lock:
            registrations = list(self._by_id.values())
            self._by_id.clear()
        for registration in registrations:
            self._retire(registration)

    def __len__(self) -> int:
        return len(self._by_id)

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
