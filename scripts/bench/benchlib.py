"""What the benchmark scripts share: the bare ZMQ echo floor and a p50 timer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

#: A ROUTER that sends every message straight back: run as ``python -c ECHO <url>``; prints
#: "ready" once bound. The floor our server's round trips are measured against.
ECHO = """
import sys, zmq
sock = zmq.Context.instance().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("ready", flush=True)
while True:
    sock.send_multipart(sock.recv_multipart())
"""


def timed(fn: Callable[[], Any], n: int) -> float:
    """p50 of n calls, in microseconds (after n/10 warm-up calls)."""
    for _ in range(max(1, n // 10)):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6
