"""What the connector reads from its settings and from vLLM's config, and the setups it refuses.

The lmcache client config from ``kv_connector_extra_config``; the model's KV cache groups (full
attention, MLA, sliding window, chunked-local attention, Mamba state in vLLM's ``align`` or ``all``
cache mode; other specs are refused with a message naming them); the attention backend of the model's layers;
no GPU KV cache that vLLM's sleep mode allocates. Part of :mod:`.lmcache_connector`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmcache_core.config import LMCacheConfig, load_config
from lmcache_core.errors import IncompatibleError
from lmcache_core.integration.vllm.connector_log import logger
from lmcache_core.keys import GroupKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: vLLM KV cache specs the connector stores, by the kind of group they make.
SPEC_KINDS: dict[str, GroupKind] = {"FullAttentionSpec": "full", "MLAAttentionSpec": "full",
                                    "SlidingWindowSpec": "sliding", "MambaSpec": "mamba",
                                    "ChunkedLocalAttentionSpec": "local"}
SUPPORTED_SPECS = tuple(SPEC_KINDS)
#: vLLM's Mamba cache modes that keep the state at block boundaries (a chunk's end state is then
#: the chunk's last block); "none" keeps only the running state, which no later request can use.
MAMBA_CACHE_MODES = ("align", "all")


@dataclass(frozen=True)
class KVGroupInfo:
    """One of vLLM's ``kv_cache_config.kv_cache_groups``, as the connector uses it."""

    index: int
    kind: GroupKind
    block_size: int
    """Tokens per scheduler block of this group (``kv_cache_spec.block_size``)."""
    window_tokens: int
    """``SlidingWindowSpec.sliding_window`` for a sliding group, ``ChunkedLocalAttentionSpec.
    attention_chunk_size`` for a local one, else 0."""
    layer_names: tuple[str, ...]


def client_config(extra: dict[str, Any]) -> LMCacheConfig:
    """The lmcache config the connector runs with: ``kv_connector_extra_config``'s keys over
    its ``config_file`` (and the ``LMCACHE_*`` environment, as for every client)."""
    overrides = {
        "server.url": extra.get("url"),
        "min_hit_tokens": extra.get("min_hit_tokens"),
        "timeouts.connect_s": extra.get("connect_timeout_s"),
        "timeouts.request_s": extra.get("request_timeout_s"),
        "timeouts.lookup_ms": (int(float(extra["lookup_timeout_s"]) * 1000)
                               if extra.get("lookup_timeout_s") is not None else None),
        "timeouts.lookup_wait_us": extra.get("lookup_wait_us"),
    }
    return load_config(extra.get("config_file"), overrides)


def backend_name(vllm_config: VllmConfig, get_layers: Any, attention_cls: Any) -> str | None:
    """The attention backend of the model's layers (e.g. ``CPU_ATTN``, ``FLASH_ATTN``)."""
    try:
        layers = get_layers(vllm_config, attention_cls)
        for layer in layers.values():
            backend = layer.get_attn_backend() if hasattr(layer, "get_attn_backend") else getattr(
                layer, "attn_backend", None)
            if backend is not None:
                return str(backend.get_name())
    except Exception as exc:  # an older or newer vLLM: fall back to the platform
        logger.debug("lmcache: cannot read the attention backend: %s", exc)
    device = str(vllm_config.device_config.device_type)
    return "CPU_ATTN" if device == "cpu" else None


def refuse_unexportable(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> None:
    """IncompatibleError when vLLM's sleep mode allocates the GPU KV cache: its cuMemCreate
    memory cannot be exported with cudaIpcGetMemHandle (registration would fail obscurely)."""
    first = next(iter(kv_caches.values()), None)
    if first is None or first.device.type != "cuda":
        return
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        from lmcache_core.kv.cuda_ipc import unexportable_message

        raise IncompatibleError(unexportable_message("vLLM runs with enable_sleep_mode=True"))


def kv_groups(kv_cache_config: KVCacheConfig | None, block_size: int) -> list[KVGroupInfo]:
    """The model's KV cache groups (one full group of ``block_size`` when vLLM gave no config);
    ValueError naming the spec for one the connector cannot store."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return [KVGroupInfo(0, "full", block_size, 0, ())]
    return [_group_info(i, g, block_size)
            for i, g in enumerate(kv_cache_config.kv_cache_groups)]


def _group_info(index: int, group: Any, block_size: int) -> KVGroupInfo:
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one kind inside
    names = {type(s).__name__ for s in (inner.values() if inner else [spec])}
    for name in sorted(names):
        if name not in SPEC_KINDS:
            raise ValueError(
                f"LMCacheConnector cannot cache KV cache group {index} ({name}): not a KV cache "
                f"spec the connector knows. "
                f"Supported: {', '.join(SUPPORTED_SPECS)}.")
    kinds = {SPEC_KINDS[n] for n in names}
    if len(kinds) != 1:
        raise ValueError(f"KV cache group {index} mixes {', '.join(sorted(names))}")
    (kind,) = kinds
    mode = getattr(spec, "mamba_cache_mode", "align")
    if kind == "mamba" and mode not in MAMBA_CACHE_MODES:
        raise ValueError(
            f"LMCacheConnector cannot cache KV cache group {index} (MambaSpec) with "
            f"mamba_cache_mode={mode!r}: it keeps no state at block boundaries. Start vLLM with "
            "prefix caching and --mamba-cache-mode align.")
    window = (int(getattr(spec, "sliding_window", 0) or 0) if kind == "sliding"
              else int(getattr(spec, "attention_chunk_size", 0) or 0) if kind == "local" else 0)
    return KVGroupInfo(index, kind, int(getattr(spec, "block_size", 0) or block_size), window,
                       tuple(getattr(group, "layer_names", ()) or ()))
