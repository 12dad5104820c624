"""CUDA IPC handles of tensor storages: export on the worker, open on the server.

Nothing here touches CUDA at import time. Devices are matched by UUID, not index, because the
worker and the server may see different ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection

import torch

from lmcache_core.errors import IncompatibleError
from lmcache_core.kv.shm import SHM_DIR, check_segment_uid
from lmcache_core.kv.tensors import dtype_name, span_elems
from lmcache_core.protocol.messages import CudaIpcHandle, TensorDescriptor

StorageKey = tuple[bytes, int]
#: ``cudaIpcMemHandle_t`` and ``cudaIpcEventHandle_t``: 64 bytes each.
IPC_HANDLE_BYTES = 64
#: Counters in one of torch's reference-counter files (``CUDA_IPC_REF_COUNTER_FILE_SIZE``), 8 bytes
#: each, after a 64-byte header.
REF_COUNTERS_PER_FILE = 10_000
#: torch's name for them (``at::NewProcessWideShmHandle``): ``/torch_<pid>_<n>`` or, newer,
#: ``/torch_<pid>_<random>_<n>``.
_REF_COUNTER_NAME = re.compile(rb"/torch_(?P<pid>[1-9][0-9]{0,9})_[0-9]{1,20}(?:_[0-9]{1,20})?")


def ref_counter_pid(name: bytes) -> int | None:
    """The pid in the name of one of torch's reference-counter files (``/torch_<pid>_...``): the
    process whose CUDA memory an IPC handle exports; None for any other name."""
    match = _REF_COUNTER_NAME.fullmatch(name)
    return int(match["pid"]) if match else None


def require_cuda(what: str) -> None:
    """IncompatibleError naming ``what`` unless CUDA is usable in this process."""
    if not torch.cuda.is_available():
        raise IncompatibleError(f"{what} needs CUDA, but torch.cuda.is_available() is False here")


def device_uuid(device: torch.device | int) -> str:
    """The UUID string of a CUDA device, as carried in ``TensorDescriptor.device_uuid``."""
    return str(torch.cuda.get_device_properties(device).uuid)


def device_index_by_uuid(uuid: str) -> int:
    """The local index of the CUDA device with this UUID; IncompatibleError if none."""
    require_cuda("opening a CUDA KV cache")
    seen = []
    for index in range(torch.cuda.device_count()):
        found = device_uuid(index)
        if found == uuid:
            return index
        seen.append(found)
    raise IncompatibleError(
        f"no CUDA device with UUID {uuid} is visible to this process (visible: {seen}); run the "
        "server on the worker's host with that GPU visible")


def unexportable_settings() -> list[str]:
    """This process's allocator settings under which KV memory is not from ``cudaMalloc``, so
    ``cudaIpcGetMemHandle`` cannot export it (CUDA IPC of ``cuMemCreate`` memory needs
    ``cuMemExportToShareableHandle`` instead)."""
    found = []
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(name, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            found.append(f"{name} has expandable_segments:True")
        if "backend:cudamallocasync" in conf:
            found.append(f"{name} has backend:cudaMallocAsync")
    return found


def export_storage(tensor: torch.Tensor) -> CudaIpcHandle:
    """The IPC handle of ``tensor``'s storage (``UntypedStorage._share_cuda_()``).

    IncompatibleError naming the setting when the memory cannot be exported (vLLM's sleep-mode
    allocator, ``expandable_segments:True``, the ``cudaMallocAsync`` backend)."""
    try:
        (device, handle, size_bytes, offset_bytes, rc_handle, rc_offset, event_handle,
         event_sync) = tensor.untyped_storage()._share_cuda_()
    except RuntimeError as exc:
        raise IncompatibleError(unexportable_message(str(exc).splitlines()[0])) from None
    return CudaIpcHandle(
        device=int(device),
        handle=bytes(handle),
        storage_nbytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(rc_handle),
        ref_counter_offset=int(rc_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync),
    )


def unexportable_message(cause: str) -> str:
    """Why a KV cache could not be shared over CUDA IPC, and what to change."""
    settings = unexportable_settings()
    found = f" This process has: {'; '.join(settings)}." if settings else ""
    return (f"the KV cache cannot be shared with the lmcache server over CUDA IPC ({cause}): "
            "cudaIpcGetMemHandle exports only cudaMalloc memory, not the cuMemCreate memory of "
            "vLLM's sleep mode (--enable-sleep-mode), of PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True, or of the cudaMallocAsync backend." + found +
            " Start vLLM without these to use lmcache.")


def cuda_descriptor(tensor: torch.Tensor, handle: CudaIpcHandle) -> TensorDescriptor:
    """A ``kind="cuda"`` descriptor of ``tensor`` whose storage was exported as ``handle``."""
    return TensorDescriptor(
        kind="cuda",
        dtype=dtype_name(tensor.dtype),
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        offset_bytes=int(tensor.storage_offset()) * tensor.element_size(),
        segment_nbytes=handle.storage_nbytes,
        cuda=handle,
        device_uuid=device_uuid(tensor.device),
    )


def check_ipc_handle(handle: CudaIpcHandle, owner_pid: int | None,
                     allowed_uids: Collection[int] = ()) -> None:
    """IncompatibleError unless ``handle`` is what torch's export of ``owner_pid``'s memory makes.

    torch trusts these fields: short handles are read past their end, and when the server lets
    the storage go, torch opens ``/dev/shm<ref_counter_handle>`` read-write, grows it if small
    and decrements the counter at ``ref_counter_offset`` with no bounds check. So the handles
    must be full size, the offset one of the file's counters, and the file torch's own, of that
    process, a regular file of an allowed owner at full size."""
    if len(handle.handle) != IPC_HANDLE_BYTES or (
            handle.event_handle is not None and len(handle.event_handle) != IPC_HANDLE_BYTES):
        raise IncompatibleError(f"CUDA IPC handles are {IPC_HANDLE_BYTES} bytes")
    if handle.ref_counter_offset >= REF_COUNTERS_PER_FILE:
        raise IncompatibleError(f"ref_counter_offset {handle.ref_counter_offset} is past the "
                                f"{REF_COUNTERS_PER_FILE} counters of torch's file")
    match = _REF_COUNTER_NAME.fullmatch(handle.ref_counter_handle)
    if match is None or (owner_pid is not None and int(match["pid"]) != owner_pid):
        raise IncompatibleError(
            f"ref_counter_handle {handle.ref_counter_handle[:64]!r} is not a reference-counter "
            f"file torch made for the registering process {owner_pid}")
    name = handle.ref_counter_handle.decode()
    try:
        st = os.stat(SHM_DIR + name, follow_symlinks=False)
    except OSError as exc:
        raise IncompatibleError(f"reference-counter file {name}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size < 8 * REF_COUNTERS_PER_FILE:
        raise IncompatibleError(f"{SHM_DIR}{name} is not one of torch's reference-counter files")
    check_segment_uid(name, st.st_uid, allowed_uids)


def open_storage(handle: CudaIpcHandle, device_index: int) -> torch.UntypedStorage:
    """Map another process's storage on local device ``device_index``."""
    require_cuda("opening a CUDA IPC handle")
    torch.cuda._lazy_init()
    return torch.UntypedStorage._new_shared_cuda(
        device_index,
        handle.handle,
        handle.storage_nbytes,
        handle.storage_offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )


def open_cuda_tensor(
    desc: TensorDescriptor,
    dtype: torch.dtype,
    cache: dict[StorageKey, torch.UntypedStorage],
    owner_pid: int | None = None,
    allowed_uids: Collection[int] = (),
) -> torch.Tensor:
    """The tensor ``desc`` names, its storage opened once per (handle, offset) via ``cache``
    (its handle checked first: ``check_ipc_handle``)."""
    if desc.cuda is None:
        raise IncompatibleError("a kind='cuda' tensor descriptor carries no CUDA IPC handle")
    handle = desc.cuda
    key = (handle.handle, handle.storage_offset_bytes)
    storage = cache.get(key)
    if storage is None:
        check_ipc_handle(handle, owner_pid, allowed_uids)
        storage = open_storage(handle, device_index_by_uuid(desc.device_uuid))
        cache[key] = storage
    itemsize = dtype.itemsize
    span = span_elems(desc.shape, desc.stride) * itemsize
    if desc.offset_bytes % itemsize or desc.offset_bytes + span > storage.nbytes():
        raise IncompatibleError(
            f"CUDA tensor {desc.shape} at offset {desc.offset_bytes} ({span} bytes) does not fit "
            f"its shared storage of {storage.nbytes()} bytes")
    view = torch.empty((0,), dtype=dtype, device=storage.device)
    return view.set_(storage, desc.offset_bytes // itemsize, desc.shape, desc.stride)


def release_cached_cuda_memory() -> None:
    """Give the server's cached CUDA blocks (copy staging buffers) back to the driver, once a
    GPU mapping is closed, so the GPU's free memory shows it. No-op where CUDA was never used."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
