"""The suite's one harness: factory fixtures for the real processes tests run beside them, one
``wait_until`` and one fake clock (both in ``tests/harness.py``), the ``perf`` marker, and GPU
tests skipped without CUDA.

Factories (arq's ``tests/conftest.py`` is the model): ``make_server(overrides, name=...)`` starts an
``lmcache serve`` in the test's temp dir, ``make_worker(url, **shape)`` a stand-in vLLM worker
process, ``make_redis(cluster=False)`` a ``redis-server``, ``mooncake_master`` (a module's) a
Mooncake Store master with its metadata server; whatever a test made is stopped after it,
however it ended, so tests hold no try/finally of their own for that. ``module_server`` is
``make_server`` for a whole module (its servers outlive each test, and are killed after the last),
and ``server`` is a module's one shared server made by it: TINY with the overrides the module's
``server_config`` marker names, e.g. ``pytestmark = pytest.mark.server_config({"server":
{"pool_size": "2MiB"}})`` (its tests store chunks of their own, so they do not need a fresh one).
``short_tmp`` and ``module_tmp`` are temp dirs short enough for ``ipc://`` paths (107 bytes).

``perf`` tests measure real latency (bounds generous, but still about speed): they are deselected
by default (``-m "not perf"`` in pyproject.toml's addopts) and run with ``-m perf`` or
``LMCACHE_PERF=1``. Speed figures proper are ``scripts/bench/bench_*.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.kv.shm import SCOPE_ENV
from tests import forkserver
from tests.harness import FakeClock, wait_until
from tests.integration.servers import (
    MooncakeMaster,
    RedisServer,
    ServerProcess,
    WorkerProcess,
    mooncake_binaries,
    redis_binary,
)

__all__ = ["FakeClock", "wait_until"]

# One shared-memory scope for every process of this run (set before the fork server starts, so
# its children inherit it): the servers the tests start sweep only this run's names of dead
# owners at start, never the files a second copy of the suite on this machine keeps on purpose.
os.environ.setdefault(SCOPE_ENV, f"run{secrets.token_hex(4)}")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("LMCACHE_PERF") == "1" and config.option.markexpr == "not perf":
        config.option.markexpr = ""  # LMCACHE_PERF=1: the perf tests run too


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("integration" in item.path.parts for item in items):
        forkserver.prestart()  # its torch import overlaps the first tests
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    forkserver.stop()  # and every child it still has


@pytest.fixture
def own_objects_gc() -> Iterator[None]:
    """For the test, ``gc.collect()`` walks only the objects made since it began: the session's
    (torch, hypothesis, every earlier test's) are frozen, as each full collection of them took
    0.3-2.5 s late in a full run."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def fake_clock() -> FakeClock:
    """A clock that stands still until ``fake_clock.advance(s)``: pass it as ``clock=``."""
    return FakeClock()


@contextlib.contextmanager
def _short_dir(prefix: str) -> Iterator[Path]:
    """A new dir under /tmp (an ``ipc://`` path holds at most 107 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """The test's own temp dir, short enough for ``ipc://`` socket paths."""
    with _short_dir("lmt") as path:
        yield path


@pytest.fixture(scope="module")
def module_tmp() -> Iterator[Path]:
    """A temp dir for a whole module (its ``module_server`` servers' files), as ``short_tmp``."""
    with _short_dir("lmm") as path:
        yield path


def _servers(workdir: Path) -> Iterator[Callable[..., ServerProcess]]:
    """The server factory of ``make_server`` and ``module_server``: it kills what it made last."""
    made: list[ServerProcess] = []

    def make(overrides: dict[str, Any] | None = None, *, name: str = "srv",
             start: bool = True) -> ServerProcess:
        server = ServerProcess(workdir, overrides, name=name)
        made.append(server)
        return server.start() if start else server

    yield make
    for server in reversed(made):
        server.kill()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``make_server(overrides=None, name="srv", start=True)``: an ``lmcache serve`` on an ipc://
    socket in the test's temp dir (``ServerProcess``), killed after the test if still running."""
    yield from _servers(tmp_path)


@pytest.fixture(scope="module")
def module_server(module_tmp: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``make_server`` for a whole module: the servers it starts serve every test of the module
    that asks, and are killed after its last test."""
    yield from _servers(module_tmp)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest,
           module_server: Callable[..., ServerProcess]) -> ServerProcess:
    """The module's one ``lmcache serve``, shared by its tests: TINY with the arguments of the
    module's ``server_config`` marker (``module_server``'s: overrides, ``name=``), if it has one.
    A module-level ``pytestmark`` names it; a test's own marker is not seen (one server a module)."""
    marker = request.node.get_closest_marker("server_config")
    return module_server(*marker.args, **marker.kwargs) if marker else module_server()


@pytest.fixture
def make_worker() -> Iterator[Callable[..., WorkerProcess]]:
    """``make_worker(url, rank=0, world_size=1, ...)``: a ``kv_worker.py`` process registered with
    the server at ``url`` (``WorkerProcess``), closed after the test."""
    made: list[WorkerProcess] = []

    def make(url: str, **shape: Any) -> WorkerProcess:
        worker = WorkerProcess(url, **shape)
        made.append(worker)
        return worker

    yield make
    for worker in reversed(made):
        worker.close()


@pytest.fixture
def make_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """``make_redis(cluster=False)``: a started ``redis-server`` (``RedisServer``), killed after the
    test; the test is skipped where no redis-server is installed."""
    made: list[RedisServer] = []

    def make(cluster: bool = False) -> RedisServer:
        server = RedisServer(redis_binary(), tmp_path, cluster=cluster)
        made.append(server)
        return server.start()

    yield make
    for server in reversed(made):
        server.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One ``redis-server`` for a whole test module (``redis_up`` hands it to each test empty)."""
    server = RedisServer(redis_binary(), tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_up(redis_server: RedisServer) -> RedisServer:
    """The module's Redis, running (restarted if a test stopped it) and empty."""
    if not redis_server.running():
        redis_server.start()
    with redis_server.client() as c:
        c.flushall()
    return redis_server


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One ``mooncake_master`` (and metadata server) for a whole test module; skipped where the
    ``mooncake`` extra or its libraries are missing. A test that stops it starts it again."""
    server = MooncakeMaster(mooncake_binaries(), tmp_path_factory.mktemp("mooncake")).start()
    yield server
    server.close()
