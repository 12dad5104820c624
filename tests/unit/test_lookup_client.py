"""Async lookup client and servers in one process (threads), with scripted engines; and the engine's
``async_lookup_and_prefetch`` / ``cleanup_memory_objs``."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.engine import CacheEngine
from lmcache_core.errors import BindError, ConfigError, ProtocolError
from lmcache_core.keys import ChunkKey, chain_hashes, layout_key, opaque_layout
from lmcache_core.lookup_client import (
    LMCacheAsyncLookupClient,
    LMCacheAsyncLookupServer,
    LMCacheEngineConfig,
    LMCacheMetadata,
)
from lmcache_core.storage.pool import MemoryPool
from tests.harness import wait_until

CHUNK = 4
TOKENS = list(range(CHUNK * 5))


class ScriptedEngine:
    """Answers ``hits`` tokens at once, later (``hold``), or raises; records pins and cleanups."""

    def __init__(self, hits: int, hold: bool = False, fail: bool = False) -> None:
        self.hits, self.hold, self.fail = hits, hold, fail
        self.pinned: dict[str, int] = {}
        self.cleanups: list[str] = []
        self.held: list[tuple[str, Callable[[str, int], None]]] = []
        self.seen: list[tuple[str, list[int], dict[str, Any] | None, str, int]] = []

    def async_lookup_and_prefetch(self, lookup_id: str, hashes: Sequence[bytes],
                                  offsets: Sequence[int] | None = None, pin: bool = True,
                                  request_configs: dict[str, Any] | None = None, *,
                                  model_name: str = "", world_size: int = 1, worker_id: int = 0,
                                  on_result: Callable[[str, int], None] | None = None) -> int | None:
        assert on_result is not None and offsets is not None
        self.seen.append((lookup_id, list(offsets), request_configs, model_name, worker_id))
        if self.fail:
            raise RuntimeError("engine broke")
        self.pinned[lookup_id] = self.hits
        if self.hold:
            self.held.append((lookup_id, on_result))
        else:
            on_result(lookup_id, self.hits)
        return self.hits

    def cleanup_memory_objs(self, lookup_id: str) -> int:
        self.cleanups.append(lookup_id)
        return 1 if self.pinned.pop(lookup_id, None) is not None else 0


@pytest.fixture
def runtime_dir(short_tmp: Path) -> str:
    return str(short_tmp)


class Setup:
    def __init__(self, runtime_dir: str, engines: dict[int, ScriptedEngine], world_size: int,
                 timeout_ms: int = 5000, clock: Callable[[], float] = time.monotonic,
                 **meta: Any) -> None:
        self.meta = dict(model_name="m", world_size=world_size, engine_id="u", runtime_dir=runtime_dir,
                         **meta)
        self.engines = engines
        self.servers = {w: LMCacheAsyncLookupServer(e, LMCacheMetadata(worker_id=w, **self.meta))
                        for w, e in engines.items()}
        self.client = LMCacheAsyncLookupClient(
            LMCacheEngineConfig(chunk_size=CHUNK, lookup_timeout_ms=timeout_ms),
            LMCacheMetadata(**self.meta), clock=clock)

    def close(self) -> None:
        self.client.close()
        for server in self.servers.values():
            server.close()


@pytest.fixture
def setup(runtime_dir: str) -> Iterator[Callable[..., Setup]]:
    made: list[Setup] = []

    def make(engines: dict[int, ScriptedEngine], world_size: int = 2, **kw: Any) -> Setup:
        made.append(Setup(runtime_dir, engines, world_size, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
    assert os.listdir(runtime_dir) == []  # every socket file removed


def test_min_over_workers_with_offsets_and_request_configs(setup):
    s = setup({0: ScriptedEngine(16), 1: ScriptedEngine(8)})
    s.client.lookup([*TOKENS, 1, 2], "a", request_configs={"lmcache.tag": "x"})
    assert s.client.wait_for_result("a", 5) == 8
    assert s.engines[0].seen == [("a", [4, 8, 12, 16, 20], {"lmcache.tag": "x"}, "m", 0)]
    assert s.engines[1].seen[0][4] == 1


def test_mla_asks_worker_zero_only(setup):
    s = setup({0: ScriptedEngine(12)}, world_size=4, use_mla=True)
    s.client.lookup(TOKENS, "mla")
    assert s.client.wait_for_result("mla", 5) == 12
    with pytest.raises(ConfigError, match="not one of the lookup-server workers"):
        LMCacheAsyncLookupServer(ScriptedEngine(1), LMCacheMetadata(worker_id=1, **s.meta))


def test_an_engine_error_is_answered_with_zero_at_once(setup):
    s = setup({0: ScriptedEngine(16, fail=True)}, world_size=1)
    start = time.monotonic()
    s.client.lookup(TOKENS, "boom")
    assert s.client.wait_for_result("boom", 5) == 0
    assert time.monotonic() - start < 2.0  # not the 5 s timeout
    assert s.servers[0].stats()["engine_errors"] == 1 and s.engines[0].cleanups == ["boom"]


def test_answers_from_another_thread_and_the_seed_send_response(setup):
    s = setup({0: ScriptedEngine(16, hold=True)}, world_size=1)
    s.client.lookup(TOKENS, "x")
    wait_until(lambda: len(s.engines[0].held) == 1)
    lookup_id, on_result = s.engines[0].held.pop()
    threading.Thread(target=on_result, args=(lookup_id, 12)).start()
    assert s.client.wait_for_result("x", 5) == 12
    s.client.lookup(TOKENS, "y")
    wait_until(lambda: len(s.engines[0].held) == 1)
    s.servers[0].send_response_to_scheduler("y", 4)  # the seed's API, from this thread
    assert s.client.wait_for_result("y", 5) == 4


def test_timeout_reports_zero_and_a_late_answer_is_cleaned_up(setup):
    fast, slow = ScriptedEngine(16), ScriptedEngine(16, hold=True)
    s = setup({0: fast, 1: slow}, timeout_ms=200)
    s.client.lookup(TOKENS, "t")
    assert s.client.lookup_cache("t") is None
    wait_until(lambda: "t" in fast.pinned and len(slow.held) == 1)
    wait_until(lambda: s.client.lookup_cache("t") is not None, 2.0)
    assert s.client.lookup_cache("t") == 0  # and stays 0 until cleared
    wait_until(lambda: fast.cleanups == ["t"])  # what answered in time is released at the timeout
    _, on_result = slow.held.pop()
    on_result("t", 16)  # the late answer
    wait_until(lambda: slow.cleanups == ["t"])
    assert s.client.stats()["late_answers"] == 1 and s.client.stats()["timeouts"] == 1
    s.client.clear_lookup_status("t")
    assert s.client.lookup_cache("t") == -1


def test_lookup_cache_applies_the_timeout_itself_without_waiting(setup, fake_clock):
    # The thread waits the whole timeout (a minute, in real time) before it looks again: a 0 now
    # comes from lookup_cache itself, reading the clock, not from the thread.
    s = setup({0: ScriptedEngine(16, hold=True)}, world_size=1, timeout_ms=60_000,
              clock=fake_clock)
    s.client.lookup(TOKENS, "p")
    wait_until(lambda: len(s.engines[0].held) == 1)
    assert s.client.lookup_cache("p") is None
    fake_clock.advance(59.9)
    assert s.client.lookup_cache("p") is None
    fake_clock.advance(0.2)
    assert s.client.lookup_cache("p") == 0
    assert s.client.stats()["timeouts"] == 1


def test_asking_again_replaces_the_attempt_and_its_stale_cleanup_is_ignored(setup):
    engine = ScriptedEngine(16, hold=True)
    s = setup({0: engine}, world_size=1)
    s.client.lookup(TOKENS, "r")
    wait_until(lambda: len(engine.held) == 1)
    s.client.lookup(TOKENS, "r")  # a second attempt under the same id
    wait_until(lambda: len(engine.held) == 2)
    first, second = engine.held
    first[1]("r", 16)  # the first attempt's answer: late, so the client sends its cleanup...
    wait_until(lambda: s.client.stats()["late_answers"] == 1)
    wait_until(lambda: s.servers[0].stats()["stale_cleanups"] == 1)  # ...which the server ignores
    assert engine.cleanups == [] and s.client.lookup_cache("r") is None
    second[1]("r", 8)
    assert s.client.wait_for_result("r", 5) == 8


def test_cancel_after_the_answer_releases_and_clear_does_not(setup):
    s = setup({0: ScriptedEngine(16), 1: ScriptedEngine(0)})
    s.client.lookup(TOKENS, "keep")
    s.client.lookup(TOKENS, "drop")
    assert s.client.wait_for_result("keep", 5) == 0 and s.client.wait_for_result("drop", 5) == 0
    s.client.clear_lookup_status("keep")  # used: the retrieve releases the pins
    s.client.cancel_lookup("drop")  # min is 0, but worker 0 pinned 16 tokens: clean up both
    wait_until(lambda: s.engines[0].cleanups == ["drop"] and s.engines[1].cleanups == ["drop"])
    assert "keep" in s.engines[0].pinned


def test_prompts_without_a_complete_chunk_answer_at_once(setup):
    s = setup({0: ScriptedEngine(16)}, world_size=1)
    s.client.lookup(TOKENS[:CHUNK - 1], "tiny")
    assert s.client.lookup_cache("tiny") == 0
    assert s.servers[0].stats()["requests"] == 0


def test_a_worker_socket_in_use_is_refused_and_stale_files_are_replaced(setup, runtime_dir):
    s = setup({0: ScriptedEngine(16)}, world_size=1)
    with pytest.raises(BindError, match="in use"):
        LMCacheAsyncLookupServer(ScriptedEngine(1), LMCacheMetadata(worker_id=0, **s.meta))
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a dead client's answer socket
    stale.bind(os.path.join(runtime_dir, "u.lookup-sched.999999-0.sock"))
    stale.close()
    s.servers[0].close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a dead worker's request socket
    stale.bind(s.servers[0].socket_path)
    stale.close()
    s.servers[0] = LMCacheAsyncLookupServer(s.engines[0], LMCacheMetadata(worker_id=0, **s.meta))
    client = LMCacheAsyncLookupClient(LMCacheEngineConfig(chunk_size=CHUNK), LMCacheMetadata(**s.meta))
    try:
        assert "u.lookup-sched.999999-0.sock" not in os.listdir(runtime_dir)
        client.lookup(TOKENS, "z")
        assert client.wait_for_result("z", 5) == 16
    finally:
        client.close()


def test_two_clients_of_one_engine_each_get_their_own_answers(setup):
    s = setup({0: ScriptedEngine(16)}, world_size=1)
    other = LMCacheAsyncLookupClient(LMCacheEngineConfig(chunk_size=CHUNK), LMCacheMetadata(**s.meta))
    try:
        assert other.reply_to != s.client.reply_to
        s.client.lookup(TOKENS, "same-id")
        other.lookup(TOKENS, "same-id")
        assert s.client.wait_for_result("same-id", 5) == 16
        assert other.wait_for_result("same-id", 5) == 16
    finally:
        other.close()


def _engine_with(hashes: Sequence[bytes], ranks_chunks: dict[int, int]) -> CacheEngine:
    engine = CacheEngine(MemoryPool.slots(8, 32, pin=False), chunk_size=CHUNK)
    for rank, n in ranks_chunks.items():
        plan = engine.store.begin_store([ChunkKey("m", opaque_layout(2), rank, rank + 1, h)
                                   for h in hashes[:n]], 8)
        engine.store.finish_store(plan)
    return engine


def test_engine_counts_its_own_rank_pins_and_cleans_up():
    hashes = chain_hashes(TOKENS, CHUNK)
    engine = _engine_with(hashes, {0: 2, 1: 4})
    answers: list[tuple[str, int]] = []
    offsets = [4, 8, 12, 16, 19]
    got = engine.async_lookup_and_prefetch("q", hashes, offsets, True, None, model_name="m",
                                           world_size=2, worker_id=1,
                                           on_result=lambda i, n: answers.append((i, n)))
    assert got == 16 and answers == [("q", 16)] and len(engine.store.inspect().locks_of("q")) == 4
    assert engine.cleanup_memory_objs("q") == 4 and engine.store.inspect().locks_of("q") == []
    assert engine.async_lookup_and_prefetch("n", hashes, None, False, model_name="m", world_size=2,
                                            worker_id=0) == 2 * CHUNK
    assert engine.store.inspect().locks_of("n") == []
    assert engine.async_lookup_and_prefetch("w", hashes, model_name="other", world_size=2) == 0
    with pytest.raises(ProtocolError):
        engine.async_lookup_and_prefetch("e", hashes, [4], model_name="m", world_size=2)
    with pytest.raises(ProtocolError):
        engine.async_lookup_and_prefetch("e", hashes, model_name="m", world_size=2, worker_id=2)


def test_engine_counts_pieces_of_other_tp_sizes_under_a_real_layout():
    layout = layout_key("float16", 2, 8, 16, False)
    hashes = chain_hashes(TOKENS, CHUNK)
    engine = CacheEngine(MemoryPool.slots(8, 32, pin=False), chunk_size=CHUNK)
    keys = [ChunkKey("m", layout, 0, 8, h) for h in hashes[:3]]  # stored by a TP=1 engine
    engine.store.finish_store(engine.store.begin_store(keys, 8))
    for world_size, worker_id in ((1, 0), (2, 1), (4, 3)):
        lookup_id = f"tp{world_size}"
        assert engine.async_lookup_and_prefetch(lookup_id, hashes, model_name="m",
                                                world_size=world_size, worker_id=worker_id,
                                                layout=layout) == 3 * CHUNK
        assert sorted(engine.store.inspect().locks_of(lookup_id)) == sorted(keys)
        assert engine.cleanup_memory_objs(lookup_id) == 3
    # No layout: the opaque one of the world size, which these pieces are not.
    assert engine.async_lookup_and_prefetch("o", hashes, model_name="m", world_size=2,
                                            worker_id=1) == 0
    with pytest.raises(ProtocolError, match="divide"):
        engine.async_lookup_and_prefetch("3", hashes, model_name="m", world_size=3, layout=layout)


def test_engine_with_a_disk_tier_loads_the_prefix_off_the_callers_thread(tmp_path):
    from lmcache_core.storage.disk import DiskTier

    hashes = chain_hashes(TOKENS, CHUNK)
    disk = DiskTier(tmp_path, 1 << 20, write_through=True)
    writer = CacheEngine(MemoryPool.slots(64, 8, pin=False), chunk_size=CHUNK, disk=disk)
    assert writer.tiers is not None
    writer.tiers.start()
    try:
        plan = writer.store.begin_store([ChunkKey("m", opaque_layout(1), 0, 1, h)
                                         for h in hashes[:3]], 64)
        for i, (_, _, view) in enumerate(plan.writes):
            view.fill_(i)
        writer.store.finish_store(plan)
        assert disk.flush(5)
    finally:
        disk.stop()
    engine = CacheEngine(MemoryPool.slots(64, 8, pin=False), chunk_size=CHUNK,
                         disk=DiskTier(tmp_path, 1 << 20))  # a restarted worker: memory is empty
    done = threading.Event()
    answers: list[tuple[str, int, str]] = []

    def on_result(lookup_id: str, tokens: int) -> None:
        answers.append((lookup_id, tokens, threading.current_thread().name))
        done.set()

    assert engine.async_lookup_and_prefetch("d", hashes, None, True, None, model_name="m",
                                            on_result=on_result) is None
    assert done.wait(5)
    lookup_id, tokens, thread = answers[0]
    assert (lookup_id, tokens) == ("d", 3 * CHUNK) and thread.startswith("lmcache-prefetch")
    assert len(engine.store.inspect().locks_of("d")) == 3  # loaded into memory and pinned
    assert engine.async_lookup_and_prefetch("e", hashes, model_name="m") == 3 * CHUNK  # no callback
    assert engine.cleanup_memory_objs("d") == 3


def test_a_waiter_is_woken_when_another_thread_receives_its_answer(setup):
    s = setup({0: ScriptedEngine(16, hold=True)}, world_size=1)
    s.client.lookup(TOKENS, "w")
    wait_until(lambda: len(s.engines[0].held) == 1)
    results: list[int | None] = []
    waiter = threading.Thread(target=lambda: results.append(s.client.wait_for_result("w", 5)))
    waiter.start()
    stop = threading.Event()

    def poll() -> None:  # a scheduler loop polling the same id receives the answer itself
        while not stop.is_set() and s.client.lookup_cache("w") is None:
            pass

    poller = threading.Thread(target=poll)
    poller.start()
    lookup_id, on_result = s.engines[0].held.pop()
    on_result(lookup_id, 8)
    waiter.join(5)
    stop.set()
    poller.join(5)
    assert results == [8] and not waiter.is_alive()


def test_a_dead_client_thread_is_logged_and_lookups_still_end_at_their_deadline(setup, caplog):
    s = setup({0: ScriptedEngine(16, hold=True)}, world_size=1, timeout_ms=200)

    def broken() -> int:
        raise RuntimeError("injected")

    s.client._poll_timeout_ms = broken  # the thread's next round raises
    s.client.lookup(TOKENS, "d")
    wait_until(lambda: "I/O thread lmcache-lookup-client failed" in caplog.text)
    start = time.monotonic()
    assert s.client.wait_for_result("d", 5) == 0  # at the lookup's deadline, not the wait's
    assert time.monotonic() - start < 2.0
    s.client.lookup(TOKENS, "e")  # nobody reads answers any more: 0 at once, nothing sent
    assert s.client.lookup_cache("e") == 0
    assert s.client.wait_for_result("e", 5) == 0


def test_answers_that_cannot_be_delivered_release_their_pins_and_cost_few_lines(
        setup, caplog) -> None:
    """A request naming an answer socket no one can reach (here: a path too long for ipc) is
    answered by releasing its pins; any client may send those at will, so they are logged through
    a LogBudget (20 lines per 10 s), and a failing release does not stop the lookup server."""
    import logging

    from lmcache_core.lookup_client.messages import LookupRequestMsg, encode

    engine = ScriptedEngine(8)
    s = setup({0: engine}, world_size=1)
    server = s.servers[0]
    caplog.set_level(logging.DEBUG, logger="lmcache_core.lookup_client.server")
    with raw_push(server) as push:
        for i in range(40):
            push.send(encode(LookupRequestMsg(lookup_id=f"x{i}", seq=1, reply_to="a" * 115 + ".sock",
                                              hashes=[b"h" * 32], offsets=[CHUNK])))
        wait_until(lambda: server.stats()["dropped_responses"] == 40)
    wait_until(lambda: len(engine.cleanups) == 40)
    assert not engine.pinned  # every pin released
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING
                and "cannot answer" in r.getMessage()]
    assert 1 <= len(warnings) <= 20  # the LogBudget's lines per window
    s.client.lookup(TOKENS, "still")  # the server still answers lookups
    assert s.client.wait_for_result("still", 5) == 8


@contextlib.contextmanager
def raw_push(server: LMCacheAsyncLookupServer) -> Iterator[Any]:
    """A PUSH socket to ``server``'s requests socket, as any client could connect one."""
    import zmq

    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"ipc://{server.socket_path}")
    try:
        yield push
    finally:
        push.close(0)


class FailingCleanupEngine(ScriptedEngine):
    def cleanup_memory_objs(self, lookup_id: str) -> int:
        super().cleanup_memory_objs(lookup_id)
        raise RuntimeError("cleanup broke")


def test_malformed_messages_and_failing_cleanups_cost_few_lines(setup, caplog) -> None:
    """Malformed messages (any client may send them) and an engine whose every cleanup fails are
    logged through LogBudgets (20 lines per 10 s each), not one line or traceback each."""
    import logging

    from lmcache_core.lookup_client.messages import LookupCleanupMsg, encode

    engine = FailingCleanupEngine(8)
    s = setup({0: engine}, world_size=1)
    server = s.servers[0]
    caplog.set_level(logging.DEBUG, logger="lmcache_core.lookup_client.server")
    with raw_push(server) as push:
        for i in range(40):
            push.send(b"junk")
            push.send(encode(LookupCleanupMsg(lookup_id=f"c{i}", seq=1)))
        wait_until(lambda: server.stats()["malformed"] == 40 and len(engine.cleanups) == 40)
    malformed = [r for r in caplog.records if "malformed message" in r.getMessage()]
    failed = [r for r in caplog.records if "cleanup of" in r.getMessage()]
    assert len(malformed) == 20 and len(failed) == 20
    assert all(r.exc_info for r in failed)  # the lines let through keep their traceback
    s.client.lookup(TOKENS, "still")  # the server still answers lookups
    assert s.client.wait_for_result("still", 5) == 8


def test_connect_push_closes_its_socket_when_connect_fails(tmp_path) -> None:
    import zmq

    from lmcache_core.lookup_client import _ipc

    made: list[zmq.Socket[Any]] = []

    class Recording(zmq.Context):  # type: ignore[type-arg]
        def socket(self, *args: Any, **kw: Any) -> Any:
            made.append(super().socket(*args, **kw))
            return made[-1]

    context = Recording()
    try:
        with pytest.raises(zmq.ZMQError):
            _ipc.connect_push(context, tmp_path / ("a" * 200 + ".sock"), 10)
        assert len(made) == 1 and made[0].closed
    finally:
        context.destroy(linger=0)
