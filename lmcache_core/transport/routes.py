"""What a ``MessageQueueServer`` serves: its route table's entries (``Route``: a handler, whether it
blocks, what it waits for), the hook of a second dialect on the same socket (``Dialect``), and the
work items its loop queues for the worker threads (``Job``, ``Task``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from lmcache_core.protocol import messages as m
from lmcache_core.protocol.codec import RequestHead
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.gate import Waitable

Handler = Callable[[Any, bytes], m.Reply]
#: ``observe(op, seconds, error_code)`` after each request a route served ("" when it succeeded);
#: a dialect's requests are observed under its op name (a str), their error code always "".
Observer = Callable[[RequestType | str, float, str], None]
#: ``gate(payload) -> (waitable, timeout_s) | None``: what a blocking request must wait for before
#: its handler runs (e.g. the worker's CUDA event); it then waits in the ``Gate``, not on a worker.
GateFn = Callable[[Any], tuple[Waitable, float] | None]


class Route(NamedTuple):
    """How one op is served: ``handler(payload, client_identity) -> Reply``."""

    handler: Handler
    blocking: bool = False
    gate: GateFn | None = None


class Dialect(Protocol):
    """A second wire on the same socket (LMCache's own clients): it claims a request by its
    frames, then answers it (reply frames, or None: no reply now) or hands back a task for a
    worker thread. It never raises; its replies bypass our codec. ``attach(post)`` at the
    server's start gives it ``post([identity, *reply])``: a reply sent later, from any thread."""

    def attach(self, post: Callable[[list[bytes]], None]) -> None: ...

    def owns(self, frames: list[bytes]) -> str | None: ...

    def serve(self, op: str, frames: list[bytes],
              client: bytes) -> list[bytes] | Callable[[], list[bytes] | None] | None: ...

    def refuse(self, op: str, frames: list[bytes], client: bytes, why: str) -> list[bytes]:
        """The reply to ``frames`` that the server will not serve (``why``: e.g. too large)."""

    def dropped(self, op: str, frames: list[bytes], client: bytes) -> list[bytes] | None:
        """A task ``serve`` handed back for ``frames`` (from ``client``) will not run (the workers'
        queue was full): settle whatever it had started (e.g. a lookup already acknowledged)
        and return the reply still owed, if any."""


class Task(NamedTuple):
    """A dialect's request to serve on a worker thread."""

    identity: bytes
    run: Callable[[], list[bytes] | None]
    size: int  # the request's bytes, counted against the workers' queue bound
    op: str = ""  # the dialect's op name (for ``observe``)


class Job(NamedTuple):
    """One of our own requests, served on a worker thread (or parked in the gate first)."""

    identity: bytes
    head: RequestHead
    route: Route
    payload: Any = None  # decoded already (by the gate check)
    gated: bool = False  # back from the gate: serve it now
    expired: bool = False  # what it waited for did not complete in time: answer a timeout
