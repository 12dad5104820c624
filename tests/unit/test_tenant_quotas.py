"""Per-tenant (cache_salt) memory quotas: the engine keeps each piece's tenant tag and its bytes per
tenant; a tenant at its quota evicts its own oldest pieces, never another tenant's; a piece under a
model quota too fits both; tier loads carry no tenant. Plus the wire field and the figures."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from lmcache_core.engine import CacheEngine, Retention
from lmcache_core.keys import ChunkKey, opaque_layout, tenant_tag
from lmcache_core.protocol import messages as m
from lmcache_core.server.listing import tenant_stats
from lmcache_core.storage.pool import MemoryPool
from tests.harness import FakeClock
from tests.unit.engines import SLOT, h, lookup

ALICE, BOB = tenant_tag("alice"), tenant_tag("bob")


def key(i: int, model: str = "a") -> ChunkKey:
    return ChunkKey(model, opaque_layout(1), 0, 1, h(i))


def make(slots: int = 16, quotas: dict[str, int] | None = None,
         tenant_quotas: dict[str, int] | None = None) -> CacheEngine:
    """An engine; ``tenant_quotas`` by salt, each labelled ``team-<salt>``."""
    tenants = {f"team-{salt}": (salt, size) for salt, size in (tenant_quotas or {}).items()}
    return CacheEngine(MemoryPool.slots(SLOT, slots, pin=False), chunk_size=16, clock=FakeClock(),
                       quotas=quotas, tenant_quotas=tenants)


def store(engine: CacheEngine, keys: Sequence[ChunkKey], tenant: str = "",
          nbytes: int = SLOT) -> m.StoreReply:
    plan = engine.store.begin_store(keys, nbytes, tenant=tenant)
    for _, k, view in plan.writes:
        view.fill_(k.chunk_hash[0])
    engine.store.finish_store(plan)
    return m.StoreReply(stored=plan.stored, already_present=plan.already_present,
                        skipped_full=plan.skipped_full, skipped_quota=plan.skipped_quota)


def resident(engine: CacheEngine, keys: Sequence[ChunkKey]) -> list[bool]:
    pieces = engine.store.inspect().pieces
    return [k in pieces for k in keys]


def figures(engine: CacheEngine) -> dict[str, tuple[str, int, int, int | None]]:
    return {row.tenant: (row.name, row.pieces, row.bytes_used, row.quota_bytes)
            for row in tenant_stats(engine)}


def tenant_bytes(engine: CacheEngine) -> dict[str, int]:
    """The resident bytes of each tenant tag (the quotas' own count)."""
    return {tag: nbytes for tag, (_, nbytes) in engine.store.inspect().tenants.items()}


def test_a_tenant_at_its_quota_evicts_its_own_oldest_pieces_only() -> None:
    engine = make(tenant_quotas={"alice": 3 * SLOT})
    bob = [key(i) for i in range(10, 12)]
    plain = [key(20)]
    store(engine, bob, BOB)  # the least recently used pieces of all
    store(engine, plain)
    alice = [key(i) for i in range(4)]
    for k in alice[:3]:
        assert store(engine, [k], ALICE).stored == 1
    assert engine.snapshot().engine.evictions == 0
    assert store(engine, [alice[3]], ALICE).stored == 1
    assert resident(engine, alice) == [False, True, True, True]
    assert resident(engine, bob + plain) == [True, True, True]  # other tenants', no tenant's
    assert engine.snapshot().engine.evictions == 1
    assert figures(engine) == {ALICE: ("team-alice", 3, 3 * SLOT, 3 * SLOT),
                               BOB: ("", 2, 2 * SLOT, None)}
    # bob has no quota: he stores on, past alice's figure
    assert store(engine, [key(i) for i in range(30, 35)], BOB).stored == 5
    assert figures(engine)[BOB][1:3] == (7, 7 * SLOT)


def test_a_store_of_many_pieces_over_the_tenant_quota_keeps_the_head() -> None:
    engine = make(tenant_quotas={"alice": 3 * SLOT})
    keys = [key(i) for i in range(5)]
    reply = store(engine, keys, ALICE)
    assert (reply.stored, reply.skipped_quota, reply.skipped_full) == (3, 2, 0)
    assert resident(engine, keys) == [True] * 3 + [False] * 2
    assert engine.snapshot().engine.evictions == 0


def test_over_quota_with_nothing_evictable_is_skipped_quota_and_evicts_nothing() -> None:
    engine = make(tenant_quotas={"alice": 2 * SLOT})
    alice = [key(i) for i in range(2)]
    bob = [key(10)]
    store(engine, bob, BOB)
    store(engine, alice, ALICE)
    assert lookup(engine, 1, [k.chunk_hash for k in alice], "held", model="a") == 2  # locked
    reply = store(engine, [key(5)], ALICE)
    assert (reply.stored, reply.skipped_quota, reply.skipped_full) == (0, 1, 0)
    assert engine.snapshot().engine.store_skipped_quota == 1
    assert engine.snapshot().engine.evictions == 0
    assert resident(engine, alice + bob) == [True, True, True]
    engine.store.free_lookup_locks("held")
    assert store(engine, [key(5)], ALICE).stored == 1  # now alice's oldest may go: the tail
    assert resident(engine, alice + bob + [key(5)]) == [True, False, True, True]


def test_pinned_pieces_of_a_tenant_stay_and_its_store_is_skipped() -> None:
    engine = make(tenant_quotas={"alice": SLOT})
    engine.store.finish_store(engine.store.begin_store([key(1)], SLOT, Retention(pin=True), tenant=ALICE))
    reply = store(engine, [key(2)], ALICE)
    assert (reply.stored, reply.skipped_quota) == (0, 1)
    assert engine.store.inspect().resident(key(1))


def test_model_and_tenant_quotas_are_both_honoured() -> None:
    engine = make(quotas={"a": 4 * SLOT}, tenant_quotas={"alice": 2 * SLOT})
    # The tenant's quota is the tighter: alice's third piece evicts alice's first.
    for i in range(3):
        assert store(engine, [key(i)], ALICE).stored == 1
    assert resident(engine, [key(0), key(1), key(2)]) == [False, True, True]
    # bob fills model a to its quota: 1A 2A 10B 11B, oldest first.
    for i in (10, 11):
        assert store(engine, [key(i)], BOB).stored == 1
    assert engine.snapshot().engine.evictions == 1
    # bob's next piece: the model's quota takes the model's oldest piece (alice's 1).
    assert store(engine, [key(12)], BOB).stored == 1
    assert resident(engine, [key(1), key(2), key(10), key(11), key(12)]) == [
        False, True, True, True, True]
    # alice under her quota, the model at its: the model's oldest goes (alice's 2, then bob's 10).
    assert store(engine, [key(3)], ALICE).stored == 1
    assert store(engine, [key(4)], ALICE).stored == 1
    assert resident(engine, [key(2), key(10), key(11), key(12), key(3), key(4)]) == [
        False, False, True, True, True, True]
    assert engine.snapshot().engine.evictions == 4
    # Both at their quota: alice's oldest (3) goes for her quota and counts for the model's too,
    # one eviction (the model's oldest, bob's 11, stays: never another tenant's for hers).
    assert store(engine, [key(5)], ALICE).stored == 1
    assert resident(engine, [key(11), key(12), key(3), key(4), key(5)]) == [
        True, True, False, True, True]
    assert engine.snapshot().engine.evictions == 5
    # bob's next piece: the model at its quota, its oldest is bob's 11.
    assert store(engine, [key(13)], BOB).stored == 1
    assert resident(engine, [key(11), key(12), key(13)]) == [False, True, True]
    assert lookup(engine, 1, [h(12), h(13)], "touch", lock=False, model="a") == 2
    # alice at her quota again: her oldest (4) goes, counting for both quotas.
    assert store(engine, [key(6)], ALICE).stored == 1
    assert resident(engine, [key(4), key(5), key(6), key(12), key(13)]) == [
        False, True, True, True, True]
    assert engine.snapshot().engine.evictions == 7
    assert engine.store.inspect().models["a"][1] == 4 * SLOT
    assert figures(engine)[ALICE][1:3] == (2, 2 * SLOT)
    assert engine.snapshot().engine.store_skipped_quota == 0


def test_a_tenant_quota_that_cannot_be_met_evicts_nothing_for_the_model_either() -> None:
    engine = make(quotas={"a": 3 * SLOT}, tenant_quotas={"alice": 2 * SLOT})
    bob = key(10)
    store(engine, [bob], BOB)
    alice = [key(1), key(2)]
    store(engine, alice, ALICE)
    assert lookup(engine, 1, [k.chunk_hash for k in alice], "held", model="a") == 2
    # model a is at its quota (bob's piece could go) but alice's own cannot: nothing goes.
    reply = store(engine, [key(3)], ALICE)
    assert (reply.stored, reply.skipped_quota) == (0, 1)
    assert resident(engine, [bob, *alice]) == [True, True, True]
    assert engine.snapshot().engine.evictions == 0


def test_tenant_bytes_return_to_zero_after_eviction_and_clear() -> None:
    engine = make(slots=4, tenant_quotas={"alice": 8 * SLOT})
    store(engine, [key(i) for i in range(2)], ALICE)
    store(engine, [key(i) for i in range(10, 12)], BOB)
    assert tenant_bytes(engine) == {ALICE: 2 * SLOT, BOB: 2 * SLOT}
    store(engine, [key(i) for i in range(20, 24)])  # no tenant: fills the pool, evicting all
    assert engine.snapshot().engine.evictions == 4
    assert engine.store.inspect().tenants == {}
    # listed at zero, by its label: the salt itself is in no figure
    assert figures(engine) == {ALICE: ("team-alice", 0, 0, 8 * SLOT)}
    store(engine, [key(30)], BOB)
    assert tenant_bytes(engine) == {BOB: SLOT}
    assert engine.store.clear(force=True) == (4, 0)
    assert tenant_bytes(engine) == {} and engine.snapshot().engine.bytes_used == 0


def test_tier_loads_are_untagged_and_only_the_model_quota_applies() -> None:
    engine = make(quotas={"a": 2 * SLOT}, tenant_quotas={"alice": SLOT})
    store(engine, [key(1)], ALICE)
    items = engine.store.reserve_loads([(key(2), SLOT), (key(3), SLOT)])
    # Both reserved: the second passes the model's quota (the first counts, being written), so
    # alice's piece went; the loads are no tenant's, so her quota had no say.
    assert [item[0] for item in items] == [key(2), key(3)]
    assert not engine.store.inspect().resident(key(1))
    engine.store.commit_loaded(items, [SLOT, SLOT])
    state = engine.store.inspect()
    assert [state.pieces[k].tenant for k in (key(2), key(3))] == ["", ""]
    assert state.tenants == {}


def test_store_request_tenant_is_a_bounded_hex_tag() -> None:
    base = {"instance_id": 1, "chunk_hashes": [], "block_ids": []}
    ok = msgspec.msgpack.decode(msgspec.msgpack.encode({**base, "tenant": ALICE}),
                                type=m.StoreRequest)
    assert ok.tenant == ALICE
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(base), type=m.StoreRequest).tenant == ""
    for bad in ("alice", "A" * 16, "0" * 33):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode({**base, "tenant": bad}),
                                   type=m.StoreRequest)


def test_stores_in_flight_at_once_count_against_the_quotas() -> None:
    """Two stores of one tenant (or one model) copying at once: the second sees the first's
    pieces being written, so together they stay within the quota."""
    engine = make(quotas={"b": 3 * SLOT}, tenant_quotas={"alice": 3 * SLOT})
    first = engine.store.begin_store([key(1), key(2)], SLOT, tenant=ALICE)
    second = engine.store.begin_store([key(3), key(4)], SLOT, tenant=ALICE)  # first still copying
    assert (len(first.writes), len(second.writes), second.skipped_quota) == (2, 1, 1)
    engine.store.finish_store(second)
    engine.store.finish_store(first)
    assert figures(engine)[ALICE][1:3] == (3, 3 * SLOT)
    other = [ChunkKey("b", opaque_layout(1), 0, 1, h(i)) for i in range(10, 14)]
    model_first = engine.store.begin_store(other[:2], SLOT)
    model_second = engine.store.begin_store(other[2:], SLOT)
    assert (len(model_first.writes), len(model_second.writes)) == (2, 1)
    engine.store.finish_store(model_first, ok=False)  # a failed store gives its share back
    engine.store.finish_store(model_second)
    state = engine.store.inspect()
    assert state.models["b"][1] == SLOT
    assert state.writing == {} and state.writing_models == {}
