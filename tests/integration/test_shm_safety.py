"""A real ``lmcache serve`` and its workers' shared memory: what it maps, reaps, unlinks and sweeps.

The server maps and unlinks only this project's segments, created by the registering process and
owned by an allowed user; it unlinks the segments of workers that died (zombies too) and, at start,
those left by workers that died while no server ran; and a worker keeps its names through a server
restart, so it registers again by itself and goes on storing and retrieving.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_core.errors import IncompatibleError
from lmcache_core.kv.shm import SHM_DIR, SharedSegment
from lmcache_core.kv.tensors import contiguous_stride
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import segment_name, wait_until
from tests.integration.chunks import blocks, stats, tokens
from tests.integration.servers import ServerProcess, WorkerProcess, process_state

NOBODY = 65534
SHAPE = [2, 8, 16, 4, 32]  # flash_attn, float16, the TINY server's model: 64 KiB per layer
LAYER_BYTES = 2 * 8 * 16 * 4 * 32 * 2
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait(10)
    return child.pid


def exists(name: str) -> bool:
    return os.path.lexists(f"{SHM_DIR}/{name}")


@pytest.fixture
def made() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        if exists(name):
            os.unlink(f"{SHM_DIR}/{name}")


def create(made: list[str], name: str, uid: int | None = None) -> str:
    made.append(name)
    SharedSegment.create(name, 2 * LAYER_BYTES).close()
    if uid is not None:
        os.chown(f"{SHM_DIR}/{name}", uid, -1)
    return name


def register(client: MessageQueueClient, name: str, pid: int,
             instance_id: int | None = None) -> int:
    """Register a 2-layer KV cache in segment ``name`` as process ``pid``; its instance id."""
    instance_id = instance_id if instance_id is not None else secrets.randbits(62)
    descs = [m.TensorDescriptor(kind="shm", dtype="float16", shape=SHAPE,
                                stride=contiguous_stride(SHAPE), offset_bytes=i * LAYER_BYTES,
                                segment_nbytes=2 * LAYER_BYTES, shm_name=name) for i in range(2)]
    client.request(m.RegisterKVCacheRequest(
        instance_id=instance_id, model_name="tiny", world_size=1, kv_rank=0, block_size=16,
        layout="flash_attn", layers=descs, pid=pid, hostname=socket.gethostname()))
    return instance_id


def wait_reaped(client: MessageQueueClient, before: m.ServerStats, count: int,
                timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``count`` more workers were reaped than in ``before``."""
    wait_until(lambda: stats(client).workers.reaped_instances
               >= before.workers.reaped_instances + count,
               timeout_s, f"fewer than {count} worker(s) reaped")


@pytest.fixture
def client(server: ServerProcess) -> Iterator[MessageQueueClient]:
    with MessageQueueClient(server.url, request_timeout_s=10) as c:
        yield c


# ---------------------------------------------------------------- what the server maps


def test_foreign_names_and_other_pids_are_refused_and_never_unlinked(
        client: MessageQueueClient, made: list[str]) -> None:
    before = stats(client)
    foreign = create(made, f"otherapp-segment-{secrets.token_hex(4)}")
    with pytest.raises(IncompatibleError, match="is not an lmcache segment"):
        register(client, foreign, exited_pid())  # the attack: its pid is gone, so it'd be unlinked
    someone_elses = create(made, segment_name(exited_pid()))
    with pytest.raises(IncompatibleError, match="was created by process"):
        register(client, someone_elses, os.getpid())
    # More than one housekeeping round (kept sleep: it waits for an unlink that must not happen,
    # so a slow machine can only hide a bug, never fail the test).
    time.sleep(1.5)
    assert exists(foreign) and exists(someone_elses)
    assert stats(client).workers.registered_instances == before.workers.registered_instances


@needs_root
def test_another_users_segment_is_refused_unless_allowed(
        tmp_path: Path, made: list[str], make_server) -> None:
    name = create(made, segment_name(os.getpid()), uid=NOBODY)
    plain = make_server(name="plain")
    allowing = make_server({"server": {"shm_allowed_uids": [NOBODY]}},
                 name="allowing")
    with MessageQueueClient(plain.url) as c, pytest.raises(
            IncompatibleError, match=f"owned by uid {NOBODY}"):
        register(c, name, os.getpid())
    with MessageQueueClient(allowing.url) as c:
        instance = register(c, name, os.getpid())
        c.request(m.UnregisterKVCacheRequest(instance_id=instance))


def test_ipc_socket_is_for_its_user_only(server: ServerProcess) -> None:
    # Whoever can connect can make the server read and write the memory it maps.
    path = server.url[len("ipc://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


# ---------------------------------------------------------------- what the reaper unlinks


def test_reaper_never_unlinks_a_file_that_replaced_the_workers(
        client: MessageQueueClient, made: list[str]) -> None:
    before = stats(client)
    child = subprocess.Popen(["sleep", "30"])
    try:
        name = create(made, segment_name(child.pid))
        register(client, name, child.pid)
        os.unlink(f"{SHM_DIR}/{name}")  # another file now stands under that name
        SharedSegment.create(name, 4096).close()
    finally:
        child.kill()
        child.wait(10)
    wait_reaped(client, before, 1)
    assert exists(name)


def test_a_zombie_worker_is_reaped_and_its_segment_unlinked(
        server: ServerProcess, client: MessageQueueClient) -> None:
    before = stats(client)
    worker = WorkerProcess(server.url, fresh=True)  # our child: it stays a zombie till waited for
    name = worker.hello["shm_name"]
    try:
        worker.proc.send_signal(signal.SIGKILL)  # and not waited for (no poll()): a zombie
        wait_until(lambda: process_state(worker.proc.pid) == "Z")
        # reap_timeout_s is 60: only the zombie check can do it within the wait
        registered = before.workers.registered_instances
        wait_until(lambda: not exists(name)
                   and stats(client).workers.registered_instances <= registered,
                   30, "the zombie worker was not reaped")
        assert process_state(worker.proc.pid) == "Z"  # reaped while still a zombie
        assert "process exited" in server.log()
    finally:
        worker.kill()


def test_a_pid_that_does_not_exist_never_stops_reaping(
        server: ServerProcess, client: MessageQueueClient, made: list[str]) -> None:
    before = stats(client)
    nowhere = 2**22  # the largest pid the wire takes; no process has it on this machine
    ghost = create(made, segment_name(nowhere))
    register(client, ghost, nowhere)
    worker = WorkerProcess(server.url)
    worker.proc.kill()
    worker.proc.wait(10)
    wait_reaped(client, before, 2)
    assert not exists(ghost) and not exists(worker.hello["shm_name"])
    time.sleep(1.5)  # further housekeeping rounds: the server lives on and answers (kept, as above)
    assert server.proc is not None and server.proc.poll() is None
    assert stats(client).workers.registered_instances == before.workers.registered_instances


# ---------------------------------------------------------------- the start-up sweep


def test_startup_sweep_removes_dead_owners_segments_only(
        tmp_path: Path, made: list[str], make_server) -> None:
    dead = create(made, segment_name(exited_pid()))
    live = create(made, segment_name(os.getpid()))
    foreign = create(made, f"otherapp-{exited_pid()}-{secrets.token_hex(4)}")
    other_user = create(made, segment_name(exited_pid()), uid=NOBODY if os.geteuid() == 0 else None)
    srv = make_server()
    assert not exists(dead)
    assert exists(live) and exists(foreign)
    assert exists(other_user) == (os.geteuid() == 0)
    # the sweep logs its line after removing the files
    wait_until(lambda: "shared-memory segment(s) of exited workers" in srv.log(),
               what=srv.log)


# ---------------------------------------------------------------- a server restart


def test_a_segment_its_worker_truncated_is_refused_not_a_crash(
        client: MessageQueueClient, server: ServerProcess, made: list[str]) -> None:
    """The worker owns its segment file and may shrink it: a copy through the old mapping would
    touch pages past its end (SIGBUS: the server and every worker's session gone). Stores and
    retrieves are refused with a typed error instead, and the server keeps serving."""
    name = create(made, segment_name(os.getpid()))
    instance_id = register(client, name, os.getpid())
    stored = secrets.token_bytes(32)
    assert client.request(m.StoreRequest(instance_id=instance_id, chunk_hashes=[stored],
                                         block_ids=blocks(0, 1))).stored == 1
    os.truncate(f"{SHM_DIR}/{name}", LAYER_BYTES // 2)
    with pytest.raises(IncompatibleError, match="shrank"):
        client.request(m.StoreRequest(instance_id=instance_id, chunk_hashes=[b"t" * 32],
                                      block_ids=blocks(1, 1)))
    with pytest.raises(IncompatibleError, match="shrank"):
        client.request(m.RetrieveRequest(instance_id=instance_id, chunk_hashes=[stored],
                                         block_ids=blocks(1, 1)))
    assert client.ping().pid == server.proc.pid and server.proc.poll() is None


def test_cpu_worker_stores_and_retrieves_again_after_a_server_restart(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path).start()
    worker = WorkerProcess(srv.url)  # heartbeat every second
    try:
        worker("fill", blocks=blocks(0, 2), seed=4)
        assert not worker("store", req="before", keys=tokens(2, 1), blocks=blocks(0, 2))["failed"]
        name = worker.hello["shm_name"]
        assert srv.stop() == 0  # SIGTERM
        assert exists(name)  # the worker lives: its name stays
        srv.start()  # same url; it has never heard of the worker (and swept nothing of it)
        assert exists(name)
        toks = tokens(2, 2)
        attempts = itertools.count()
        wait_until(lambda: not worker("store", req=f"after{next(attempts)}", keys=toks,
                                      blocks=blocks(0, 2))["failed"],
                   15, "the worker never registered again")
        want = worker("digest", blocks=blocks(0, 2))["digest"]
        worker("zero", blocks=blocks(2, 2))
        assert worker("digest", blocks=blocks(2, 2))["digest"] != want
        got = worker("retrieve", req="load", keys=toks, blocks=blocks(2, 2))
        assert got["finished"] and not got["failed"] and not got["load_errors"]
        assert worker("digest", blocks=blocks(2, 2))["digest"] == want  # byte-exact
    finally:
        worker.close()
        srv.kill()
    assert not exists(name)  # the worker unlinked it at exit
