"""Scatter chunks stored by another tensor-parallel size: pieces of head ranges -> this rank's heads.

A chunk stored by TP size W is held as *pieces*: piece ``[lo, hi)`` is the canonical chunk of only
the model's KV heads ``lo..hi`` (``[num_layers, planes, chunk_tokens, hi - lo, head_dim]``,
contiguous, exactly what :meth:`BlockCopier.gather` writes for a cache holding those heads; in the
``cpu_attn`` block order ``[num_layers, blocks, hi - lo, 2 * block_size, head_dim]``). A
cache holding heads ``[a, b)`` takes, for each head, the first piece (in the given order) that
covers it; consecutive heads taken from one piece form a *segment*.

Copies go straight from the piece slots into the cache, with ``index_copy_`` along the block dim
of strided views built on the storages (``[*lead, blocks, block_size, n, w, head_dim]``): no
reassembly buffer on the host. Bytes are moved, never interpreted: every view is reinterpreted as
the widest element (16, 8, 4 or 2 bytes) its row, strides and addresses allow (see
:mod:`.copy`), so float8 and any bit pattern survive.

*Fused runs.* On CPU a copy that writes only part of each cache row (a head slice) runs about half
as fast as one writing whole rows (the strided writes, not the reads, are slow; measured on one
thread, see ``scripts/bench_heads.py``). When consecutive segments have one width, one in-piece
offset, pieces of one width, and lie in one storage at equally spaced increasing addresses (e.g.
consecutive slots of one pool, and always in a staging buffer), they become one view with an extra
``n`` dim whose stride is the address step, and one ``index_copy_`` then writes whole rows. Other
segments are copied one by one.

*Device caches.* When the cache is on a GPU (slots in host memory), each chunk's needed pieces are
first copied whole (contiguous host->device, ``non_blocking``) into one staging buffer on the KV
device, one after the other at equally spaced offsets when they have one size, so the segments fuse
there; all on the current stream, like :meth:`BlockCopier.scatter`.

MLA caches have no head dim (one latent piece serves every rank): :func:`scatter_heads` raises
IncompatibleError for them; use :meth:`BlockCopier.scatter`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from lmcache_core.errors import IncompatibleError, ProtocolError

if TYPE_CHECKING:
    from lmcache_core.kv.layout import KVGeometry

BlockIds = Sequence[int] | torch.Tensor


class BlockCopierLike(Protocol):
    """What the head copies need of their ``copy.BlockCopier`` (typed here, so that the two
    modules do not import each other)."""

    @property
    def geometry(self) -> KVGeometry: ...
    @property
    def layout(self) -> str: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def blocks_per_chunk(self) -> int: ...
    def index(self, block_ids: BlockIds, n_chunks: int) -> torch.Tensor: ...
    def check_skip(self, skip_blocks: int, n_chunks: int) -> int: ...
    def _scatter_flats(self, flats: list[torch.Tensor], index: torch.Tensor,
                       skip_blocks: int = 0) -> None: ...

Piece = tuple[torch.Tensor, int, int]

_UNITS = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_STAGE_ALIGN = 256  # bytes between staged pieces (keeps every staged piece 16-byte aligned)


@dataclass
class _Segment:
    """Cache heads ``[dst, dst + width)`` come from heads ``[off, off + width)`` of a piece of
    ``piece_heads`` heads whose bytes start at ``flat`` (flat uint8)."""

    flat: torch.Tensor
    piece_heads: int
    off: int
    dst: int
    width: int


class HeadCopier:
    """Per-cache views with the heads dim kept, and the head-range scatter (see the module)."""

    def __init__(self, copier: BlockCopierLike, views: list[torch.Tensor], block_dim: int,
                 row: int = 0) -> None:
        """``views[g]``: group ``g`` (all layers, or one layer) as ``[*lead, NB, bs, H, D]`` in
        the copy dtype (KV dtype, or uint8 for float8), blocks along ``block_dim``. ``row``:
        the elements of a head's last dim when that is not ``D`` (``cpu_attn``'s views are
        ``[*lead, NB, H, row]``, a head's whole block as its row)."""
        geometry = copier.geometry
        if geometry.planes != 2 or len(geometry.token_shape) != 2:
            raise IncompatibleError(
                f"{copier.layout} KV caches have no head dim (one piece serves every TP rank); "
                "use scatter")
        self._copier = copier
        self._views = views
        self._block_dim = block_dim
        self._heads, dim = geometry.token_shape
        self._dim = row or dim
        self._head_bytes = copier.chunk_bytes // self._heads
        self._force_staging = False  # tests: stage on the KV device even when slots are there

    def scatter(self, chunks: Sequence[Sequence[Piece]], heads: tuple[int, int],
                block_ids: BlockIds, skip_blocks: int = 0) -> None:
        """``BlockCopier.scatter_heads``; ``skip_blocks``: the first chunk's leading blocks
        are not copied (its sources and block ids narrowed)."""
        a = self._check_heads(heads)
        if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
            raise ProtocolError("chunks must be a sequence of piece lists")
        plans = [self._resolve(pieces, a, i) for i, pieces in enumerate(chunks)]
        index = self._copier.index(block_ids, len(plans))
        skip_blocks = self._copier.check_skip(skip_blocks, len(plans))
        device = self._copier.device
        stage_bytes = max((_stage_size(segs) for segs in plans
                           if not self._whole(segs) and self._must_stage(segs)), default=0)
        staging = (torch.empty(stage_bytes, dtype=torch.uint8, device=device)
                   if stage_bytes else None)
        with torch.inference_mode():
            for i, segs in enumerate(plans):
                skip = 0 if i else skip_blocks
                if self._whole(segs):  # the piece is exactly this rank's heads: plain scatter
                    self._copier._scatter_flats([segs[0].flat[: self._copier.chunk_bytes]],
                                                index[i: i + 1], skip)
                    continue
                if staging is not None and self._must_stage(segs):
                    segs = _stage(segs, staging)
                for run in _runs(segs):
                    self._copy_run(run, index[i], skip)

    # ------------------------------------------------------------------ validation

    def _check_heads(self, heads: tuple[int, int]) -> int:
        try:
            a, b = heads
        except (TypeError, ValueError):
            raise ProtocolError(f"heads must be a pair (a, b), got {heads!r}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)) or a < 0:
            raise ProtocolError(f"heads must be non-negative integers, got {heads!r}")
        if b - a != self._heads:
            raise IncompatibleError(
                f"head range [{a}, {b}) has {b - a} heads; this KV cache holds {self._heads}")
        return a

    def _resolve(self, pieces: Sequence[Piece], a: int, chunk: int) -> list[_Segment]:
        """Checked pieces of one chunk -> its segments in head order (first covering piece wins)."""
        if isinstance(pieces, (str, bytes)) or not isinstance(pieces, Sequence):
            raise ProtocolError(f"chunk {chunk}: pieces must be a sequence of (slot, lo, hi)")
        b = a + self._heads
        checked: list[tuple[torch.Tensor, int, int]] = []
        for piece in pieces:
            try:
                slot, lo, hi = piece
            except (TypeError, ValueError):
                raise ProtocolError(
                    f"chunk {chunk}: a piece must be (slot, lo, hi), got {piece!r}") from None
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not (
                    0 <= lo < hi):
                raise ProtocolError(f"chunk {chunk}: bad piece head range ({lo!r}, {hi!r})")
            checked.append((self._piece_bytes(slot, hi - lo), lo, hi))
        segments: list[_Segment] = []
        head = a
        while head < b:
            found = next(((i, p) for i, p in enumerate(checked) if p[1] <= head < p[2]), None)
            if found is None:
                gap_end = min([lo for _, lo, _ in checked if lo > head] + [b])
                raise ProtocolError(
                    f"chunk {chunk}: no piece covers heads [{head}, {gap_end}) of [{a}, {b})")
            first, (flat, lo, hi) = found
            end = min(hi, b)
            for _, olo, _ in checked[:first]:  # an earlier piece starting inside takes over
                if head < olo < end:
                    end = olo
            segments.append(_Segment(flat, hi - lo, head - lo, head - a, end - head))
            head = end
        return segments

    def _piece_bytes(self, slot: torch.Tensor, piece_heads: int) -> torch.Tensor:
        """A piece slot's first ``chunk_bytes * piece_heads / heads`` bytes as flat uint8."""
        dtype = self._copier.dtype
        if not isinstance(slot, torch.Tensor):
            raise ProtocolError(f"a piece slot must be a tensor, got {type(slot).__name__}")
        if slot.dtype not in (torch.uint8, dtype):
            raise IncompatibleError(
                f"piece slot dtype {slot.dtype} is neither uint8 nor the KV dtype {dtype}")
        if not slot.is_contiguous():
            raise IncompatibleError("piece slot must be contiguous")
        need = self._head_bytes * piece_heads
        nbytes = slot.numel() * slot.element_size()
        if nbytes < need:
            raise IncompatibleError(
                f"piece slot of {nbytes} bytes is smaller than a piece of {piece_heads} heads "
                f"({need} bytes)")
        if slot.data_ptr() % dtype.itemsize:
            raise IncompatibleError(f"piece slot address is not aligned to the {dtype} item size")
        return slot.reshape(-1).view(torch.uint8)[:need]

    # ------------------------------------------------------------------ copies

    def _whole(self, segs: list[_Segment]) -> bool:
        return len(segs) == 1 and segs[0].width == self._heads == segs[0].piece_heads

    def _must_stage(self, segs: list[_Segment]) -> bool:
        return self._force_staging or any(s.flat.device != self._copier.device for s in segs)

    def _copy_run(self, run: list[_Segment], index: torch.Tensor, skip: int = 0) -> None:
        """One ``index_copy_`` per group for segments fused into one strided source view (but
        the first ``skip`` blocks: the source and ``index`` narrowed)."""
        first = run[0]
        n, width, dim = len(run), first.width, self._dim
        step = run[1].flat.data_ptr() - first.flat.data_ptr() if n > 1 else 0
        bpc = self._copier.blocks_per_chunk
        for group, view in enumerate(self._views):
            isz = view.element_size()
            lead = list(view.shape[: self._block_dim])
            # the piece, viewed [groups, *lead, bpc, bs, piece_heads, D]: contiguous strides
            src_shape = [len(self._views), *lead, bpc, *view.shape[self._block_dim + 1: -2],
                         first.piece_heads, dim]
            src_strides = _contiguous_strides(src_shape, isz)
            src_addr = (first.flat.data_ptr() + group * src_strides[0]
                        + first.off * src_strides[-2])
            src_strides = src_strides[1:-2]
            dst_strides = [s * isz for s in view.stride()[:-2]]
            sh, sd = (s * isz for s in view.stride()[-2:])
            dst_addr = view.data_ptr() + first.dst * sh
            shape = [*view.shape[:-2], n, width, dim]
            shape[self._block_dim] = bpc  # the source's shape; the cache has NB blocks there
            src_strides += [step, dim * isz, isz]
            dst_strides += [width * sh, sh, sd]
            if sd == isz and sh == dim * isz:  # rows of width * D elements on both sides
                shape[-2:] = [width * dim]
                del src_strides[-2], dst_strides[-2]
            # rows contiguous on both sides may be widened; else copy single items
            row_bytes = shape[-1] * isz if dst_strides[-1] == isz else isz
            unit = _widest_unit(row_bytes, [
                *src_strides[:-1], *dst_strides[:-1], src_addr, dst_addr,
                first.flat.untyped_storage().data_ptr(), view.untyped_storage().data_ptr()])
            if unit < isz:
                raise IncompatibleError("KV cache or piece address is not aligned to its items")
            if row_bytes > isz:
                shape[-1] = row_bytes // unit
                src_strides[-1] = dst_strides[-1] = unit
            dst_shape = list(shape)
            dst_shape[self._block_dim] = view.shape[self._block_dim]
            src = _strided(first.flat, src_addr, shape, src_strides, unit)
            dst = _strided(view, dst_addr, dst_shape, dst_strides, unit)
            if skip:
                src = src.narrow(self._block_dim, skip, bpc - skip)
            dst.index_copy_(self._block_dim, index[skip:] if skip else index, src)


def _runs(segs: list[_Segment]) -> list[list[_Segment]]:
    """Consecutive segments that fit one strided view (see the module docstring)."""
    runs: list[list[_Segment]] = []
    for seg in segs:
        run = runs[-1] if runs else None
        if run is not None and _fits(run, seg):
            run.append(seg)
        else:
            runs.append([seg])
    return runs


def _fits(run: list[_Segment], seg: _Segment) -> bool:
    first, last = run[0], run[-1]
    if (seg.width != first.width or seg.off != first.off or seg.piece_heads != first.piece_heads
            or seg.flat.device != first.flat.device
            or seg.flat.untyped_storage().data_ptr() != first.flat.untyped_storage().data_ptr()):
        return False
    step = seg.flat.data_ptr() - last.flat.data_ptr()
    if len(run) > 1:
        return step == last.flat.data_ptr() - run[-2].flat.data_ptr()
    return step > 0


def _stage_size(segs: list[_Segment]) -> int:
    return sum(_round_up(flat.numel()) for flat in _distinct(segs))


def _stage(segs: list[_Segment], staging: torch.Tensor) -> list[_Segment]:
    """Copy each distinct piece whole into ``staging`` (in head order, back to back) and point the
    segments there."""
    moved: dict[int, torch.Tensor] = {}
    offset = 0
    for flat in _distinct(segs):
        size = flat.numel()
        moved[id(flat)] = staging[offset: offset + size].copy_(flat, non_blocking=True)
        offset += _round_up(size)
    return [_Segment(moved[id(s.flat)], s.piece_heads, s.off, s.dst, s.width) for s in segs]


def _distinct(segs: list[_Segment]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for s in segs:
        seen.setdefault(id(s.flat), s.flat)
    return list(seen.values())


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _STAGE_ALIGN) * _STAGE_ALIGN


def _contiguous_strides(shape: list[int], itemsize: int) -> list[int]:
    strides, acc = [], itemsize
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def _widest_unit(row_bytes: int, values: list[int]) -> int:
    """The widest element that divides the row, every stride and every address."""
    g = math.gcd(row_bytes, *values)
    return next(u for u in _UNITS if g % u == 0)


def _strided(base: torch.Tensor, addr: int, shape: list[int], strides: list[int],
             unit: int) -> torch.Tensor:
    """A view of ``base``'s storage as ``_UNITS[unit]`` at byte address ``addr`` with byte
    ``strides`` (all multiples of ``unit``)."""
    storage = base.untyped_storage()
    offset = addr - storage.data_ptr()
    out = torch.empty(0, dtype=_UNITS[unit], device=base.device)
    return out.set_(storage, offset // unit, shape, [s // unit for s in strides])
