"""``BackgroundWriter``: the write-behind thread the disk and remote tiers share.

A tier hands it keys with ``submit`` (never blocks: a full queue drops what does not fit and says
how many, for the tier to count) and a ``write`` function that the writer thread calls with batches
of them. Around that it owns the lifecycle: ``start``, ``stop`` (drain what is queued, for at most a
deadline, then end the thread) and ``flush`` (wait until everything submitted is written).

Every wait is on one ``threading.Condition`` with a timeout: new items, finished batches, a stop
request and the thread's end all notify it, so nothing polls or sleeps in a loop. Hooks a tier may give:

* ``idle``: called on the writer thread when nothing came for ``idle_s``, and after the next item
  once ``request_idle()`` was called (the disk tier saves the memory chunks nearest eviction then);
* ``down``/``probe``: while ``down()`` is true the writer takes nothing and calls ``probe()`` every
  ``probe_interval_s``, and ``stop`` does not wait for the queue (the remote tier, Redis away);
* ``on_start``: called first on the writer thread (the remote tier's initial PING).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from lmcache_core.supervision import Supervisor

logger = logging.getLogger(__name__)
T = TypeVar("T")


class BackgroundWriter(Generic[T]):
    """A daemon thread taking items off a bounded queue, ``batch`` at a time, for ``write``."""

    def __init__(self, name: str, thread_name: str, queue_size: int,
                 write: Callable[[list[T]], None], *, batch: int = 1, idle_s: float = 0.25,
                 idle: Callable[[], None] | None = None, down: Callable[[], bool] | None = None,
                 probe: Callable[[], object] | None = None, probe_interval_s: float = 1.0,
                 on_start: Callable[[], None] | None = None) -> None:
        if batch < 1:
            raise ValueError(f"batch must be positive, got {batch}")
        self.name = name  # for log lines: "disk tier", "remote tier"
        self.thread_name = thread_name
        self.queue_size = queue_size  # as for queue.Queue, 0 or less: no bound
        self._write = write
        self._batch = batch
        self._idle_s = idle_s
        self._idle = idle
        self._down = down
        self._probe = probe
        self._probe_interval_s = probe_interval_s
        self._on_start = on_start
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[T] = deque()
        self._pending = 0  # submitted and not yet written (queued plus the batch being written)
        self._idle_requested = False
        self._stopping = False
        self._running = False  # the thread is in its loop (false once it has left it, however)
        self._thread: threading.Thread | None = None
        self._supervisor = Supervisor()

    # ------------------------------------------------------------------ producers

    def submit(self, items: Iterable[T]) -> int:
        """Queue ``items``; those a full queue has no room for are dropped. Returns how many were
        dropped. Never blocks beyond taking the lock."""
        with self._cond:
            room = self.queue_size - len(self._items) if self.queue_size > 0 else sys.maxsize
            before = len(self._items)
            dropped = 0
            for item in items:
                if room > 0:
                    self._items.append(item)
                    room -= 1
                else:
                    dropped += 1
            added = len(self._items) - before
            if added:
                self._pending += added
                self._cond.notify_all()
        return dropped

    def request_idle(self) -> None:
        """Have the writer call ``idle`` after its next item (or idle tick) too. Does not wake it:
        a producer calling this on every store costs no thread switch."""
        with self._cond:
            self._idle_requested = True

    @property
    def queued(self) -> int:
        """Items waiting in the queue (not counting a batch being written)."""
        return len(self._items)

    @property
    def pending(self) -> int:
        """Items submitted and not written yet (the queue plus a batch being written)."""
        return self._pending

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` was called (a long ``write`` or ``idle`` may check it to end early)."""
        return self._stopping

    # ------------------------------------------------------------------ lifecycle

    def start(self, supervisor: Supervisor | None = None) -> None:
        """Start the thread, watched by ``supervisor`` (the server's; by default one that only
        logs): an exception that escapes ``_run`` ends it, and the supervisor learns of it."""
        if self._thread is not None:
            return
        with self._cond:
            self._stopping = False
            self._running = True
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._thread = self._supervisor.spawn(self.thread_name, self._run)

    def stop(self, drain_timeout_s: float, grace_s: float = 1.0) -> bool:
        """Let the writer write what is queued for at most ``drain_timeout_s`` (not at all while
        ``down()``), then end it: join for the rest of that time plus ``grace_s`` (a batch being
        written completes). True if the thread ended; a no-op (True) when it was not started."""
        thread = self._thread
        if thread is None:
            return True
        deadline = time.monotonic() + drain_timeout_s
        down = self._down
        self._supervisor.retire(thread)
        with self._cond:
            self._cond.wait_for(lambda: not self._pending or not self._running
                                or (down is not None and down()), timeout=max(0.0, drain_timeout_s))
            self._stopping = True
            self._cond.notify_all()
        thread.join(max(0.0, deadline - time.monotonic()) + grace_s)
        self._thread = None
        return not thread.is_alive()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted is written; True if that happened within ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout=max(0.0, timeout_s))

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        """The thread: an error in one batch is logged and the next taken; one outside a batch
        (the queue, a hook) propagates, ending the thread, which its supervisor reports."""
        try:
            if self._on_start is not None:
                self._on_start()
            while not self._stopping:
                if self._down is not None and self._down():
                    if self._pause():
                        return
                    if self._probe is not None:
                        self._probe()
                    continue
                batch, idle_requested = self._take()
                if batch is None:
                    return
                try:
                    if batch:
                        self._write(batch)
                    if self._idle is not None and (idle_requested or not batch):
                        self._idle()
                except Exception:  # the writer must outlive any one bad chunk or batch
                    logger.exception("%s: writer failed on %s", self.name,
                                     f"{len(batch)} chunk(s)" if batch else "its idle work")
                finally:
                    if batch:
                        self._done(len(batch))
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _pause(self) -> bool:
        """Wait ``probe_interval_s`` or until stopped (True then); tells a draining ``stop`` first
        that the writer is not writing now."""
        with self._cond:
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._stopping, timeout=self._probe_interval_s)

    def _take(self) -> tuple[list[T] | None, bool]:
        """Up to ``batch`` items (waiting at most ``idle_s`` for the first) and whether
        ``request_idle`` was called; ``(None, False)`` once stopping."""
        items = self._items
        with self._cond:
            if not items and not self._stopping:
                self._cond.wait_for(lambda: items or self._stopping, timeout=self._idle_s)
            if self._stopping:
                return None, False
            take = min(len(items), self._batch)
            batch = [items.popleft() for _ in range(take)]
            requested, self._idle_requested = self._idle_requested, False
        return batch, requested

    def _done(self, count: int) -> None:
        with self._cond:
            self._pending -= count
            self._cond.notify_all()
