"""Helpers shared by the cross-TP tests: engines of any TP size as worker processes, scheduler
lookups, stores of model-consistent contents and byte-exact loads (``kv_worker``'s ``fill_model``
and ``check_model``: every rank holds its slice of one seeded cache of all heads)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import zmq

from lmcache_core.client.scheduler import LMCacheMPSchedulerAdapter
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import lookup_result
from tests.integration.chunks import BLOCK, blocks
from tests.integration.servers import ServerProcess, WorkerProcess

HEADS = 8  # the model's KV heads, over all ranks
#: A server and the ranks of an engine at TP=1 and of one at TP=2 on it.
Node = tuple[ServerProcess, dict[int, list[WorkerProcess]]]


def in_parallel(*jobs: Callable[[], object]) -> list[object]:
    """Run the jobs on threads (process starts mostly wait); the first error is raised."""
    results: list[object] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int, job: Callable[[], object]) -> None:
        try:
            results[i] = job()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def lookup(url: str, world_size: int, request_id: str, toks: list[int], model: str) -> int:
    """Hit tokens of a scheduler lookup of ``model`` at ``world_size``."""
    adapter = LMCacheMPSchedulerAdapter(url, zmq.Context.instance(), model, world_size, 0, BLOCK)
    try:
        # token ids instead of vLLM block hashes (the adapter takes either)
        adapter.maybe_submit_lookup_request(request_id, toks)  # type: ignore[arg-type]
        return lookup_result(adapter, request_id)
    finally:
        adapter.close()


def store(workers: list[WorkerProcess], toks: list[int], seed: int, n_chunks: int) -> None:
    for worker in workers:
        worker("fill_model", blocks=blocks(0, n_chunks), seed=seed)
        result = worker("store", req=f"store-{seed}", keys=toks, blocks=blocks(0, n_chunks))
        assert result["finished"] and not result["failed"], result


def load_and_check(workers: list[WorkerProcess], request_id: str, toks: list[int], seed: int,
                   n_chunks: int) -> None:
    """Each rank retrieves into zeroed blocks and then holds exactly its slice of what was
    stored."""
    target = blocks(8, n_chunks)
    for worker in workers:
        worker("zero", blocks=target)
        result = worker("retrieve", req=request_id, keys=toks, blocks=target)
        assert result["finished"] and not result["failed"] and not result["load_errors"], result
        assert worker("check_model", blocks=target, seed=seed)["equal"]


def server_info(url: str) -> m.ServerInfoReply:
    with MessageQueueClient(url, connect_timeout_s=2) as client:
        return client.server_info()


def stats(url: str) -> m.ServerStats:
    return server_info(url).stats


def clear(url: str) -> None:
    """Drop every piece from the server's memory (the lower tiers keep theirs)."""
    with MessageQueueClient(url, connect_timeout_s=2) as client:
        assert client.request(m.ClearRequest(force=True)).kept_locked == 0
    assert stats(url).engine.chunks == 0


def start_node(server: ServerProcess, make: Callable[[str, int], list[WorkerProcess]]
               ) -> Iterator[Node]:
    """An engine (``make(url, world_size)``: its ranks) at TP=1 and one at TP=2 on ``server``,
    for a fixture to yield from; the workers are killed at its end (the server is its factory's)."""
    made: dict[int, list[WorkerProcess]] = {}
    try:
        for world_size in (1, 2):
            made[world_size] = make(server.url, world_size)
        yield server, made
    finally:
        for workers in made.values():
            for worker in workers:
                worker.kill()


def redis_pair(make_server: Callable[..., ServerProcess], redis_url: str,
               config: dict) -> tuple[ServerProcess, ServerProcess]:
    """Two servers of ``config`` (``make_server``'s: stopped after the test) sharing the Redis at
    ``redis_url`` as their remote tier, started side by side."""
    remote = {"url": redis_url, "timeout_ms": 500, "retry_interval_s": 0.2}
    pair = [make_server({**config, "remote": remote}, name=name, start=False) for name in "ab"]
    in_parallel(*(server.start for server in pair))
    return pair[0], pair[1]
