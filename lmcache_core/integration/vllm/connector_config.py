"""What the connector reads from its settings and from vLLM's config, and the setups it refuses.

The lmcache client config from ``kv_connector_extra_config``; single-group full-attention or MLA
models only; the attention backend of the model's layers; no GPU KV cache that vLLM's sleep mode
allocates. Part of :mod:`.lmcache_connector`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from lmcache_core.config import LMCacheConfig, load_config
from lmcache_core.errors import IncompatibleError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# The connector's one logger, named as before the split, so logging configured for it still applies.
logger = logging.getLogger("lmcache_core.integration.vllm.lmcache_connector")
SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def _client_config(extra: dict[str, Any]) -> LMCacheConfig:
    overrides = {
        "server.url": extra.get("url"),
        "min_hit_tokens": extra.get("min_hit_tokens"),
        "timeouts.connect_s": extra.get("connect_timeout_s"),
        "timeouts.request_s": extra.get("request_timeout_s"),
        "timeouts.lookup_ms": (int(float(extra["lookup_timeout_s"]) * 1000)
                               if extra.get("lookup_timeout_s") is not None else None),
    }
    return load_config(extra.get("config_file"), overrides)


def _backend_name(vllm_config: VllmConfig, get_layers: Any, attention_cls: Any) -> str | None:
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


def _refuse_unexportable(vllm_config: VllmConfig, kv_caches: dict[str, torch.Tensor]) -> None:
    """IncompatibleError when vLLM's sleep mode allocates the GPU KV cache: its cuMemCreate
    memory cannot be exported with cudaIpcGetMemHandle (registration would fail obscurely)."""
    first = next(iter(kv_caches.values()), None)
    if first is None or first.device.type != "cuda":
        return
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        from lmcache_core.kv.cuda_ipc import unexportable_message

        raise IncompatibleError(unexportable_message("vLLM runs with enable_sleep_mode=True"))


def _check_single_group(kv_cache_config: KVCacheConfig | None) -> None:
    """ValueError unless the model has one KV cache group, of full attention or MLA layers."""
    if kv_cache_config is None:
        return
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) > 1:
        raise ValueError(
            f"LMCacheConnector supports single-group (non-hybrid) models only; this model has "
            f"{len(groups)} KV cache groups "
            f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)}). Start vLLM with "
            "--disable-hybrid-kv-cache-manager or use a model whose layers all use full "
            "attention.")
    if groups:
        spec = groups[0].kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        names = {type(s).__name__ for s in (inner.values() if inner else [spec])}
        if not names <= set(SUPPORTED_SPECS):
            raise ValueError(
                f"LMCacheConnector supports full attention and MLA layers only, not "
                f"{', '.join(sorted(names - set(SUPPORTED_SPECS)))}")
