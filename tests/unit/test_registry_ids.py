"""A registration's id belongs to one worker process: the worker client draws it from the OS's
random source (vLLM seeds Python's ``random`` alike in every engine, so two engines once drew the
same id and the second took over the first's registration: its stores read, and its loads wrote,
the other engine's KV cache), and the server refuses an id a live other process holds."""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Iterator

import pytest

from lmcache_core.client.worker import new_instance_id
from lmcache_core.errors import IncompatibleError
from lmcache_core.kv.shm import pid_namespace
from lmcache_core.protocol import messages as m
from lmcache_core.server.registry import KVRegistry
from tests.unit.mappings import FakeMapping, register_request


def request(instance_id: int, pid: int, hostname: str | None = None) -> m.RegisterKVCacheRequest:
    desc = m.TensorDescriptor(kind="shm", dtype="float16", shape=[2, 8, 16, 2, 64],
                              stride=[16384, 2048, 128, 64, 1], offset_bytes=0,
                              segment_nbytes=1 << 20,
                              shm_name=f"lmcache-x-{pid}-{pid_namespace()}-0123456789ab")
    return register_request(instance_id, pid, desc, hostname)


@pytest.fixture
def other_process() -> Iterator[int]:
    """The pid of another process that runs for the test."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait(10)


def test_ids_do_not_follow_pythons_seeded_random() -> None:
    random.seed(0)
    first = new_instance_id()
    random.seed(0)  # what vLLM does in every engine
    assert new_instance_id() != first
    assert all(0 <= new_instance_id() < 2**63 for _ in range(100))


def test_another_live_process_cannot_take_an_id_over(other_process: int) -> None:
    registry = KVRegistry(lambda r: FakeMapping(), reap_timeout_s=60.0)
    first = registry.register(request(7, os.getpid()))
    with pytest.raises(IncompatibleError, match=f"registered by process {os.getpid()}"):
        registry.register(request(7, other_process))
    with registry.lease(7) as held:  # the first worker keeps its registration
        assert held is first and not first.mapped.closed


def test_the_same_process_registers_again_and_a_gone_ones_id_is_free(other_process: int) -> None:
    registry = KVRegistry(lambda r: FakeMapping(), reap_timeout_s=60.0)
    first = registry.register(request(7, os.getpid()))
    again = registry.register(request(7, os.getpid()))  # after a reconnect: replaces it
    assert first.retired and not again.retired
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    registry.register(request(8, gone.pid))
    taken = registry.register(request(8, other_process))  # its holder exited: stale
    with registry.lease(8) as held:
        assert held is taken
