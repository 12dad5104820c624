"""The one exception tree of lmcache, and the wire error codes each exception maps to.

Every error that can cross the wire has a stable ``code``; the server turns an exception into an
``ErrorReply(code, message)`` and the client turns that reply back into the same exception class.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Stable, machine-readable error codes carried in ``ErrorReply``."""

    BAD_REQUEST = "bad_request"
    UNKNOWN_OP = "unknown_op"
    TOO_LARGE = "too_large"
    NOT_REGISTERED = "not_registered"
    INCOMPATIBLE = "incompatible"
    SHUTTING_DOWN = "shutting_down"
    BUSY = "busy"
    PIN_LIMIT = "pin_limit"
    INTERNAL = "internal"


class LMCacheError(Exception):
    """Root of every error lmcache raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL


class ConfigError(LMCacheError, ValueError):
    """A configuration file, variable or flag is wrong. The message names the source and key."""

    code = ErrorCode.BAD_REQUEST


class ProtocolError(LMCacheError):
    """A frame or message does not follow the protocol (bad shape, bad type, bad op)."""

    code = ErrorCode.BAD_REQUEST


class UnknownOperationError(ProtocolError):
    """The op frame names an operation this server does not serve."""

    code = ErrorCode.UNKNOWN_OP


class RequestTooLargeError(ProtocolError):
    """A request exceeds the server's frame-size or keys-per-request limit."""

    code = ErrorCode.TOO_LARGE


class NotRegisteredError(LMCacheError):
    """A store/retrieve names a KV-cache instance the server does not know (or has reaped)."""

    code = ErrorCode.NOT_REGISTERED


class IncompatibleError(LMCacheError):
    """Two sides disagree on something fixed: chunk size, block size, KV layout, slot size."""

    code = ErrorCode.INCOMPATIBLE


class ShuttingDownError(LMCacheError):
    """The server is stopping and no longer takes this kind of request."""

    code = ErrorCode.SHUTTING_DOWN


class ServerBusyError(LMCacheError):
    """The server's queue of long requests is full; this one was not served (retry later, or
    treat it as a miss: nothing was stored or loaded)."""

    code = ErrorCode.BUSY


class PinLimitError(LMCacheError):
    """A pin would hold more than ``server.max_pinned`` bytes: refused, nothing pinned."""

    code = ErrorCode.PIN_LIMIT


class ServerError(LMCacheError):
    """The server failed while handling a request; the message says why."""

    code = ErrorCode.INTERNAL


class LifecycleError(ServerError):
    """A chunk piece was moved in a way its lifecycle does not allow (``engine/lifecycle.py``):
    a bug in the engine, reported as an internal error."""


class BindError(LMCacheError, OSError):
    """The server cannot listen on its url (address in use, bad path, permission)."""


class LMCacheTimeoutError(LMCacheError, TimeoutError):
    """A wait ran past its timeout (connect, request, lookup)."""


class CopiesStalledError(LMCacheTimeoutError):
    """The server's own GPU copies did not complete in time: they may still land later, so the
    memory they touch must not be handed out again (the server stops)."""


class RemoteTierError(LMCacheError, ConnectionError):
    """A remote tier's store (Mooncake Store) failed a call or cannot be reached: the tier counts
    it and goes down until a probe succeeds; a lookup misses."""


class ConnectionClosedError(LMCacheError, ConnectionError):
    """The client was closed while requests were still waiting for replies."""


class ServerUnreachableError(LMCacheError, ConnectionError):
    """Nothing answered at the server url within the connect timeout."""


#: How much of a text that may carry a client's input goes into an error message or a log line.
MAX_MESSAGE_CHARS = 200


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many more there were: a client's input (an
    op name, a field name) may be megabytes, and must not be logged or echoed whole."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


_BY_CODE: dict[ErrorCode, type[LMCacheError]] = {
    ErrorCode.BAD_REQUEST: ProtocolError,
    ErrorCode.UNKNOWN_OP: UnknownOperationError,
    ErrorCode.TOO_LARGE: RequestTooLargeError,
    ErrorCode.NOT_REGISTERED: NotRegisteredError,
    ErrorCode.INCOMPATIBLE: IncompatibleError,
    ErrorCode.SHUTTING_DOWN: ShuttingDownError,
    ErrorCode.BUSY: ServerBusyError,
    ErrorCode.PIN_LIMIT: PinLimitError,
    ErrorCode.INTERNAL: ServerError,
}


def error_from_code(code: str, message: str) -> LMCacheError:
    """Rebuild the exception a server reported as ``(code, message)``."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        cls = ServerError
    return cls(message)
