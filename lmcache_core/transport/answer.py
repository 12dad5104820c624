"""The server's one error boundary: a request's reply frames, a result or a typed ``ErrorReply``,
whatever its payload or its handler does (no exception from one request reaches the loop)."""

from __future__ import annotations

import logging

from lmcache_core.errors import LMCacheError, LMCacheTimeoutError, ServerError, clip
from lmcache_core.protocol.codec import (
    Limits,
    RequestHead,
    decode_payload,
    encode_reply,
    error_reply,
)
from lmcache_core.transport.counters import LogBudget
from lmcache_core.transport.routes import Job


def serve(job: Job, limits: Limits, rejections: LogBudget,
          failures: LogBudget) -> tuple[list[bytes], str]:
    """Run ``job``'s handler: the reply frames, and the error's code ("" for a result). Typed
    errors are logged to ``rejections``, anything else to ``failures``."""
    head = job.head
    if job.expired:
        late = LMCacheTimeoutError(f"{head.op.value}: what it waits for (the worker's CUDA "
                                   "event) did not complete in time; nothing was copied")
        return reply_error(head, late), late.code.value
    try:
        payload = job.payload if job.payload is not None else decode_payload(head, limits)
        reply = job.route.handler(payload, job.identity)
    except LMCacheError as exc:
        rejections.log(logging.INFO, "%s failed: %s", head.op.value, clip(str(exc)))
        return reply_error(head, exc), exc.code.value
    except Exception as exc:
        error = ServerError(f"{type(exc).__name__}: {clip(str(exc))}")
        failures.log(logging.ERROR, "%s raised", head.op.value, exc_info=True)
        return reply_error(head, error), error.code.value
    return encode_reply(head.uid_frame, head.op_frame, reply), ""


def reply_error(head: RequestHead, exc: LMCacheError) -> list[bytes]:
    """The reply frames of an ``ErrorReply`` for ``exc``, to the request ``head`` read."""
    return encode_reply(head.uid_frame, head.op_frame, error_reply(exc))
