"""What ``lmcache lookup --explain`` stands on, without a server: the engine's and the disk tier's
look-ups of a hash under every (model, layout) (touching nothing, bounded), the per-model counts
of tenants and of stores by hash mode, the adapters' hash mode, the CLI's seed (the connector's)
and its words for layouts and head ranges."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from lmcache_cli.lookup_explain import Asked, Probe, _gaps, explain, layout_difference, seed_parts
from lmcache_core.client.transfers import LoadStoreOp, store_hash_mode
from lmcache_core.engine import PLAIN, CacheEngine
from lmcache_core.integration.vllm.connector_requests import request_prefix
from lmcache_core.keys import ChunkKey, salted_prefix
from lmcache_core.protocol import explain_messages as em
from lmcache_core.server.explain import MAX_MODE_MODELS, StoreModes
from lmcache_core.storage.disk import DiskTier
from lmcache_core.storage.pool import MemoryPool
from tests.unit.engines import h

A, B = "float16:2x4x32", "bfloat16:2x4x32"
SLOT = 64


def stored(engine: CacheEngine, keys: list[ChunkKey], tenant: str = "") -> None:
    plan = engine.store.begin_store(keys, SLOT, PLAIN, tenant)
    engine.store.finish_store(plan)


def test_the_engine_finds_a_hash_under_every_model_and_layout_and_touches_nothing() -> None:
    engine = CacheEngine(MemoryPool.slots(SLOT, 16, pin=False), chunk_size=16)
    stored(engine, [ChunkKey("m", A, 0, 2, h(1))], tenant="aa")
    stored(engine, [ChunkKey("m", A, 2, 4, h(1)), ChunkKey("m", B, 0, 4, h(2))])
    stored(engine, [ChunkKey("/models/m", A, 0, 4, h(1))])
    before = [(key, p.hits) for key, p in engine.store.inspect().pieces.items()]

    finds = engine.holders([h(1), h(2), h(3)], "m", [], 1.0)
    assert (finds.cut, finds.remote) == (False, "")
    assert sorted((f.probe, f.model_name, f.layout, f.tier, f.ranges, f.tenants)
                  for f in finds.found) == [
        (0, "/models/m", A, "memory", ((0, 4),), ()),
        (0, "m", A, "memory", ((0, 2), (2, 4)), ("aa",)),
        (1, "m", B, "memory", ((0, 4),), ())]
    # no LRU move, no hit
    assert [(key, p.hits) for key, p in engine.store.inspect().pieces.items()] == before
    assert engine.snapshot().engine.lookups == 0
    assert engine.store.model_tenants("m") == (3, {"aa": 1})

    found, cut = engine.store.holders([h(1)], "/models/m", max_pairs=1)
    assert cut and [(f.model_name, f.layout) for f in found] == [("/models/m", A)]
    engine.store.clear(force=True)
    assert engine.store.model_tenants("m") == (0, {})
    assert engine.holders([h(1)], "m", [], 1.0).found == []


def test_the_disk_index_finds_a_hash_under_every_pair_across_writes_removes_and_a_restart(
        tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    payload = memoryview(bytes(SLOT))
    keys = [ChunkKey("m", A, 0, 2, h(1)), ChunkKey("m", A, 2, 4, h(1)),
            ChunkKey("other", B, 0, 4, h(1)), ChunkKey("m", A, 0, 4, h(2))]
    for key in keys:
        assert disk.write(key, payload)
    assert sorted(disk.pairs()) == [("m", A), ("other", B)]
    found, cut = disk.holders([h(1), h(2)], "other", max_pairs=8)
    assert not cut and found[0][1] == "other"
    assert sorted(found) == [(0, "m", A, [(0, 2), (2, 4)]), (0, "other", B, [(0, 4)]),
                             (1, "m", A, [(0, 4)])]
    assert disk.remove(keys[2]) and disk.pairs() == [("m", A)]
    again = DiskTier(tmp_path, 1 << 20)  # the scan rebuilds the pairs too
    assert again.pairs() == [("m", A)]
    assert again.holders([h(2)], "m", max_pairs=0) == ([], True)


def test_stores_are_counted_per_model_by_hash_mode_for_the_last_models_only() -> None:
    modes = StoreModes()
    modes.count("m", "vllm")
    modes.count("m", "vllm")
    modes.count("m", "")
    assert modes.of("m") == {"vllm": 2, "": 1} and modes.of("other") == {}
    for i in range(MAX_MODE_MODELS):
        modes.count(f"model-{i}", "tokens")
    assert modes.of("m") == {} and modes.of("model-0") == {"tokens": 1}


def test_the_adapters_tell_vllm_block_hashes_from_token_chains() -> None:
    assert store_hash_mode(LoadStoreOp([1, 2, 3], [])) == ""  # token ids
    # the connector's own chain at each chunk's last block (connector_metadata.per_block_hashes),
    # with one block a chunk too
    assert store_hash_mode(LoadStoreOp([b"", h(1), b"", h(2)], [], token_chain=True)) == ""
    assert store_hash_mode(LoadStoreOp([h(1), h(2)], [], token_chain=True)) == ""
    assert store_hash_mode(LoadStoreOp([h(1), h(2)], [])) == "vllm"
    assert store_hash_mode(LoadStoreOp([], [])) == ""


def test_the_cli_seeds_the_chain_as_the_vllm_connector_does() -> None:
    lora = SimpleNamespace(lora_name="sql#adapter", lora_int_id=7)
    for salt, request_lora in ((None, None), ("tenant-a", None), (None, lora), ("t", lora)):
        request = SimpleNamespace(cache_salt=salt, lora_request=request_lora)
        flag = None if request_lora is None else "sql#adapter#7"
        assert salted_prefix(seed_parts(salt, flag)) == request_prefix(request)  # type: ignore[arg-type]


def test_layout_differences_and_missing_heads_in_words() -> None:
    assert layout_difference(A, B) == "dtype bfloat16 vs float16"
    assert layout_difference(A, "float16:4x8x64") == "layers 4 vs 2, KV heads 8 vs 4, head size 64 vs 32"
    assert layout_difference(A, "float16:2xmla32") == "MLA vs not"
    assert layout_difference(A, "float16:2x4x32b16") == "CPU block order b16 vs token order"
    assert layout_difference(A, "float16:2x4x32+g0of2") == "hybrid group set +g0of2 vs none"
    assert _gaps([(0, 2)], (0, 4)) == [(2, 4)]
    assert _gaps([(0, 1), (3, 4)], (0, 4)) == [(1, 3)]
    assert _gaps([(0, 4)], (2, 4)) == [] and _gaps([], (0, 2)) == [(0, 2)]


def _miss(layout: str) -> dict[str, object]:
    return {"full_chunks": 4, "hit_chunks": 0, "memory_chunks": 0, "disk_chunks": 0,
            "remote_chunks": 0, "layout": layout, "groups": None}


def test_the_nearest_mismatch_of_a_hash_held_under_the_asked_model() -> None:
    """Rank 0 of TP=2 stored heads 0-2 in A. A lookup that named no layout tried every layout the
    server holds for the model: too few ranks, whatever layout its peek reported (the config's,
    B); one that named B alone (--layout) asked another layout."""
    probes = [Probe(h(1), 64, 0, True)]
    reply = em.ExplainReply(holders=[em.ProbeHolder(probe=0, model_name="m", layout=A,
                                                    tier="memory", heads=[(0, 2)])],
                            pieces=4, layouts=[A])
    tried = Asked("m", 1, B, False, 64, None, None)
    found = explain(tried, _miss(B), probes, reply)
    assert found["cause"] == "world_size" and "needs heads 2-4 too" in found["detail"], found
    exact = tried._replace(exact=True)
    found = explain(exact, _miss(B), probes, reply)
    assert found["cause"] == "layout" and "dtype float16 vs bfloat16" in found["detail"], found
    whole = em.ExplainReply(holders=[em.ProbeHolder(probe=0, model_name="m", layout=A,
                                                    tier="memory", heads=[(0, 4)])])
    found = explain(tried._replace(layout=A), _miss(A), probes, whole)
    assert found["cause"] is None and "did not count it" in found["detail"], found
