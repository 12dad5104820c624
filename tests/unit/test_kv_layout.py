"""detect_layout / kv_geometry / block_view: vLLM layouts and the canonical chunk order."""

from __future__ import annotations

import sys

import pytest
import torch

from lmcache_core.errors import IncompatibleError
from lmcache_core.kv.layout import block_view, detect_layout, kv_geometry


def test_detect_each_layout() -> None:
    assert detect_layout([2, 100, 16, 8, 128]) == "flash_attn"
    assert detect_layout([100, 2, 16, 8, 128]) == "flashinfer"
    assert detect_layout((100, 16, 576)) == "mla"
    assert detect_layout([100, 8, 128, 256]) == "cpu_attn"
    assert kv_geometry([100, 8, 128, 256], "cpu_attn").token_shape == (8, 128)
    assert detect_layout(torch.Size([2, 7, 16, 1, 64]), block_size_hint=16) == "flash_attn"


@pytest.mark.parametrize("shape", [[100, 16], [3, 100, 16, 8, 128], [2, 100, 16, 7], [1] * 6, []])
def test_unknown_shapes_refused(shape: list[int]) -> None:
    with pytest.raises(IncompatibleError, match="no known layout"):
        detect_layout(shape)


def test_two_block_cache_is_ambiguous() -> None:
    with pytest.raises(IncompatibleError, match="ambiguous"):
        detect_layout([2, 2, 16, 8, 128])


def test_block_size_hint_checked() -> None:
    with pytest.raises(IncompatibleError, match="block size 16, expected 32"):
        detect_layout([2, 100, 16, 8, 128], block_size_hint=32)


def test_geometry() -> None:
    g = kv_geometry([100, 2, 16, 8, 128], "flashinfer")
    assert (g.num_blocks, g.block_size, g.planes, g.width) == (100, 16, 2, 1024)
    assert g.chunk_shape(32, 256) == (32, 2, 256, 1024)
    m = kv_geometry([100, 16, 576], "mla")
    assert (m.num_blocks, m.block_size, m.planes, m.width) == (100, 16, 1, 576)
    with pytest.raises(IncompatibleError, match="does not fit layout 'mla'"):
        kv_geometry([2, 100, 16, 8, 128], "mla")
    with pytest.raises(IncompatibleError, match="unknown KV layout"):
        kv_geometry([2, 100, 16, 8, 128], "paged")  # type: ignore[arg-type]
    with pytest.raises(IncompatibleError, match="empty"):
        kv_geometry([2, 0, 16, 8, 128], "flash_attn")


def test_block_views_are_zero_copy_and_canonical() -> None:
    fa = torch.randn(2, 5, 4, 2, 3)
    v = block_view(fa, "flash_attn")
    assert v.shape == (2, 5, 24) and v.data_ptr() == fa.data_ptr()
    fi = fa.transpose(0, 1).contiguous()
    w = block_view(fi, "flashinfer")
    assert w.shape == (2, 5, 24) and torch.equal(w, v)
    mla = torch.randn(5, 4, 6)
    assert block_view(mla, "mla").shape == (1, 5, 24)


def test_block_view_keeps_dims_when_block_is_not_contiguous() -> None:
    physical = torch.randn(5, 2, 2, 4, 3)  # [NB, 2, heads, block, dim] (head-major)
    logical = physical.permute(0, 1, 3, 2, 4)  # presented as [NB, 2, block, heads, dim]
    v = block_view(logical, "flashinfer")
    assert v.shape == (2, 5, 4, 2, 3)
    assert torch.equal(v.reshape(2, 5, 24), block_view(logical.contiguous(), "flashinfer"))


def test_layout_module_does_not_import_torch() -> None:
    import subprocess

    code = ("import sys, lmcache_core.kv.layout, lmcache_core.kv.shm; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"
