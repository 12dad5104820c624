"""LMCache's requests in our terms: its keys as our chunk hashes, its block-id groups as ours, its
``cpu_shm`` layers as our tensor descriptors (torch's dtypes: only where a KV cache registers).

A key's ``token_ids[0:end]`` become blake3 chain hashes (LMCache's chain, ours too), the chunks
``[start, end)`` of it are the ones named, and ``(world_size, worker_id)`` is our
``(world_size, kv_rank)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from lmcache_core.errors import IncompatibleError, clip
from lmcache_core.keys import chain_hashes, salt_prefix, tenant_tag
from lmcache_core.kv.layout import check_cpu_attn_strides
from lmcache_core.protocol import lmcache_wire as w
from lmcache_core.protocol import messages as m


def check_range(key: w.IPCCacheServerKey, chunk_size: int) -> None:
    """LMCache's STORE/RETRIEVE assertions: chunk-aligned ``[start, end)`` within the tokens."""
    if key.start % chunk_size or key.end % chunk_size or key.start > key.end \
            or key.end > len(key.token_ids):
        raise w.DialectError(f"[{key.start}, {key.end}) is not chunk-aligned ({chunk_size}) "
                           f"within {len(key.token_ids)} tokens")


def key_hashes(key: w.IPCCacheServerKey, chunk_size: int, *, from_start: bool = True) -> list[bytes]:
    """The chain hashes of the complete chunks of ``token_ids[0:end]``, those from ``start`` on
    (or all of them: a lookup ignores ``start``). A ``cache_salt`` seeds the chain as in our own
    token mode (``keys.salt_prefix``), so tenants with different salts never share chunks, in
    either dialect; LMCache's server puts the salt in the object key instead."""
    hashes = chain_hashes(key.token_ids[:key.end], chunk_size, salt_prefix(key.cache_salt))
    return hashes[key.start // chunk_size:] if from_start else hashes


def lookup_request(key: w.IPCCacheServerKey, chunk_size: int) -> m.LookupRequest:
    """A LOOKUP (worker_id None: every rank) as our locking lookup under its request id."""
    if key.num_kv_readers < 1:
        raise w.DialectError("num_kv_readers must be at least 1")
    return m.LookupRequest(model_name=key.model_name, world_size=key.world_size,
                           lookup_id=key.request_id,
                           chunk_hashes=key_hashes(key, chunk_size, from_start=False))


def _flat_blocks(groups: Sequence[Sequence[int]], num_chunks: int, per_chunk: int) -> list[int]:
    """The block ids of ``num_chunks`` chunks; one KV group only (hybrid models are not served)."""
    if len(groups) != 1:
        raise w.DialectError(f"{len(groups)} KV groups: this server serves one plain group")
    blocks = list(groups[0])
    if len(blocks) < num_chunks * per_chunk:
        raise ValueError("too few block ids")  # LMCache answers this in-band: (event, False)
    return blocks[:num_chunks * per_chunk]


def store_request(key: w.IPCCacheServerKey, instance_id: int, groups: Sequence[Sequence[int]],
                  chunk_size: int, per_chunk: int, event_handle: bytes = b"") -> m.StoreRequest:
    """A STORE of chunks ``[start, end)`` into our store (``ValueError``: answer ``False``), for
    its ``cache_salt``'s tenant (``server.tenant_quotas``), as our workers' stores."""
    check_range(key, chunk_size)
    hashes = key_hashes(key, chunk_size)
    return m.StoreRequest(instance_id=instance_id, chunk_hashes=hashes,
                          block_ids=_flat_blocks(groups, len(hashes), per_chunk),
                          request_ids=[key.request_id], tenant=tenant_tag(key.cache_salt),
                          event_handle=event_handle, hash_mode="tokens")


def retrieve_request(key: w.IPCCacheServerKey, instance_id: int, groups: Sequence[Sequence[int]],
                     chunk_size: int, per_chunk: int, skip_tokens: int = 0,
                     event_handle: bytes = b"") -> tuple[m.RetrieveRequest, list[bytes]]:
    """A RETRIEVE of chunks ``[start, end)``, consuming the locks of its request's LOOKUP, and
    the hashes of the chunks it leaves out.

    The whole chunks within the first ``skip_tokens`` of the range (blocks vLLM's prefix cache
    already holds) are left out (their lookup reads are the caller's to count); a chunk only
    partly within them is written whole."""
    check_range(key, chunk_size)
    hashes = key_hashes(key, chunk_size)
    blocks = _flat_blocks(groups, len(hashes), per_chunk)
    skip = min(skip_tokens // chunk_size, len(hashes))
    request = m.RetrieveRequest(instance_id=instance_id, chunk_hashes=hashes[skip:],
                                block_ids=blocks[skip * per_chunk:],
                                lookup_id=key.request_id, request_ids=[key.request_id],
                                event_handle=event_handle)
    return request, hashes[:skip]


def tensor_descriptor(layer: w.CpuShmIPCData | w.CudaIPCData) -> m.TensorDescriptor:
    """An LMCache layer as our descriptor: ``cpu_shm`` as shared memory (its leading '/' dropped),
    ``cuda`` as a CUDA IPC handle of its storage (the same fields as our own workers export:
    ``kv.cuda_ipc``'s checks, events and reaping then apply as to theirs)."""
    meta = layer.metadata
    from lmcache_core.kv.tensors import parse_dtype  # torch only where a KV cache is registered
    try:
        itemsize = parse_dtype(meta.dtype).itemsize
    except Exception as exc:
        raise w.DialectError(f"unsupported dtype {meta.dtype!r}: {clip(str(exc))}") from None
    offset = meta.storage_offset * itemsize
    if isinstance(layer, w.CudaIPCData):
        return _cuda_descriptor(layer, offset)
    if meta.device_uuid != "cpu":
        raise w.DialectError(f"cpu_shm descriptor on device {meta.device_uuid!r}")
    return m.TensorDescriptor(kind="shm", dtype=meta.dtype, shape=meta.shape, stride=meta.stride,
                              offset_bytes=offset, segment_nbytes=layer.nbytes,
                              shm_name=layer.shm_name.lstrip("/"))


def _cuda_descriptor(layer: w.CudaIPCData, offset_bytes: int) -> m.TensorDescriptor:
    meta = layer.metadata
    device, handle, nbytes, storage_offset, counter, counter_offset, event, sync = layer.handle
    if handle is None or counter is None:
        raise w.DialectError("a cuda descriptor without its storage's IPC handle or ref counter")
    if meta.device_uuid == "cpu":
        raise w.DialectError("a cuda descriptor on the CPU")
    return m.TensorDescriptor(
        kind="cuda", dtype=meta.dtype, shape=meta.shape, stride=meta.stride,
        offset_bytes=offset_bytes, segment_nbytes=nbytes, device_uuid=meta.device_uuid,
        cuda=m.CudaIpcHandle(device=device, handle=handle, storage_nbytes=nbytes,
                             storage_offset_bytes=storage_offset, ref_counter_handle=counter,
                             ref_counter_offset=counter_offset, event_handle=event,
                             event_sync_required=sync))


def view_hnd(desc: m.TensorDescriptor) -> m.TensorDescriptor:
    """An HND tensor as a layout we serve, over the same bytes.

    5-D ``[2, NB, NH, BS, HS]`` / ``[NB, 2, NH, BS, HS]``: a flash-attn (NHD) view, the head and
    block-size dims swapped. 4-D ``[NB, NH, BS, 2*HS]`` is vLLM's CPU backend (the only vLLM
    backend on a CPU host): each (block, head) run holds ``BS`` K rows then ``BS`` V rows of
    ``HS``; it stays as it is, our ``cpu_attn`` layout, whose chunks are in its block order (as
    our own connector registers it, ``integration/vllm/kv_views.py``), so chunks match those our
    connector stores. ``desc`` comes of a decoded ``TensorMetadata``: its shape and stride pair
    (checked there)."""
    if len(desc.shape) == 4:
        try:
            check_cpu_attn_strides(desc.shape, desc.stride)
        except IncompatibleError as exc:
            raise w.DialectError(f"4-D HND tensor {desc.shape} (stride {desc.stride}) is not "
                                 f"vLLM's CPU layout [blocks, heads, block size, 2 * head size], "
                                 f"contiguous: {exc}") from None
        return desc
    if len(desc.shape) != 5:
        raise w.DialectError(f"kv_layout HND with a {len(desc.shape)}-D tensor")
    shape, stride = list(desc.shape), list(desc.stride)
    shape[2], shape[3] = shape[3], shape[2]
    stride[2], stride[3] = stride[3], stride[2]
    return msgspec.structs.replace(desc, shape=shape, stride=stride)
