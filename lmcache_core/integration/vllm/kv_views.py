"""vLLM's per-layer KV tensors as zero-copy views in a layout the kv layer knows.

vLLM has shipped three generations of per-layer KV tensors:

- 5-D, older releases: flash-attn ``[2, num_blocks, block_size, heads, dim]`` and flashinfer
  ``[num_blocks, 2, block_size, heads, dim]``; 3-D MLA ``[num_blocks, block_size, dim]``. These
  pass through unchanged.
- 4-D logical ``[B, H, N, C]`` (vLLM >= 0.2x, ``vllm/v1/kv_cache_layout.py``): blocks, head slots,
  tokens, content; the physical order comes from a ``KVCacheLayout`` stride permutation (LBHNC,
  LBNHC, ...) and each attention backend decides what ``C`` means:

  * flash-attn, triton and most others: ``C = 2 * head_size``, a token's K then its V
    (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``);
  * head slots: ``H = 2 * num_kv_heads`` and ``C = head_size``, K heads then V heads (flashinfer's
    ``kv_cache.split(num_kv_heads, dim=1)``);
  * vLLM's CPU backend (``CPU_ATTN``, block size 128, layout LBHNC): the nominal shape is
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, contiguous, but the kernel views
    each (block, head) run as ``[2 * block_size, head_size]`` and takes the first ``block_size``
    rows as K and the rest as V (``kv_cache.view(NB, H, 2 * BS, D).chunk(2, dim=2)``). So the
    nominal token dim does NOT index tokens: row ``n`` of ``C`` holds K of tokens ``2n, 2n + 1``;
  * MLA: ``H = 1``, ``C`` = the latent.

Each of these but the CPU backend's is re-expressed as a strided 5-D flash-attn view ``[2, B, N,
H, D]`` (or 3-D MLA ``[B, N, C]``) over the same memory, so the canonical chunk ``[layers, 2,
tokens, heads * dim]`` holds real K and V per token whatever the backend: chunks written by GPU
engines of the same model and dtype are byte-identical. Every mapping is a bijection onto the
block's bytes, so a store followed by a retrieve is byte-exact even for a backend read wrongly.

The CPU backend's tensors go as they are, layout ``cpu_attn``: their chunks are in the engine's
block order (a memcpy per block instead of a transposing copy of head-size rows: a load 1.4-2x as
fast, ``kv/layout.py``), and shared with CPU engines of the same block size only.

Torch-only at import time (no vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lmcache_core.errors import IncompatibleError
from lmcache_core.kv.layout import check_cpu_attn_strides, kv_geometry
from lmcache_core.protocol.messages import KVLayoutName

CPU_BACKENDS = frozenset({"CPU_ATTN", "TORCH_SDPA", "CPU"})


@dataclass(frozen=True)
class KVViews:
    """The per-layer views to register and what they hold."""

    layout: KVLayoutName
    views: dict[str, torch.Tensor]
    block_size: int
    """Tokens per block of the views (the kernel block size when vLLM splits blocks)."""
    blocks_per_vllm_block: int
    """Kernel blocks per scheduler block (1 unless vLLM split its blocks for the kernel)."""
    source: str
    """How the views were derived, for logs and error messages."""


def describe_tensor(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)} stride {list(t.stride())} {t.dtype} on {t.device}"


def canonical_kv_views(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    backend: str | None,
    num_kv_heads: int,
    head_size: int,
    vllm_block_size: int,
    use_mla: bool = False,
    head_size_v: int | None = None,
) -> KVViews:
    """Views of ``kv_caches`` (layer name -> tensor, in layer order) in a layout the kv layer knows.

    Layers that alias one tensor (vLLM's cross-layer KV sharing) are registered once.
    IncompatibleError, naming the shape and strides, when no mapping fits.
    """
    if not kv_caches:
        raise IncompatibleError("vLLM registered no KV cache tensors")
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    unique: dict[str, torch.Tensor] = {}
    for name, t in kv_caches.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen.add(key)
            unique[name] = t
    first = next(iter(unique.values()))
    if head_size_v is not None and head_size_v != head_size and not use_mla:
        raise IncompatibleError(
            f"K and V head sizes differ ({head_size} vs {head_size_v}); not supported")
    views: dict[str, torch.Tensor] = {}
    layout: KVLayoutName | None = None
    source = ""
    for name, t in unique.items():
        layout, view, source = _layer_view(t, backend, num_kv_heads, head_size, use_mla)
        views[name] = view
    assert layout is not None
    block_size = kv_geometry(next(iter(views.values())).shape, layout).block_size
    if block_size <= 0 or vllm_block_size % block_size:
        raise IncompatibleError(
            f"KV cache block size {block_size} (from {describe_tensor(first)}, {source}) does not "
            f"divide vLLM's block size {vllm_block_size}")
    return KVViews(layout, views, block_size, vllm_block_size // block_size, source)


def _layer_view(t: torch.Tensor, backend: str | None, heads: int, dim: int,
                use_mla: bool) -> tuple[KVLayoutName, torch.Tensor, str]:
    if t.dim() == 5:
        if t.shape[0] == 2 and t.shape[1] != 2:
            return "flash_attn", t, "5-D flash-attn tensor"
        if t.shape[1] == 2 and t.shape[0] != 2:
            return "flashinfer", t, "5-D flashinfer tensor"
        raise IncompatibleError(f"ambiguous 5-D KV cache tensor: {describe_tensor(t)}")
    if t.dim() == 3:
        return "mla", t, "3-D MLA tensor"
    if t.dim() != 4:
        raise IncompatibleError(f"unsupported KV cache tensor: {describe_tensor(t)}")
    nb, h, n, c = (int(s) for s in t.shape)
    sb, sh, sn, sc = (int(s) for s in t.stride())
    offset = t.storage_offset()
    if use_mla:
        if h != 1:
            raise IncompatibleError(f"MLA KV cache with {h} head slots: {describe_tensor(t)}")
        return "mla", t[:, 0], "4-D [B, 1, N, C] MLA tensor"
    if backend in CPU_BACKENDS and h == heads and c == 2 * dim:
        # Each (block, head) run is [2 * N, D]: K rows then V rows (see the module docstring).
        check_cpu_attn_strides(t.shape, t.stride())
        return "cpu_attn", t, "4-D CPU_ATTN [B, H, N, 2*D] tensor (K rows, then V rows)"
    if h == heads and c == 2 * dim:
        view = t.as_strided((2, nb, n, h, dim), (dim * sc, sb, sn, sh, sc), offset)
        return "flash_attn", view, f"4-D [B, H, N, K|V] tensor ({backend or 'unknown backend'})"
    if h == 2 * heads and c == dim:
        view = t.as_strided((2, nb, n, heads, dim), (heads * sh, sb, sn, sh, sc), offset)
        return "flash_attn", view, f"4-D [B, K heads|V heads, N, D] tensor ({backend})"
    raise IncompatibleError(
        f"KV cache tensor {describe_tensor(t)} from backend {backend} fits no known layout for "
        f"{heads} KV heads of size {dim}")


def expand_block_ids(block_ids: list[int], ratio: int) -> list[int]:
    """Scheduler block ids as kernel block ids (``ratio`` consecutive kernel blocks each)."""
    if ratio == 1:
        return list(block_ids)
    return [b * ratio + j for b in block_ids for j in range(ratio)]
