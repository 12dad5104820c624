"""vLLM's 4-D per-layer KV tensors as canonical views (torch only: runs in the main suite too)."""

from __future__ import annotations

import pytest
import torch

from lmcache_core.errors import IncompatibleError
from lmcache_core.integration.vllm.kv_views import canonical_kv_views, expand_block_ids
from lmcache_core.kv.copy import BlockCopier

NB, H, BS, D, L = 6, 2, 8, 4, 2
CHUNK = 2 * BS


def _raw(layers: int = L) -> torch.Tensor:
    """One backing buffer holding every layer, as vLLM allocates it (layer-major, LBHNC)."""
    return torch.arange(layers * NB * H * BS * 2 * D, dtype=torch.float32).view(
        layers, NB, H, BS, 2 * D)


def _cpu_kv(raw: torch.Tensor, layer: int, plane: int, block: int, token: int, head: int):
    """What vLLM's CPU kernel reads as K (plane 0) or V (plane 1) of one token."""
    run = raw[layer, block, head].reshape(2 * BS, D)  # the kernel's [2 * BS, D] view
    return run[plane * BS + token]


def test_cpu_backend_tensors_go_as_they_are_in_the_cpu_attn_layout() -> None:
    raw = _raw()
    caches = {f"model.layers.{i}.self_attn.attn": raw[i] for i in range(L)}
    kv = canonical_kv_views(caches, backend="CPU_ATTN", num_kv_heads=H, head_size=D,
                            vllm_block_size=BS)
    assert kv.layout == "cpu_attn" and kv.block_size == BS and kv.blocks_per_vllm_block == 1
    assert kv.views["model.layers.1.self_attn.attn"] is caches["model.layers.1.self_attn.attn"]
    with pytest.raises(IncompatibleError, match="not contiguous"):  # heads not back to back
        canonical_kv_views({"l": raw[0].transpose(1, 2).contiguous().transpose(1, 2)},
                           backend="CPU_ATTN", num_kv_heads=H, head_size=D, vllm_block_size=BS)


def test_kv_split_in_content_dim() -> None:
    raw = _raw()
    view = canonical_kv_views({"l0": raw[0]}, backend="FLASH_ATTN", num_kv_heads=H, head_size=D,
                              vllm_block_size=BS).views["l0"]
    assert torch.equal(view[0, 2, 3, 1], raw[0, 2, 1, 3, :D])
    assert torch.equal(view[1, 2, 3, 1], raw[0, 2, 1, 3, D:])


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_round_trip_through_block_copier_is_byte_exact(backend: str) -> None:
    raw = _raw()
    caches = {f"l{i}": raw[i] for i in range(L)}
    kv = canonical_kv_views(caches, backend=backend, num_kv_heads=H, head_size=D, vllm_block_size=BS)
    copier = BlockCopier(list(kv.views.values()), kv.layout, CHUNK)
    assert copier.stacked
    slot = torch.empty(copier.chunk_bytes, dtype=torch.uint8)
    copier.gather([4, 1], [slot])
    if backend == "CPU_ATTN":  # the engine's block order: [layers, blocks, heads, 2 * BS, D]
        chunk = slot.view(torch.float32).view(L, 2, H, 2 * BS, D)
        assert torch.equal(chunk[1, 1, 1, BS + 1], _cpu_kv(raw, 1, 1, 1, 1, 1))  # V, token 1
        assert torch.equal(chunk[0, 0, 0, 3], _cpu_kv(raw, 0, 0, 4, 3, 0))  # K, block 4, token 3
    else:  # canonical order: token 9 of the chunk is token 1 of block 1
        chunk = slot.view(torch.float32).view(L, 2, CHUNK, H * D)
        assert torch.equal(chunk[1, 1, 9].view(H, D)[1], raw[1, 1, 1, 1, D:])
    before = raw.clone()
    raw.zero_()
    copier.scatter([slot], [0, 5])
    assert torch.equal(raw[:, 0], before[:, 4]) and torch.equal(raw[:, 5], before[:, 1])
    assert raw[:, 1:5].count_nonzero() == 0


def test_head_slot_split_and_mla() -> None:
    slots = torch.zeros(NB, 2 * H, BS, D)
    kv = canonical_kv_views({"l": slots}, backend="FLASHINFER", num_kv_heads=H, head_size=D,
                            vllm_block_size=BS)
    assert kv.views["l"].data_ptr() == slots.data_ptr()
    assert list(kv.views["l"].shape) == [2, NB, BS, H, D]
    mla = torch.zeros(NB, 1, BS, 12)
    kv = canonical_kv_views({"l": mla}, backend="FLASHMLA", num_kv_heads=1, head_size=12,
                            vllm_block_size=BS, use_mla=True)
    assert kv.layout == "mla" and list(kv.views["l"].shape) == [NB, BS, 12]


def test_kernel_blocks_and_refusals() -> None:
    raw = _raw()
    kv = canonical_kv_views({"l": raw[0]}, backend="CPU_ATTN", num_kv_heads=H, head_size=D,
                            vllm_block_size=4 * BS)
    assert kv.blocks_per_vllm_block == 4
    assert expand_block_ids([2, 0], 4) == [8, 9, 10, 11, 0, 1, 2, 3]
    with pytest.raises(IncompatibleError, match="fits no known layout"):
        canonical_kv_views({"l": raw[0]}, backend="CPU_ATTN", num_kv_heads=3, head_size=D,
                           vllm_block_size=BS)
    with pytest.raises(IncompatibleError, match="does not divide"):
        canonical_kv_views({"l": raw[0]}, backend="CPU_ATTN", num_kv_heads=H, head_size=D,
                           vllm_block_size=BS + 1)


def test_shared_layers_register_once() -> None:
    raw = _raw()
    kv = canonical_kv_views({"a": raw[0], "b": raw[1], "c": raw[0]}, backend="CPU_ATTN",
                            num_kv_heads=H, head_size=D, vllm_block_size=BS)
    assert list(kv.views) == ["a", "b"]


@pytest.mark.parametrize("wide", [True, False])
def test_cpu_layout_scatters_block_by_block_byte_exact(wide: bool) -> None:
    """vLLM's CPU blocks (``cpu_attn``) scatter block by block (a memmove per block and layer:
    ``copy._BlockRuns``; index_copy_ was 2-4x slower there); a layout whose blocks are one run
    per layer and plane keeps one index_copy_. Several chunks in one scatter, ids out of order,
    both copy dtypes."""
    raw = _raw()
    caches = {f"l{i}": raw[i] for i in range(L)}
    kv = canonical_kv_views(caches, backend="CPU_ATTN", num_kv_heads=H, head_size=D,
                            vllm_block_size=BS)
    copier = BlockCopier(list(kv.views.values()), kv.layout, CHUNK, allow_wide=wide)
    assert copier._runs is not None
    flash = [torch.zeros(2, NB, BS, H, D) for _ in range(L)]  # a block: one run a layer and plane
    flash_copier = BlockCopier(flash, "flash_attn", CHUNK)
    assert flash_copier._runs is None and not flash_copier._native.per_block
    slots = [torch.empty(copier.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
    copier.gather([4, 1, 2, 0], slots)
    before = raw.clone()
    raw.zero_()
    copier.scatter(slots, [5, 3, 0, 1])
    for dst, src in ((5, 4), (3, 1), (0, 2), (1, 0)):
        assert torch.equal(raw[:, dst], before[:, src])
    assert raw[:, 2].count_nonzero() == 0 and raw[:, 4].count_nonzero() == 0


def test_cpu_layout_block_by_block_scatter_skips_leading_blocks() -> None:
    """skip_blocks (a sliding window's partial oldest piece) on the block-by-block path: the
    first chunk's first block is neither read nor written, the rest land where they should."""
    raw = _raw()
    kv = canonical_kv_views({f"l{i}": raw[i] for i in range(L)}, backend="CPU_ATTN",
                            num_kv_heads=H, head_size=D, vllm_block_size=BS)
    copier = BlockCopier(list(kv.views.values()), kv.layout, CHUNK)
    assert copier._runs is not None
    slots = [torch.empty(copier.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
    copier.gather([4, 1, 2, 0], slots)
    before = raw.clone()
    raw.zero_()
    copier.scatter(slots, [5, 3, 0, 1], skip_blocks=1)
    assert raw[:, 5].count_nonzero() == 0  # skipped
    for dst, src in ((3, 1), (0, 2), (1, 0)):
        assert torch.equal(raw[:, dst], before[:, src])
