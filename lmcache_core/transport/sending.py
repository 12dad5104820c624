"""``send_frames``: a multipart message sent without blocking, for the hot paths.

pyzmq's ``send_multipart(frames, zmq.NOBLOCK)`` computes ``flags | SNDMORE`` on its IntFlag
members for every frame (Python enum arithmetic, ~4 us a message with the GIL held); the same sends
with the flags as plain ints cost half. The message is as atomic as ``send_multipart``'s: libzmq
queues the parts of a message together, so a full peer refuses its first part (``zmq.Again``) and
nothing of it is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)


def send_frames(sock: zmq.Socket[Any], frames: Sequence[Any]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK)``, cheaper. Raises what it raises."""
    send = sock.send
    for frame in frames[:-1]:
        send(frame, _MORE)
    send(frames[-1], _LAST)
