"""The connector's scheduler side carries a request's kv_transfer_params hints (lmcache.ttl_s,
lmcache.pin, lmcache.priority) into the stores it sends the workers, and stores nothing for
lmcache.skip_store; the worker side turns them into the adapter's LoadStoreOps. Needs vLLM
importable, no engine, no server."""

from __future__ import annotations

import pickle
from typing import Any

from lmcache_core.integration.vllm import lmcache_connector as lc
from lmcache_core.keys import chain_hashes
from tests.vllm.connectors import (
    CHUNK,
    TOKENS,
    allocated_blocks,
    scheduler_output,
    vllm_request,
)


def _store_meta(connector: Any, req: Any) -> Any:
    assert connector.get_num_new_matched_tokens(req, 0) == (None, False)
    connector._scheduler.answers[req.request_id] = 0
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = list(range(10, 18))
    connector.update_state_after_alloc(req, allocated_blocks(blocks), 0)
    return connector.build_connector_meta(scheduler_output(new=[(req.request_id, blocks, 0)],
                                                  scheduled={req.request_id: len(TOKENS)}))


def test_hints_reach_the_stores(conn: Any) -> None:
    req = vllm_request("r", TOKENS, kv_transfer_params={
        "lmcache.pin": True, "lmcache.ttl_s": 120, "lmcache.priority": 3, "x": 1})
    (store,) = _store_meta(conn, req).stores
    assert store.chunk_hashes == chain_hashes(TOKENS, CHUNK)
    assert (store.ttl_s, store.pin, store.priority) == (120.0, True, 3)
    again = pickle.loads(pickle.dumps(store))
    assert (again.ttl_s, again.pin, again.priority) == (120.0, True, 3)


def test_bad_or_missing_hints_store_plainly(conn: Any) -> None:
    req = vllm_request("r", TOKENS, kv_transfer_params={"lmcache.pin": "yes",
                                                    "lmcache.priority": 1000})
    (store,) = _store_meta(conn, req).stores
    assert (store.ttl_s, store.pin, store.priority) == (None, False, 0)
    (plain,) = _store_meta(conn, vllm_request("q", TOKENS)).stores  # no kv_transfer_params at all
    assert (plain.ttl_s, plain.pin, plain.priority) == (None, False, 0)


def test_skip_store_stores_nothing(conn: Any) -> None:
    req = vllm_request("r", TOKENS, kv_transfer_params={"lmcache.skip_store": True})
    meta = _store_meta(conn, req)
    assert meta.stores == []
    assert conn.request_finished(req, list(range(10, 18))) == (False, None)


def test_the_worker_side_passes_the_hints_to_the_adapter() -> None:
    worker = object.__new__(lc.LMCacheConnector)
    worker._views = type("V", (), {"blocks_per_vllm_block": 1})()
    worker._bpc = 2
    spec = lc.TransferSpec("r", [b"h" * 32], [4, 5], ttl_s=9.0, pin=True, priority=-2)
    (op,) = worker._ops([spec])
    assert (op.ttl_s, op.pin, op.priority) == (9.0, True, -2) and op.block_ids == [4, 5]
    assert op.cache_salt is None
    (salted,) = worker._ops([lc.TransferSpec("s", [b"h" * 32], [4, 5], cache_salt="team-a")])
    assert salted.cache_salt == "team-a"  # the adapter sends its tenant tag with the store


def test_a_salted_requests_stores_carry_its_tenant(conn: Any) -> None:
    req = vllm_request("r", TOKENS)
    req.cache_salt = "team-a"
    (store,) = _store_meta(conn, req).stores
    assert store.cache_salt == "team-a"
    assert store.chunk_hashes != chain_hashes(TOKENS, CHUNK)  # salted chain, as before
    assert pickle.loads(pickle.dumps(store)).cache_salt == "team-a"
    (plain,) = _store_meta(conn, vllm_request("q", TOKENS)).stores
    assert plain.cache_salt is None
