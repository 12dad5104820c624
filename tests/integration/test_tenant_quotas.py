"""Per-tenant (cache_salt) memory quotas through a real ``lmcache serve`` and the seed worker adapter
in a real worker process: a tenant flooding past its quota evicts only its own chunks, the other
tenant's stay, and what remains of both retrieves byte-exact. The figures follow (SERVER_INFO,
/metrics, ``lmcache inspect-chunks``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from typing import Any

import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

from lmcache_core.client.scheduler import LMCacheMPSchedulerAdapter
from lmcache_core.keys import tenant_tag
from tests.harness import lookup_result, wait_until
from tests.integration.chunks import BLOCK, CHUNK, PER_CHUNK, blocks, tokens
from tests.integration.cross_tp import HEADS, server_info
from tests.integration.servers import ServerProcess

PIECE = 2 * 2 * CHUNK * HEADS * 32 * 2  # layers x K/V x tokens x heads x dim x fp16


def lookup(url: str, request_id: str, toks: list[int], salt: str) -> int:
    """Hit tokens of a scheduler lookup of ``toks`` under ``salt`` (the chain's seed)."""
    adapter = LMCacheMPSchedulerAdapter(url, zmq.Context.instance(), "m", 1, 0, BLOCK)
    try:
        adapter.maybe_submit_lookup_request(request_id, toks, salt)  # type: ignore[arg-type]
        result = lookup_result(adapter, request_id)
        adapter.free_lookup_locks(request_id).result(5)  # locked pieces would not be evicted
        return result
    finally:
        adapter.close()


def inspect_chunks(url: str, *args: str) -> Any:
    """``lmcache inspect-chunks --url URL ARGS``: its JSON with --json, else its text."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    proc = subprocess.run([sys.executable, "-m", "lmcache_cli", "inspect-chunks", "--url", url,
                           *args], capture_output=True, text=True, timeout=60,
                          env={**env, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout) if "--json" in args else proc.stdout


def metrics(srv: ServerProcess) -> dict[tuple[str, str], float]:
    """The tenant gauges of /metrics: ``(name, tenant label) -> value``."""
    with urllib.request.urlopen(srv.http_url() + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(sample.name, sample.labels["tenant"]): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("lmcache_tenant_")}


def test_a_tenant_at_its_quota_evicts_only_its_own_chunks(tmp_path, make_server, make_worker):
    srv = make_server({"server": {"pool_size": "4MiB", "slab_size": "1MiB",
                                  "tenant_quotas": {"ops": {"salt": "small",
                                                            "size": 3 * PIECE}}}})
    # the ready panel (printed once the server answers)
    wait_until(lambda: "tenants     ops 384.0 KiB (server.tenant_quotas" in srv.log(), what=srv.log)
    worker = make_worker(srv.url, model="m", heads=HEADS, num_blocks=96)
    # (salt, seed, first chunk, chunks): each prompt's tokens and the blocks it is stored from
    big, small1, big2, small2, small3 = (("big", 71, 0, 4), ("small", 72, 4, 3), ("big", 73, 7, 2),
                                         ("small", 74, 9, 3), ("small", 75, 12, 5))
    worker("fill", blocks=blocks(0, 17), seed=7)
    for salt, seed, first, n in (big, small1):
        result = worker("store", req=f"s{seed}", keys=tokens(n, seed),
                        blocks=blocks(first, n), salt=salt)
        assert result["finished"] and not result["failed"], result
    assert lookup(srv.url, "l72", tokens(3, 72), "small") == 3 * CHUNK  # at its quota
    # One batch of both tenants: the adapter sends one store per tenant, each with its tag.
    result = worker("batch_store", reqs=["s73", "s74"],
                    keys=[tokens(2, 73), tokens(3, 74)],
                    blocks=[blocks(7, 2), blocks(9, 3)], salts=["big", "small"])
    assert result["finished"] and not result["failed"], result
    # The small tenant floods on: 5 chunks, past its quota in one store.
    result = worker("store", req="s75", keys=tokens(5, 75), blocks=blocks(12, 5),
                    salt="small")
    assert result["finished"] and not result["failed"], result

    hits = {seed: lookup(srv.url, f"h{seed}", tokens(n, seed), salt)
            for salt, seed, _, n in (big, small1, big2, small2, small3)}
    # big's chunks all stay; small's older prompts went to make room for its newer ones, and
    # the last store kept the head of its prompt (3 chunks: the quota), skipping 2.
    assert hits == {71: 4 * CHUNK, 72: 0, 73: 2 * CHUNK, 74: 0, 75: 3 * CHUNK}
    info = server_info(srv.url)
    assert (info.stats.engine.evictions, info.stats.engine.store_skipped_quota) == (6, 2)
    tenants = {row.tenant: row for row in info.tenants}
    small_row, big_row = tenants[tenant_tag("small")], tenants[tenant_tag("big")]
    assert (small_row.name, small_row.pieces, small_row.bytes_used, small_row.quota_bytes) == (
        "ops", 3, 3 * PIECE, 3 * PIECE)
    assert (big_row.name, big_row.pieces, big_row.bytes_used, big_row.quota_bytes) == (
        "", 6, 6 * PIECE, None)
    gauges = metrics(srv)
    assert gauges[("lmcache_tenant_used_bytes", "ops")] == 3 * PIECE
    assert gauges[("lmcache_tenant_quota_bytes", "ops")] == 3 * PIECE
    assert gauges[("lmcache_tenant_used_bytes", tenant_tag("big"))] == 6 * PIECE
    listing = inspect_chunks(srv.url, "--json")
    assert {(row["name"], row["pieces"]) for row in listing["tenants"]} == {("ops", 3),
                                                                            ("", 6)}
    table = inspect_chunks(srv.url)
    assert "tenants (cache_salt)" in table and tenant_tag("big") in table
    assert "ops" in table and "100%" in table  # the small tenant is at its quota
    # No salt is shown anywhere: configured tenants by their label, others by their tag.
    for shown in (msgspec.json.encode(info).decode(), table, json.dumps(listing),
                  json.dumps([list(k) for k in gauges])):
        assert "small" not in shown and "big" not in shown

    # What remains of both tenants retrieves byte-exact.
    target = blocks(17, 4)
    for salt, seed, first, n in (big, big2, (*small3[:3], 3)):
        want = worker("digest", blocks=blocks(first, n))["digest"]
        worker("zero", blocks=target)
        result = worker("retrieve", req=f"r{seed}", keys=tokens(n, seed),
                        blocks=target[:n * PER_CHUNK], salt=salt)
        assert result["finished"] and not result["failed"] and not result["load_errors"], result
        assert worker("digest", blocks=target[:n * PER_CHUNK])["digest"] == want
