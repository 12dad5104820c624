"""``lmcache serve`` with one fault injected into a long-lived thread, for supervision tests.

Usage: ``python faulty_server.py FAULT serve -c CONFIG``. FAULT names the thread to break:
``loop`` (the transport loop raises on its first request), ``housekeeper`` (reaping raises, once
the file named by ``LMCACHE_TEST_FAULT_TRIGGER`` exists: a test lets the server come up first,
however long that takes on a busy machine) or ``worker`` (a copy worker dies, as on a
BaseException no handler boundary catches).
The rest of the command line is the ``lmcache`` command, run as the real CLI runs it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from lmcache_core.server.registry import KVRegistry
from lmcache_core.transport.server import MessageQueueServer


class InjectedFault(BaseException):
    """Not an Exception: no error boundary of the server catches it, as with a bug that escapes."""


def _raise(*_args: Any, **_kwargs: Any) -> Any:
    raise InjectedFault("injected fault")


def main() -> None:
    fault = sys.argv.pop(1)
    if fault == "loop":
        MessageQueueServer._receive = _raise  # type: ignore[method-assign]
    elif fault == "housekeeper":
        reap = KVRegistry.reap
        trigger = os.environ.get("LMCACHE_TEST_FAULT_TRIGGER", "")

        def reap_or_die(self: KVRegistry, *args: Any, **kwargs: Any) -> Any:
            if not trigger or os.path.exists(trigger):
                _raise()
            return reap(self, *args, **kwargs)

        KVRegistry.reap = reap_or_die  # type: ignore[method-assign]
    elif fault == "worker":
        answer = MessageQueueServer._answer

        def answer_or_die(self: MessageQueueServer, job: Any) -> Any:
            if "worker" in threading.current_thread().name:
                _raise()
            return answer(self, job)

        MessageQueueServer._answer = answer_or_die  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    from lmcache_cli.main import run

    run()


if __name__ == "__main__":
    main()
