"""Block <-> chunk copies: gather vLLM blocks of every layer into flat chunk slots, and back.

A chunk slot holds ``[num_layers, planes, chunk_tokens, width]`` (see :mod:`.layout`). Copies are
``torch.index_select(..., out=slot_view)`` (gather) and ``index_copy_`` (scatter) on zero-copy
views: one op per chunk when every layer is an equally strided view into one storage (the layers
are then one strided tensor ``[num_layers, ...]``), else one op per (chunk, layer). There is no
Python loop over blocks. Block ids are validated for the whole request before anything is copied,
so a bad id raises ProtocolError and writes nothing.

When the KV tensors live on a GPU and the slots in host memory, each chunk goes through one staging
buffer on the KV device (``index_select`` there, then one device->host copy), on the current
stream; see :mod:`.cuda_events` for running that on a dedicated stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from lmcache_core.errors import IncompatibleError, ProtocolError
from lmcache_core.kv.layout import KVGeometry, block_view, kv_geometry, merge_leading
from lmcache_core.kv.tensors import check_uniform_layers, span_elems
from lmcache_core.protocol.messages import KVLayoutName

BlockIds = Sequence[int] | torch.Tensor


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
    ) -> None:
        """``layers``: per-layer KV tensors, all of one shape/stride/dtype/device, in layer order.

        ``chunk_size`` (tokens) must be a multiple of the block size. ``allow_stacked=False``
        forces the per-layer path (for tests and comparisons).
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
        stacked = stack_layers(self._layers) if allow_stacked else None
        self._views: list[torch.Tensor] = []
        self._stacked: torch.Tensor | None = None
        if stacked is not None:
            # [L, planes, NB, *row], merged to [L * planes, NB, *row] when that is a view.
            unmerged = block_view(stacked, layout, leading=1)
            self._stacked = merge_leading(unmerged)
            self._block_dim = 2 - (unmerged.dim() - self._stacked.dim())
            src_shape = list(self._stacked.shape)
        else:
            self._views = [block_view(t, layout) for t in self._layers]  # [planes, NB, *row]
            self._block_dim = 2  # of the slot view [L, planes, bpc, *row]
            src_shape = [len(self._layers), *self._views[0].shape]
        src_shape[self._block_dim] = self._bpc
        self._slot_shape = tuple(src_shape)

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
        return self._stacked is not None

    @property
    def layers(self) -> list[torch.Tensor]:
        return list(self._layers)

    # ------------------------------------------------------------------ copies

    def gather(self, block_ids: BlockIds, slots: Sequence[torch.Tensor]) -> None:
        """Copy chunk ``i``'s blocks (``block_ids[i*bpc:(i+1)*bpc]``) of every layer into
        ``slots[i]``."""
        outs = [self._slot_view(s) for s in slots]
        index = self.index(block_ids, len(outs))
        staging: torch.Tensor | None = None
        with torch.no_grad():
            for i, out in enumerate(outs):
                if out.device == self._device:
                    self._gather_into(index[i], out)
                    continue
                if staging is None:
                    staging = torch.empty(self._slot_shape, dtype=self._dtype, device=self._device)
                self._gather_into(index[i], staging)
                out.copy_(staging, non_blocking=True)

    def scatter(self, slots: Sequence[torch.Tensor], block_ids: BlockIds) -> None:
        """Copy ``slots[i]`` into chunk ``i``'s blocks of every layer, in place."""
        srcs = [self._slot_view(s) for s in slots]
        index = self.index(block_ids, len(srcs))
        staging: torch.Tensor | None = None
        with torch.no_grad():
            for i, src in enumerate(srcs):
                if src.device != self._device:
                    if staging is None:
                        staging = torch.empty(
                            self._slot_shape, dtype=self._dtype, device=self._device)
                    src = staging.copy_(src, non_blocking=True)
                self._scatter_from(src, index[i])

    def _gather_into(self, index: torch.Tensor, out: torch.Tensor) -> None:
        if self._stacked is not None:
            torch.index_select(self._stacked, self._block_dim, index, out=out)
            return
        for layer, view in enumerate(self._views):
            torch.index_select(view, 1, index, out=out[layer])

    def _scatter_from(self, src: torch.Tensor, index: torch.Tensor) -> None:
        if self._stacked is not None:
            self._stacked.index_copy_(self._block_dim, index, src)
            return
        for layer, view in enumerate(self._views):
            view.index_copy_(1, index, src[layer])

    # ------------------------------------------------------------------ validation

    def index(self, block_ids: BlockIds, n_chunks: int) -> torch.Tensor:
        """Validated ``[n_chunks, blocks_per_chunk]`` int64 block ids on the KV device."""
        try:
            if isinstance(block_ids, torch.Tensor):
                ids = block_ids.detach().to("cpu", torch.int64).reshape(-1)
            else:
                ids = torch.tensor(list(block_ids), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ProtocolError(f"block ids must be integers: {exc}") from None
        want = n_chunks * self._bpc
        if ids.numel() != want:
            raise ProtocolError(
                f"{n_chunks} chunks need {want} block ids ({self._bpc} per chunk), "
                f"got {ids.numel()}")
        if want:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_blocks:
                bad = lo if lo < 0 else hi
                raise ProtocolError(
                    f"block id {bad} is out of range [0, {self.num_blocks}) for this KV cache")
        return ids.view(n_chunks, self._bpc).to(self._device)

    def _slot_view(self, slot: torch.Tensor) -> torch.Tensor:
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
        flat = slot.reshape(-1)
        if slot.dtype == self._dtype:
            return flat[: self._chunk_elems].view(self._slot_shape)
        if flat.data_ptr() % self._dtype.itemsize:
            raise IncompatibleError(
                f"chunk slot address is not aligned to the {self._dtype} item size")
        return flat[: self.chunk_bytes].view(self._dtype).view(self._slot_shape)


def _check_layers(layers: list[torch.Tensor], layout: KVLayoutName) -> KVGeometry:
    check_uniform_layers(layers)
    return kv_geometry(layers[0].shape, layout)
