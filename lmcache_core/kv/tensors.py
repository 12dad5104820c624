"""Dtype names as they travel in ``TensorDescriptor.dtype``, and strided-memory arithmetic.

Torch is imported lazily (only by :func:`parse_dtype`), so shape and span checks stay cheap to
import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_core.errors import IncompatibleError, ProtocolError

if TYPE_CHECKING:
    import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name without the ``torch.`` prefix)."""
    return str(dtype).removeprefix("torch.")


#: Torch's quantized dtypes: their tensors carry scales apart from the bytes, so a view of plain
#: memory as one fails inside torch (an internal assert), never a KV cache's dtype.
_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (e.g. ``"bfloat16"``); IncompatibleError if there is none
    or it is a quantized one."""
    import torch

    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise IncompatibleError(f"unknown tensor dtype {name!r} (expected e.g. 'bfloat16')")
    if name in _QUANTIZED:
        raise IncompatibleError(f"tensor dtype {name!r} is quantized: not a KV cache dtype")
    return dtype


def check_geometry(shape: Sequence[int], stride: Sequence[int]) -> None:
    """ProtocolError unless ``shape``/``stride`` are equally long lists of non-negative ints."""
    if len(shape) != len(stride):
        raise ProtocolError(f"shape {list(shape)} and stride {list(stride)} differ in length")
    for v in (*shape, *stride):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ProtocolError(
                f"shape {list(shape)} / stride {list(stride)}: need non-negative integers")


def span_elems(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a strided tensor's first element to one past its last (0 when empty)."""
    check_geometry(shape, stride)
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))


def check_no_overlap(shape: Sequence[int], stride: Sequence[int]) -> None:
    """IncompatibleError unless no two elements of the strided view share memory.

    Sufficient (and what every real KV layout meets: a permutation of a dense layout, possibly
    padded): with the dimensions ordered by stride, each stride steps past the whole span of the
    smaller ones. A client-sent stride of 0 (or K and V at one address) would otherwise be
    accepted and make every later copy into the cache fail; and since no element is counted twice,
    the element count is at most the span, which the caller checks against the memory it maps.
    """
    check_geometry(shape, stride)
    if 0 in shape:
        return  # no elements at all
    covered = 0  # elements spanned by the dimensions taken so far, minus one
    for size, step in sorted((pair for pair in zip(shape, stride, strict=True) if pair[0] > 1),
                             key=lambda pair: pair[1]):
        if step <= covered:
            raise IncompatibleError(
                f"shape {list(shape)} with stride {list(stride)} puts several elements at one "
                f"address; a KV cache tensor must not overlap itself")
        covered += (size - 1) * step


def contiguous_stride(shape: Sequence[int]) -> list[int]:
    """Row-major strides of ``shape``."""
    stride: list[int] = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return stride[::-1]


def numel(shape: Sequence[int]) -> int:
    """Product of ``shape`` (1 for a scalar shape)."""
    return math.prod(shape)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def check_uniform_layers(layers: Sequence[torch.Tensor]) -> None:
    """ProtocolError if empty or not tensors; IncompatibleError unless all layers share one
    shape, stride, dtype and device."""
    import torch

    if not layers:
        raise ProtocolError("no KV cache layers given")
    first = layers[0]
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise ProtocolError(f"KV layer {i} is not a tensor but {type(t).__name__}")
        if (t.shape, t.stride(), t.dtype, t.device) != (
                first.shape, first.stride(), first.dtype, first.device):
            raise IncompatibleError(
                f"KV layer {i} ({list(t.shape)}, stride {list(t.stride())}, {t.dtype}, "
                f"{t.device}) differs from layer 0 ({list(first.shape)}, stride "
                f"{list(first.stride())}, {first.dtype}, {first.device})")
