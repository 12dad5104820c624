"""``lmcache stats`` against a real ``lmcache serve``: JSON snapshots, the live view, exit codes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from lmcache_core.transport.client import MessageQueueClient
from tests.integration.chunks import CHUNK, CHUNK_BYTES
from tests.integration.cli import assert_no_torch, cli
from tests.integration.servers import ServerProcess, WorkerProcess


def test_json_is_one_snapshot_of_a_server_that_stored_and_looked_up(
        server: ServerProcess, make_worker: Callable[..., WorkerProcess]) -> None:
    worker = make_worker(server.url)
    toks = list(range(2 * CHUNK))
    worker("fill", blocks=list(range(8)), seed=1)
    assert worker("store", req="s", keys=toks, blocks=list(range(8)))["finished"]
    result = cli("stats", "--url", server.url, "--json", importtime=True)
    assert result.code == 0, result.err
    assert_no_torch(result)
    lines = result.out.splitlines()
    assert len(lines) == 1
    snap = result.json()
    assert snap["url"] == server.url and snap["http_url"] == server.http_url()
    assert snap["workers"]["registered"] == 1
    assert snap["counters"]["stored_chunks"] >= 2 and snap["counters"]["stored_bytes"] >= 2 * CHUNK_BYTES
    pool = snap["pool"]
    assert pool["pieces"] >= 2 and 0 < pool["use"] <= 1
    assert pool["bytes"] == 8 * 2**20 and (pool["slab_bytes"], pool["slabs"]) == (2 * 2**20, 4)
    assert 2 * CHUNK_BYTES <= pool["used_bytes"] <= pool["allocated_bytes"] <= pool["bytes"]
    [model] = snap["models"]
    assert (model["model"], model["registered"]) == ("tiny", 1)
    assert model["layouts"] == ["float16:2x4x32"] and model["bytes_used"] == pool["used_bytes"]
    assert snap["rates"] is None and snap["interval_s"] is None  # one reply: no rates yet
    assert snap["tiers"] == {}
    # Every figure of every section by its flat name, those of sections not configured as zeros.
    from lmcache_core.stats import ServerStats, flat_all

    assert set(snap["counters"]) == set(flat_all(ServerStats()))
    assert snap["counters"]["disk_written_chunks"] == 0 and snap["counters"]["events_batches"] == 0


def test_json_with_count_gives_rates_from_the_second_line(server: ServerProcess) -> None:
    stop = threading.Event()

    def keep_pinging() -> None:
        with MessageQueueClient(server.url) as client:
            while not stop.is_set():
                client.wait_until_reachable(5)

    pinger = threading.Thread(target=keep_pinging)
    pinger.start()
    try:
        result = cli("stats", "--url", server.url, "--json", "--count", "3", "--interval", "0.2")
    finally:
        stop.set()
        pinger.join(10)
    assert result.code == 0, result.err
    import json

    snaps = [json.loads(line) for line in result.out.splitlines()]
    assert len(snaps) == 3 and snaps[0]["rates"] is None
    for snap in snaps[1:]:
        assert 0.1 < snap["interval_s"] < 1.0
        assert snap["rates"]["requests_per_s"] > 0  # the pings
        assert snap["rates"]["stores_per_s"] == 0


def test_live_view_refreshes_count_times_and_exits_0(server: ServerProcess) -> None:
    result = cli("stats", "--url", server.url, "--count", "2", "--interval", "0.1", importtime=True)
    assert result.code == 0, result.err
    assert_no_torch(result)
    for text in ("lmcache stats", server.url, "requests", "hit ratio", "GB/s", "pool", "workers",
                 "memory only", "rates over the last interval", server.http_url() + "/metrics"):
        assert text in result.out, result.out


def test_no_server_is_exit_1_and_bad_usage_exit_2(tmp_path: Path) -> None:
    result = cli("stats", "--url", f"ipc://{tmp_path}/none.sock", "--json",
                 env={"LMCACHE_TIMEOUTS_CONNECT_S": "0.5"})
    assert result.code == 1
    assert "no lmcache server answered" in result.one_error_line()
    assert cli("stats", "--interval", "0").code == 2
    assert cli("stats", "--count", "0").code == 2
    helped = cli("stats", "--help")
    assert helped.code == 0 and "Example" in helped.out


def test_tenants_pins_and_integrity_are_shown(
        server: ServerProcess, make_worker: Callable[..., WorkerProcess]) -> None:
    worker = make_worker(server.url)
    toks = list(range(5000, 5000 + 2 * CHUNK))
    worker("fill", blocks=list(range(8)), seed=3)
    assert worker("store", req="t", keys=toks, blocks=list(range(8)), salt="acme",
                  pin=True)["finished"]
    snap = cli("stats", "--url", server.url, "--json").json()
    view = cli("stats", "--url", server.url, "--count", "1")
    from lmcache_core.keys import tenant_tag

    [tenant] = [t for t in snap["tenants"] if t["tenant"] == tenant_tag("acme")]
    assert tenant["pieces"] == 2 and tenant["bytes_used"] >= 2 * CHUNK_BYTES
    assert tenant["name"] == "" and tenant["quota_bytes"] is None  # not in server.tenant_quotas
    assert snap["pins"]["pieces"] >= 2 and snap["pins"]["bytes"] >= 2 * CHUNK_BYTES
    assert snap["integrity"] == {"failures": 0, "verified_chunks": 0}
    assert view.code == 0, view.err
    for text in ("pins", "pinned", "integrity", "corrupt", tenant_tag("acme")):
        assert text in view.out, view.out
