"""A stand-in vLLM worker for the async lookup tests: a CacheEngine and a lookup server in a child.

Started by multiprocessing (``tests.forkserver.mp_context``: forked from its fork server, a clean
interpreter that imported torch once; no state of the test's process, as vLLM's workers have
none of the scheduler's) and driven through a ``Pipe``: ``("stats",)``, ``("locks", id)``,
``("free", id)``, ``("release",)``, ``("close",)``. Lookup ids that start with ``gate-`` wait
until ``release`` before the engine answers (a slow worker).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from tests import forkserver

MODEL = "tiny"
GATE_PREFIX = "gate-"


def worker_main(conn: Connection, runtime_dir: str, engine_id: str, worker_id: int,
                world_size: int, tokens: list[int], chunk_size: int, num_chunks: int) -> None:
    import msgspec

    from lmcache_core.engine import CacheEngine
    from lmcache_core.keys import ChunkKey, chain_hashes, opaque_layout
    from lmcache_core.lookup_client import LMCacheAsyncLookupServer, LMCacheMetadata
    from lmcache_core.storage.pool import MemoryPool

    gate = threading.Event()

    class GatedEngine(CacheEngine):
        def async_lookup_and_prefetch(self, lookup_id: str, hashes: Sequence[bytes],
                                      offsets: Sequence[int] | None = None, pin: bool = True,
                                      request_configs: dict[str, Any] | None = None,
                                      **kw: Any) -> int | None:
            if lookup_id.startswith(GATE_PREFIX):
                gate.wait(30)
            return super().async_lookup_and_prefetch(lookup_id, hashes, offsets, pin,
                                                     request_configs, **kw)

    engine = GatedEngine(MemoryPool.slots(64, 64, pin=False), chunk_size)
    hashes = chain_hashes(tokens, chunk_size)[:num_chunks]
    layout = opaque_layout(world_size)  # the default of async_lookup_and_prefetch
    plan = engine.store.begin_store([ChunkKey(MODEL, layout, worker_id, worker_id + 1, h)
                                     for h in hashes], 64)
    engine.store.finish_store(plan)
    server = LMCacheAsyncLookupServer(engine, LMCacheMetadata(
        model_name=MODEL, world_size=world_size, worker_id=worker_id, engine_id=engine_id,
        runtime_dir=runtime_dir))
    conn.send(("ready", os.getpid()))
    commands: dict[str, Callable[..., Any]] = {
        "stats": lambda: {**msgspec.structs.asdict(engine.snapshot().engine),
                          **{f"server_{k}": v for k, v in server.stats().items()}},
        "locks": lambda lookup_id: len(engine.store.inspect().locks_of(lookup_id)),
        "free": engine.store.free_lookup_locks,  # what the worker's retrieve would release
        "release": gate.set,
    }
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:  # the test process went away
            server.close()
            return
        if cmd == "close":
            server.close()
            conn.send({"socket_left": os.path.exists(server.socket_path),
                       "threads": [t.name for t in threading.enumerate()]})
            return
        conn.send(commands[cmd](*args))


class LookupWorker:
    """One ``worker_main`` child and its control pipe."""

    def __init__(self, runtime_dir: str, engine_id: str, worker_id: int, world_size: int,
                 tokens: list[int], chunk_size: int, num_chunks: int) -> None:
        ctx = forkserver.mp_context()
        self.conn, child = ctx.Pipe()
        self.worker_id = worker_id
        self.closed = False  # "close" was sent: the child is exiting
        self.proc = ctx.Process(target=worker_main, name=f"lookup-worker-{worker_id}", daemon=True,
                                args=(child, runtime_dir, engine_id, worker_id, world_size, tokens,
                                      chunk_size, num_chunks))
        self.proc.start()
        child.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"lookup worker {self.worker_id} did not start in {timeout_s}s")
        assert self.conn.recv()[0] == "ready"

    def __call__(self, cmd: str, *args: Any, timeout_s: float = 10.0) -> Any:
        self.closed = self.closed or cmd == "close"
        self.conn.send((cmd, *args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"lookup worker {self.worker_id}: no answer to {cmd!r}")
        return self.conn.recv()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)

    def close(self) -> dict[str, Any] | None:
        result = None
        if self.proc.is_alive() and not self.closed:
            with contextlib.suppress(TimeoutError, OSError, EOFError):
                result = self("close")
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
        return result
