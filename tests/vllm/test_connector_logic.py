"""The connector's scheduler-side bookkeeping against vLLM's contract, with a fake server adapter.

Needs vLLM importable (for ``KVConnectorBase_V1`` and ``RequestStatus``) but no engine and no
server: fast checks of the paths an engine run rarely takes (trimmed loads, failed-load retries,
preemption, aborts while a load is pending, refusals).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from lmcache_core.integration.vllm import lmcache_connector as lc
from lmcache_core.integration.vllm.connector_log import LOGGER_NAME
from lmcache_core.keys import chain_hashes
from tests.harness import FakeClock
from tests.vllm.connectors import (
    BLOCK,
    CHUNK,
    TOKENS,
    FakeSchedulerAdapter,
    allocated_blocks,
    scheduler_connector,
    scheduler_output,
    vllm_configs,
    vllm_request,
)


def test_hit_is_loaded_then_only_new_chunks_are_stored(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", TOKENS)
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)  # lookup in flight
    assert sched.lookups["r"] == chain_hashes(TOKENS, CHUNK)
    sched.answers["r"] = 2 * CHUNK
    assert conn.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    blocks = list(range(10, 18))
    conn.update_state_after_alloc(req, allocated_blocks(blocks), 2 * CHUNK)
    meta = conn.build_connector_meta(scheduler_output())
    (load,) = meta.loads
    assert load.chunk_hashes == chain_hashes(TOKENS, CHUNK)[:2]
    assert load.block_ids == blocks[:4] and load.invalid_block_ids == []
    assert not meta.stores
    assert meta.idle  # nothing computed in this step: the worker may wait for the load
    # the load finished; vLLM schedules the rest of the prompt (512..1000)
    meta = conn.build_connector_meta(scheduler_output(new=[("r", blocks, 512)], scheduled={"r": 488}))
    assert not meta.idle
    (store,) = meta.stores
    assert store.chunk_hashes == chain_hashes(TOKENS, CHUNK)[2:3]  # chunk 2 only
    assert store.block_ids == blocks[4:6]
    assert conn.request_finished(req, blocks) == (True, None)
    assert sched.ended == ["r"]


def test_a_lookup_answered_within_the_steps_wait_loads_in_that_step(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    sched.arriving["r"] = 2 * CHUNK  # the server answers while the scheduler waits
    assert conn.get_num_new_matched_tokens(vllm_request("r", TOKENS), 0) == (2 * CHUNK, True)
    assert sched.waits == [("r", 2e-3)]  # timeouts.lookup_wait_us: 2000


def test_the_lookup_wait_is_one_budget_per_step_and_only_where_the_lookup_is_sent(
        conn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    clock = sched.clock = FakeClock(start=0.0)
    monkeypatch.setattr(conn, "_wait_clock", clock)
    sched.wait_takes_s = 0.0012  # no answer comes: each wait takes this long
    a, b, c = (vllm_request(r, TOKENS) for r in "abc")
    assert conn.get_num_new_matched_tokens(a, 0) == (None, False)
    assert conn.get_num_new_matched_tokens(b, 0) == (None, False)
    assert conn.get_num_new_matched_tokens(c, 0) == (None, False)
    # a waited 1.2 ms, b the 0.8 ms left, c not at all: the step waited 2 ms in all
    assert [r for r, _ in sched.waits] == ["a", "b"]
    assert sched.waits[1][1] == pytest.approx(0.0008)
    conn.build_connector_meta(scheduler_output())  # the next step: a fresh budget
    assert conn.get_num_new_matched_tokens(a, 0) == (None, False)  # asked again: no wait
    assert conn.get_num_new_matched_tokens(vllm_request("d", TOKENS), 0) == (None, False)
    assert [r for r, _ in sched.waits] == ["a", "b", "d"]
    assert sched.waits[2][1] == pytest.approx(0.002)


def test_lookup_wait_us_0_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = scheduler_connector(monkeypatch, lookup_wait_us=0)
    conn._scheduler.arriving["r"] = CHUNK
    assert conn.get_num_new_matched_tokens(vllm_request("r", TOKENS), 0) == (None, False)
    assert conn._scheduler.waits == []


def test_vllm_hit_inside_a_chunk_loads_nothing_and_frees_the_locks(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", TOKENS)
    sched.answers["r"] = 3 * CHUNK
    assert conn.get_num_new_matched_tokens(req, 384) == (0, False)
    conn.update_state_after_alloc(req, allocated_blocks(list(range(8))), 0)
    assert sched.freed == ["r"]
    assert not conn.build_connector_meta(scheduler_output()).loads
    # its chunks are on the server already: vLLM's computing them stores nothing again
    meta = conn.build_connector_meta(scheduler_output(new=[("r", list(range(8)), 384)], scheduled={"r": 616}))
    assert not meta.stores
    assert conn.request_finished(req, []) == (False, None)


def test_a_vllm_hit_of_every_whole_chunk_is_not_looked_up_nor_stored_again(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", TOKENS)  # 3 whole chunks and a tail
    assert conn.get_num_new_matched_tokens(req, 3 * CHUNK) == (0, False)
    assert "r" not in sched.lookups and sched.waits == []  # no round trip, no wait
    conn.update_state_after_alloc(req, allocated_blocks(list(range(8))), 0)
    meta = conn.build_connector_meta(scheduler_output(new=[("r", list(range(8)), 768)], scheduled={"r": 232}))
    assert not meta.loads and not meta.stores
    assert conn.request_finished(req, []) == (False, None)
    assert sched.ended == [] and sched.freed == []  # it locked nothing


def test_trimmed_external_tokens_report_the_unloadable_blocks(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", TOKENS)
    sched.answers["r"] = 3 * CHUNK
    assert conn.get_num_new_matched_tokens(req, 0) == (768, True)
    blocks = list(range(20, 28))
    conn.update_state_after_alloc(req, allocated_blocks(blocks), 640)  # vLLM took 640 of 768
    (load,) = conn.build_connector_meta(scheduler_output()).loads
    assert len(load.chunk_hashes) == 2 and load.block_ids == blocks[:4]
    assert load.invalid_block_ids == [blocks[4]]  # tokens 512..639


def test_failed_load_is_not_retried_and_is_stored_again(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", TOKENS)
    sched.answers["r"] = 2 * CHUNK
    assert conn.get_num_new_matched_tokens(req, 0) == (512, True)
    conn.update_state_after_alloc(req, allocated_blocks(list(range(8))), 512)
    assert conn.build_connector_meta(scheduler_output()).loads
    # the load failed: vLLM resets the request and asks again before it ever ran
    sched.answers.clear()
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "r" not in sched.lookups  # no second lookup
    meta = conn.build_connector_meta(scheduler_output(new=[("r", list(range(8)), 0)], scheduled={"r": 1000}))
    assert [len(s.chunk_hashes) for s in meta.stores] == [3]


def test_preempted_request_looks_up_afresh(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", TOKENS)
    sched.answers["r"] = 0
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, allocated_blocks(list(range(8))), 0)
    meta = conn.build_connector_meta(scheduler_output(new=[("r", list(range(8)), 0)], scheduled={"r": 1000}))
    assert len(meta.stores) == 1
    req.status = RequestStatus.PREEMPTED
    meta = conn.build_connector_meta(scheduler_output(preempted={"r"}))
    assert meta.preempted == {"r"}
    sched.answers["r"] = 3 * CHUNK
    assert conn.get_num_new_matched_tokens(req, 0) == (768, True)  # a new lookup, a new load
    conn.update_state_after_alloc(req, allocated_blocks(list(range(30, 38))), 768)
    (load,) = conn.build_connector_meta(scheduler_output()).loads
    assert load.block_ids == list(range(30, 36))
    # the stores sent before the preemption still hold the blocks when it finishes
    assert conn.request_finished(req, []) == (True, None)


def test_finished_while_its_load_is_pending_releases_it(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", TOKENS)
    sched.answers["r"] = 2 * CHUNK
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, allocated_blocks(list(range(8))), 512)
    assert conn.request_finished(req, []) == (False, None)
    (load,) = conn.build_connector_meta(scheduler_output()).loads
    assert (load.request_id, load.chunk_hashes, load.block_ids) == ("r", [], [])


def test_salted_lora_and_multimodal_requests(conn: Any) -> None:
    sched: FakeSchedulerAdapter = conn._scheduler
    plain = chain_hashes(TOKENS, CHUNK)
    conn.get_num_new_matched_tokens(vllm_request("s", TOKENS, **{}), 0)
    salted = vllm_request("t", TOKENS)
    salted.cache_salt = "tenant-1"
    conn.get_num_new_matched_tokens(salted, 0)
    lora = vllm_request("u", TOKENS)
    lora.lora_request = SimpleNamespace(lora_name="adapter", lora_int_id=1)
    conn.get_num_new_matched_tokens(lora, 0)
    assert sched.lookups["s"] == plain
    assert len({tuple(sched.lookups[r]) for r in "stu"}) == 3
    assert not set(plain) & (set(sched.lookups["t"]) | set(sched.lookups["u"]))
    mm = vllm_request("v", TOKENS)
    mm.mm_features = [object()]
    assert conn.get_num_new_matched_tokens(mm, 0) == (0, False)
    assert "v" not in sched.lookups
    assert conn.get_num_new_matched_tokens(vllm_request("w", TOKENS[:200]), 0) == (0, False)


def _spec(name: str, **fields: Any) -> Any:
    return SimpleNamespace(kv_cache_spec=type(name, (), {"block_size": BLOCK, **fields})(),
                           layer_names=[])


GEMMA3 = [_spec("SlidingWindowSpec", sliding_window=128), _spec("SlidingWindowSpec",
                                                                sliding_window=128),
          _spec("FullAttentionSpec")]  # vLLM's 3 groups for tiny_gemma3 (hma_facts)


@pytest.fixture
def hybrid(monkeypatch: pytest.MonkeyPatch) -> Any:
    return scheduler_connector(monkeypatch, GEMMA3)


def _group_blocks(*groups: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: tuple(list(g) for g in groups))


def test_hybrid_load_and_store_carry_each_groups_blocks(hybrid: Any) -> None:
    sched: FakeSchedulerAdapter = hybrid._scheduler
    req = vllm_request("r", TOKENS)
    sched.answers["r"] = 2 * CHUNK
    assert hybrid.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    # what vLLM 0.32 allocates for 512 external tokens (hma_facts.md): the sliding groups get the
    # null block before their window
    first = ([0, 0, 0, 30], [0, 0, 0, 2], [11, 5, 6, 9])
    hybrid.update_state_after_alloc(req, _group_blocks(*first), 2 * CHUNK)
    meta = hybrid.build_connector_meta(scheduler_output())
    (load,) = meta.loads
    assert load.block_ids == [] and load.group_block_ids == [list(g) for g in first]
    assert not load.fail and load.invalid_block_ids == []
    # after the load vLLM calls again with every block (the first call's and the new tail)
    full = ([0, 0, 0, 30, 10, 14, 8, 16], [0, 0, 0, 2, 24, 31, 32, 33],
            [11, 5, 6, 9, 34, 35, 36, 37])
    hybrid.update_state_after_alloc(req, _group_blocks(*full), 0)
    out = scheduler_output(scheduled={"r": 488})
    out.scheduled_new_reqs = [SimpleNamespace(req_id="r", block_ids=full, num_computed_tokens=512)]
    meta = hybrid.build_connector_meta(out)
    (store,) = meta.stores
    assert store.chunk_hashes == chain_hashes(TOKENS, CHUNK)[2:3]  # chunk 2 only
    assert store.group_block_ids == [[10, 14], [24, 31], [34, 35]] and store.block_ids == []
    assert meta.window_stores  # the worker waits for it before the next forward pass
    assert hybrid.request_finished_all_groups(req, full) == (True, None)
    assert sched.ended == ["r"]


def test_hybrid_decode_blocks_extend_every_group(hybrid: Any) -> None:
    req = vllm_request("r", TOKENS[:500])
    hybrid._scheduler.answers["r"] = 0
    hybrid.get_num_new_matched_tokens(req, 0)
    groups = ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    hybrid.update_state_after_alloc(req, _group_blocks(*groups), 0)
    out = scheduler_output(scheduled={"r": 500})
    out.scheduled_new_reqs = [SimpleNamespace(req_id="r", block_ids=groups, num_computed_tokens=0)]
    (store,) = hybrid.build_connector_meta(out).stores
    assert store.group_block_ids == [[1, 2], [5, 6], [9, 10]]
    req.all_token_ids = TOKENS[:800]
    out = scheduler_output(scheduled={"r": 300})
    out.scheduled_cached_reqs = SimpleNamespace(
        req_ids=["r"], resumed_req_ids=set(), num_computed_tokens=[500],
        new_block_ids=[([13, 14], [15, 16], [17, 18])])
    (store,) = hybrid.build_connector_meta(out).stores
    # chunks 1 and 2 (800 tokens computed): each group's old tail and the blocks just added
    assert store.group_block_ids == [[3, 4, 13, 14], [7, 8, 15, 16], [11, 12, 17, 18]]
    assert hybrid._trackers["r"].block_ids[2] == [9, 10, 11, 12, 17, 18]


def test_hybrid_trimmed_load_is_failed_per_request(hybrid: Any) -> None:
    """A hybrid model cannot report block-level load errors (vLLM raises RuntimeError): a load
    that vLLM trimmed to a partial chunk is reported failed as a whole."""
    req = vllm_request("r", TOKENS)
    hybrid._scheduler.answers["r"] = 3 * CHUNK
    assert hybrid.get_num_new_matched_tokens(req, 0) == (768, True)
    ids = list(range(1, 7))
    hybrid.update_state_after_alloc(req, _group_blocks(ids, ids, ids), 640)
    (load,) = hybrid.build_connector_meta(scheduler_output()).loads
    assert load.fail and load.invalid_block_ids == []


def test_hits_are_attributed_to_host_memory(hybrid: Any) -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert hybrid.get_external_cache_hit_sources(vllm_request("r", TOKENS), 512) == {
        CacheHitSource.HOST: 512}


def test_unknown_specs_and_mamba_without_state_checkpoints_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lc, "LMCacheMPSchedulerAdapter", FakeSchedulerAdapter)
    for group, why in ((_spec("EncoderOnlyAttentionSpec"),
                        "EncoderOnlyAttentionSpec\\): not a KV cache spec the connector knows"),
                       (_spec("MambaSpec", mamba_cache_mode="none"),
                        "MambaSpec\\) with mamba_cache_mode='none'")):
        vllm_config, kv_cache_config = vllm_configs([_spec("FullAttentionSpec"), group])
        with pytest.raises(ValueError, match=f"group 1 \\({why}"):
            lc.LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_chunked_local_attention_is_a_local_group_of_its_attention_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 4: its chunked-local layers' group is stored as kind "local", its attention chunk
    size the group's window; its stores go out in the step that computes them (vLLM frees the
    blocks before the attention chunk being computed); a load names its first chunk."""
    monkeypatch.setattr(lc, "LMCacheMPSchedulerAdapter", FakeSchedulerAdapter)
    vllm_config, kv_cache_config = vllm_configs([
        _spec("FullAttentionSpec"), _spec("ChunkedLocalAttentionSpec", attention_chunk_size=512)])
    conn = lc.LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert [(g.kind, g.window_tokens) for g in conn._groups] == [("full", 0), ("local", 512)]
    req = vllm_request("r", TOKENS[:600])
    conn._scheduler.answers["r"] = 0
    conn.get_num_new_matched_tokens(req, 0)
    groups = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    conn.update_state_after_alloc(req, _group_blocks(*groups), 0)
    out = scheduler_output(scheduled={"r": 600})
    out.scheduled_new_reqs = [SimpleNamespace(req_id="r", block_ids=groups, num_computed_tokens=0)]
    meta = conn.build_connector_meta(out)
    (store,) = meta.stores
    assert store.group_block_ids == [[1, 2, 3, 4], [6, 7, 8, 9]] and meta.window_stores
    assert store.first_chunk == 0
    # after vLLM's own hit of chunk 0, a load of chunks 1-2: what it needs of the local group
    # (from 512) depends on where it ends in the request, which the worker side reads from it
    later = vllm_request("q", TOKENS)
    conn._scheduler.answers["q"] = 3 * CHUNK
    assert conn.get_num_new_matched_tokens(later, CHUNK) == (2 * CHUNK, True)
    conn.update_state_after_alloc(later, _group_blocks([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 7, 8]),
                                  2 * CHUNK)
    (load,) = conn.build_connector_meta(scheduler_output()).loads
    assert load.first_chunk == 1 and load.group_block_ids == [[3, 4, 5, 6], [0, 0, 7, 8]]


def test_mamba_states_are_stored_for_prompt_chunks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's align mode (hma_facts.md): one live state block, at the current position."""
    monkeypatch.setattr(lc, "LMCacheMPSchedulerAdapter", FakeSchedulerAdapter)
    vllm_config, kv_cache_config = vllm_configs([_spec("MambaSpec", mamba_cache_mode="align"),
                                            _spec("FullAttentionSpec")])
    conn = lc.LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    req = vllm_request("r", TOKENS[:600])
    conn._scheduler.answers["r"] = 0
    conn.get_num_new_matched_tokens(req, 0)
    groups = ([0, 0, 0, 7, 8], [1, 2, 3, 4, 5])
    conn.update_state_after_alloc(req, _group_blocks(*groups), 0)
    out = scheduler_output(scheduled={"r": 600})
    out.scheduled_new_reqs = [SimpleNamespace(req_id="r", block_ids=groups, num_computed_tokens=0)]
    meta = conn.build_connector_meta(out)
    (store,) = meta.stores
    assert store.group_block_ids == [[0, 0, 0, 7], [1, 2, 3, 4]] and meta.window_stores
    req.all_token_ids = TOKENS[:800]  # decode crossed chunk 2's end (768): its state is not stored
    out = scheduler_output(scheduled={"r": 1})
    out.scheduled_cached_reqs = SimpleNamespace(
        req_ids=["r"], resumed_req_ids=set(), num_computed_tokens=[767],
        new_block_ids=[([9], [6])])
    (store,) = conn.build_connector_meta(out).stores
    assert store.group_block_ids == [[0, 0], [5, 6]]


def test_metadata_is_picklable() -> None:
    # Not our wire: vLLM's multiprocess executor pickles SchedulerOutput (and so this metadata) to
    # hand it from its scheduler to its workers; the metadata must survive that. lmcache's own
    # sockets carry msgspec only.
    import pickle

    meta = lc.LMCacheConnectorMetadata()
    meta.loads.append(lc.TransferSpec("r", [b"h" * 32], [1, 2], [3]))
    meta.preempted.add("q")
    again = pickle.loads(pickle.dumps(meta))
    assert again.loads == meta.loads and again.preempted == {"q"}


def test_min_hit_tokens_reaches_the_scheduler_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector hands min_hit_tokens (extra config) to the adapter, and each check the
    tokens vLLM already computed, so the adapter declines loads by what they would bring."""
    monkeypatch.setattr(lc, "LMCacheMPSchedulerAdapter", FakeSchedulerAdapter)
    vllm_config, kv_cache_config = vllm_configs()
    vllm_config.kv_transfer_config.kv_connector_extra_config["min_hit_tokens"] = 512
    connector = lc.LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    sched: FakeSchedulerAdapter = connector._scheduler
    assert sched.kwargs["min_hit_tokens"] == 512
    connector.get_num_new_matched_tokens(vllm_request("m", TOKENS), CHUNK)
    assert sched.computed["m"] == CHUNK


# ------------------------------------------------------------------ what newer vLLMs changed


def test_a_decode_block_of_a_vllm_without_resumed_req_ids_is_appended(conn: Any) -> None:
    """vLLM 0.34's ``CachedRequestData`` has no ``resumed_req_ids`` (a resumed request comes in
    ``scheduled_new_reqs``): the blocks of a running request are appended, and the chunk the
    decode completes is stored from them."""
    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", TOKENS)
    sched.answers["r"] = 0
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, allocated_blocks(list(range(8))), 0)
    conn.build_connector_meta(scheduler_output(new=[("r", list(range(8)), 0)], scheduled={"r": 1000}))
    req.all_token_ids = TOKENS + list(range(30))  # decoded past 1024: a 9th block
    out = scheduler_output(cached=[("r", [50], 1023)], scheduled={"r": 1})
    del out.scheduled_cached_reqs.resumed_req_ids
    (store,) = conn.build_connector_meta(out).stores
    assert store.block_ids == [6, 7] and store.chunk_hashes == chain_hashes(req.all_token_ids,
                                                                             CHUNK)[3:4]
    assert conn._trackers["r"].block_ids == [[*range(8), 50]]


def test_token_ids_in_an_int32_array_hash_as_a_list(conn: Any) -> None:
    """vLLM 0.34 keeps a request's tokens in a ``TokenBuffer`` (an ``array('i')``)."""
    from array import array

    sched: FakeSchedulerAdapter = conn._scheduler
    req = vllm_request("r", [])
    req.all_token_ids = array("i", TOKENS)
    conn.get_num_new_matched_tokens(req, 0)
    assert sched.lookups["r"] == chain_hashes(TOKENS, CHUNK)


def test_may_load_async_says_yes_for_a_hit_only(conn: Any) -> None:
    """vLLM 0.34's ``may_load_async`` (with ``--max-num-inflight-kv-loads``): the lookup goes out
    when the request is queued and is waited for within the step's budget; a hit says yes, a
    miss, an answer still out, a prompt without a whole chunk or an uncacheable request no. The
    lookup is not sent again when the request is scheduled."""
    sched: FakeSchedulerAdapter = conn._scheduler
    sched.arriving["hit"] = 2 * CHUNK
    assert conn.may_load_async(vllm_request("hit", TOKENS)) is True
    sched.arriving["miss"] = 0
    assert conn.may_load_async(vllm_request("miss", TOKENS)) is False
    assert conn.may_load_async(vllm_request("out", TOKENS)) is False  # no answer within the budget
    assert conn.may_load_async(vllm_request("short", TOKENS[:CHUNK - 1])) is False
    image = vllm_request("mm", TOKENS)
    image.mm_features = ["image"]
    assert conn.may_load_async(image) is False
    assert sorted(sched.lookups) == ["hit", "miss", "out"]
    sent = [r for r, _ in sched.waits]
    assert conn.get_num_new_matched_tokens(vllm_request("hit", TOKENS), 0) == (2 * CHUNK, True)
    assert [r for r, _ in sched.waits] == sent  # answered: no second wait, no second lookup


@pytest.fixture
def connector_records(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for the connector's logger, a child of vLLM's, which does not propagate to the root
    logger caplog listens on."""
    connector_logger = logging.getLogger(LOGGER_NAME)
    propagates = connector_logger.propagate
    connector_logger.addHandler(caplog.handler)
    connector_logger.propagate = False  # each record once, whether vLLM's logger is set up or not
    try:
        yield caplog
    finally:
        connector_logger.removeHandler(caplog.handler)
        connector_logger.propagate = propagates


def test_the_connector_logs_where_vllm_logs() -> None:
    """Under vLLM's logger, whose handler and level vLLM sets when it runs an engine."""
    vllm_logger = logging.getLogger("vllm")  # (made now if vLLM has not set up its logging yet)
    assert logging.getLogger(LOGGER_NAME).parent is vllm_logger


def test_an_untested_vllm_gets_one_warning_at_start(
        monkeypatch: pytest.MonkeyPatch, connector_records: pytest.LogCaptureFixture) -> None:
    caplog = connector_records
    monkeypatch.setattr(lc, "LMCacheMPSchedulerAdapter", FakeSchedulerAdapter)
    monkeypatch.setattr(lc.vllm, "__version__", "0.31.2")
    with caplog.at_level("WARNING"):
        lc.LMCacheConnector(*vllm_configs()[:1], KVConnectorRole.SCHEDULER, vllm_configs()[1])
    (record,) = [r for r in caplog.records if "outside the range" in r.getMessage()]
    assert "vLLM 0.31.2" in record.getMessage() and "0.32 to 0.34" in record.getMessage()
    caplog.clear()
    monkeypatch.setattr(lc.vllm, "__version__", "0.34.1")
    with caplog.at_level("WARNING"):
        lc.LMCacheConnector(*vllm_configs()[:1], KVConnectorRole.SCHEDULER, vllm_configs()[1])
    assert not [r for r in caplog.records if "outside the range" in r.getMessage()]


# ------------------------------------------------------------------ synchronous loads


def _busy(conn: Any) -> None:
    """A step that computed tokens: the engine is busy."""
    conn.build_connector_meta(scheduler_output(scheduled={"other": 1}))


def test_a_hit_loads_in_its_step_while_the_engine_is_busy_and_async_when_idle(conn: Any) -> None:
    """sync_loads "auto": a hit admitted while the engine computes is loaded before the forward
    pass of the step that admits it (vLLM told the load is synchronous); on an idle engine it
    loads asynchronously."""
    sched: FakeSchedulerAdapter = conn._scheduler
    sched.answers["idle"] = sched.answers["busy"] = 2 * CHUNK
    assert conn.get_num_new_matched_tokens(vllm_request("idle", TOKENS), 0) == (2 * CHUNK, True)
    _busy(conn)
    busy = vllm_request("busy", TOKENS)
    assert conn.get_num_new_matched_tokens(busy, 0) == (2 * CHUNK, False)
    conn.update_state_after_alloc(busy, allocated_blocks(list(range(8))), 2 * CHUNK)
    (load,) = conn.build_connector_meta(scheduler_output(new=[("busy", list(range(8)), 2 * CHUNK)],
                                                scheduled={"busy": 488})).loads
    assert load.sync and load.block_ids == list(range(4))


def test_may_load_async_keeps_its_word_on_a_busy_engine(conn: Any) -> None:
    """A request vLLM queued for an async load (may_load_async said yes) gets one."""
    sched: FakeSchedulerAdapter = conn._scheduler
    sched.arriving["r"] = 2 * CHUNK
    req = vllm_request("r", TOKENS)
    assert conn.may_load_async(req)
    _busy(conn)
    assert conn.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)


@pytest.mark.parametrize(("mode", "idle", "busy"), [("always", False, False),
                                                    ("never", True, True)])
def test_sync_loads_always_and_never(monkeypatch: pytest.MonkeyPatch, mode: str, idle: bool,
                                     busy: bool) -> None:
    conn = scheduler_connector(monkeypatch, sync_loads=mode)
    conn._scheduler.answers["a"] = conn._scheduler.answers["b"] = CHUNK
    assert conn.get_num_new_matched_tokens(vllm_request("a", TOKENS), 0) == (CHUNK, idle)
    _busy(conn)
    assert conn.get_num_new_matched_tokens(vllm_request("b", TOKENS), 0) == (CHUNK, busy)


def test_a_bad_sync_loads_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="sync_loads='sometimes': expected one of auto, always"):
        scheduler_connector(monkeypatch, sync_loads="sometimes")


def test_a_hybrid_model_always_loads_asynchronously(hybrid: Any) -> None:
    """vLLM takes a failed load of several KV cache groups only per request, from an async one."""
    hybrid._scheduler.answers["r"] = 2 * CHUNK
    _busy(hybrid)
    assert hybrid.get_num_new_matched_tokens(vllm_request("r", TOKENS), 0) == (2 * CHUNK, True)
