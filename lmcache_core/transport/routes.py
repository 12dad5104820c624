"""What a ``MessageQueueServer`` serves: the wires it reads (``Wire``: our codec, LMCache's dialect),
its route table's entries (``Route``: a handler and how it is served), and the one work item its
loop queues for the worker threads (``Job``), whichever wire a request came on.

A request goes one way whatever its dialect: a wire claims its frames and reads their head (cheap:
uid, op, size), the route of its op says how it is served (inline or on a worker, after a gate, its
ack first, no reply at all), the handler runs on the decoded payload, and the wire encodes the
result, or the error the one error boundary (``answer.serve``) caught, in its own form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from lmcache_core.errors import LMCacheError
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.gate import Waitable

#: ``handler(payload, client_identity) -> result``; ``LATER`` when its reply is sent later (the
#: handler arranged it, through the server's ``post``).
Handler = Callable[[Any, bytes], Any]
#: ``observe(op, seconds, error_code)`` after each request a route served ("" when it succeeded);
#: LMCache's requests are observed under their op name (a str).
Observer = Callable[[RequestType | str, float, str], None]
#: ``gate(payload) -> (waitable, timeout_s) | None``: what a blocking request must wait for before
#: its handler runs (e.g. the worker's CUDA event); it then waits in the ``Gate``, not on a worker.
GateFn = Callable[[Any], tuple[Waitable, float] | None]
#: ``before(payload, client)``: runs ahead of a route's handler; for an ``ack_first`` request on
#: the loop thread, before its ack goes (e.g. a lookup's "running" marker, so a status asked after
#: the ack sees it).
Before = Callable[[Any, bytes], None]
#: What a handler returns when its reply is sent later, not by the pipeline.
LATER = object()


class AfterReply(NamedTuple):
    """A handler's ``result`` with work to start once its reply is sent (or, with no reply to
    send, once it is answered): ``then()`` runs on the loop thread, so it must only hand work
    off. E.g. a store's checksums: started before the reply, the hash takes a core the reply
    needs on a small host."""

    result: Any
    then: Callable[[], None]


class Head(Protocol):
    """What the pipeline reads of any request before its payload is decoded."""

    @property
    def op(self) -> RequestType | str: ...

    @property
    def size(self) -> int: ...


class Wire(Protocol):
    """One dialect's framing: which frames are its own, their payloads, and its replies. Never
    sees a socket; ``check`` and ``decode`` raise ``LMCacheError`` (its subclasses) only."""

    name: str

    def claim(self, frames: Sequence[bytes]) -> Any:
        """The head of a request in this wire (None: another wire's frames). The last wire claims
        everything, raising ``LMCacheError`` for frames it cannot read a head from."""

    def check(self, head: Any) -> None:
        """Raise ``LMCacheError`` when a claimed request may not be served (too large)."""

    def decode(self, head: Any) -> Any: ...

    def reply(self, head: Any, result: Any) -> list[bytes]: ...

    def error(self, head: Any, exc: LMCacheError) -> list[bytes]: ...


class Route(NamedTuple):
    """How one op is served: ``handler(payload, client_identity) -> result``.

    ``blocking``: on a worker thread; ``blocking_over``: a request larger than that many bytes
    is decoded and served on a worker thread too, and answered as any (never acked first);
    ``gate``: what it waits for first; ``ack_first``: a blocking request's ack (the void reply)
    is sent as it is admitted, its payload decoded on the loop thread and ``before`` run, and its
    handler's own reply is not sent (it runs behind the ack: LMCache's prefetching lookup);
    ``before(payload, client)``: runs ahead of the handler (of the ack, for an acked one);
    ``silent``: its protocol defines no reply (nothing runs)."""

    handler: Handler
    blocking: bool = False
    gate: GateFn | None = None
    blocking_over: int | None = None
    ack_first: bool = False
    before: Before | None = None
    silent: bool = False

    def oversize(self, size: int) -> bool:
        return self.blocking_over is not None and size > self.blocking_over

    def blocks(self, size: int) -> bool:
        return self.blocking or self.oversize(size)


def silent_route() -> Route:
    """A frame its protocol answers with nothing (e.g. LMCache's stream credit)."""
    return Route(lambda _payload, _client: None, silent=True)


class Job(NamedTuple):
    """One request, of either wire, served on a worker thread (or parked in the gate first)."""

    identity: bytes
    head: Any
    route: Route
    wire: Wire
    payload: Any = None  # decoded already (by the gate check, or to admit an ack-first request)
    gated: bool = False  # back from the gate: serve it now
    expired: bool = False  # what it waited for did not complete in time: answer a timeout
    acked: bool = False  # its ack went already: its handler's reply is not sent
