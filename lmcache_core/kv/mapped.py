"""Server side: a worker's KV caches mapped from their descriptors, with gather/scatter.

``MappedKVCache.open`` attaches each distinct shared-memory segment once and views every layer in
it (zero-copy; layers of one segment share one storage, so equally spaced layers are copied with
one op per chunk), or opens CUDA IPC handles on the GPU whose UUID the worker reported.
``close()`` drops every view and segment at once, so the pages are unmapped right away unless a
copy still running in another thread holds a view (then when that copy ends).

A shared-memory mapping's page tables are filled in the background right after ``open``
(``SharedSegment.populate``): a page this process touches for the first time costs a fault, and a
load into blocks the server had not touched yet took 2.5x as long (24 MiB: ~25 ms instead of
~10; ``scripts/profile_hit.py``). Copies never wait for it: before it reaches a page, that page
faults in as before.

The server passes the registering worker's pid and its allowed uids, so only segments lmcache made
for that worker, owned by an allowed user, are mapped (see :mod:`.shm`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence

import torch

from lmcache_core.errors import IncompatibleError, NotRegisteredError, ProtocolError
from lmcache_core.keys import LayoutGroup, layout_key
from lmcache_core.kv.copy import BlockCopier, BlockIds
from lmcache_core.kv.cuda_ipc import StorageKey, open_cuda_tensor, require_cuda
from lmcache_core.kv.layout import kv_geometry
from lmcache_core.kv.shm import SegmentFile, SharedSegment
from lmcache_core.kv.tensors import check_no_overlap, parse_dtype
from lmcache_core.protocol.messages import KVLayoutName, TensorDescriptor

logger = logging.getLogger(__name__)
#: How long ``close`` waits for a populate step to end (one takes milliseconds; a machine that is
#: swamped may take longer, and then the mapping goes when that step ends).
POPULATE_JOIN_S = 2.0


class MappedKVCache:
    """One registered worker's per-layer KV tensors, mapped into this process."""

    def __init__(
        self,
        copier: BlockCopier,
        segments: Sequence[SharedSegment] = (),
        cuda_storages: Sequence[torch.UntypedStorage] = (),
    ) -> None:
        self._copier: BlockCopier | None = copier
        self._segments = list(segments)
        self._cuda_storages = list(cuda_storages)
        self._info = _Frozen(copier)  # figures stay readable after close()
        self._stop_populate = threading.Event()
        self._populator: threading.Thread | None = None

    @classmethod
    def open(
        cls,
        layers: Sequence[TensorDescriptor],
        layout: KVLayoutName,
        block_size: int,
        chunk_size: int,
        *,
        owner_pid: int | None = None,
        allowed_uids: Collection[int] = (),
    ) -> MappedKVCache:
        """Map ``layers`` (in layer order). IncompatibleError/NotRegisteredError/ProtocolError
        name what does not fit; nothing stays mapped after a failure.

        Shared-memory segments must be owned by this process's euid or one of ``allowed_uids``,
        and with ``owner_pid`` be named as lmcache names that process's segments."""
        descs = list(layers)
        dtype = _check_descriptors(descs, layout, block_size, chunk_size)
        segments: dict[str, SharedSegment] = {}
        storages: dict[StorageKey, torch.UntypedStorage] = {}
        try:
            if descs[0].kind == "shm":
                tensors = [_open_shm_tensor(d, dtype, segments, owner_pid, allowed_uids)
                           for d in descs]
            else:
                require_cuda("a KV cache shared with kind='cuda'")
                tensors = [open_cuda_tensor(d, dtype, storages, owner_pid, allowed_uids)
                           for d in descs]
            copier = BlockCopier(tensors, layout, chunk_size)
        except BaseException:
            for segment in segments.values():
                segment.close()
            raise
        mapped = cls(copier, list(segments.values()), list(storages.values()))
        mapped.populate_in_background()
        return mapped

    def populate_in_background(self) -> None:
        """Fill the page tables of the shared-memory segments on a daemon thread (see the module
        docstring); ``close`` stops it within one step. Nothing for CUDA IPC mappings."""
        if not self._segments or self._populator is not None:
            return
        self._populator = threading.Thread(target=self._populate, name="lmcache-populate",
                                           daemon=True)
        self._populator.start()

    def _populate(self) -> None:
        for segment in list(self._segments):
            try:
                if segment.populate(self._stop_populate) is None:
                    return  # the kernel lacks MADV_POPULATE_WRITE: pages fault in on first use
            except OSError as exc:  # e.g. the owner truncated it: the copies' check reports that
                logger.debug("populating %s stopped: %s", segment.name, exc)

    # ------------------------------------------------------------------ properties

    @property
    def closed(self) -> bool:
        return self._copier is None

    @property
    def chunk_bytes(self) -> int:
        return self._info.chunk_bytes

    @property
    def blocks_per_chunk(self) -> int:
        return self._info.blocks_per_chunk

    @property
    def num_blocks(self) -> int:
        return self._info.num_blocks

    @property
    def num_layers(self) -> int:
        return self._info.num_layers

    @property
    def block_size(self) -> int:
        return self._info.block_size

    @property
    def chunk_size(self) -> int:
        return self._info.chunk_size

    @property
    def layout(self) -> KVLayoutName:
        return self._info.layout

    @property
    def dtype(self) -> torch.dtype:
        return self._info.dtype

    @property
    def device(self) -> torch.device:
        return self._info.device

    @property
    def token_shape(self) -> tuple[int, ...]:
        """Per token and plane: ``(heads, head_size)``, or ``(latent size,)`` for MLA."""
        return self._info.token_shape

    def fingerprint(self, world_size: int, group: LayoutGroup | None = None) -> str:
        """The layout fingerprint (``keys.layout_key``) of this cache as one rank of
        ``world_size``: dtype, layers, the heads of all ranks, head size, MLA or not (and the
        KV-cache ``group`` of a hybrid model), the block size of a ``cpu_attn`` cache (its chunks
        are in its block order)."""
        mla = self.layout == "mla"
        heads = 1 if mla else self.token_shape[0] * world_size
        dtype = str(self.dtype).removeprefix("torch.")
        block_tokens = self.block_size if self.layout == "cpu_attn" else 0
        return layout_key(dtype, self.num_layers, heads, self.token_shape[-1], mla, group,
                          block_tokens=block_tokens)

    @property
    def stacked(self) -> bool:
        """True when one op per chunk covers every layer."""
        return self._info.stacked

    @property
    def shm_names(self) -> list[str]:
        return [s.name for s in self._segments]

    @property
    def shm_files(self) -> list[SegmentFile]:
        """The segment files as mapped (readable after close(): the reaper checks them)."""
        return [s.file for s in self._segments]

    @property
    def layers(self) -> list[torch.Tensor]:
        """The mapped per-layer tensors (keep no reference past close())."""
        return self._live().layers

    # ------------------------------------------------------------------ copies

    def gather(self, block_ids: BlockIds, slots: Sequence[torch.Tensor]) -> None:
        """Copy chunk ``i``'s blocks of every layer into ``slots[i]`` (flat uint8 tensors)."""
        self._live().gather(block_ids, slots)

    def scatter(self, slots: Sequence[torch.Tensor], block_ids: BlockIds,
                skip_blocks: int = 0) -> None:
        """Copy ``slots[i]`` into chunk ``i``'s blocks of every layer, but the first chunk's
        leading ``skip_blocks`` (``BlockCopier.scatter``)."""
        self._live().scatter(slots, block_ids, skip_blocks)

    def scatter_heads(self, chunks: Sequence[Sequence[tuple[torch.Tensor, int, int]]],
                      heads: tuple[int, int], block_ids: BlockIds,
                      skip_blocks: int = 0) -> None:
        """Copy chunk ``i``, held as pieces ``chunks[i]`` of other head ranges, into its blocks
        (``BlockCopier.scatter_heads``: this cache holds heads ``heads`` of the model)."""
        self._live().scatter_heads(chunks, heads, block_ids, skip_blocks)

    def _live(self) -> BlockCopier:
        """The copier, once every segment is checked still whole: a worker that truncated its
        segment would make the copy fault (SIGBUS ends the server, every worker's session with
        it). One that does so during a copy still can; a check per copy catches the rest."""
        copier = self._copier
        if copier is None:
            raise NotRegisteredError("this KV cache was unregistered (its mapping is closed)")
        for segment in self._segments:
            size = segment.shrunk()
            if size is not None:
                raise IncompatibleError(
                    f"shared-memory segment {segment.name!r} shrank to {size} bytes since it was "
                    f"registered ({segment.nbytes}): its owner truncated it; register again")
        return copier

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Drop all views and unmap now (idempotent). A populate in progress is stopped first:
        its current step (``POPULATE_STEP``, a few ms) holds the mapping until it ends."""
        self._stop_populate.set()
        populator = self._populator
        if populator is not None and populator is not threading.current_thread():
            populator.join(POPULATE_JOIN_S)
        self._copier = None
        self._cuda_storages.clear()
        for segment in self._segments:
            segment.close()

    def __enter__(self) -> MappedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (f"MappedKVCache({self.layout}, {self.num_layers} layers, {self.num_blocks} blocks, "
                f"chunk {self.chunk_bytes} bytes, {self.device}, {state})")


class _Frozen:
    """The copier's figures without its tensors, so a closed cache still reports them."""

    def __init__(self, src: BlockCopier) -> None:
        self.chunk_bytes = src.chunk_bytes
        self.blocks_per_chunk = src.blocks_per_chunk
        self.num_blocks = src.num_blocks
        self.num_layers = src.num_layers
        self.block_size = src.block_size
        self.chunk_size = src.chunk_size
        self.layout: KVLayoutName = src.layout
        self.dtype = src.dtype
        self.device = src.device
        self.stacked = src.stacked
        self.token_shape = src.geometry.token_shape


def _check_descriptors(
    descs: list[TensorDescriptor], layout: KVLayoutName, block_size: int, chunk_size: int,
) -> torch.dtype:
    if not descs:
        raise ProtocolError("a KV cache registration needs at least one layer")
    if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
        raise IncompatibleError(
            f"chunk size {chunk_size} is not a positive multiple of the KV block size "
            f"{block_size}")
    first = descs[0]
    for i, d in enumerate(descs):
        if (d.kind, d.dtype, d.shape, d.stride) != (first.kind, first.dtype, first.shape,
                                                     first.stride):
            raise IncompatibleError(
                f"KV layer {i} ({d.kind}, {d.dtype}, {d.shape}, stride {d.stride}) differs from "
                f"layer 0 ({first.kind}, {first.dtype}, {first.shape}, stride {first.stride})")
    check_no_overlap(first.shape, first.stride)
    geometry = kv_geometry(first.shape, layout)
    if geometry.block_size != block_size:
        raise IncompatibleError(
            f"KV layer shape {first.shape} ({layout}) has block size {geometry.block_size}, but "
            f"the registration says {block_size}")
    return parse_dtype(first.dtype)


def _open_shm_tensor(
    desc: TensorDescriptor, dtype: torch.dtype, segments: dict[str, SharedSegment],
    owner_pid: int | None, allowed_uids: Collection[int],
) -> torch.Tensor:
    segment = segments.get(desc.shm_name)
    if segment is None:
        segment = SharedSegment.attach(desc.shm_name, expected_min_nbytes=desc.segment_nbytes,
                                       owner_pid=owner_pid, allowed_uids=allowed_uids)
        segments[desc.shm_name] = segment
    return segment.tensor(dtype, desc.shape, desc.stride, desc.offset_bytes)
