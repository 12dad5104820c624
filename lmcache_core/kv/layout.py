"""vLLM per-layer KV-cache layouts and the canonical, layout-independent chunk order.

Per-layer tensors as vLLM allocates them:

- ``flash_attn``: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K/V plane first)
- ``flashinfer``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (block first)
- ``mla``: ``[num_blocks, block_size, head_dim]`` (one latent plane)
- ``cpu_attn``: vLLM's CPU backend, ``[num_blocks, heads, block_size, 2 * head_dim]`` nominally,
  each block contiguous; its kernel reads a (block, head) run as ``block_size`` K rows then
  ``block_size`` V rows of ``head_dim`` (``integration/vllm/kv_views.py``)

A stored chunk (one pool slot) holds every layer of its tokens contiguously in the canonical order
``[num_layers, planes, chunk_tokens, width]``: ``planes`` is 2 (K then V) or 1 for MLA, ``width``
is ``heads * dim`` (``dim`` for MLA). flash_attn and flashinfer caches of one model therefore give
byte-identical chunks. :func:`block_view` turns a layer tensor into ``[planes, num_blocks, ...]``
so that selecting blocks along dim 1 yields exactly that order.

A ``cpu_attn`` chunk is instead in the engine's block order, ``[num_layers, blocks, heads,
2 * block_size, head_dim]``: each block of each layer is one run of bytes on both sides, so a
load is a memcpy per block (1.4-2x the transposing copy into that layout on a 2-core VM, two copy
threads, cold caches: 5.4-7.1 GB/s against 3.0-3.7). The price: its chunks mean something else,
so their fingerprint names the block size (``keys.layout_key``'s ``block_tokens``) and a CPU
engine shares chunks only with CPU engines of that block size, not with GPU engines of the model.
Its pieces of head ranges (cross-TP) are ``[num_layers, blocks, hi - lo, 2 * block_size,
head_dim]``: each block's heads are contiguous, so a TP rank's chunk is exactly its piece.

Torch-free at import: the functions only call methods of the tensors they are given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

from lmcache_core.errors import IncompatibleError
from lmcache_core.protocol.messages import KVLayoutName

if TYPE_CHECKING:
    import torch

LAYOUTS: tuple[KVLayoutName, ...] = get_args(KVLayoutName)


@dataclass(frozen=True)
class KVGeometry:
    """What one layer tensor of a given layout holds."""

    layout: KVLayoutName
    num_blocks: int
    block_size: int
    planes: int
    """2 for K and V (flash_attn, flashinfer), 1 for MLA."""
    token_shape: tuple[int, ...]
    """Per-token, per-plane dims: ``(heads, dim)`` or ``(dim,)`` for MLA."""

    @property
    def width(self) -> int:
        """Elements per token per plane."""
        return math.prod(self.token_shape)

    def chunk_shape(self, num_layers: int, chunk_tokens: int) -> tuple[int, int, int, int]:
        """The canonical chunk shape ``[num_layers, planes, chunk_tokens, width]``."""
        return (num_layers, self.planes, chunk_tokens, self.width)

    def chunk_elems(self, num_layers: int, chunk_tokens: int) -> int:
        """Elements of one canonical chunk."""
        return math.prod(self.chunk_shape(num_layers, chunk_tokens))


def detect_layout(tensor_shape: Sequence[int], block_size_hint: int | None = None) -> KVLayoutName:
    """The layout of a per-layer KV tensor of this shape.

    5-D shapes are told apart by where the K/V plane dim of size 2 sits; when both leading dims are
    2 (a cache of exactly 2 blocks) the shape is ambiguous and the caller must name the layout.
    ``block_size_hint``, when given, must equal the block-size dim.
    """
    shape = _int_shape(tensor_shape)
    if len(shape) == 3:
        layout: KVLayoutName = "mla"
    elif len(shape) == 5 and shape[0] == 2 and shape[1] != 2:
        layout = "flash_attn"
    elif len(shape) == 5 and shape[1] == 2 and shape[0] != 2:
        layout = "flashinfer"
    elif len(shape) == 4 and shape[3] % 2 == 0:
        layout = "cpu_attn"
    elif len(shape) == 5 and shape[0] == 2 and shape[1] == 2:
        raise IncompatibleError(
            f"KV cache shape {shape} is ambiguous (flash_attn [2, num_blocks=2, ...] or "
            "flashinfer [num_blocks=2, 2, ...]); name the layout explicitly")
    else:
        raise IncompatibleError(
            f"KV cache shape {shape} matches no known layout: expected flash_attn "
            "[2, num_blocks, block_size, num_kv_heads, head_dim], flashinfer "
            "[num_blocks, 2, block_size, num_kv_heads, head_dim], mla "
            "[num_blocks, block_size, head_dim] or cpu_attn "
            "[num_blocks, num_kv_heads, block_size, 2 * head_dim]")
    geometry = kv_geometry(shape, layout)
    if block_size_hint is not None and geometry.block_size != block_size_hint:
        raise IncompatibleError(
            f"KV cache shape {shape} ({layout}) has block size {geometry.block_size}, "
            f"expected {block_size_hint}")
    return layout


def kv_geometry(tensor_shape: Sequence[int], layout: KVLayoutName) -> KVGeometry:
    """Parse a per-layer shape under ``layout``; IncompatibleError if the shape does not fit."""
    shape = _int_shape(tensor_shape)
    if layout == "flash_attn" and len(shape) == 5 and shape[0] == 2:
        geometry = KVGeometry(layout, shape[1], shape[2], 2, (shape[3], shape[4]))
    elif layout == "flashinfer" and len(shape) == 5 and shape[1] == 2:
        geometry = KVGeometry(layout, shape[0], shape[2], 2, (shape[3], shape[4]))
    elif layout == "mla" and len(shape) == 3:
        geometry = KVGeometry(layout, shape[0], shape[1], 1, (shape[2],))
    elif layout == "cpu_attn" and len(shape) == 4 and shape[3] % 2 == 0:
        geometry = KVGeometry(layout, shape[0], shape[2], 2, (shape[1], shape[3] // 2))
    elif layout not in LAYOUTS:
        raise IncompatibleError(f"unknown KV layout {layout!r}; known: {', '.join(LAYOUTS)}")
    else:
        raise IncompatibleError(f"KV cache shape {shape} does not fit layout {layout!r}")
    if min(shape) <= 0:
        raise IncompatibleError(f"KV cache shape {shape} has an empty dimension")
    return geometry


def check_cpu_attn_strides(tensor_shape: Sequence[int], stride: Sequence[int]) -> None:
    """IncompatibleError unless a ``cpu_attn`` tensor's blocks are contiguous, their heads back
    to back (as vLLM allocates them), and its last dim ``2 * head_dim``: its chunks are whole
    blocks, and a piece of head ranges is each block's run of those heads."""
    _, _, tokens, width = _int_shape(tensor_shape)
    _, head_stride, token_stride, item_stride = (int(s) for s in stride)
    if width % 2 or (item_stride, token_stride, head_stride) != (1, width, tokens * width):
        raise IncompatibleError(
            f"cpu_attn KV cache {list(tensor_shape)} of stride {list(stride)}: its blocks are "
            f"not contiguous [heads, block_size, 2 * head_dim] runs with an even last dim")


def block_view(tensor: torch.Tensor, layout: KVLayoutName, leading: int = 0) -> torch.Tensor:
    """A zero-copy view ``[*lead, planes, num_blocks, *row]`` of a layer (or stacked layers).

    ``leading`` dims (0 for one layer, 1 for ``[num_layers, ...]`` stacks) are kept in front.
    ``row`` is one flat ``block_size * width`` dim when the block's elements are contiguous (the
    fast case), else ``[block_size, *token_shape]``. Either way, picking blocks along dim
    ``leading + 1`` yields the canonical chunk order. A ``cpu_attn`` tensor has one "plane" of
    whole blocks (``planes`` 1 here, its K and V inside each block's row): picking blocks yields
    its block order.
    """
    if layout == "flash_attn":
        view = tensor
    elif layout == "flashinfer":
        order = list(range(tensor.dim()))
        order[leading], order[leading + 1] = order[leading + 1], order[leading]
        view = tensor.permute(order)
    elif layout in ("mla", "cpu_attn"):
        view = tensor.unsqueeze(leading)
    else:
        raise IncompatibleError(f"unknown KV layout {layout!r}")
    head = list(view.shape[: leading + 2])
    try:
        return view.view(*head, -1)
    except RuntimeError:  # block not contiguous (e.g. a head-major physical order): keep dims
        return view


def merge_leading(view: torch.Tensor) -> torch.Tensor:
    """``[L, planes, NB, *row]`` as ``[L * planes, NB, *row]`` when that is a view, else as is."""
    if view.dim() < 3:
        return view
    try:
        return view.view(view.shape[0] * view.shape[1], *view.shape[2:])
    except RuntimeError:
        return view


def _int_shape(shape: Sequence[int]) -> list[int]:
    out = [int(s) for s in shape]
    if any(s < 0 for s in out):
        raise IncompatibleError(f"KV cache shape {out} has a negative dimension")
    return out
