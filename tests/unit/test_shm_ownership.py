"""Whose shared memory the server maps and unlinks: names, pids (zombies too), uids, the sweep.

Real segments in /dev/shm and real child processes throughout; the uid cases chown a segment to
nobody (65534) and need root.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
from collections.abc import Iterator

import pytest

from lmcache_core.config import load_config
from lmcache_core.errors import ConfigError, IncompatibleError
from lmcache_core.kv.mapped import MappedKVCache
from lmcache_core.kv.share import new_segment_name
from lmcache_core.kv.shm import (
    SCOPE_ENV,
    SHM_DIR,
    SegmentOwner,
    SharedSegment,
    name_scope,
    parse_segment_name,
    pid_namespace,
    segment_scope,
)
from lmcache_core.kv.tensors import contiguous_stride
from lmcache_core.protocol import messages as m
from lmcache_core.server.registry import KVRegistry
from lmcache_core.server.segments import files_in_use, process_gone, sweep_stale_segments
from tests.harness import segment_name, wait_until
from tests.integration.servers import process_state

NOBODY = 65534
SHAPE = [2, 8, 16, 4, 32]  # flash_attn, float16: 64 KiB per layer
LAYER_BYTES = 2 * 8 * 16 * 4 * 32 * 2
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def exited_pid() -> int:
    """The pid of a child that has exited and been waited for."""
    child = subprocess.Popen(["true"])
    child.wait(10)
    return child.pid


def wait_state(pid: int, state: str, timeout_s: float = 10.0) -> None:
    wait_until(lambda: process_state(pid) == state, timeout_s,
               f"process {pid} never reached state {state}")


@pytest.fixture
def made() -> Iterator[list[str]]:
    """Names to remove after the test, whatever it left."""
    names: list[str] = []
    yield names
    for name in names:
        if os.path.lexists(f"{SHM_DIR}/{name}"):
            os.unlink(f"{SHM_DIR}/{name}")


def create(made: list[str], name: str, uid: int | None = None, nbytes: int = 2 * LAYER_BYTES
           ) -> SharedSegment:
    made.append(name)
    segment = SharedSegment.create(name, nbytes)
    if uid is not None:
        os.chown(f"{SHM_DIR}/{name}", uid, -1)
    return segment


# ---------------------------------------------------------------- names


def test_new_names_carry_pid_and_pid_namespace() -> None:
    for prefix in (None, "lmcache", "lmcache-vllm-kv", "lmcache-bench", "lmcache-a.b_c"):
        name = new_segment_name(prefix)
        assert parse_segment_name(name) == SegmentOwner(os.getpid(), pid_namespace()), name
    for bad in ("foo", "lmcachex", "lmcache-", "lmcache-a b", "LMCACHE-kv"):
        with pytest.raises(ValueError, match="does not give a name of the form"):
            new_segment_name(bad)


def test_parse_refuses_other_names() -> None:
    ns = pid_namespace()
    for name in ("otherapp-segment", f"lmcache-kv-12-{ns}", f"lmcache-kv-0-{ns}-aaaaaaaaaaaa",
                 f"lmcache-kv-{2**22 + 1}-{ns}-aaaaaaaaaaaa", f"xlmcache-kv-12-{ns}-aaaaaaaaaaaa",
                 f"lmcache-kv-12-{ns}-AAAAAAAAAAAA", f"lmcache-kv-012-{ns}-aaaaaaaaaaaa"):
        assert parse_segment_name(name) is None, name
    assert parse_segment_name(f"lmcache-1-{ns}-0123456789ab") == SegmentOwner(1, ns)


# ---------------------------------------------------------------- attach


def test_attach_refuses_a_foreign_name(made: list[str]) -> None:
    name = f"otherapp-segment-{secrets.token_hex(4)}"
    create(made, name)
    with pytest.raises(IncompatibleError, match="is not an lmcache segment"):
        SharedSegment.attach(name, owner_pid=os.getpid())


def test_attach_refuses_our_form_with_another_pid(made: list[str]) -> None:
    name = segment_name(exited_pid())
    create(made, name)
    with pytest.raises(IncompatibleError, match=r"was created by process \d+, not by the "
                                                f"registering process {os.getpid()}"):
        SharedSegment.attach(name, owner_pid=os.getpid())
    SharedSegment.attach(name, owner_pid=parse_segment_name(name).pid).close()  # type: ignore


@needs_root
def test_attach_refuses_another_users_segment_unless_allowed(made: list[str]) -> None:
    name = segment_name(os.getpid())
    create(made, name, uid=NOBODY)
    for owner_pid in (None, os.getpid()):
        with pytest.raises(IncompatibleError, match=f"is owned by uid {NOBODY}, not by this "
                                                    "server's uid 0"):
            SharedSegment.attach(name, owner_pid=owner_pid)
    SharedSegment.attach(name, owner_pid=os.getpid(), allowed_uids=[NOBODY]).close()


def test_mapped_kv_cache_passes_the_rules_on(made: list[str]) -> None:
    name = segment_name(exited_pid())
    create(made, name)
    descs = [m.TensorDescriptor(kind="shm", dtype="float16", shape=SHAPE,
                                stride=contiguous_stride(SHAPE), offset_bytes=i * LAYER_BYTES,
                                segment_nbytes=2 * LAYER_BYTES, shm_name=name) for i in range(2)]
    with pytest.raises(IncompatibleError, match="was created by process"):
        MappedKVCache.open(descs, "flash_attn", 16, 64, owner_pid=os.getpid())
    owner = parse_segment_name(name)
    assert owner is not None
    with MappedKVCache.open(descs, "flash_attn", 16, 64, owner_pid=owner.pid) as mapped:
        st = os.stat(f"{SHM_DIR}/{name}")
        assert [(f.name, f.ino, f.uid) for f in mapped.shm_files] == [(name, st.st_ino, st.st_uid)]


# ---------------------------------------------------------------- processes


def test_process_gone_sees_exited_zombie_and_live_processes() -> None:
    assert not process_gone(os.getpid())
    assert process_gone(exited_pid())
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_gone(child.pid)
        child.send_signal(signal.SIGKILL)  # not waited for: a zombie
        wait_state(child.pid, "Z")
        assert process_gone(child.pid)
    finally:
        child.kill()
        child.wait(10)
    for impossible in (0, -1, 2**22 + 1, 2**62):
        with pytest.raises(ValueError, match="is not a pid"):
            process_gone(impossible)


# ---------------------------------------------------------------- the start-up sweep


def test_sweep_removes_only_dead_owners_segments_of_allowed_uids(made: list[str]) -> None:
    dead, live = segment_name(exited_pid()), new_segment_name("lmcache-test")
    foreign = f"otherapp-{exited_pid()}-{secrets.token_hex(4)}"
    other_ns = segment_name(exited_pid(), ns=pid_namespace() + 1)  # that pid is not ours to judge
    for name in (dead, live, foreign, other_ns):
        create(made, name, nbytes=4096)
    swept = sweep_stale_segments()
    assert dead in swept and not os.path.exists(f"{SHM_DIR}/{dead}")
    for kept in (live, foreign, other_ns):
        assert kept not in swept and os.path.exists(f"{SHM_DIR}/{kept}"), kept


def test_sweep_takes_only_its_own_scopes_names(made: list[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs on one machine (two copies of the suite): a server sweeps only the dead owners'
    names of its own scope (``LMCACHE_SHM_SCOPE``), and an unscoped one only unscoped names."""
    ours = segment_name(exited_pid())  # this run's scope (tests/conftest.py)
    assert name_scope(ours) == segment_scope() != ""
    monkeypatch.setenv(SCOPE_ENV, "otherrun")
    theirs = segment_name(exited_pid())
    monkeypatch.delenv(SCOPE_ENV)
    unscoped = segment_name(exited_pid())
    assert (name_scope(theirs), name_scope(unscoped)) == ("otherrun", "")
    for name in (ours, theirs, unscoped):
        create(made, name, nbytes=4096).close()
    assert unscoped in sweep_stale_segments()  # unscoped: production's
    assert os.path.exists(f"{SHM_DIR}/{ours}") and os.path.exists(f"{SHM_DIR}/{theirs}")
    monkeypatch.setenv(SCOPE_ENV, "otherrun")
    assert sweep_stale_segments() == [theirs]
    assert os.path.exists(f"{SHM_DIR}/{ours}")
    monkeypatch.setenv(SCOPE_ENV, "no-dashes")
    with pytest.raises(ValueError, match="LMCACHE_SHM_SCOPE='no-dashes': a scope is"):
        new_segment_name()


def test_sweep_leaves_a_dead_owners_file_that_is_still_open_or_mapped(made: list[str]) -> None:
    """Abandoned means used by nobody: a file some process still maps (a server that registered
    it) or holds open stays, whatever its creator's pid says."""
    mapped, opened, free = (segment_name(exited_pid()) for _ in range(3))
    kept = create(made, mapped, nbytes=4096)  # this process maps it
    create(made, opened, nbytes=4096).close()
    create(made, free, nbytes=4096).close()
    with open(f"{SHM_DIR}/{opened}", "rb"):
        assert files_in_use({f"{SHM_DIR}/{n}" for n in (mapped, opened, free)}) == {
            f"{SHM_DIR}/{mapped}", f"{SHM_DIR}/{opened}"}
        swept = sweep_stale_segments()
    assert free in swept and mapped not in swept and opened not in swept
    assert os.path.exists(f"{SHM_DIR}/{mapped}") and os.path.exists(f"{SHM_DIR}/{opened}")
    kept.close()


@needs_root
def test_sweep_keeps_another_users_segment_unless_allowed(made: list[str]) -> None:
    name = segment_name(exited_pid())
    create(made, name, uid=NOBODY, nbytes=4096)
    assert name not in sweep_stale_segments()
    assert os.path.exists(f"{SHM_DIR}/{name}")
    assert name in sweep_stale_segments(allowed_uids=[NOBODY])
    assert not os.path.exists(f"{SHM_DIR}/{name}")


def test_sweep_logs_one_line_with_count_and_names(made: list[str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    names = [segment_name(exited_pid()) for _ in range(7)]
    for name in names:
        create(made, name, nbytes=4096)
    with caplog.at_level(logging.INFO, logger="lmcache_core.server.segments"):
        swept = sweep_stale_segments()
    assert set(names) <= set(swept)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"removed {len(swept)} shared-memory segment(s) of exited workers: ")
    assert line.endswith(f"(+{len(swept) - 5} more)")


# ---------------------------------------------------------------- the registry


def register(registry: KVRegistry, name: str, pid: int, instance_id: int) -> None:
    descs = [m.TensorDescriptor(kind="shm", dtype="float16", shape=SHAPE,
                                stride=contiguous_stride(SHAPE), offset_bytes=i * LAYER_BYTES,
                                segment_nbytes=2 * LAYER_BYTES, shm_name=name) for i in range(2)]
    registry.register(m.RegisterKVCacheRequest(
        instance_id=instance_id, model_name="tiny", world_size=1, kv_rank=0, block_size=16,
        layout="flash_attn", layers=descs, pid=pid, hostname=socket.gethostname()))


def open_mapping(request: m.RegisterKVCacheRequest) -> MappedKVCache:
    return MappedKVCache.open(request.layers, request.layout, request.block_size, 64)


def test_an_impossible_pid_never_stops_reaping_others(
        made: list[str], caplog: pytest.LogCaptureFixture) -> None:
    # The wire bounds pids now; the registry must not depend on it (os.kill(2**62, 0) raises
    # OverflowError, which used to end every housekeeping round from then on).
    registry = KVRegistry(open_mapping, reap_timeout_s=60)
    impossible, dead = segment_name(os.getpid()), segment_name(exited_pid())
    create(made, impossible)
    create(made, dead)
    register(registry, impossible, 2**62, 1)
    register(registry, dead, parse_segment_name(dead).pid, 2)  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="lmcache_core.server.registry"):
        assert registry.reap() == [2]
        assert registry.reap() == []
    assert len(registry) == 1
    assert not os.path.exists(f"{SHM_DIR}/{dead}")  # unlinked for the dead worker
    assert os.path.exists(f"{SHM_DIR}/{impossible}")
    checks = [r for r in caplog.records if "cannot check process" in r.getMessage()]
    assert len(checks) == 1  # logged once, not every round
    registry.close_all()


def test_reaper_unlinks_only_the_file_it_mapped(made: list[str]) -> None:
    registry = KVRegistry(open_mapping, reap_timeout_s=60)
    child = subprocess.Popen(["sleep", "30"])
    try:
        name = segment_name(child.pid)
        create(made, name)
        register(registry, name, child.pid, 3)
        os.unlink(f"{SHM_DIR}/{name}")  # someone else's file now stands under that name
        SharedSegment.create(name, 4096)
    finally:
        child.kill()
        child.wait(10)
    assert registry.reap() == [3]
    assert os.path.exists(f"{SHM_DIR}/{name}")


def test_a_silent_worker_that_lives_keeps_its_segment(made: list[str]) -> None:
    now = [0.0]
    registry = KVRegistry(open_mapping, reap_timeout_s=5, clock=lambda: now[0])
    name = new_segment_name("lmcache-test")
    create(made, name)
    register(registry, name, os.getpid(), 4)
    now[0] = 10.0
    assert registry.reap() == [4]  # silent: unmapped, but this process still owns the name
    assert os.path.exists(f"{SHM_DIR}/{name}")


# ---------------------------------------------------------------- config


def test_config_allowed_uids() -> None:
    assert load_config().server.allowed_uids == ()
    for given, uids in (([1000, 1001], (1000, 1001)), (1000, (1000,)), ("1000, 1001", (1000, 1001))):
        assert load_config(overrides={"server.shm_allowed_uids": given}).server.allowed_uids == uids
    env = {"LMCACHE_SERVER_SHM_ALLOWED_UIDS": "[7, 8]"}
    assert load_config(environ=env).server.allowed_uids == (7, 8)
    for bad in ("-1", "root", 2**32 - 1, [1, "x"]):
        with pytest.raises(ConfigError, match=r"server\.shm_allowed_uids"):
            load_config(overrides={"server.shm_allowed_uids": bad})


def test_layouts_follow_registrations(made: list[str]) -> None:
    """Every lookup asks the registered layouts (cached): a registration, an unregistration and a
    reap each show at once."""
    registry = KVRegistry(open_mapping, reap_timeout_s=60)
    live, dead = segment_name(os.getpid()), segment_name(exited_pid())
    create(made, live)
    create(made, dead)
    assert registry.layouts("tiny", 1) == []
    register(registry, live, os.getpid(), 1)
    (layout,) = registry.layouts("tiny", 1)
    assert registry.layouts("tiny", 2) == [] and registry.layouts("other", 1) == []
    registry.unregister(1)
    assert registry.layouts("tiny", 1) == []
    register(registry, dead, parse_segment_name(dead).pid, 2)  # type: ignore[union-attr]
    assert registry.layouts("tiny", 1) == [layout]
    assert registry.reap() == [2]
    assert registry.layouts("tiny", 1) == []
    registry.close_all()
