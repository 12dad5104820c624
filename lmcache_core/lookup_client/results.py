"""The lookup client's per-lookup bookkeeping: the attempts still running (with their deadlines,
in order), the results nobody cleared yet, the cleanups owed to workers that hold pins, the callers
waiting on a lookup, and the counters.

``LookupTable`` is not thread-safe: the client calls it under its own lock (dict work only, never
I/O). Each abandoned attempt is handed back as ``(seq, workers to clean up)`` for the client to send.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence

from lmcache_core.lookup_client.messages import LookupResponseMsg
from lmcache_core.transport.waker import Waker

logger = logging.getLogger(__name__)

#: Results nobody cleared are dropped (oldest first, their pins released) beyond this many.
MAX_RESULTS = 1 << 17
_LOGGED_BAD = 10  # timeouts logged before only every 1000th is

Abandoned = tuple[int, list[int]]  # (seq, workers to clean up)


class Running:
    """One attempt at a lookup that not every expected worker has answered yet."""

    __slots__ = ("answers", "deadline", "seq")

    def __init__(self, seq: int, deadline: float) -> None:
        self.seq = seq
        self.deadline = deadline
        self.answers: dict[int, int] = {}  # worker id -> hit tokens


class LookupTable:
    """Every lookup's state, from ``start`` to the result the scheduler clears."""

    def __init__(self, worker_ids: Sequence[int], timeout_ms: int) -> None:
        self.worker_ids = tuple(worker_ids)
        self._timeout_ms = timeout_ms  # for the log line of a timeout
        self._worker_set = frozenset(self.worker_ids)
        self._num_workers = len(self.worker_ids)
        self.running: dict[str, Running] = {}
        # lookup id -> (hit tokens, seq, whether workers may still hold pins for it)
        self.results: dict[str, tuple[int, int, bool]] = {}
        self.pending_cleanups: list[tuple[str, int, list[int]]] = []  # (lookup id, seq, workers)
        self.deadlines: deque[tuple[float, int, str]] = deque()  # in deadline order
        # lookup id -> (thread id, waker) of each wait_for_result() caller waiting on it
        self.waiters: dict[str, list[tuple[int, Waker]]] = {}
        self.counts = {"lookups": 0, "completed": 0, "timeouts": 0, "cancelled": 0,
                       "late_answers": 0, "cleanups_sent": 0, "send_failures": 0}

    def state(self, lookup_id: str) -> int | Running:
        """What ``lookup_cache`` answers for a settled id (hit tokens, or -1 if never asked), or
        the lookup still running."""
        result = self.results.get(lookup_id)
        if result is not None:
            return result[0]
        running = self.running.get(lookup_id)
        return -1 if running is None else running

    def start(self, lookup_id: str, seq: int, deadline: float) -> bool:
        """A new attempt; True when its deadline is the first one (the thread must wake for it)."""
        self.running[lookup_id] = Running(seq, deadline)
        first = not self.deadlines  # deadlines are appended in order: only a new head wakes
        self.deadlines.append((deadline, seq, lookup_id))
        return first

    def finish(self, lookup_id: str, hit_tokens: int, seq: int, pinned: bool) -> None:
        """Store a result; ``pinned``: workers may hold pins for it until a retrieve or a cleanup."""
        results = self.results
        results[lookup_id] = (hit_tokens, seq, pinned)
        if len(results) > MAX_RESULTS:  # never cleared: drop the oldest, and its pins
            old_id = next(iter(results))
            _, old_seq, old_pinned = results.pop(old_id)
            if old_pinned:
                self.pending_cleanups.append((old_id, old_seq, list(self.worker_ids)))

    def forget(self, lookup_id: str) -> Abandoned | None:
        """Drop ``lookup_id``'s attempt; returns ``(seq, workers to clean up)`` if it held pins."""
        result = self.results.pop(lookup_id, None)
        if result is not None:
            _, seq, pinned = result
            return (seq, list(self.worker_ids)) if pinned else None
        running = self.running.pop(lookup_id, None)
        if running is not None:
            return running.seq, list(running.answers)
        return None

    def clear(self, lookup_id: str) -> Abandoned | None:
        """The scheduler used the result: drop it; a lookup still running is abandoned."""
        self.results.pop(lookup_id, None)
        running = self.running.pop(lookup_id, None)
        return (running.seq, list(running.answers)) if running is not None else None

    def cancel(self, lookup_id: str) -> Abandoned | None:
        """The request is gone: ``forget``, counted as cancelled if it was known."""
        if lookup_id in self.running or lookup_id in self.results:
            self.counts["cancelled"] += 1
        return self.forget(lookup_id)

    def fail(self, lookup_id: str, seq: int) -> Abandoned | None:
        """Attempt ``seq`` could not reach every worker: 0 hit tokens now, if it still runs."""
        running = self.running.get(lookup_id)
        if running is None or running.seq != seq:
            return None
        del self.running[lookup_id]
        self.finish(lookup_id, 0, seq, pinned=False)
        return seq, list(running.answers)

    def time_out(self, lookup_id: str, running: Running) -> Abandoned:
        """``running`` passed its deadline: 0 hit tokens (the caller cleans up what answered)."""
        del self.running[lookup_id]
        self.finish(lookup_id, 0, running.seq, pinned=False)
        self.counts["timeouts"] += 1
        self.notify(lookup_id)
        timeouts = self.counts["timeouts"]
        if timeouts <= _LOGGED_BAD or timeouts % 1000 == 0:  # a dead worker must not flood the log
            missing = [w for w in self.worker_ids if w not in running.answers]
            logger.warning("lookup %r: no answer from worker(s) %s within %d ms; reporting 0 hit "
                           "tokens (%d timeouts so far)", lookup_id, missing, self._timeout_ms,
                           timeouts)
        return running.seq, list(running.answers)

    def due(self, now: float) -> list[tuple[str, Running]]:
        """The attempts still running whose deadline is ``now`` or earlier (their deadlines popped)."""
        due: list[tuple[str, Running]] = []
        deadlines, running = self.deadlines, self.running
        while deadlines and deadlines[0][0] <= now:
            _, seq, lookup_id = deadlines.popleft()
            attempt = running.get(lookup_id)
            if attempt is not None and attempt.seq == seq:
                due.append((lookup_id, attempt))
        return due

    def first_deadline(self) -> float | None:
        """The first deadline of a lookup still running (None: none); stale heads are dropped."""
        deadlines, running = self.deadlines, self.running
        while deadlines:
            deadline, seq, lookup_id = deadlines[0]
            attempt = running.get(lookup_id)
            if attempt is not None and attempt.seq == seq:
                return deadline
            deadlines.popleft()
        return None

    def record(self, msg: LookupResponseMsg) -> bool:
        """Count one worker's answer; False when nobody waits for it."""
        running = self.running.get(msg.lookup_id)
        if running is None or running.seq != msg.seq:
            return False
        answers = running.answers
        if msg.worker_id not in self._worker_set or msg.worker_id in answers:
            logger.warning("lookup %r: dropping an unexpected answer from worker %d",
                           msg.lookup_id, msg.worker_id)
            return True
        answers[msg.worker_id] = msg.num_hit_tokens
        if len(answers) == self._num_workers:
            del self.running[msg.lookup_id]
            self.finish(msg.lookup_id, min(answers.values()), msg.seq,
                        pinned=max(answers.values()) > 0)
            self.counts["completed"] += 1
            if self.waiters:
                self.notify(msg.lookup_id)
        return True

    def close(self) -> list[tuple[str, Running]]:
        """Every running lookup reports 0 and every waiting caller is woken; returns what ran."""
        abandoned = list(self.running.items())
        for lookup_id, running in abandoned:
            self.finish(lookup_id, 0, running.seq, pinned=False)
        self.running.clear()
        for waiters in self.waiters.values():
            for _, waker in waiters:
                waker.wake()
        return abandoned

    def take_pending_cleanups(self) -> list[tuple[str, int, list[int]]]:
        """The cleanups owed for evicted results, handed over once."""
        pending = list(self.pending_cleanups)
        self.pending_cleanups.clear()
        return pending

    def add_waiter(self, lookup_id: str, waiter: tuple[int, Waker]) -> None:
        self.waiters.setdefault(lookup_id, []).append(waiter)

    def remove_waiter(self, lookup_id: str, waiter: tuple[int, Waker]) -> None:
        waiters = self.waiters.get(lookup_id)
        if waiters is not None:
            waiters.remove(waiter)
            if not waiters:
                del self.waiters[lookup_id]

    def notify(self, lookup_id: str) -> None:
        """``lookup_id`` is done: wake the callers waiting on it on other threads."""
        waiters = self.waiters.get(lookup_id)
        if waiters:
            me = threading.get_ident()
            for ident, waker in waiters:
                if ident != me:
                    waker.wake()

    def stats(self, **extra: int) -> dict[str, int]:
        """The counters, ``extra``, and how many lookups run and how many results are held."""
        out = dict(self.counts)
        out.update(extra, running=len(self.running), results=len(self.results))
        return out
