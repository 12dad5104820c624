"""``server.http_url`` in the config, and the rates ``lmcache stats`` derives from two replies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest

from lmcache_cli.config_flags import config_flags, parse_sets
from lmcache_cli.stats import render, snapshot
from lmcache_core.config import load_config
from lmcache_core.errors import ConfigError
from lmcache_core.protocol import messages as m
from lmcache_core.stats import DiskStats, EngineStats, RemoteStats, TransportStats, counter


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


def info(uptime_s: float, pid: int = 7, remote: RemoteStats | None = None,
         **engine: int) -> m.ServerInfoReply:
    transport = TransportStats(requests=engine.pop("requests", 0))
    stats = m.ServerStats(engine=EngineStats(pool_slabs=16, **engine), transport=transport,
                          remote=remote or RemoteStats())
    return m.ServerInfoReply(version="v", url="tcp://x:1", pid=pid, chunk_size=256, uptime_s=uptime_s,
                             pool_bytes=1 << 30, slab_bytes=1 << 26, eviction="lru",
                             stats=stats, tiers=["remote"],
                             http_url="http://127.0.0.1:9464", models=[
                                 m.ModelStats(model_name="llama", pieces=3, bytes_used=3 << 20,
                                              layouts=["bfloat16:32x8x128"], quota_bytes=1 << 29,
                                              registered=2)])


def test_rates_are_counter_differences_over_the_servers_uptime() -> None:
    first = info(10.0, requests=100, lookups=10, lookup_hit_chunks=30, lookup_miss_chunks=10,
                 stored_bytes=0)
    second = info(12.0, requests=300, lookups=30, lookup_hit_chunks=60, lookup_miss_chunks=40,
                  stored_bytes=4 * 10**9, pool_bytes_allocated=1 << 28, pool_slabs_free=12,
                  store_skipped_quota=5, remote=RemoteStats(up=0))
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


# ---------------------------------------------------------------- the stats schema


def test_every_field_of_every_section_is_declared_with_a_prometheus_name() -> None:
    from lmcache_core.stats import declared, sections

    families: dict[str, str] = {}
    for name, struct in sections():
        for figure in declared(struct):  # raises for a field declared neither counter nor gauge
            assert figure.help.endswith(".") and figure.kind in ("counter", "gauge"), figure
            assert not figure.metric.endswith("_total") and figure.metric.islower(), figure
            if figure.metric.endswith("bytes") or figure.field.endswith("bytes"):
                assert figure.metric.endswith("_bytes"), figure  # base units in the name
            if figure.total_of or figure.tier:
                continue
            where = f"stats.{name}.{figure.field}"
            assert families.setdefault(figure.family, where) == where, "two fields, one family"


def test_a_field_undeclared_is_refused() -> None:
    from lmcache_core.stats import Stats, declared

    class Undeclared(Stats):
        plain: int = 0

    with pytest.raises(TypeError, match=r"Undeclared\.plain is declared neither counter nor gauge"):
        declared(Undeclared)


def test_a_new_field_reaches_server_info_lmcache_stats_and_metrics_with_no_other_edit() -> None:
    """What adding one line to a section does: the field travels in SERVER_INFO, ``lmcache stats``
    prints it, ``/metrics`` exports it (``schema_families`` reads the struct's declarations)."""
    import msgspec

    from lmcache_core.server.metrics import schema_families

    class NewDiskStats(DiskStats):
        fsyncs: Annotated[int, counter("Files synced.", "disk_fsyncs")] = 0

    sent = info(1.0)
    sent.stats.disk = NewDiskStats(fsyncs=7, loaded_chunks=2)
    wire = msgspec.msgpack.encode(sent)
    assert msgspec.msgpack.decode(wire)["stats"]["disk"]["fsyncs"] == 7
    assert snapshot(sent)["counters"]["disk_fsyncs"] == 7
    samples = {(family.name, tuple(s.labels.items())): s.value
               for family in schema_families(sent.stats) for s in family.samples}
    assert samples[("lmcache_disk_fsyncs", ())] == 7
    assert samples[("lmcache_tier_read_chunks", (("tier", "disk"),))] == 2
    assert samples[("lmcache_tier_read_chunks", (("tier", "remote"),))] == 0


def test_docs_metrics_md_is_generated_from_the_schema_and_up_to_date() -> None:
    from lmcache_core.server.metrics import markdown
    from lmcache_core.stats import declared, sections

    text = markdown()
    for name, struct in sections():
        for figure in declared(struct):
            assert f"`stats.{name}.{figure.field}`" in text and figure.family in text, figure
    path = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    assert path.read_text() == text, (
        "docs/metrics.md is stale: python -m lmcache_core.server.metrics --markdown > docs/metrics.md")
