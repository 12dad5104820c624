"""``server.http_url`` in the config, and the rates ``lmcache stats`` derives from two replies."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_cli.config_flags import config_flags, parse_sets
from lmcache_cli.stats import render, snapshot
from lmcache_core.config import load_config
from lmcache_core.errors import ConfigError
from lmcache_core.protocol import messages as m


def test_http_url_defaults_to_loopback_9464_and_off_disables_it(tmp_path: Path) -> None:
    assert load_config().server.http_address == ("127.0.0.1", 9464)
    yaml_off = tmp_path / "off.yaml"
    yaml_off.write_text("server:\n  http_url: off\n")  # YAML reads a bare off as false
    assert load_config(yaml_off).server.http_url == "off"
    assert load_config(yaml_off).server.http_address is None
    assert load_config(environ={"LMCACHE_SERVER_HTTP_URL": "off"}).server.http_address is None
    assert load_config(overrides=parse_sets(["server.http_url=off"])).server.http_address is None
    env = {"LMCACHE_SERVER_HTTP_URL": "http://0.0.0.0:0"}
    assert load_config(environ=env).server.http_address == ("0.0.0.0", 0)
    ipv6 = load_config(overrides={"server.http_url": "http://[::1]:9000/"})
    assert ipv6.server.http_address == ("::1", 9000)
    assert "--http-url" in {decl for flag in config_flags() for decl in flag.decls}


@pytest.mark.parametrize("bad", ["https://127.0.0.1:9464", "http://127.0.0.1", "127.0.0.1:9464",
                                 "http://127.0.0.1:70000", "http://127.0.0.1:9464/metrics",
                                 "http://user:pw@127.0.0.1:1", "http://[::1:5", True, "on"])
def test_a_bad_http_url_is_one_config_error_naming_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^defaults: server\.http_url: "):
        load_config(overrides={"server.http_url": bad})


def info(uptime_s: float, pid: int = 7, **stats: int) -> m.ServerInfoReply:
    return m.ServerInfoReply(version="v", url="tcp://x:1", pid=pid, chunk_size=256, uptime_s=uptime_s,
                             pool_bytes=1 << 30, slab_bytes=1 << 26, eviction="lru",
                             stats=m.ServerStats(pool_slabs=16, **stats), tiers=["remote"],
                             http_url="http://127.0.0.1:9464", models=[
                                 m.ModelStats(model_name="llama", pieces=3, bytes_used=3 << 20,
                                              layouts=["bfloat16:32x8x128"], quota_bytes=1 << 29,
                                              registered=2)])


def test_rates_are_counter_differences_over_the_servers_uptime() -> None:
    first = info(10.0, requests=100, lookups=10, lookup_hit_chunks=30, lookup_miss_chunks=10,
                 stored_bytes=0)
    second = info(12.0, requests=300, lookups=30, lookup_hit_chunks=60, lookup_miss_chunks=40,
                  stored_bytes=4 * 10**9, pool_bytes_allocated=1 << 28, pool_slabs_free=12,
                  store_skipped_quota=5, remote_down=1)
    snap = snapshot(second, first)
    assert snap["interval_s"] == 2.0
    assert snap["rates"]["requests_per_s"] == 100.0 and snap["rates"]["lookups_per_s"] == 10.0
    assert snap["rates"]["stored_bytes_per_s"] == 2e9
    assert snap["interval_hit_ratio"] == 0.5 and snap["hit_ratio"] == 0.6
    assert snap["pool"]["use"] == 0.25  # allocated bytes over the pool's bytes
    assert (snap["pool"]["slabs"], snap["pool"]["free_slabs"]) == (16, 12)
    assert snap["models"] == [{"model": "llama", "pieces": 3, "bytes_used": 3 << 20,
                               "layouts": ["bfloat16:32x8x128"], "quota_bytes": 1 << 29,
                               "registered": 2}]
    assert snap["tiers"] == {"remote": {"up": False, "queued": 0, "dropped_writes": 0,
                                        "failed_writes": 0, "errors": 0, "outages": 0}}
    assert snapshot(second)["rates"] is None
    assert snapshot(info(1.0, pid=8), second)["rates"] is None  # a restarted server: no rates
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "2.00 GB/s" in text and "DOWN" in text and "50.0%" in text and "60.0%" in text
    assert "256.0 MiB of 1.0 GiB allocated (25.0%)" in text and "12/16 slabs" in text
    assert "llama" in text and "bfloat16:32x8x128" in text and "512.0 MiB" in text
    assert "5 piece(s) not stored" in text
