"""``PrefetchResults``: LMCache's lookup results by request id, handed over once, and the
``wait_prefetch_status`` calls waiting for one, answered later (never blocking a thread).

LMCache's LOOKUP acknowledges at once and leaves its hit count under the request id; the count is
handed over once, to the first ``query_prefetch_status`` (``None`` while the lookup runs, ``0`` for
an unknown id) or ``wait_prefetch_status(request_id, timeout)``, which waits up to ``timeout``
seconds for a running lookup (``None`` when it did not finish in time). LMCache's server blocks a
thread of its pool per wait; here a wait on a running lookup is parked: its answer is sent by the
thread that records the lookup's result, or by one timer thread when its timeout passes, whichever
comes first (the server loop and its other clients never wait). Waits are bounded: a timeout is
clamped to ``max_wait_s``, and beyond ``max_waits`` parked waits a new one is answered at once
(``None``: as if it had timed out at once). Thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

#: ``reply(hit_chunks_or_None)``: sends a parked wait's answer (from any thread; must not raise).
Reply = Callable[[int | None], None]
#: Lookup results waiting for their one hand-over; the oldest are dropped beyond this (a client
#: that never asks must not grow the table).
MAX_RESULTS = 65536
#: Parked ``wait_prefetch_status`` calls at most; more are answered at once.
MAX_WAITS = 1024
#: The longest a wait is parked, whatever timeout it asked for (LMCache's client waits 300 s for
#: any reply; a longer wait would only hold a slot).
MAX_WAIT_S = 60.0
PENDING = -1
#: ``wait`` parked the call: its reply comes later.
DEFERRED = object()


class _Wait:
    __slots__ = ("reply", "request_id")

    def __init__(self, request_id: str, reply: Reply) -> None:
        self.request_id = request_id
        self.reply = reply


class PrefetchResults:
    """Lookup results (hit chunks) by request id, and the waits parked on running lookups."""

    def __init__(self, *, max_results: int = MAX_RESULTS, max_waits: int = MAX_WAITS,
                 max_wait_s: float = MAX_WAIT_S,
                 clock: Callable[[], float] | None = None) -> None:
        self.max_results = max_results
        self.max_waits = max_waits
        self.max_wait_s = max_wait_s
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._results: OrderedDict[str, int] = OrderedDict()  # request id -> hits, or PENDING
        self._waits: dict[str, list[_Wait]] = {}  # request id -> parked waits, oldest first
        # A min-heap; the entries of waits answered by ``set`` stay until compacted (``_compact``).
        self._deadlines: list[tuple[float, int, _Wait]] = []
        self._parked = 0
        self._seq = itertools.count()
        self._timer: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._results)

    @property
    def parked(self) -> int:
        """How many waits are parked now."""
        return self._parked

    def pending(self, request_id: str) -> None:
        """A lookup under ``request_id`` started (its status is ``None`` until ``set``)."""
        self.set(request_id, PENDING)

    def set(self, request_id: str, hits: int) -> bool:
        """Record a lookup's result: the oldest parked wait on it gets it (handed over), any
        later ones ``0`` (as LMCache's: the result went to the first); with no wait parked it is
        kept for ``take`` only while the lookup's ``pending`` marker is still there (a session
        ended by ``drop`` while its lookup ran does not get the late result back). False when
        it went nowhere (that session ended)."""
        with self._lock:
            if hits == PENDING:
                self._keep(request_id, PENDING)
                return True
            waits = self._waits.pop(request_id, None)
            if not waits:
                if self._results.get(request_id) != PENDING:
                    return False
                self._keep(request_id, hits)
                return True
            self._results.pop(request_id, None)
            self._parked -= len(waits)
            if len(self._deadlines) > 2 * self._parked + 64:
                self._compact()
        for i, wait in enumerate(waits):
            wait.reply(hits if i == 0 else 0)
        return True

    def _keep(self, request_id: str, hits: int) -> None:
        self._results[request_id] = hits
        self._results.move_to_end(request_id)
        while len(self._results) > self.max_results:
            self._results.popitem(last=False)

    def _compact(self) -> None:
        """Drop the heap entries of waits answered by ``set`` (they would stay until their
        deadline reached the head: the heap would grow with the wait rate x ``max_wait_s``)."""
        live = {id(wait) for waits in self._waits.values() for wait in waits}
        self._deadlines = [item for item in self._deadlines if id(item[2]) in live]
        heapq.heapify(self._deadlines)

    def take(self, request_id: str) -> int | None:
        """``query_prefetch_status``: ``None`` while running; else the hits, once (then 0)."""
        with self._lock:
            return self._take(request_id)

    def _take(self, request_id: str) -> int | None:
        hits = self._results.get(request_id, 0)
        if hits == PENDING:
            return None
        self._results.pop(request_id, None)
        return hits

    def wait(self, request_id: str, timeout_s: float, reply: Reply) -> int | object | None:
        """``wait_prefetch_status``: the answer now (as ``take``) when the lookup is done, unknown,
        the timeout is not positive or too many waits are parked; else ``DEFERRED``: ``reply``
        is called once, with the hits when the lookup's result comes, or ``None`` at the
        timeout (clamped to ``max_wait_s``)."""
        with self._lock:
            if self._results.get(request_id) != PENDING or not timeout_s > 0 \
                    or self._parked >= self.max_waits:
                return self._take(request_id)
            wait = _Wait(request_id, reply)
            self._waits.setdefault(request_id, []).append(wait)
            self._parked += 1
            deadline = self._clock() + min(timeout_s, self.max_wait_s)
            heapq.heappush(self._deadlines, (deadline, next(self._seq), wait))
            if self._timer is None:
                self._timer = threading.Thread(target=self._time_out, daemon=True,
                                               name="lmcache-prefetch-waits")
                self._timer.start()
            elif self._deadlines[0][2] is wait:
                self._wake.notify()
        return DEFERRED

    def drop(self, request_id: str) -> None:
        """Forget ``request_id``'s result or pending marker (its session ended): a result its
        still-running lookup sets later is not kept; parked waits keep their timeout (or get that
        result)."""
        with self._lock:
            self._results.pop(request_id, None)

    def _time_out(self) -> None:
        """The timer thread: answers ``None`` to each parked wait whose timeout passed; exits when
        none is parked (the next wait starts it again)."""
        while True:
            due: list[_Wait] = []
            with self._lock:
                while self._deadlines and not due:
                    deadline, _, wait = self._deadlines[0]
                    if not self._is_parked(wait):
                        heapq.heappop(self._deadlines)
                        continue
                    left = deadline - self._clock()
                    if left > 0:
                        self._wake.wait(left)
                        continue
                    heapq.heappop(self._deadlines)
                    self._unpark(wait)
                    due.append(wait)
                if not due:  # nothing parked any more
                    self._timer = None
                    return
            for wait in due:
                wait.reply(None)

    def _is_parked(self, wait: _Wait) -> bool:
        return any(w is wait for w in self._waits.get(wait.request_id, ()))

    def _unpark(self, wait: _Wait) -> None:
        waits = self._waits[wait.request_id]
        waits.remove(wait)
        if not waits:
            del self._waits[wait.request_id]
        self._parked -= 1
