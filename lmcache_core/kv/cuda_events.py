"""Interprocess CUDA events and the server's copy stream.

The worker records a ``torch.cuda.Event(interprocess=True)`` after its forward pass and sends
:func:`export_event`'s bytes. The worker must keep that event alive until the server has answered
the request (:class:`InflightEvents`): CUDA leaves ``cudaIpcOpenEventHandle`` of a destroyed event
undefined (failed opens, no-op waits that let half-written KV be stored, or waits that never end).

The server opens the event and polls it, with a deadline, before it queues any copy: first in the
transport's gate (one thread for all requests, so no copy thread waits for a forward pass; see
``server/handlers.py``), then once more in :class:`CopyStream`. A worker that died or hung times the
request out *before* anything was queued, so no copy can land after the reply said it failed. Its
own copies are then waited for the same way (a polled event, bounded), never with an unbounded
``stream.synchronize()``. On CPU hosts everything here is a no-op that accepts the empty handle
``b""``. CUDA is only touched when a CUDA device is actually used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from lmcache_core.errors import (
    ConnectionClosedError,
    CopiesStalledError,
    IncompatibleError,
    LMCacheTimeoutError,
    ProtocolError,
    ServerUnreachableError,
)
from lmcache_core.kv.cuda_ipc import require_cuda

IPC_EVENT_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE
DEFAULT_EVENT_TIMEOUT_S = 30.0
#: Polling an event: the first sleep, and the longest (a forward pass takes milliseconds; 1 ms of
#: extra latency at worst, and no CPU burnt spinning in cudaEventSynchronize).
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3

DeviceLike = torch.device | str | int | None


def as_device(device: DeviceLike) -> torch.device:
    """``None`` -> cpu, an int -> that CUDA device, else ``torch.device(device)``."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def export_event(event: torch.cuda.Event | None) -> bytes:
    """The IPC handle of an interprocess event (``b""`` for None, i.e. on CPU hosts)."""
    if event is None:
        return b""
    return bytes(event.ipc_handle())


class _Queryable(Protocol):
    def query(self) -> bool: ...


def wait_event_done(event: _Queryable, timeout_s: float, what: str = "a CUDA event",
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll ``event.query()`` until it is done; LMCacheTimeoutError after ``timeout_s``.

    ``cudaEventSynchronize`` has no timeout: on a dead worker's event it may never return and would
    hold a server thread (and the worker's GPU memory) for good."""
    deadline = clock() + timeout_s
    pause = _POLL_FIRST_S
    while not event.query():
        if clock() >= deadline:
            raise LMCacheTimeoutError(f"{what} did not complete within {timeout_s:g}s")
        sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def open_ipc_event(handle: bytes, device: DeviceLike) -> torch.cuda.Event | None:
    """The worker's event opened in this process (None for ``b""``)."""
    if not handle:
        return None
    if len(handle) != IPC_EVENT_HANDLE_BYTES:
        raise ProtocolError(
            f"a CUDA event handle has {IPC_EVENT_HANDLE_BYTES} bytes, got {len(handle)}")
    dev = as_device(device)
    if dev.type != "cuda":
        raise IncompatibleError(f"got a CUDA event handle for a KV cache on {dev}")
    require_cuda("waiting on a CUDA event")
    try:
        return torch.cuda.Event.from_ipc_handle(dev, handle)
    except RuntimeError as exc:  # e.g. the worker destroyed it, or exited
        raise IncompatibleError(f"cannot open the worker's CUDA event: {exc}") from None


def wait_on_ipc_event(
    handle: bytes, device: DeviceLike, stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    """Make ``stream`` (default: the current stream of ``device``) wait for the worker's event.

    No-op returning None for ``b""``. Returns the opened event, which the caller may keep until
    the stream's work is done.
    """
    event = open_ipc_event(handle, device)
    if event is not None:
        (stream or torch.cuda.current_stream(as_device(device))).wait_event(event)
    return event


class CopyStream:
    """A dedicated CUDA stream for the server's copies (nothing at all on CPU).

    ``with copy_stream.run(event_handle, timeout_s): cache.gather(...)`` first waits (polled,
    bounded) until the worker's event has completed, then runs the copies on this stream and
    waits for them the same way on exit, so the data is in place (and the slots readable) before
    the reply goes out. Waiting for the worker's event on the CPU before queueing anything, rather
    than only with ``stream.wait_event``, is what makes the bound safe: a timed-out request has
    queued no copy that could land after its failure was reported.
    """

    def __init__(self, device: DeviceLike = None) -> None:
        self._device = as_device(device)
        self._stream: torch.cuda.Stream | None = None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_cuda(self) -> bool:
        return self._device.type == "cuda"

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream (created on first use), None on CPU."""
        if not self.is_cuda:
            return None
        if self._stream is None:
            require_cuda("a CUDA copy stream")
            self._stream = torch.cuda.Stream(self._device)
        return self._stream

    @contextmanager
    def run(self, event_handle: bytes = b"",
            timeout_s: float = DEFAULT_EVENT_TIMEOUT_S) -> Iterator[None]:
        """Run the body's copies on this stream after the worker's event; wait for them at exit.

        LMCacheTimeoutError if the worker's event is not done within ``timeout_s`` (nothing was
        queued then), or the copies are not."""
        stream = self.stream
        if stream is None:
            if event_handle:
                raise IncompatibleError("got a CUDA event handle for a KV cache on the CPU")
            yield
            return
        worker_event = open_ipc_event(event_handle, self._device)
        if worker_event is not None:
            wait_event_done(worker_event, timeout_s, "the worker's CUDA event")
            stream.wait_event(worker_event)  # done already; keeps the GPU-side order explicit
        with torch.cuda.stream(stream):
            try:
                yield
            finally:
                self.synchronize(timeout_s)
        del worker_event

    def synchronize(self, timeout_s: float = DEFAULT_EVENT_TIMEOUT_S) -> None:
        """Wait (polled, bounded) for everything queued on this stream; no-op on CPU.
        CopiesStalledError past ``timeout_s``: the copies are queued and may still land."""
        if self._stream is None:
            return
        done = torch.cuda.Event()
        done.record(self._stream)
        try:
            wait_event_done(done, timeout_s, "the server's copies")
        except LMCacheTimeoutError as exc:
            raise CopiesStalledError(str(exc)) from None


class _FutureLike(Protocol):
    def query(self) -> bool: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...


#: Client-side failures: the request may still sit in the server's queue, which would then open
#: the event's handle later.
_NO_REPLY = (LMCacheTimeoutError, ConnectionClosedError, ServerUnreachableError)


class InflightEvents:
    """The worker's interprocess events, each kept alive until every request carrying its
    handle has been answered (the server opens the handle only while serving the request).

    A request that ended without a reply (timed out, connection lost) may still be served later,
    so its event is kept ``grace_s`` longer. Released events are reused (up to ``spare``): each is
    recorded again only after the server is done with it, never while a request could still wait
    on it (re-recording one shared event starves the waits of earlier requests). Not thread-safe:
    the worker's model thread is the only user.
    """

    def __init__(self, grace_s: float, spare: int = 8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._grace_s = grace_s
        self._spare_max = spare
        self._clock = clock
        self._held: list[tuple[Any, list[_FutureLike]]] = []
        self._late: list[tuple[float, Any]] = []  # (release time, event)
        self._spare: list[Any] = []

    def acquire(self, make: Callable[[], Any]) -> Any:
        """A free event: a spare one whose requests were all answered, else ``make()``."""
        self.release_answered()
        return self._spare.pop() if self._spare else make()

    def hold(self, event: Any, futures: Iterable[_FutureLike]) -> None:
        """Keep ``event`` until every future in ``futures`` has resolved (None: nothing)."""
        if event is not None:
            self._held.append((event, list(futures)))

    def release_answered(self) -> int:
        """Let go of the events whose requests were all answered; returns how many are held."""
        now = self._clock()
        held = []
        for event, futures in self._held:
            if not all(f.query() for f in futures):
                held.append((event, futures))
            elif any(isinstance(f.exception(0), _NO_REPLY) for f in futures):
                self._late.append((now + self._grace_s, event))
            else:
                self._recycle(event)
        self._held = held
        late = [(t, e) for t, e in self._late if t > now]
        self._late = late
        return len(self._held) + len(self._late)

    def _recycle(self, event: Any) -> None:
        if len(self._spare) < self._spare_max:
            self._spare.append(event)

    def __len__(self) -> int:
        return len(self._held) + len(self._late)
