"""float8 KV caches are copied through a same-width integer view (issue 16, finding 7).

Some admitted torch versions have no float8 ``index_select``/``index_copy_`` kernels (on GPU); the
copier must never ask for them. Bytes are moved, never interpreted: NaN patterns survive.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_core.kv.copy import BlockCopier

FLOAT8 = [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                            "float8_e5m2fnuz") if hasattr(torch, name)]
SHAPE = (2, 8, 4, 2, 16)  # flash_attn [2, blocks, block_size, heads, dim]
CHUNK = 8  # two blocks


def _layers(dtype: torch.dtype, n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, *SHAPE), dtype=torch.uint8, generator=gen)
    return list(raw.view(dtype).unbind(0))


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("stacked", [True, False])
def test_float8_round_trip_is_byte_exact_through_integer_views(dtype: torch.dtype,
                                                                stacked: bool) -> None:
    layers = _layers(dtype)
    copier = BlockCopier(layers, "flash_attn", CHUNK, allow_stacked=stacked)
    assert copier.dtype == dtype
    assert not copier._native.dtype.is_floating_point  # the copies never use float8 kernels
    assert not copier.scatter_dtype.is_floating_point or copier.scatter_dtype.is_complex
    slots = [torch.empty(copier.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
    blocks = [5, 1, 2, 7]
    copier.gather(blocks, slots)
    expected = torch.stack([t.view(torch.uint8)[:, blocks] for t in layers])  # [L, 2, 4, ...]
    for i, slot in enumerate(slots):
        want = expected[:, :, 2 * i:2 * i + 2].contiguous().view(-1)
        assert torch.equal(slot, want)
    targets = _layers(dtype, 3)
    BlockCopier(targets, "flash_attn", CHUNK, allow_stacked=stacked).scatter(slots, [0, 3, 4, 6])
    for src, dst in zip(layers, targets, strict=True):
        assert torch.equal(src.view(torch.uint8)[:, blocks], dst.view(torch.uint8)[:, [0, 3, 4, 6]])


def test_float8_slot_of_the_kv_dtype_is_accepted() -> None:
    if not FLOAT8:
        pytest.skip("this torch has no float8 dtypes")
    layers = _layers(FLOAT8[0])
    copier = BlockCopier(layers, "flash_attn", CHUNK)
    slot = torch.empty(copier.chunk_bytes, dtype=torch.uint8).view(FLOAT8[0])
    copier.gather([0, 1], [slot])
    assert torch.equal(slot.view(torch.uint8)[:slot.numel() // 3],
                       layers[0].view(torch.uint8)[:, :2].reshape(-1))
