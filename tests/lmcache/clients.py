"""LMCache 0.5.6's own client adapters, as the tests here drive them: the TINY model's shape (2
layers of 4 KV heads x 32, fp16; chunks of 64 tokens, blocks of 16), one prompt of 4 chunks and
a partial tail, where its blocks are stored from (``SRC``) and loaded into (``DST``), and waits
for the adapters' answers (``tests.harness.wait_until``). Needs the ``lmcache`` package."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("LMCACHE_MP_TRANSFER_MODE", "lmcache_driven")  # CPU: SHM, server-driven
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    ParallelStrategy,
)

from tests.harness import wait_until

CHUNK, BLOCK, NUM_BLOCKS = 64, 16, 64
PER_CHUNK = CHUNK // BLOCK
N_CHUNKS = 4
TOKENS = [(7 + i * 31) % 32000 for i in range(N_CHUNKS * CHUNK + 10)]  # a partial tail too
SRC = list(range(0, N_CHUNKS * PER_CHUNK))
DST = list(range(N_CHUNKS * PER_CHUNK, 2 * N_CHUNKS * PER_CHUNK))
EXTRA = {"lmcache.mp.mq_timeout": 20, "lmcache.mp.heartbeat_interval": 1}


def strategy(worker_id: int = 0, world_size: int = 1) -> ParallelStrategy:
    """Rank ``worker_id`` of a tensor-parallel engine of ``world_size`` on one server."""
    return ParallelStrategy(mla_only=False, vllm_world_size=world_size, vllm_worker_id=worker_id,
                            tp_size=world_size, pp_size=1, n_servers=1)


def until(fn: Callable[[], Any], what: str, timeout_s: float = 20.0) -> Any:
    """``fn()`` once it answers (anything but None or False: a count of 0 is an answer)."""
    answers: list[Any] = []

    def answered() -> bool:
        result = fn()
        if result is None or result is False:
            return False
        answers.append(result)
        return True

    wait_until(answered, timeout_s, f"{what} did not finish")
    return answers[-1]


def lookup(scheduler: LMCacheMPSchedulerAdapter, request_id: str) -> int:
    """Hit tokens of a lookup of ``TOKENS``."""
    scheduler.maybe_submit_lookup_request(request_id, TOKENS)
    return until(lambda: scheduler.check_lookup_result(request_id), "lookup")


def finished(adapter: LMCacheMPWorkerAdapter, request_id: str, store: bool) -> None:
    """Wait until the adapter reports ``request_id``'s store (or retrieve) finished."""
    def done() -> bool:
        stores, retrieves = adapter.get_finished({request_id} if store else set())
        return request_id in ((stores if store else retrieves) or set())
    until(done, "store" if store else "retrieve")
