"""BlockCopier.scatter_heads: chunks stored as head-range pieces by one TP size, read by another."""

from __future__ import annotations

import pytest
import torch

from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.kv import heads as heads_mod
from lmcache_core.kv.copy import BlockCopier
from lmcache_core.protocol.messages import KVLayoutName

L, NB, BS, D = 3, 24, 4, 8
CHUNK = 16  # tokens: 4 blocks per chunk
BPC = CHUNK // BS
STORE_IDS = [17, 3, 9, 4, 0, 23, 22, 1, 12, 5, 13, 6]  # 3 chunks, unsorted
LOAD_IDS = [2, 7, 8, 10, 11, 14, 15, 16, 18, 19, 20, 21]
FP8 = torch.float8_e4m3fn


def _data(heads: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes as KV data in the order [layers, planes, blocks, block_size, heads, dim]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (L, 2, NB, BS, heads, D * dtype.itemsize), generator=g,
                        dtype=torch.uint8)
    return raw.view(dtype)


def _cache(data: torch.Tensor, layout: KVLayoutName, lo: int, hi: int) -> list[torch.Tensor]:
    """Per-layer tensors of ``layout`` holding heads [lo, hi) of ``data``, in one storage."""
    part = data[:, :, :, :, lo:hi]
    if layout == "cpu_attn":  # vLLM's CPU tensors: [NB, heads, BS, 2 * D], K rows then V rows
        layers, _, nb, bs, heads, dim = part.shape
        blocks = part.permute(0, 2, 4, 1, 3, 5).contiguous()
        return list(blocks.view(layers, nb, heads, bs, 2 * dim).unbind(0))
    full = part.transpose(1, 2) if layout == "flashinfer" else part
    return list(full.contiguous().unbind(0))


def _copier(layers: list[torch.Tensor], layout: KVLayoutName, stacked: bool) -> BlockCopier:
    copier = BlockCopier(layers, layout, CHUNK, allow_stacked=stacked)
    assert copier.stacked is stacked
    return copier


def _store(data: torch.Tensor, layout: KVLayoutName, world: int, where: str,
           ) -> list[list[tuple[torch.Tensor, int, int]]]:
    """Pieces of the 3 chunks at STORE_IDS as TP size ``world`` stores them: one piece per rank.

    ``where``: "apart" (one storage per piece), "pool" (one storage, the ranks' pieces of a
    chunk at increasing addresses), "reversed" (one storage, decreasing addresses).
    """
    heads = data.shape[4]
    per = heads // world
    chunks: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in range(3)]
    pool = None
    for rank in range(world):
        lo, hi = rank * per, (rank + 1) * per
        copier = BlockCopier(_cache(data, layout, lo, hi), layout, CHUNK)
        n = copier.chunk_bytes
        if where == "apart":
            slots = [torch.full((n + 16,), 0xCD, dtype=torch.uint8)[:n] for _ in range(3)]
        else:
            if pool is None:
                pool = torch.full((3 * world * n,), 0xCD, dtype=torch.uint8)
            pos = [c * world + (rank if where == "pool" else world - 1 - rank) for c in range(3)]
            slots = [pool[p * n: (p + 1) * n] for p in pos]
        copier.gather(STORE_IDS, slots)
        for c in range(3):
            chunks[c].append((slots[c], lo, hi))
    return chunks


def _check(data: torch.Tensor, layout: KVLayoutName, layers: list[torch.Tensor],
           before: list[torch.Tensor], lo: int, hi: int) -> None:
    """Blocks LOAD_IDS of ``layers`` hold heads [lo, hi) of STORE_IDS of ``data``; the rest as
    ``before``."""
    want = _cache(data, layout, lo, hi)
    block_dim = 0 if layout in ("flashinfer", "cpu_attn") else 1
    src, dst = torch.tensor(STORE_IDS), torch.tensor(LOAD_IDS)
    other = torch.tensor(sorted(set(range(NB)) - set(LOAD_IDS)))
    for got, ref, old in zip(layers, want, before, strict=True):
        assert torch.equal(got.index_select(block_dim, dst).view(torch.uint8),
                           ref.index_select(block_dim, src).view(torch.uint8))
        assert torch.equal(got.index_select(block_dim, other).view(torch.uint8),
                           old.index_select(block_dim, other).view(torch.uint8))


def _blank(heads: int, dtype: torch.dtype, layout: KVLayoutName) -> list[torch.Tensor]:
    return _cache(_data(heads, dtype, seed=99), layout, 0, heads)


SCENARIOS = [(8, 2, 1), (8, 1, 2), (8, 2, 4), (8, 4, 1), (4, 2, 1), (4, 1, 4), (4, 4, 2)]


@pytest.mark.parametrize(("heads", "store_tp", "read_tp"), SCENARIOS)
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "cpu_attn"])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("where", ["apart", "pool", "reversed"])
def test_cross_tp_reads(heads: int, store_tp: int, read_tp: int, layout: KVLayoutName,
                        stacked: bool, dtype: torch.dtype, where: str) -> None:
    data = _data(heads, dtype)
    chunks = _store(data, layout, store_tp, where)
    per = heads // read_tp
    for rank in range(read_tp):
        lo, hi = rank * per, (rank + 1) * per
        layers = _blank(per, dtype, layout)
        before = [t.clone() for t in layers]
        _copier(layers, layout, stacked).scatter_heads(chunks, (lo, hi), LOAD_IDS)
        _check(data, layout, layers, before, lo, hi)


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "cpu_attn"])
@pytest.mark.parametrize("stacked", [True, False])
def test_staging_path(layout: KVLayoutName, stacked: bool) -> None:
    """The device path (pieces copied whole into a staging buffer first), forced on CPU."""
    data = _data(8, torch.bfloat16, seed=4)
    for store_tp, read_tp in ((2, 1), (4, 1), (1, 2), (2, 4), (1, 1)):
        chunks = _store(data, layout, store_tp, "reversed")
        per = 8 // read_tp
        for rank in range(read_tp):
            layers = _blank(per, torch.bfloat16, layout)
            before = [t.clone() for t in layers]
            copier = _copier(layers, layout, stacked)
            copier._heads = copier._head_copier()
            copier._heads._force_staging = True
            copier.scatter_heads(chunks, (rank * per, (rank + 1) * per), LOAD_IDS)
            _check(data, layout, layers, before, rank * per, (rank + 1) * per)


def test_overlapping_pieces_first_wins() -> None:
    layout: KVLayoutName = "flash_attn"
    a, b = _data(8, torch.bfloat16, seed=1), _data(8, torch.bfloat16, seed=2)
    full = _store(a, layout, 1, "apart")  # [0, 8) of a
    halves = _store(b, layout, 2, "apart")  # [0, 4), [4, 8) of b
    quarters = _store(b, layout, 4, "apart")  # [0, 2), [2, 4), ... of b
    mixed = a.clone()
    mixed[..., 4:, :] = b[..., 4:, :]
    split = a.clone()
    split[..., 2:4, :] = b[..., 2:4, :]
    cases = [
        ([[halves[c][1], full[c][0]] for c in range(3)], mixed),  # [4,8) of b, the rest of a
        ([[full[c][0], halves[c][1]] for c in range(3)], a),  # a covers all: b never read
        ([[quarters[c][1], full[c][0]] for c in range(3)], split),  # a, then b, then a again
    ]
    for stacked in (True, False):
        for chunks, want in cases:
            layers = _blank(8, torch.bfloat16, layout)
            before = [t.clone() for t in layers]
            _copier(layers, layout, stacked).scatter_heads(chunks, (0, 8), LOAD_IDS)
            _check(want, layout, layers, before, 0, 8)


def test_typed_slots_and_ids_tensor() -> None:
    data = _data(8, torch.bfloat16, seed=5)
    chunks = [[(s.view(torch.bfloat16), lo, hi) for s, lo, hi in pieces]
              for pieces in _store(data, "flash_attn", 2, "apart")]
    layers = _blank(4, torch.bfloat16, "flash_attn")
    before = [t.clone() for t in layers]
    BlockCopier(layers, "flash_attn", CHUNK).scatter_heads(chunks, (4, 8),
                                                           torch.tensor(LOAD_IDS))
    _check(data, "flash_attn", layers, before, 4, 8)


def test_non_contiguous_block_rows() -> None:
    """A head-major physical order ([NB, 2, H, BS, D] viewed as flashinfer) still copies right."""
    data = _data(8, torch.bfloat16, seed=6)
    chunks = _store(data, "flashinfer", 2, "pool")
    logical = _blank(8, torch.bfloat16, "flashinfer")
    physical = [t.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for t in logical]
    assert not physical[0].is_contiguous()
    before = [t.clone() for t in physical]
    for stacked in (True, False):
        BlockCopier(physical, "flashinfer", CHUNK, allow_stacked=stacked).scatter_heads(
            chunks, (0, 8), LOAD_IDS)
        _check(data, "flashinfer", physical, before, 0, 8)


def test_fused_runs() -> None:
    """Pieces at equally spaced increasing addresses of one storage become one copy."""
    data = _data(8, torch.bfloat16, seed=7)
    copier = BlockCopier(_blank(8, torch.bfloat16, "flash_attn"), "flash_attn", CHUNK)
    hc = copier._head_copier()
    for where, runs in (("pool", [4]), ("reversed", [1, 1, 1, 1]), ("apart", [1, 1, 1, 1])):
        pieces = _store(data, "flash_attn", 4, where)[0]
        segs = hc._resolve(pieces, 0, 0)
        assert [len(r) for r in heads_mod._runs(segs)] == runs


def test_gap_and_bad_ids_write_nothing() -> None:
    data = _data(8, torch.bfloat16, seed=8)
    quarters = _store(data, "flash_attn", 4, "apart")
    layers = _blank(8, torch.bfloat16, "flash_attn")
    before = [t.clone() for t in layers]
    copier = BlockCopier(layers, "flash_attn", CHUNK)
    gap = [quarters[0], quarters[1], [quarters[2][0], quarters[2][1], quarters[2][3]]]
    with pytest.raises(ProtocolError, match=r"chunk 2: no piece covers heads \[4, 6\)"):
        copier.scatter_heads(gap, (0, 8), LOAD_IDS)
    with pytest.raises(ProtocolError, match=r"no piece covers heads \[6, 8\)"):
        copier.scatter_heads([quarters[0][:3]], (0, 8), LOAD_IDS[:4])
    bad = [*LOAD_IDS[:-1], NB]  # the bad id is in the last chunk
    with pytest.raises(ProtocolError, match=f"block id {NB} is out of range"):
        copier.scatter_heads(quarters, (0, 8), bad)
    with pytest.raises(ProtocolError, match="3 chunks need 12 block ids"):
        copier.scatter_heads(quarters, (0, 8), LOAD_IDS[:8])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(layers, before, strict=True))


def test_piece_and_head_checks() -> None:
    data = _data(8, torch.bfloat16, seed=9)
    halves = _store(data, "flash_attn", 2, "apart")
    layers = _blank(8, torch.bfloat16, "flash_attn")
    before = [t.clone() for t in layers]
    copier = BlockCopier(layers, "flash_attn", CHUNK)
    need = copier.chunk_bytes // 2

    def with_first(slot: torch.Tensor) -> list[list[tuple[torch.Tensor, int, int]]]:
        return [[(slot, 0, 4), halves[0][1]], *halves[1:]]

    short = halves[0][0][0][: need - 1]
    with pytest.raises(IncompatibleError, match=f"smaller than a piece of 4 heads \\({need}"):
        copier.scatter_heads([*halves[:2], [(short, 0, 4), halves[2][1]]], (0, 8), LOAD_IDS)
    with pytest.raises(IncompatibleError, match="neither uint8 nor"):
        copier.scatter_heads(with_first(torch.empty(need, dtype=torch.float32)), (0, 8), LOAD_IDS)
    with pytest.raises(IncompatibleError, match="contiguous"):
        copier.scatter_heads(with_first(torch.empty(2, need, dtype=torch.uint8)[:, 0]), (0, 8),
                             LOAD_IDS)
    with pytest.raises(IncompatibleError, match="aligned"):
        copier.scatter_heads(with_first(torch.empty(need + 1, dtype=torch.uint8)[1:]), (0, 8),
                             LOAD_IDS)
    with pytest.raises(IncompatibleError, match=r"\[0, 4\) has 4 heads; this KV cache holds 8"):
        copier.scatter_heads(halves, (0, 4), LOAD_IDS)
    with pytest.raises(ProtocolError, match="bad piece head range"):
        copier.scatter_heads([[(halves[0][0][0], 4, 4)]], (0, 8), LOAD_IDS[:4])
    with pytest.raises(ProtocolError, match="must be a pair"):
        copier.scatter_heads(halves, 8, LOAD_IDS)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="must be"):
        copier.scatter_heads([[halves[0][0][0]]], (0, 8), LOAD_IDS[:4])  # type: ignore[list-item]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(layers, before, strict=True))
    copier.scatter_heads([], (0, 8), [])  # nothing to do


def test_mla_is_incompatible() -> None:
    layers = [torch.zeros(NB, BS, 16, dtype=torch.bfloat16) for _ in range(L)]
    copier = BlockCopier(layers, "mla", CHUNK)
    slot = torch.zeros(copier.chunk_bytes, dtype=torch.uint8)
    with pytest.raises(IncompatibleError, match="no head dim"):
        copier.scatter_heads([[(slot, 0, 1)]], (0, 1), [0, 1, 2, 3])


@pytest.mark.parametrize(("heads", "store_tp", "read_tp"), [(8, 2, 1), (8, 1, 2), (8, 2, 2)])
@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer", "cpu_attn"])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("staged", [False, True])
def test_partial_first_chunk_cross_tp(heads: int, store_tp: int, read_tp: int,
                                      layout: KVLayoutName, stacked: bool, staged: bool) -> None:
    """``skip_blocks`` through the head-range copies (fused runs, the exact-heads path, the
    device path's staging): the first chunk's leading blocks are not written, the rest are."""
    skip = BPC - 1
    data = _data(heads, torch.bfloat16, seed=31)
    chunks = _store(data, layout, store_tp, "pool")
    per = heads // read_tp
    load = [0] * skip + LOAD_IDS[skip:]  # block 0 stands for vLLM's null block
    for rank in range(read_tp):
        lo, hi = rank * per, (rank + 1) * per
        layers = _blank(per, torch.bfloat16, layout)
        before = [t.clone() for t in layers]
        copier = _copier(layers, layout, stacked)
        copier._heads = copier._head_copier()
        copier._heads._force_staging = staged
        copier.scatter_heads(chunks, (lo, hi), load, skip_blocks=skip)
        want = _cache(data, layout, lo, hi)
        block_dim = 0 if layout in ("flashinfer", "cpu_attn") else 1
        written = torch.tensor(LOAD_IDS[skip:])
        untouched = torch.tensor(sorted(set(range(NB)) - set(LOAD_IDS[skip:])))
        for got, ref, old in zip(layers, want, before, strict=True):
            assert torch.equal(got.index_select(block_dim, written).view(torch.uint8),
                               ref.index_select(block_dim, torch.tensor(STORE_IDS[skip:]))
                               .view(torch.uint8))
            assert torch.equal(got.index_select(block_dim, untouched).view(torch.uint8),
                               old.index_select(block_dim, untouched).view(torch.uint8))


def test_partial_cross_tp_checks_skip_before_writing() -> None:
    data = _data(8, torch.bfloat16, seed=32)
    chunks = _store(data, "flash_attn", 2, "apart")
    layers = _blank(8, torch.bfloat16, "flash_attn")
    before = [t.clone() for t in layers]
    with pytest.raises(ProtocolError, match=f"skip_blocks {BPC} must be in"):
        _copier(layers, "flash_attn", True).scatter_heads(chunks, (0, 8), LOAD_IDS,
                                                          skip_blocks=BPC)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # random bytes: NaNs too
               for a, b in zip(layers, before, strict=True))
