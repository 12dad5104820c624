"""BlockCopier: gather/scatter of blocks <-> chunk slots for every layout, byte-exact."""

from __future__ import annotations

import pytest
import torch

from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.kv.copy import BlockCopier, stack_layers
from lmcache_core.protocol.messages import KVLayoutName

L, NB, BS, H, D = 3, 24, 4, 2, 8
CHUNK = 16  # tokens: 4 blocks per chunk
BPC = CHUNK // BS


def _canonical(num_layers: int = L, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
               planes: int = 2, width: int = H * D) -> torch.Tensor:
    """Random KV data in a neutral order [layers, planes, blocks, block_size, width]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_layers, planes, NB, BS, width, generator=g).to(dtype)


def _layers(layout: KVLayoutName, data: torch.Tensor, one_storage: bool) -> list[torch.Tensor]:
    """Per-layer tensors of ``layout`` holding ``data``, in one storage or one per layer."""
    n = data.shape[0]
    if layout == "flash_attn":
        full = data.reshape(n, 2, NB, BS, H, D)
    elif layout == "flashinfer":
        full = data.reshape(n, 2, NB, BS, H, D).transpose(1, 2)
    elif layout == "cpu_attn":  # [NB, H, BS, 2 * D]: a (block, head) run is K rows then V rows
        full = data.reshape(n, 2, NB, BS, H, D).permute(0, 2, 4, 1, 3, 5).reshape(n, NB, H, BS, 2 * D)
    else:
        full = data.reshape(n, NB, BS, -1)
    full = full.contiguous()
    if one_storage:
        return list(full.unbind(0))
    return [full[i].clone() for i in range(n)]


def _slots(copier: BlockCopier, n: int, fill: int = 0xAB, extra: int = 8) -> list[torch.Tensor]:
    return [torch.full((copier.chunk_bytes + extra,), fill, dtype=torch.uint8) for _ in range(n)]


def _ids(seed: int, n_chunks: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NB, generator=g)[: n_chunks * BPC].tolist()


LAYOUTS: list[KVLayoutName] = ["flash_attn", "flashinfer", "mla", "cpu_attn"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("one_storage", [True, False])
def test_gather_scatter_round_trip(layout: KVLayoutName, dtype: torch.dtype,
                                   one_storage: bool) -> None:
    planes = 1 if layout == "mla" else 2
    width = 24 if layout == "mla" else H * D
    src = _layers(layout, _canonical(dtype=dtype, planes=planes, width=width), one_storage)
    gather = BlockCopier(src, layout, CHUNK)
    assert gather.stacked is one_storage
    assert gather.chunk_bytes == L * planes * CHUNK * width * dtype.itemsize
    assert gather.blocks_per_chunk == BPC and gather.num_blocks == NB
    ids = [17, 3, 9, 4, 0, 23, 22, 1, 12, 5, 13, 6]  # non-contiguous, unsorted
    slots = _slots(gather, 3)
    gather.gather(ids, slots)
    for s in slots:
        assert s[gather.chunk_bytes:].eq(0xAB).all()  # nothing past the chunk written

    dst = [torch.zeros_like(t) for t in src]
    scatter = BlockCopier(dst, layout, CHUNK)
    scatter.scatter(slots, ids)
    block_dim = 1 if layout == "flash_attn" else 0
    touched = torch.zeros(NB, dtype=torch.bool)
    touched[ids] = True
    for s_layer, d_layer in zip(src, dst, strict=True):
        a = s_layer.index_select(block_dim, torch.tensor(ids))
        b = d_layer.index_select(block_dim, torch.tensor(ids))
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # byte-exact
        rest = d_layer.index_select(block_dim, torch.nonzero(~touched).flatten())
        assert not rest.any()  # other blocks untouched


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slot_is_canonical_order(layout: KVLayoutName) -> None:
    planes = 1 if layout == "mla" else 2
    data = _canonical(planes=planes, width=H * D)
    copier = BlockCopier(_layers(layout, data, True), layout, CHUNK)
    ids = [5, 2, 2, 7]  # a repeated id is fine for a gather
    slot = _slots(copier, 1)[0]
    copier.gather(ids, [slot])
    got = slot[: copier.chunk_bytes].view(torch.bfloat16)
    if layout == "cpu_attn":  # the engine's block order: [layers, blocks, H, 2 * BS, D]
        want = torch.stack(_layers(layout, data, True))[:, ids].reshape(-1)
    else:
        want = data[:, :, ids].reshape(-1)
    assert torch.equal(got, want)


def test_flash_attn_and_flashinfer_give_identical_slots() -> None:
    data = _canonical(seed=3)
    ids = _ids(4, 5)
    out = {}
    for layout in ("flash_attn", "flashinfer"):
        for one_storage in (True, False):
            c = BlockCopier(_layers(layout, data, one_storage), layout, CHUNK)
            slots = _slots(c, 5)
            c.gather(ids, slots)
            out[(layout, one_storage)] = torch.cat(slots)
    first = next(iter(out.values()))
    assert all(torch.equal(first, v) for v in out.values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stacked_and_per_layer_paths_agree(layout: KVLayoutName) -> None:
    data = _canonical(seed=5, planes=1 if layout == "mla" else 2)
    layers = _layers(layout, data, True)
    fast = BlockCopier(layers, layout, CHUNK)
    slow = BlockCopier(layers, layout, CHUNK, allow_stacked=False)
    assert fast.stacked and not slow.stacked
    ids = _ids(6, 4)
    a, b = _slots(fast, 4), _slots(slow, 4)
    fast.gather(ids, a)
    slow.gather(ids, b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # and back: scatter the same slots through both paths into fresh caches
    da = _layers(layout, torch.zeros_like(data), True)
    db = _layers(layout, torch.zeros_like(data), True)
    BlockCopier(da, layout, CHUNK).scatter(a, ids)
    BlockCopier(db, layout, CHUNK, allow_stacked=False).scatter(b, ids)
    assert all(torch.equal(x, y) for x, y in zip(da, db, strict=True))


def test_non_contiguous_block_rows() -> None:
    """A head-major physical order ([NB, 2, H, BS, D] viewed as flashinfer) still copies right."""
    data = _canonical(seed=8)
    logical = _layers("flashinfer", data, True)
    physical = [t.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for t in logical]
    assert not physical[0].is_contiguous()
    ids = _ids(9, 2)
    a = BlockCopier(logical, "flashinfer", CHUNK)
    b = BlockCopier(physical, "flashinfer", CHUNK)
    sa, sb = _slots(a, 2), _slots(b, 2)
    a.gather(ids, sa)
    b.gather(ids, sb)
    assert all(torch.equal(x, y) for x, y in zip(sa, sb, strict=True))
    zeros = [torch.zeros_like(t) for t in physical]
    BlockCopier(zeros, "flashinfer", CHUNK).scatter(sb, ids)
    idx = torch.tensor(ids)
    for z, p in zip(zeros, physical, strict=True):
        assert torch.equal(z.index_select(0, idx), p.index_select(0, idx))


@pytest.mark.parametrize("bad", [NB, -1, 10**6])
def test_out_of_range_block_id_writes_nothing(bad: int) -> None:
    data = _canonical(seed=1)
    layers = _layers("flash_attn", data, True)
    before = [t.clone() for t in layers]
    copier = BlockCopier(layers, "flash_attn", CHUNK)
    ids = [1, 2, 3, 4, 5, 6, 7, bad]  # the bad id is in the last chunk
    slots = _slots(copier, 2)
    with pytest.raises(ProtocolError, match=f"block id {bad} is out of range"):
        copier.gather(ids, slots)
    assert all(s.eq(0xAB).all() for s in slots)
    good = _slots(copier, 2, fill=1)
    with pytest.raises(ProtocolError, match="out of range"):
        copier.scatter(good, ids)
    assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))


@pytest.mark.parametrize("spacing", [1, 3])
def test_cpu_attn_scatters_by_memmove_and_checks_everything_first(spacing: int) -> None:
    """vLLM's CPU tensors (``cpu_attn``) scatter by one memmove per block and layer, addressed
    from pointers (``_BlockRuns``): also for layers spaced apart in one storage (a hybrid
    group's every third layer); bad ids, slots or skips raise before anything is written."""
    data = _canonical(num_layers=L * spacing, seed=8)
    every = _layers("cpu_attn", data, True)
    layers = every[::spacing]
    copier = BlockCopier(layers, "cpu_attn", CHUNK)
    assert copier.stacked and copier._runs is not None
    ids, load = _ids(9, 3), _ids(10, 3)
    slots = _slots(copier, 3)
    copier.gather(ids, slots)
    before = [t.clone() for t in every]
    for bad_ids, match in (([*load[:-1], NB], "out of range"), (load[:-1], "need 12 block ids"),
                           ([float(b) for b in load], "integers")):
        with pytest.raises(ProtocolError, match=match):
            copier.scatter(slots, bad_ids)  # type: ignore[arg-type]
    with pytest.raises(IncompatibleError, match="smaller than one chunk"):
        copier.scatter([*slots[:2], slots[2][:-9]], load)
    with pytest.raises(ProtocolError, match="skip_blocks"):
        copier.scatter(slots, load, skip_blocks=BPC)
    assert all(torch.equal(a, b) for a, b in zip(every, before, strict=True))
    copier.scatter(slots, torch.tensor(load), skip_blocks=1)
    with pytest.raises(IncompatibleError, match="not contiguous"):  # refused when registered
        BlockCopier([t.transpose(1, 2).contiguous().transpose(1, 2) for t in layers], "cpu_attn",
                    CHUNK)
    written = torch.tensor(load[1:])
    for i, layer in enumerate(every):
        want = before[i].clone()
        if i % spacing == 0:
            want[written] = before[i][torch.tensor(ids[1:])]
        assert torch.equal(layer, want)  # the others, and the skipped block, untouched


def test_block_id_count_checked() -> None:
    copier = BlockCopier(_layers("mla", _canonical(planes=1), True), "mla", CHUNK)
    with pytest.raises(ProtocolError, match="2 chunks need 8 block ids"):
        copier.gather([1, 2, 3], _slots(copier, 2))
    with pytest.raises(ProtocolError, match="integers"):
        copier.gather(["a", "b", "c", "d"], _slots(copier, 1))  # type: ignore[list-item]
    copier.gather([], [])  # nothing to do
    copier.gather(torch.tensor([3, 2, 1, 0]), _slots(copier, 1))  # a tensor of ids works too


def test_slot_checks() -> None:
    copier = BlockCopier(_layers("flash_attn", _canonical(), True), "flash_attn", CHUNK)
    ids = [0, 1, 2, 3]
    with pytest.raises(IncompatibleError, match="smaller than one chunk"):
        copier.gather(ids, [torch.empty(copier.chunk_bytes - 1, dtype=torch.uint8)])
    with pytest.raises(IncompatibleError, match="neither uint8 nor"):
        copier.gather(ids, [torch.empty(copier.chunk_bytes, dtype=torch.float32)])
    with pytest.raises(IncompatibleError, match="contiguous"):
        copier.gather(ids, [torch.empty(2, copier.chunk_bytes, dtype=torch.uint8)[:, 0]])
    with pytest.raises(IncompatibleError, match="aligned"):
        copier.gather(ids, [torch.empty(copier.chunk_bytes + 1, dtype=torch.uint8)[1:]])
    typed = torch.empty(copier.chunk_bytes // 2, dtype=torch.bfloat16)  # the KV dtype is fine
    copier.gather(ids, [typed])
    raw = torch.empty(copier.chunk_bytes, dtype=torch.uint8)
    copier.gather(ids, [raw])
    assert torch.equal(raw, typed.view(torch.uint8))


def test_layer_and_chunk_checks() -> None:
    layers = _layers("flash_attn", _canonical(), False)
    with pytest.raises(IncompatibleError, match=r"chunk size 18 .* block size 4"):
        BlockCopier(layers, "flash_attn", 18)
    with pytest.raises(IncompatibleError, match="layer 1"):
        BlockCopier([layers[0], layers[1].float()], "flash_attn", CHUNK)
    with pytest.raises(ProtocolError, match="no KV cache layers"):
        BlockCopier([], "flash_attn", CHUNK)
    with pytest.raises(IncompatibleError, match="does not fit layout"):
        BlockCopier(layers, "mla", CHUNK)


def test_stack_layers_rules() -> None:
    base = torch.zeros(4, 2, 3)
    assert stack_layers(list(base.unbind(0))) is not None
    assert stack_layers([base[0], base[2], base[1]]) is None  # unequal steps
    assert stack_layers([base[0], base[0]]) is None  # same memory twice
    assert stack_layers([base[0], torch.zeros(2, 3)]) is None  # two storages
    single = stack_layers([base[1]])
    assert single is not None and single.shape == (1, 2, 3)
    spaced = torch.zeros(4, 10)[:, :6].reshape(4, 2, 3)  # a gap after each layer is fine
    stacked = stack_layers(list(spaced.unbind(0)))
    assert stacked is not None and stacked.stride()[0] == 10


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("one_storage", [True, False])
def test_wide_copies_are_bit_exact_on_arbitrary_bytes(layout: KVLayoutName,
                                                      one_storage: bool) -> None:
    """Scatters reinterpret rows as 16-byte elements; any bit pattern (NaNs too) survives."""
    planes = 1 if layout == "mla" else 2
    g = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (L, planes, NB, BS, H * D * 2), generator=g, dtype=torch.uint8)
    data = raw.view(torch.bfloat16)
    src = _layers(layout, data, one_storage)
    wide = BlockCopier(src, layout, CHUNK)
    narrow = BlockCopier(src, layout, CHUNK, allow_wide=False)
    assert wide.scatter_dtype == torch.complex128 and narrow.scatter_dtype == torch.bfloat16
    ids = _ids(12, 3)
    a, b = _slots(wide, 3), _slots(narrow, 3)
    wide.gather(ids, a)
    narrow.gather(ids, b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for allow_wide in (True, False):
        dst = [torch.zeros_like(t) for t in src]
        BlockCopier(dst, layout, CHUNK, allow_wide=allow_wide).scatter(a, ids)
        block_dim = 1 if layout == "flash_attn" else 0
        idx = torch.tensor(ids)
        for s_layer, d_layer in zip(src, dst, strict=True):
            assert torch.equal(s_layer.index_select(block_dim, idx).view(torch.uint8),
                               d_layer.index_select(block_dim, idx).view(torch.uint8))


def test_slot_not_aligned_for_wide_copies_falls_back() -> None:
    data = _canonical(seed=13)
    copier = BlockCopier(_layers("flash_attn", data, True), "flash_attn", CHUNK)
    ids = _ids(14, 1)
    pool = torch.zeros(copier.chunk_bytes + 16, dtype=torch.uint8)
    odd = pool[2: 2 + copier.chunk_bytes]  # aligned for bf16, not for 16-byte elements
    assert odd.data_ptr() % 16 == 2
    copier.gather(ids, [odd])
    ref = _slots(copier, 1)
    copier.gather(ids, ref)
    assert torch.equal(odd, ref[0][: copier.chunk_bytes])
    dst = _layers("flash_attn", torch.zeros_like(data), True)
    BlockCopier(dst, "flash_attn", CHUNK).scatter([odd], ids)
    idx = torch.tensor(ids)
    assert all(torch.equal(d.index_select(1, idx), s.index_select(1, idx))
               for d, s in zip(dst, _layers("flash_attn", data, True), strict=True))


def test_rows_too_narrow_for_wide_copies() -> None:
    layers = [torch.randn(8, 1, 3).to(torch.bfloat16) for _ in range(2)]  # 6-byte rows
    copier = BlockCopier(layers, "mla", 2)
    assert copier.scatter_dtype == torch.bfloat16
    slot = torch.empty(copier.chunk_bytes, dtype=torch.uint8)
    copier.gather([5, 1], [slot])
    want = torch.stack([t[[5, 1]].reshape(1, 2, 3) for t in layers])
    assert torch.equal(slot.view(torch.bfloat16).view(2, 1, 2, 3), want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("one_storage", [True, False])
@pytest.mark.parametrize("allow_wide", [True, False])
@pytest.mark.parametrize("skip", [1, BPC - 1])
def test_partial_first_chunk_scatter(layout: KVLayoutName, one_storage: bool, allow_wide: bool,
                                     skip: int) -> None:
    """``skip_blocks``: the first chunk's leading blocks are not written (vLLM's null block
    stands there for blocks behind a sliding window); every other block is, byte-exact."""
    planes = 1 if layout == "mla" else 2
    g = torch.Generator().manual_seed(21)
    raw = torch.randint(0, 256, (L, planes, NB, BS, H * D * 2), generator=g, dtype=torch.uint8)
    src = _layers(layout, raw.view(torch.bfloat16), one_storage)
    ids = _ids(22, 3)
    slots = _slots(BlockCopier(src, layout, CHUNK), 3)
    BlockCopier(src, layout, CHUNK).gather(ids, slots)

    dst = [torch.zeros_like(t) for t in src]
    load = [0] * skip + ids[skip:]  # the skipped ids are vLLM's null block, never written
    BlockCopier(dst, layout, CHUNK, allow_wide=allow_wide).scatter(slots, load, skip_blocks=skip)
    block_dim = 1 if layout == "flash_attn" else 0
    written = torch.tensor(ids[skip:])
    untouched = torch.tensor(sorted(set(range(NB)) - set(ids[skip:])))
    for s_layer, d_layer in zip(src, dst, strict=True):
        assert torch.equal(s_layer.index_select(block_dim, written).view(torch.uint8),
                           d_layer.index_select(block_dim, written).view(torch.uint8))
        assert not d_layer.index_select(block_dim, untouched).view(torch.uint8).any()


def test_partial_scatter_checks_skip_before_writing() -> None:
    data = _canonical(seed=23)
    layers = _layers("flash_attn", data, True)
    copier = BlockCopier(layers, "flash_attn", CHUNK)
    slots = _slots(copier, 2, fill=7)
    before = [t.clone() for t in layers]
    for bad in (-1, BPC):
        with pytest.raises(ProtocolError, match=f"skip_blocks {bad} must be in"):
            copier.scatter(slots, _ids(24, 2), skip_blocks=bad)
    with pytest.raises(ProtocolError, match="0 without chunks"):
        copier.scatter([], [], skip_blocks=1)
    assert all(torch.equal(a, b) for a, b in zip(layers, before, strict=True))
