"""KV memory that CUDA IPC cannot export is refused with an error naming the setting (issue 16,
finding 2): vLLM's sleep mode and ``expandable_segments:True`` allocate with ``cuMemCreate``, which
``cudaIpcGetMemHandle`` (what ``_share_cuda_`` calls) cannot export."""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_core.errors import IncompatibleError
from lmcache_core.kv import cuda_ipc


class FakeStorage:
    def _share_cuda_(self) -> Any:
        raise RuntimeError("CUDA error: invalid argument\nCompile with TORCH_USE_CUDA_DSA ...")


class FakeTensor:
    def untyped_storage(self) -> FakeStorage:
        return FakeStorage()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


def test_settings_that_prevent_export_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cuda_ipc.unexportable_settings() == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    assert cuda_ipc.unexportable_settings() == [
        "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True",
        "PYTORCH_ALLOC_CONF has backend:cudaMallocAsync"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    assert cuda_ipc.unexportable_settings() == []


def test_a_failed_export_is_an_incompatible_error_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(IncompatibleError) as info:
        cuda_ipc.export_storage(FakeTensor())  # type: ignore[arg-type]
    message = str(info.value)
    assert "CUDA error: invalid argument" in message and "TORCH_USE_CUDA_DSA" not in message
    assert "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True" in message
    assert "--enable-sleep-mode" in message


def test_sleep_mode_is_named_even_without_allocator_settings() -> None:
    message = cuda_ipc.unexportable_message("vLLM runs with enable_sleep_mode=True")
    assert "enable_sleep_mode=True" in message and "This process has" not in message
