"""Interprocess CUDA events and the server's copy stream.

The worker records a ``torch.cuda.Event(interprocess=True)`` after its forward pass and sends
:func:`export_event`'s bytes; the server makes its copy stream wait on that event
(:func:`wait_on_ipc_event`) instead of blocking the GPU, runs the gather/scatter on that stream and
synchronizes it before replying (:class:`CopyStream`). On CPU hosts everything here is a no-op that
accepts the empty handle ``b""``. CUDA is only touched when a CUDA device is actually used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.kv.cuda_ipc import require_cuda

IPC_EVENT_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE

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


def wait_on_ipc_event(
    handle: bytes, device: DeviceLike, stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    """Make ``stream`` (default: the current stream of ``device``) wait for the worker's event.

    No-op returning None for ``b""``. Returns the opened event, which the caller may keep until
    the stream's work is done.
    """
    if not handle:
        return None
    if len(handle) != IPC_EVENT_HANDLE_BYTES:
        raise ProtocolError(
            f"a CUDA event handle has {IPC_EVENT_HANDLE_BYTES} bytes, got {len(handle)}")
    dev = as_device(device)
    if dev.type != "cuda":
        raise IncompatibleError(f"got a CUDA event handle for a KV cache on {dev}")
    require_cuda("waiting on a CUDA event")
    event = torch.cuda.Event.from_ipc_handle(dev, handle)
    (stream or torch.cuda.current_stream(dev)).wait_event(event)
    return event


class CopyStream:
    """A dedicated CUDA stream for the server's copies (nothing at all on CPU).

    ``with copy_stream.run(event_handle): cache.gather(...)`` waits on the worker's event on the
    GPU, runs the copies on this stream, and synchronizes it on exit, so the data is in place
    (and the slots readable) before the reply goes out.
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
    def run(self, event_handle: bytes = b"") -> Iterator[None]:
        """Run the body's copies on this stream after the worker's event; synchronize at exit."""
        stream = self.stream
        if stream is None:
            if event_handle:
                raise IncompatibleError("got a CUDA event handle for a KV cache on the CPU")
            yield
            return
        with torch.cuda.stream(stream):
            event = wait_on_ipc_event(event_handle, self._device, stream)
            try:
                yield
            finally:
                stream.synchronize()
                del event

    def synchronize(self) -> None:
        """Wait for everything queued on this stream (no-op on CPU)."""
        if self._stream is not None:
            self._stream.synchronize()
