"""The server's one error boundary, and our own wire.

``serve`` runs a request's handler and returns its reply frames, a result or an error, whatever its
payload or its handler does (no exception from one request reaches the loop); ``refusal`` is the
reply to a request refused before its handler ran (its head unreadable, its op unknown, too large,
the server busy or stopping). Both build the error in the form of the request's wire (``wire.error``):
an ``ErrorReply`` for ours, LMCache's own failure for LMCache's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lmcache_core.errors import LMCacheError, LMCacheTimeoutError, ServerError, clip
from lmcache_core.log_budget import LogBudget
from lmcache_core.protocol.codec import (
    Limits,
    RequestHead,
    decode_head,
    decode_payload,
    encode_reply,
    error_reply,
    rejection_frames,
)
from lmcache_core.transport.routes import LATER, AfterReply, Job, Wire


class OurWire:
    """Our own dialect (``lmc.*`` ops, one msgpack payload frame, ``ErrorReply`` for errors): the
    last wire, which claims every request no other wire did."""

    name = "lmc"

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def claim(self, frames: Sequence[bytes]) -> RequestHead:
        return decode_head(frames, self.limits)  # ProtocolError: refused headless (``refusal``)

    def check(self, head: RequestHead) -> None:
        return None  # decode_head checked the size

    def decode(self, head: RequestHead) -> Any:
        return decode_payload(head, self.limits)

    @staticmethod
    def reply(head: RequestHead, result: Any) -> list[bytes]:
        return encode_reply(head.uid_frame, head.op_frame, result)

    @staticmethod
    def error(head: RequestHead, exc: LMCacheError) -> list[bytes]:
        return encode_reply(head.uid_frame, head.op_frame, error_reply(exc))


class Answer(NamedTuple):
    """What ``serve`` made of a request: its reply ``frames`` (None: sent later by the handler),
    the error's ``code`` ("" for a result), and what to run once the reply is sent (``then``,
    from an ``AfterReply`` result)."""

    frames: list[bytes] | None
    code: str
    then: Callable[[], None] | None = None


def serve(job: Job, rejections: LogBudget, failures: LogBudget) -> Answer:
    """Run ``job``'s handler and encode what came of it. Typed errors are logged to
    ``rejections``, anything else to ``failures``."""
    head, wire = job.head, job.wire
    if job.expired:
        late = LMCacheTimeoutError(f"{op_name(head)}: what it waits for (the worker's CUDA "
                                   "event) did not complete in time; nothing was copied")
        return Answer(wire.error(head, late), late.code.value)
    try:
        payload = job.payload if job.payload is not None else wire.decode(head)
        if job.route.before is not None and not job.acked:  # (an acked one's ran as admitted)
            job.route.before(payload, job.identity)
        result = job.route.handler(payload, job.identity)
    except LMCacheError as exc:
        rejections.log(logging.INFO, "%s failed: %s", op_name(head), clip(str(exc)))
        return Answer(wire.error(head, exc), exc.code.value)
    except Exception as exc:
        error = ServerError(f"{type(exc).__name__}: {clip(str(exc))}")
        failures.log(logging.ERROR, "%s raised", op_name(head), exc_info=True)
        return Answer(wire.error(head, error), error.code.value)
    then = None
    if isinstance(result, AfterReply):
        result, then = result
    return Answer(None if result is LATER else wire.reply(head, result), "", then)


def refusal(wire: Wire, head: Any, frames: Sequence[bytes], exc: LMCacheError) -> list[bytes]:
    """The reply to a request refused before its handler ran: in its wire's form when it has a
    head, else ours, echoing only what of its frames is trustworthy (``rejection_frames``)."""
    return wire.error(head, exc) if head is not None else rejection_frames(frames, exc)


def op_name(head: Any) -> str:
    """The op of a head, for log lines (ours are ``RequestType``s, LMCache's names)."""
    return getattr(head.op, "value", head.op)
