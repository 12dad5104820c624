"""``send_frames`` / ``recv_frames``: multipart messages sent and received without pyzmq's enum
arithmetic, for the hot paths.

pyzmq's ``send_multipart(frames, zmq.NOBLOCK)`` computes ``flags | SNDMORE`` on its IntFlag
members for every frame (Python enum arithmetic, ~4 us a message with the GIL held); the same sends
with the flags as plain ints cost half. ``recv_multipart`` likewise asks ``RCVMORE`` as an enum
member after every frame (~1 us more each). The message is as atomic as ``send_multipart``'s: libzmq
queues the parts of a message together, so a full peer refuses its first part (``zmq.Again``) and
nothing of it is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


def send_frames(sock: zmq.Socket[Any], frames: Sequence[Any]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK)``, cheaper. Raises what it raises."""
    send = sock.send
    for frame in frames[:-1]:
        send(frame, _MORE)
    send(frames[-1], _LAST)


def recv_frames(sock: zmq.Socket[Any], flags: int = _LAST) -> list[bytes]:
    """``sock.recv_multipart(flags)`` (non-blocking by default), cheaper. Raises what it raises."""
    recv, more = sock.recv, sock.getsockopt
    frames = [recv(flags)]
    while more(_RCVMORE):
        frames.append(recv(flags))
    return frames
