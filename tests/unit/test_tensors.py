"""Strided-memory checks of client-described tensors."""

import pytest

from lmcache_core.errors import IncompatibleError
from lmcache_core.kv.tensors import check_no_overlap, contiguous_stride, parse_dtype

FLASH = [2, 64, 16, 4, 32]  # [K/V, blocks, block size, heads, head dim]


@pytest.mark.parametrize(("shape", "stride"), [
    (FLASH, contiguous_stride(FLASH)),
    (FLASH, [131072, 2048, 128, 32, 1]),      # blocks outermost in memory (a permuted layout)
    (FLASH, [262144, 4096, 128, 32, 1]),      # padded blocks
    ([1, 10], [0, 1]),                        # a size-1 dimension's stride does not matter
    ([0, 10], [0, 0]),                        # empty
])
def test_real_layouts_pass(shape, stride):
    check_no_overlap(shape, stride)


@pytest.mark.parametrize(("shape", "stride"), [
    ([2, 2**44, 16, 4, 32], [0, 0, 128, 32, 1]),  # the fuzz's find: 2**44 blocks in 128 KiB
    (FLASH, [0, 2048, 128, 32, 1]),                # K and V at one address
    ([2, 4], [3, 1]),                              # rows overlapping by one element
])
def test_self_overlapping_layouts_are_refused(shape, stride):
    with pytest.raises(IncompatibleError, match="overlap"):
        check_no_overlap(shape, stride)


@pytest.mark.parametrize("name", ["qint8", "quint8", "qint32", "quint4x2", "quint2x4",
                                  "nonsense", "Tensor", "float16 ", ""])
def test_dtypes_that_are_no_kv_dtype_are_refused_typed(name):
    with pytest.raises(IncompatibleError):
        parse_dtype(name)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float8_e4m3fn", "uint8"])
def test_kv_dtypes_parse(name):
    import torch

    assert parse_dtype(name) is getattr(torch, name)
