"""Block <-> chunk copies: gather vLLM blocks of every layer into flat chunk slots, and back.

A chunk slot holds ``[num_layers, planes, chunk_tokens, width]`` (see :mod:`.layout`). Copies are
``torch.index_select(..., out=slot_view)`` (gather) and ``index_copy_`` (scatter) on zero-copy
views: one op per chunk when every layer is an equally strided view into one storage (the layers
are then one strided tensor ``[num_layers, ...]``), else one op per (chunk, layer). There is no
Python loop over blocks but for CPU scatters into blocks that are not one run, and ``cpu_attn``'s
memmoves (below). Block ids are validated for the whole request before anything is copied, so a
bad id raises ProtocolError and writes nothing.

CPU-specific choices, all measured (single thread, a Llama-8B chunk unless said):

- ``index_select(dim=1)`` into a contiguous ``out`` takes ATen's dim-1 path, which first makes the
  whole *source* contiguous: for a non-contiguous view (flashinfer's ``[2, NB, ...]`` permute) that
  copies the entire layer per call (~100x slower). Such views get a leading size-1 dim instead.
- Scatters reinterpret rows as the widest element (16 bytes) their strides allow: ``index_copy_``
  moves element by element, so 8x fewer elements make it ~2x faster. Bytes are moved, never
  interpreted, so any bit pattern survives.
- A scatter into blocks that are not contiguous (a strided view of a head-major order, as vLLM's
  CPU blocks were read before the ``cpu_attn`` layout: a block ``[heads, K|V, tokens, dim]`` in
  memory, the canonical chunk ``[K|V, tokens, heads, dim]``) is one ``copy_`` per block:
  ``index_copy_`` took 0.5-1.3 GB/s there, ``copy_`` of the same strided block 2.5-5 GB/s
  (its loops follow the strides; 16 MiB of a Gemma-3-like chunk, 1-2 threads). So the Python
  loop over blocks is there, on that path only (a CPU chunk has few blocks: 2 of 128 tokens).
- The ``cpu_attn`` layout (vLLM's CPU tensors as allocated, chunks in their block order) scatters
  block by block too: each block of each layer is then one contiguous run on both sides. One
  thread, 16 MiB into cold, scattered blocks of a 1 GiB shared mapping: ``index_copy_`` 4.0 GB/s,
  ``copy_`` per block 5.3, libc's ``memmove`` per block 5.8 (and 1.1-1.4x ``copy_`` with two
  threads side by side), which :class:`_BlockRuns` calls with no torch op per chunk. Its
  addresses stay valid through a copy: the copier (and so every view of the mapping, which keeps
  it mapped, :mod:`.mapped`) and the slots are referenced by the calling frames until it ends.

One-byte float types (float8) are copied through a ``uint8`` view: some torch versions admitted
here have no float8 ``index_select``/``index_copy_`` kernels, and the bytes are only moved.

When the KV tensors live on a GPU and the slots in host memory, each chunk goes through one staging
buffer on the KV device (``index_select`` there, then one device->host copy), on the current
stream; see :mod:`.cuda_events` for running that on a dedicated stream and synchronizing it.

:meth:`BlockCopier.scatter_heads` reads chunks stored by another tensor-parallel size (pieces of
head ranges) into this cache's heads; the copies live in :mod:`.heads`.
"""

from __future__ import annotations

import ctypes
import itertools
import operator
from collections.abc import Sequence

import torch

from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.kv.heads import HeadCopier
from lmcache_core.kv.layout import (
    KVGeometry,
    block_view,
    check_cpu_attn_strides,
    kv_geometry,
    merge_leading,
)
from lmcache_core.kv.tensors import check_uniform_layers, span_elems
from lmcache_core.protocol.messages import KVLayoutName

BlockIds = Sequence[int] | torch.Tensor


def check_skip(skip_blocks: int, blocks_per_chunk: int, n_chunks: int) -> int:
    """``skip_blocks`` (a copy's first chunk's leading blocks left out) once checked: fewer than a
    chunk's blocks, none without a chunk; ProtocolError otherwise."""
    if not 0 <= skip_blocks < blocks_per_chunk or (skip_blocks and not n_chunks):
        raise ProtocolError(f"skip_blocks {skip_blocks} must be in [0, {blocks_per_chunk}) (the "
                            f"first chunk's leading blocks), and 0 without chunks")
    return skip_blocks


def stack_layers(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One zero-copy ``[num_layers, *shape]`` view of the layers, or None if impossible.

    Possible when all layers share one storage, shape, stride and dtype, and start at storage
    offsets that grow by one constant step at least as large as a layer's span (no overlap).
    """
    if not layers:
        return None
    first = layers[0]
    if len(layers) == 1:
        return first.unsqueeze(0)
    ptr = first.untyped_storage().data_ptr()
    for t in layers[1:]:
        if (t.untyped_storage().data_ptr() != ptr or t.shape != first.shape
                or t.stride() != first.stride() or t.dtype != first.dtype
                or t.device != first.device):
            return None
    offsets = [t.storage_offset() for t in layers]
    step = offsets[1] - offsets[0]
    if step < max(span_elems(first.shape, first.stride()), 1):
        return None
    if any(b - a != step for a, b in itertools.pairwise(offsets)):
        return None
    return first.as_strided(
        (len(layers), *first.shape), (step, *first.stride()), offsets[0])


class BlockCopier:
    """Gathers/scatters whole chunks between per-layer KV tensors and flat chunk slots."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        layout: KVLayoutName,
        chunk_size: int,
        *,
        allow_stacked: bool = True,
        allow_wide: bool = True,
    ) -> None:
        """``layers``: per-layer KV tensors, all of one shape/stride/dtype/device, in layer order.

        ``chunk_size`` (tokens) must be a multiple of the block size. ``allow_stacked=False``
        forces the per-layer path, ``allow_wide=False`` scatters in the KV dtype instead of the
        widest dtype the rows allow (both for tests and comparisons).
        """
        self._layers = list(layers)
        self._geometry = _check_layers(self._layers, layout)
        block_size = self._geometry.block_size
        if chunk_size <= 0 or chunk_size % block_size:
            raise IncompatibleError(
                f"chunk size {chunk_size} is not a positive multiple of the KV block size "
                f"{block_size}")
        first = self._layers[0]
        self._layout = layout
        self._chunk_size = chunk_size
        self._bpc = chunk_size // block_size
        self._dtype = first.dtype
        self._device = first.device
        self._chunk_elems = self._geometry.chunk_elems(len(self._layers), chunk_size)
        copy_layers = [_byte_view(t) for t in self._layers]
        stacked = stack_layers(copy_layers) if allow_stacked else None
        if stacked is not None:
            # One group: [L, planes, NB, *row], or [L * planes, NB, *row] when that is a view.
            unmerged = block_view(stacked, layout, leading=1)
            views = [merge_leading(unmerged)]
            block_dim = 2 - (unmerged.dim() - views[0].dim())
        else:
            views = [block_view(t, layout) for t in copy_layers]  # L groups: [planes, NB, *row]
            block_dim = 1
        if block_dim == 1 and not views[0].is_contiguous():
            # index_select(dim=1) into a contiguous out makes the *whole* source contiguous
            # first (ATen's dim-1 fast path); one more leading dim takes the general path.
            views = [v.unsqueeze(0) for v in views]
            block_dim = 2
        self._stacked = stacked is not None
        self._native = _Plan.build(views, block_dim, self._bpc)
        self._wide = _widest_plan(views, block_dim, self._bpc) if allow_wide else None
        #: ``cpu_attn`` scatters on the CPU as memmoves (its blocks are checked contiguous).
        self._runs = (_BlockRuns.build(views, block_dim, self._native.slot_shape)
                      if layout == "cpu_attn" else None)
        self._heads: HeadCopier | None = None  # built by the first scatter_heads

    # ------------------------------------------------------------------ properties

    @property
    def geometry(self) -> KVGeometry:
        return self._geometry

    @property
    def layout(self) -> KVLayoutName:
        return self._layout

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_blocks(self) -> int:
        return self._geometry.num_blocks

    @property
    def block_size(self) -> int:
        return self._geometry.block_size

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def blocks_per_chunk(self) -> int:
        return self._bpc

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk: num_layers * planes * chunk_tokens * width * itemsize."""
        return self._chunk_elems * self._dtype.itemsize

    @property
    def stacked(self) -> bool:
        """True when one op per chunk covers all layers."""
        return self._stacked

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self._layers)

    @property
    def scatter_dtype(self) -> torch.dtype:
        """The dtype scatters run in when the slots are aligned to it. Bytes are only moved, so a
        wider element just means fewer, larger moves: ``index_copy_`` runs ~2x faster on CPU
        with 16-byte elements than with 2-byte ones. Gathers run in the KV dtype (their speed
        does not improve; ATen's dim-1 gather is already a memcpy per block)."""
        return (self._wide or self._native).dtype

    # ------------------------------------------------------------------ copies

    def gather(self, block_ids: BlockIds, slots: Sequence[torch.Tensor]) -> None:
        """Copy chunk ``i``'s blocks (``block_ids[i*bpc:(i+1)*bpc]``) of every layer into
        ``slots[i]``."""
        flats = [self._slot_bytes(s) for s in slots]
        index = self.index(block_ids, len(flats))
        plan = self._native
        staging: torch.Tensor | None = None
        with torch.inference_mode():
            for i, flat in enumerate(flats):
                out = plan.slot_view(flat)
                if out.device == self._device:
                    plan.gather(index[i], out)
                    continue
                if staging is None:
                    staging = plan.empty_slot(self._device)
                plan.gather(index[i], staging)
                out.copy_(staging, non_blocking=True)

    def scatter(self, slots: Sequence[torch.Tensor], block_ids: BlockIds,
                skip_blocks: int = 0) -> None:
        """Copy ``slots[i]`` into chunk ``i``'s blocks of every layer, in place.

        ``skip_blocks``: the first chunk's leading blocks left as they are (a partial piece:
        its slot's first ``skip_blocks`` blocks are not copied, and their ids not used), e.g.
        where vLLM gave its null block for blocks behind a sliding window. The copy is still
        one op per layer group: the slot and the ids are narrowed, never looped over."""
        runs = self._runs
        if runs is not None and all(isinstance(s, torch.Tensor) and s.device.type == "cpu"
                                    for s in slots):
            addresses = [self._slot_address(s) for s in slots]
            blocks = self.block_list(block_ids, len(addresses))
            runs.scatter(addresses, blocks, self.check_skip(skip_blocks, len(addresses)))
            return
        flats = [self._slot_bytes(s) for s in slots]
        index = self.index(block_ids, len(flats))
        self._scatter_flats(flats, index, self.check_skip(skip_blocks, len(flats)))

    def check_skip(self, skip_blocks: int, n_chunks: int) -> int:
        """``check_skip`` for this cache's chunks."""
        return check_skip(skip_blocks, self._bpc, n_chunks)

    def scatter_heads(self, chunks: Sequence[Sequence[tuple[torch.Tensor, int, int]]],
                      heads: tuple[int, int], block_ids: BlockIds,
                      skip_blocks: int = 0) -> None:
        """Copy chunk ``i``, made of the pieces ``chunks[i] = [(piece slot, piece_lo, piece_hi),
        ...]`` that together cover this cache's head range ``heads = (a, b)`` of the model's KV
        heads, into chunk ``i``'s blocks (``block_ids[i*bpc:(i+1)*bpc]``) of every layer.

        A piece slot holds the canonical chunk of heads ``[lo, hi)`` only (what :meth:`gather`
        writes from a cache of those heads): at least ``chunk_bytes * (hi - lo) // (b - a)``
        bytes, uint8 or the KV dtype, contiguous, aligned. ``b - a`` must be this cache's heads;
        each head is copied from the first piece (in the given order) that covers it, so pieces
        may overlap; a head no piece covers is a ProtocolError. Everything (pieces, coverage,
        block ids) is checked before anything is copied. Copies go from the slots straight into
        the cache (strided views, no reassembly buffer; see :mod:`.heads`); a piece of exactly
        ``[a, b)`` takes the :meth:`scatter` path. MLA caches (no head dim) raise
        IncompatibleError: their one piece serves every rank through :meth:`scatter`.
        ``skip_blocks`` as for :meth:`scatter`.
        """
        if self._heads is None:
            self._heads = self._head_copier()
        self._heads.scatter(chunks, heads, block_ids, skip_blocks)

    def _head_copier(self) -> HeadCopier:
        """Views ``[*lead, NB, bs, H, D]`` of the cache with the heads dim kept (``cpu_attn``:
        ``[*lead, NB, H, row]``, a head's ``2 * bs * D`` elements of a block as its row)."""
        layers = [_byte_view(t) for t in self._layers]
        if self._layout == "cpu_attn":
            return self._block_head_copier(layers)
        flashinfer = self._layout == "flashinfer"
        stacked = stack_layers(layers) if self._stacked and self._geometry.planes == 2 else None
        if stacked is not None:  # [L, 2, NB, ...] -> [L * 2, NB, ...] when that is a view
            view = merge_leading(stacked.transpose(1, 2) if flashinfer else stacked)
            return HeadCopier(self, [view], view.dim() - 4)
        views = [t.transpose(0, 1) if flashinfer else t for t in layers]  # [2, NB, bs, H, D]
        return HeadCopier(self, views, 1)

    def _block_head_copier(self, layers: list[torch.Tensor]) -> HeadCopier:
        """``_head_copier`` of a ``cpu_attn`` cache: a head's part of a block (contiguous, as
        checked when the copier was made) is its row."""
        nb, heads, bs, width = layers[0].shape
        row = bs * width
        stacked = stack_layers(layers) if self._stacked else None
        if stacked is not None:
            return HeadCopier(self, [stacked.view(len(layers), nb, heads, row)], 1, row=row)
        return HeadCopier(self, [t.view(1, nb, heads, row) for t in layers], 1, row=row)

    def _scatter_flats(self, flats: list[torch.Tensor], index: torch.Tensor,
                       skip_blocks: int = 0) -> None:
        """``scatter`` of checked flat slots with a validated ``index`` (and ``skip_blocks``)."""
        runs = self._runs
        if runs is not None and all(f.device.type == "cpu" for f in flats):
            runs.scatter([f.data_ptr() for f in flats], index.reshape(-1).tolist(), skip_blocks)
            return
        plan = self._scatter_plan(flats)
        staging: torch.Tensor | None = None
        with torch.inference_mode():
            for i, flat in enumerate(flats):
                src = plan.slot_view(flat)
                if src.device != self._device:
                    if staging is None:
                        staging = plan.empty_slot(self._device)
                    src = staging.copy_(src, non_blocking=True)
                plan.scatter(src, index[i], 0 if i else skip_blocks)

    def _scatter_plan(self, flats: list[torch.Tensor]) -> _Plan:
        wide = self._wide
        if wide is not None and all(f.data_ptr() % wide.dtype.itemsize == 0 for f in flats):
            return wide
        return self._native

    # ------------------------------------------------------------------ validation

    def index(self, block_ids: BlockIds, n_chunks: int) -> torch.Tensor:
        """Validated ``[n_chunks, blocks_per_chunk]`` int64 block ids on the KV device."""
        ids = torch.tensor(self.block_list(block_ids, n_chunks), dtype=torch.int64)
        ids = ids.view(n_chunks, self._bpc)
        if self._device.type == "cuda":
            # From pageable memory the copy would wait for the whole stream; pinned, it is queued.
            return ids.pin_memory().to(self._device, non_blocking=True)
        return ids

    def block_list(self, block_ids: BlockIds, n_chunks: int) -> list[int]:
        """Checked block ids (``n_chunks * blocks_per_chunk`` integers, each a block of this
        cache; ProtocolError otherwise) as a list of ints: a tensor's converted as by
        ``.to(int64)``. No torch op for a list (see :class:`_BlockRuns`)."""
        try:
            ids = (block_ids.detach().to("cpu", torch.int64).reshape(-1).tolist()
                   if isinstance(block_ids, torch.Tensor)
                   else [operator.index(b) for b in block_ids])
        except (TypeError, RuntimeError) as exc:
            raise ProtocolError(f"block ids must be integers: {exc}") from None
        want = n_chunks * self._bpc
        if len(ids) != want:
            raise ProtocolError(
                f"{n_chunks} chunks need {want} block ids ({self._bpc} per chunk), "
                f"got {len(ids)}")
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise ProtocolError(
                f"block id {bad} is out of range [0, {self.num_blocks}) for this KV cache")
        return ids

    def _slot_address(self, slot: torch.Tensor) -> int:
        """A slot's address, after :meth:`_slot_bytes`'s checks (no view made)."""
        self._check_slot(slot)
        return slot.data_ptr()

    def _slot_bytes(self, slot: torch.Tensor) -> torch.Tensor:
        """The first ``chunk_bytes`` of a slot as flat uint8, after checking it."""
        self._check_slot(slot)
        return slot.reshape(-1).view(torch.uint8)[: self.chunk_bytes]

    def _check_slot(self, slot: torch.Tensor) -> None:
        """IncompatibleError/ProtocolError unless ``slot`` can hold a chunk."""
        if not isinstance(slot, torch.Tensor):
            raise ProtocolError(f"a chunk slot must be a tensor, got {type(slot).__name__}")
        if slot.dtype not in (torch.uint8, self._dtype):
            raise IncompatibleError(
                f"chunk slot dtype {slot.dtype} is neither uint8 nor the KV dtype {self._dtype}")
        if not slot.is_contiguous():
            raise IncompatibleError("chunk slot must be contiguous")
        nbytes = slot.numel() * slot.element_size()
        if nbytes < self.chunk_bytes:
            raise IncompatibleError(
                f"chunk slot of {nbytes} bytes is smaller than one chunk ({self.chunk_bytes} "
                "bytes)")
        if slot.data_ptr() % self._dtype.itemsize:
            raise IncompatibleError(
                f"chunk slot address is not aligned to the {self._dtype} item size")


class _Plan:
    """Source views of one copy dtype: ``views[g]`` is group ``g`` (all layers, or one layer),
    blocks along ``block_dim``; a slot is viewed as ``[groups, *group shape with bpc blocks]``."""

    def __init__(self, views: list[torch.Tensor], block_dim: int,
                 slot_shape: tuple[int, ...]) -> None:
        self.views = views
        self.block_dim = block_dim
        self.slot_shape = slot_shape
        self.dtype = views[0].dtype
        first = views[0]
        # One block of one layer and plane (the leading dims fixed): one contiguous run unless
        # the view is strided across it (a head-major order seen as flash_attn).
        run = first.select(block_dim, 0)[(0,) * block_dim] if first.shape[block_dim] else None
        #: Scatter block by block with ``copy_`` (see the module docstring): CPU blocks whose
        #: layer-and-plane part is not contiguous. On a GPU one ``index_copy_`` kernel beats a
        #: launch per block.
        self.per_block = (first.device.type == "cpu" and run is not None
                          and not run.is_contiguous())

    @classmethod
    def build(cls, views: list[torch.Tensor], block_dim: int, bpc: int) -> _Plan:
        group_shape = list(views[0].shape)
        group_shape[block_dim] = bpc
        return cls(views, block_dim, (len(views), *group_shape))

    def slot_view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.dtype).view(self.slot_shape)

    def empty_slot(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.slot_shape, dtype=self.dtype, device=device)

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """Gather the blocks ``index`` into the slot view ``out``."""
        for group, view in enumerate(self.views):
            torch.index_select(view, self.block_dim, index, out=out[group])

    def scatter(self, src: torch.Tensor, index: torch.Tensor, skip: int = 0) -> None:
        """Scatter the slot view ``src`` into the blocks ``index``, but its first ``skip``
        blocks (narrowed views: still one ``index_copy_`` per group; block by block on the
        ``per_block`` path)."""
        if skip:
            index = index[skip:]
        if self.per_block:
            dim, blocks = self.block_dim, index.tolist()
            for group, view in enumerate(self.views):
                source = src[group]
                for j, block in enumerate(blocks, start=skip):
                    view.select(dim, block).copy_(source.select(dim, j))
            return
        for group, view in enumerate(self.views):
            part = src[group]
            if skip:
                part = part.narrow(self.block_dim, skip, part.shape[self.block_dim] - skip)
            view.index_copy_(self.block_dim, index, part)


class _BlockRuns:
    """The ``cpu_attn`` scatter as one libc ``memmove`` per block and layer (through ctypes,
    which releases the GIL for each call), addressed from the slots' and views' pointers with no
    torch op per chunk: each torch op releases and takes the GIL again, and with two copy
    workers and the server's loop on 2 cores those hand-offs cost more than the ops (py-spy:
    40 % of a retrieve's time in them beside the copies). 1.1-1.4x torch's ``copy_`` of the
    same runs with two copy threads side by side. A slot is ``[groups, *lead, bpc, run]``."""

    def __init__(self, run_bytes: int, bpc: int, groups: list[tuple[list[int], int]]) -> None:
        self.run_bytes = run_bytes
        self.bpc = bpc
        self.groups = groups
        """Per group: the address of each of its lead rows (layers, planes: the dims before the
        block dim, in slot order), and the byte stride of its block dim."""

    @classmethod
    def build(cls, views: list[torch.Tensor], block_dim: int,
              slot_shape: tuple[int, ...]) -> _BlockRuns | None:
        """None unless every view is ``[*lead, NB, run]`` on the CPU with contiguous runs."""
        first = views[0]
        if (first.device.type != "cpu" or first.dim() != block_dim + 2
                or any(v.stride(-1) != 1 or v.shape != first.shape for v in views)):
            return None
        item = first.element_size()
        groups = []
        for view in views:
            rows = [view.data_ptr()]
            for size, stride in zip(view.shape[:block_dim], view.stride()[:block_dim],
                                    strict=True):
                rows = [row + i * stride * item for row in rows for i in range(size)]
            groups.append((rows, view.stride(block_dim) * item))
        return cls(first.shape[-1] * item, slot_shape[block_dim + 1], groups)

    def scatter(self, addresses: list[int], blocks: list[int], skip: int) -> None:
        """Slot ``i`` (at ``addresses[i]``) into ``blocks[i * bpc: (i + 1) * bpc]``, but the first
        slot's ``skip`` leading blocks. ``blocks`` are validated (``BlockCopier.block_list``)
        and the slots checked, so every address lies inside the views' and slots' tensors."""
        run, bpc, memmove = self.run_bytes, self.bpc, ctypes.memmove
        for i, address in enumerate(addresses):
            ids = blocks[i * bpc: (i + 1) * bpc]
            first = skip if i == 0 else 0
            src = address
            for rows, block_stride in self.groups:
                for row in rows:
                    for j in range(first, bpc):
                        memmove(row + ids[j] * block_stride, src + j * run, run)
                    src += bpc * run


# Widest first (see the module docstring).
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32)


def _widest_plan(views: list[torch.Tensor], block_dim: int, bpc: int) -> _Plan | None:
    """The same views reinterpreted in the widest dtype their strides and rows allow."""
    itemsize = views[0].dtype.itemsize
    for dtype in _WIDE_DTYPES:
        if dtype.itemsize <= itemsize:
            break
        try:
            wide = [v.view(dtype) for v in views]
        except RuntimeError:  # a row or stride is not a multiple of the wider item size
            continue
        if all(v.data_ptr() % dtype.itemsize == 0 for v in wide):
            return _Plan.build(wide, block_dim, bpc)
    return None


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte float tensor (float8) as ``uint8``, others unchanged (see the module docstring)."""
    if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point:
        return tensor.view(torch.uint8)
    return tensor


def _check_layers(layers: list[torch.Tensor], layout: KVLayoutName) -> KVGeometry:
    check_uniform_layers(layers)
    if layout == "cpu_attn":
        check_cpu_attn_strides(layers[0].shape, layers[0].stride())
    return kv_geometry(layers[0].shape, layout)
