"""Worker side: allocate KV caches the server can map, and describe them for registration.

CPU hosts share KV caches through POSIX shared memory (:mod:`.shm`); GPU hosts through CUDA IPC
handles (:mod:`.cuda_ipc`). Segments this process creates are kept in a process-local registry so
:func:`describe_kv_caches` can tell which segment (and offset) a tensor lives in from its address.
Their names stay linked while this process lives, so it can register them again (with a server
that restarted, or after sleep mode); they are unlinked by :func:`release_shared_kv_caches` or, failing
that, at interpreter exit. A process killed before either leaves its names behind: the server that
reaps it, or the next server that starts, unlinks them (the name says which process created it).

A CPU tensor that is not in shared memory is moved there in place: its bytes are copied into a new
segment and ``torch.utils.swap_tensors`` swaps the new tensor into the caller's tensor *object*,
so every Python reference to that object (a dict value, an attention layer's attribute) sees the
shared memory from then on. That is refused with a clear error when something else aliases the
tensor's memory (a view taken from it, a weak reference, autograd), since such aliases would keep
pointing at the old memory. Memory reachable only through a tensor the caller holds that this
process cannot see (e.g. the raw buffer the layer was viewed from) is not followed: allocate with
:func:`allocate_shared_kv_caches` to avoid the question altogether.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch

from lmcache_core.errors import IncompatibleError
from lmcache_core.kv.cuda_ipc import cuda_descriptor, export_storage
from lmcache_core.kv.layout import detect_layout, kv_geometry
from lmcache_core.kv.shm import (
    NAME_FORM,
    SharedSegment,
    parse_segment_name,
    pid_namespace,
    scoped_prefix,
    validate_segment_name,
)
from lmcache_core.kv.tensors import (
    check_uniform_layers,
    contiguous_stride,
    dtype_name,
    numel,
    round_up,
    span_elems,
)
from lmcache_core.protocol.messages import KVLayoutName, TensorDescriptor

ALIGN = 64  # bytes; each layer starts on a cache line
DEFAULT_PREFIX = "lmcache-kv"

_LOCK = threading.Lock()
_OWNED: list[SharedSegment] = []
_ATEXIT_REGISTERED = False


# ---------------------------------------------------------------- registry


def register_segment(segment: SharedSegment) -> None:
    """Track ``segment`` so tensors in it can be described (and unlinked at exit if owned)."""
    global _ATEXIT_REGISTERED
    with _LOCK:
        if all(s is not segment for s in _OWNED):
            _OWNED.append(segment)
        if not _ATEXIT_REGISTERED:
            atexit.register(_unlink_all_owned)
            _ATEXIT_REGISTERED = True


def find_segment(address: int, nbytes: int) -> tuple[SharedSegment, int] | None:
    """The registered segment holding bytes ``[address, address + nbytes)``, and the offset."""
    with _LOCK:
        segments = [s for s in _OWNED if not s.closed]
    for segment in segments:
        base = segment.address
        if base <= address and address + nbytes <= base + segment.nbytes:
            return segment, address - base
    return None


def new_segment_name(prefix: str | None = None) -> str:
    """``<prefix>-<pid>-<pid namespace>-<12 random hex>``, a fresh segment name (with this
    process's scope word after ``lmcache``, ``shm.scoped_prefix``).

    ``prefix`` is ``lmcache`` or starts with ``lmcache-`` (letters, digits, ``_`` and ``.`` between
    dashes): a server maps and cleans up only names of this form, created by the registering pid.
    """
    prefix = scoped_prefix(prefix or DEFAULT_PREFIX)
    name = f"{prefix}-{os.getpid()}-{pid_namespace()}-{secrets.token_hex(6)}"
    if parse_segment_name(name) is None:
        raise ValueError(f"shared-memory name prefix {prefix!r} does not give a name of the form "
                         f"{NAME_FORM} (a server would refuse it)")
    return validate_segment_name(name)


def release_shared_kv_caches(
    segments: SharedSegment | Iterable[SharedSegment] | None = None,
) -> int:
    """Unlink and close ``segments`` (all registered ones when None); how many were released.

    Unlinking removes the name only; this process's tensors stay valid until dropped, and a server
    that already mapped the segment keeps its mapping until it unregisters.
    """
    with _LOCK:
        if segments is None:
            chosen = list(_OWNED)
        elif isinstance(segments, SharedSegment):
            chosen = [segments]
        else:
            chosen = list(segments)
        for segment in chosen:
            if any(s is segment for s in _OWNED):
                _OWNED.remove(segment)
    for segment in chosen:
        segment.unlink()
        segment.close()
    return len(chosen)


def _unlink_all_owned() -> None:
    with _LOCK:
        owned = [s for s in _OWNED if s.owner]
    for segment in owned:
        segment.unlink()


# ---------------------------------------------------------------- allocation


def allocate_shared_kv_caches(
    num_layers: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    name_prefix: str | None = None,
    layer_names: Sequence[str] | None = None,
) -> tuple[dict[str, torch.Tensor], SharedSegment]:
    """``num_layers`` zeroed, contiguous KV tensors of ``shape``/``dtype`` in ONE new segment.

    Layers sit at equal strides, so the server copies a chunk of all layers with one op. Keys are
    ``layer_names`` (in layer order) or ``layer_0``, ``layer_1``, ...
    """
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    names = list(layer_names) if layer_names is not None else [
        f"layer_{i}" for i in range(num_layers)]
    if len(names) != num_layers or len(set(names)) != num_layers:
        raise ValueError(f"need {num_layers} distinct layer names, got {names}")
    shape = [int(s) for s in shape]
    layer_bytes = numel(shape) * dtype.itemsize
    if layer_bytes <= 0:
        raise ValueError(f"KV cache shape {shape} is empty")
    step = round_up(layer_bytes, ALIGN)
    segment = SharedSegment.create(new_segment_name(name_prefix), step * num_layers)
    register_segment(segment)
    stride = contiguous_stride(shape)
    caches = {name: segment.tensor(dtype, shape, stride, i * step) for i, name in enumerate(names)}
    return caches, segment


def move_to_shared_memory(
    tensors: Sequence[torch.Tensor],
    name_prefix: str | None = None,
    names: Sequence[str] | None = None,
) -> SharedSegment:
    """Move CPU ``tensors`` into one new segment in place (same objects, shapes and strides).

    IncompatibleError, with nothing changed, if any tensor cannot be moved safely.
    """
    labels = list(names) if names is not None else [str(i) for i in range(len(tensors))]
    by_id: dict[int, tuple[str, torch.Tensor]] = {}
    for label, t in zip(labels, tensors, strict=True):
        by_id.setdefault(id(t), (label, t))
    unique = [t for _, t in by_id.values()]
    for label, t in by_id.values():
        reason = _unmovable_reason(t)
        if reason:
            raise _not_shared_error(label, reason)
    aliased = _aliased(unique) or _overlapping(unique)
    if aliased:
        raise _not_shared_error(by_id[id(aliased[0])][0], aliased[1])
    spans = [span_elems(t.shape, t.stride()) * t.element_size() for t in unique]
    steps = [round_up(max(s, 1), ALIGN) for s in spans]
    segment = SharedSegment.create(new_segment_name(name_prefix), max(sum(steps), 1))
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        offset = 0
        for t, step in zip(unique, steps, strict=True):
            dst = segment.tensor(t.dtype, list(t.shape), list(t.stride()), offset)
            dst.copy_(t)
            offset += step
            torch.utils.swap_tensors(t, dst)
            swapped.append((t, dst))
    except Exception as exc:
        for t, dst in reversed(swapped):
            torch.utils.swap_tensors(t, dst)
        segment.unlink()
        segment.close()
        raise _not_shared_error(
            ", ".join(labels), f"the in-place move failed: {exc}") from exc
    register_segment(segment)
    return segment


def _unmovable_reason(t: torch.Tensor) -> str:
    if type(t) is not torch.Tensor:
        return f"it is a {type(t).__name__}, not a plain torch.Tensor"
    if t.device.type != "cpu":
        return f"it is on {t.device}"
    if t.requires_grad:
        return "it requires grad"
    if weakref.getweakrefs(t):
        return "weak references to it exist"
    if t._use_count() != 1:  # type: ignore[attr-defined]
        return "views of it or other references to its tensor exist"
    return ""


def _aliased(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, str] | None:
    """A tensor whose storage other tensors (not ``tensors`` nor their view bases) also use."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # private API gone: cannot tell, rely on the other checks
        return None
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    ours = {id(t) for t in tensors}
    for group in groups.values():
        bases = {id(t._base) for t in group if t._base is not None} - ours
        storage = group[0].untyped_storage()
        known = len(group) + len(bases) + 1  # + this Python storage object
        foreign = int(use_count(storage._cdata)) - known
        if foreign > 0:
            return group[0], f"{foreign} other tensor(s) share its memory"
    return None


def _overlapping(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, str] | None:
    spans = sorted(
        ((t.data_ptr(), t.data_ptr() + span_elems(t.shape, t.stride()) * t.element_size(), t)
         for t in tensors), key=lambda r: r[0])
    for (_, end, _), (start, _, t) in itertools.pairwise(spans):
        if start < end:
            return t, "it overlaps another KV tensor"
    return None


def _not_shared_error(name: str, reason: str) -> IncompatibleError:
    return IncompatibleError(
        f"KV cache tensor {name!r} is not in shared memory and cannot be moved there in place "
        f"({reason}); allocate the KV caches with "
        "lmcache_core.kv.share.allocate_shared_kv_caches(...) so the server can map them")


# ---------------------------------------------------------------- description


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    layout: KVLayoutName | None = None,
    *,
    move_to_shared: bool = True,
) -> tuple[KVLayoutName, int, list[TensorDescriptor]]:
    """``(layout, block_size, descriptors)`` of the layers, in ``kv_caches`` order.

    CPU tensors must live in a registered shared segment; those that do not are moved into one in
    place (``move_to_shared``) or refused with an IncompatibleError. CUDA tensors get CUDA IPC
    handles (one export per storage).
    """
    names = list(kv_caches)
    layers = [kv_caches[n] for n in names]
    check_uniform_layers(layers)
    first = layers[0]
    chosen: KVLayoutName = layout or detect_layout(first.shape)
    block_size = kv_geometry(first.shape, chosen).block_size
    if first.device.type == "cuda":
        return chosen, block_size, _describe_cuda(layers)
    if first.device.type != "cpu":
        raise IncompatibleError(f"KV caches on {first.device} cannot be shared (cpu or cuda only)")
    return chosen, block_size, _describe_shm(names, layers, move_to_shared)


def _describe_shm(
    names: list[str], layers: list[torch.Tensor], move_to_shared: bool,
) -> list[TensorDescriptor]:
    missing = [(n, t) for n, t in zip(names, layers, strict=True) if _locate(t) is None]
    if missing and not move_to_shared:
        raise _not_shared_error(missing[0][0], "moving was not allowed")
    if missing:
        move_to_shared_memory([t for _, t in missing], names=[n for n, _ in missing])
    out = []
    for name, t in zip(names, layers, strict=True):
        found = _locate(t)
        if found is None:  # pragma: no cover - the move registers the segment
            raise _not_shared_error(name, "it is not in any registered segment")
        segment, offset = found
        out.append(TensorDescriptor(
            kind="shm",
            dtype=dtype_name(t.dtype),
            shape=list(t.shape),
            stride=list(t.stride()),
            offset_bytes=offset,
            segment_nbytes=segment.nbytes,
            shm_name=segment.name,
        ))
    return out


def _locate(t: torch.Tensor) -> tuple[SharedSegment, int] | None:
    nbytes = span_elems(t.shape, t.stride()) * t.element_size()
    return find_segment(t.data_ptr(), nbytes)


def _describe_cuda(layers: list[torch.Tensor]) -> list[TensorDescriptor]:
    handles = {}
    out = []
    for t in layers:
        key = (t.device.index, t.untyped_storage().data_ptr())
        if key not in handles:
            handles[key] = export_storage(t)
        out.append(cuda_descriptor(t, handles[key]))
    return out
