"""A random-weight tiny Llama saved locally (no hub download), cached by its parameters."""

from __future__ import annotations

import json
import os
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


def tiny_llama(cache_dir: Path | None = None, spec: dict[str, Any] | None = None,
               name: str = "tiny-llama") -> Path:
    """The directory of a random-weight Llama (created on first use; reused while its spec
    matches): ``TINY_LLAMA`` unless ``spec`` (the same keys) names another size."""
    spec = dict(TINY_LLAMA if spec is None else spec)
    root = (cache_dir or default_cache_dir()) / name
    marker = root / "lmcache-spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return root
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    config = LlamaConfig(
        num_hidden_layers=spec["num_hidden_layers"], hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
        vocab_size=spec["vocab_size"], max_position_embeddings=spec["max_position_embeddings"],
        initializer_range=spec["initializer_range"], tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).to(getattr(torch, spec["dtype"]))
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return root


if __name__ == "__main__":
    print(tiny_llama())
