"""``Supervisor``: the long-lived threads of one server, and what happens when one of them dies.

A server is only as alive as its threads: a transport loop that died leaves a process that holds its
port and answers nothing, which no supervisor (systemd, Kubernetes) would ever restart. So every
long-lived thread is started through ``Supervisor.spawn``: if it raises, or returns while the server
is not stopping, the supervisor records why, logs it once and calls ``on_failure`` (``lmcache serve``
then exits non-zero within a second). Whoever spawns a thread owns it: it stops it and joins it.

The supervisor knows nothing of what the threads do; ``healthy`` and ``failure`` are what a health
probe reads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Supervisor:
    """Starts threads that must live as long as the server, and reports the first one to die."""

    def __init__(self, on_failure: Callable[[str], None] | None = None) -> None:
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._retiring: set[threading.Thread] = set()
        self._stopping = threading.Event()
        self._failed = threading.Event()
        self.failure: str | None = None

    def spawn(self, name: str, target: Callable[..., Any], *args: Any) -> threading.Thread:
        """Start ``target(*args)`` on a daemon thread called ``name``, watched."""
        thread = threading.Thread(target=self._watch, args=(name, target, args), name=name,
                                  daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()
        return thread

    def stopping(self) -> None:
        """From now on a thread that returns is finishing, not failing (call before stopping them)."""
        self._stopping.set()

    def retire(self, thread: threading.Thread | None) -> None:
        """``thread`` is about to be told to end: its return is expected (its owner's ``stop``)."""
        if thread is not None:
            with self._lock:
                self._retiring.add(thread)

    def fail(self, reason: str) -> None:
        """Report a fatal condition (the first one wins); anything may call it, from any thread."""
        with self._lock:
            if self._failed.is_set():
                return
            self.failure = reason
            self._failed.set()
        logger.critical("%s; the server cannot go on and exits so that it can be restarted", reason)
        if self._on_failure is not None:
            try:
                self._on_failure(reason)
            except Exception:
                logger.exception("the failure handler raised")

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def wait_failed(self, timeout_s: float | None = None) -> bool:
        """Block until some thread failed (True) or ``timeout_s`` passed (False)."""
        return self._failed.wait(timeout_s)

    def healthy(self) -> bool:
        """No thread failed and every spawned thread that should run still runs."""
        if self._failed.is_set():
            return False
        with self._lock:
            threads = list(self._threads)
            retiring = set(self._retiring)
        return self._stopping.is_set() or all(t.is_alive() or t in retiring for t in threads)

    def _watch(self, name: str, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            target(*args)
        except BaseException as exc:
            logger.error("thread %s died", name, exc_info=True)
            self.fail(f"thread {name} died: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            expected = self._stopping.is_set() or threading.current_thread() in self._retiring
        if not expected:
            self.fail(f"thread {name} ended while the server was running")
