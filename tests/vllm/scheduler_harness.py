"""vLLM's real scheduler + our connector (both roles) + a synthetic model, against ``lmcache serve``.

Usage: python tests/vllm/scheduler_harness.py SERVER_URL OUT.json MODEL_DIR [MODE]
(MODE: hybrid, hybrid-wide, hybrid-local, hybrid-local-even)

For vLLM builds that cannot run a model on this machine (the newest PyPI ``vllm`` is a CUDA build:
installed with ``--no-deps`` and run with ``VLLM_TARGET_DEVICE=cpu``), this drives the real
``Scheduler`` step by step the way the engine core does, with our worker-side connector over a KV
cache that vLLM's own ``allocate_kv_cache`` lays out (CPU layout, in the connector's shared-memory
pool). The "model" writes each scheduled token's K/V as a pure function of (token, position) into
the blocks the way vLLM's CPU kernel does, and samples the next token from the K values it reads
back from the request's blocks. So a token sampled after a load is right only if the load put the
right bytes in the right blocks: outputs are checked against the same function computed directly.

``hybrid``: two KV cache groups, as vLLM's hybrid KV cache manager makes them: layer 0 full
attention, layer 1 a sliding window of ``WINDOWS[mode]`` tokens (its blocks behind the window freed
by the scheduler; ``hybrid-wide``: 300 tokens, wider than a chunk but not a whole number of chunks,
so a load needs only the last block of its older chunk's piece and vLLM gives null for the other);
the model samples from every position's K of layer 0 and the window's K of layer 1, so
a load must fill both groups' blocks. ``hybrid-local``: layer 1 is chunked-local attention (Llama
4's) of ``LOCAL[mode]``-token attention chunks, which reads only its own attention chunk's K (640:
2.5 chunks, so a hit at 768 needs the last block of chunk 2's piece only, vLLM's null block before
it; ``hybrid-local-even``: 384, so a hit at 768 starts an attention chunk and needs nothing of
the group). A load made to fail (its last chunk's hash replaced) must be
reported per request (``failed_recving``): the scheduler raises RuntimeError for block-level load
errors of a multi-group model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

CHUNK = 256
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


def next_token(values: list[float]) -> int:
    return int(sum(v * (i % 13 + 1) for i, v in enumerate(values)) * 1000) % (VOCAB - 3) + 3


def expected(prompt: list[int], max_tokens: int, window: int = 0, local: int = 0) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        values = [kv_value(t, p) for p, t in enumerate(tokens)]
        if window:  # and layer 1's window: the tokens the next one attends to
            values += values[max(0, len(tokens) - window + 1):]
        if local:  # and layer 1's attention chunk, up to the next token
            values += values[len(tokens) // local * local:]
        tok = next_token(values)
        out.append(tok)
        tokens.append(tok)
    return out


def _kv_cache_config(vllm_config: Any, window: int, local: int) -> Any:
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
    budget = [64 * vllm_config.cache_config.block_size * HEADS * DIM * 2 * 4 * len(LAYERS)]
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
    """The scheduler, both connector roles, and the synthetic model, stepped together."""

    def __init__(self, url: str, model_dir: str, window: int = 0, local: int = 0) -> None:
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
            kv_connector_extra_config={"url": url, "lookup_timeout_s": 2})
        args = EngineArgs(model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
                          dtype="float32", max_model_len=4096, enable_prefix_caching=False,
                          kv_transfer_config=kv, block_size=128)
        self.vllm_config = _engine_config(args)
        self.vllm_config.cache_config.kv_cache_layout = "LBHNC"  # the CPU backend's (see kv_views)
        self.window = window
        self.local = local
        self.kv_cache_config = _kv_cache_config(self.vllm_config, window, local)
        groups = self.kv_cache_config.kv_cache_groups
        assert len(groups) == (2 if window or local else 1), groups
        # each layer's group (vLLM orders the groups by kind, not by layer)
        self.group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.worker = LMCacheConnector(self.vllm_config, KVConnectorRole.WORKER,
                                       self.kv_cache_config)
        with self.worker.get_mem_pool_context():
            self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                               KVCacheLayout.LBHNC, [128] * len(groups))
        self.worker.register_kv_caches(self.kv_caches)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config), block_size=128,
            log_stats=True)  # its connector prefix-cache stats say where our hits came from
        self.block_size = 128
        self.blocks: dict[str, list[list[int]]] = {}  # per request, per group
        self.corrupt: set[str] = set()  # requests whose load is made to fail
        self.failed_recving: set[str] = set()  # reported by the connector
        self.hits_by_source: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.loads: dict[str, list[list[int]]] = {}  # each request's load: its blocks per group

    # -------------------------------------------------------------- the synthetic model

    def _kv_rows(self, layer: str, block: int) -> torch.Tensor:
        t = self.kv_caches[layer]  # [NB, H, BS, 2*D]: the CPU kernel's [2*BS, D] rows per head
        nb, h, bs, c = t.shape
        return t.view(nb, h, 2 * bs, c // 2)[block]

    def _block(self, rid: str, layer: str, p: int) -> int:
        block = self.blocks[rid][self.group_of[layer]][p // self.block_size]
        assert block != 0, f"{rid}: position {p} of {layer} is in the null block"
        return block

    def _write(self, rid: str, start: int, end: int) -> None:
        for p in range(start, end):
            slot = p % self.block_size
            v = kv_value(self.tokens[rid][p], p)
            for layer in LAYERS:
                rows = self._kv_rows(layer, self._block(rid, layer, p))
                rows[:, slot].fill_(v)
                rows[:, self.block_size + slot].fill_(-v)

    def _read(self, rid: str, end: int) -> list[float]:
        def k(layer: str, p: int) -> float:
            rows = self._kv_rows(layer, self._block(rid, layer, p))
            return float(rows[HEADS - 1, p % self.block_size, DIM - 1])

        if self.local:  # layer 1 reads its attention chunk only: vLLM freed the blocks before
            return ([k(LAYERS[0], p) for p in range(end)]
                    + [k(LAYERS[1], p) for p in range(end // self.local * self.local, end)])
        if not self.window:
            return [k(LAYERS[-1], p) for p in range(end)]
        return ([k(LAYERS[0], p) for p in range(end)]
                + [k(LAYERS[1], p) for p in range(max(0, end - self.window + 1), end)])

    # -------------------------------------------------------------- the engine loop

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.tokens[rid] = list(prompt)
        self.outputs[rid] = []
        self.scheduler.add_request(Request(rid, list(prompt), params, None))

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        for spec in so.kv_connector_metadata.loads:
            if spec.chunk_hashes:
                self.loads.setdefault(spec.request_id, [list(ids) for ids in
                                                        spec.group_block_ids or [spec.block_ids]])
            if spec.request_id in self.corrupt and spec.chunk_hashes:
                spec.chunk_hashes[-1] = os.urandom(32)  # a chunk the server never saw
        for new in so.scheduled_new_reqs:
            self.blocks[new.req_id] = [list(ids) for ids in new.block_ids]
            self.cached.setdefault(new.req_id, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids:
                if rid in cached.resumed_req_ids:
                    self.blocks[rid] = [list(group) for group in ids]
                else:
                    for mine, added in zip(self.blocks[rid], ids, strict=True):
                        mine += list(added)
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        self.worker.bind_connector_metadata(so.kv_connector_metadata)
        self.worker.handle_preemptions(so.kv_connector_metadata)
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
        self.worker.start_load_kv(None)  # async loads start after the forward, as in vLLM
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(so.finished_req_ids)
        invalid = self.worker.get_block_ids_with_load_errors()
        self.failed_recving |= results.failed_recving
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

    def _count_hit_sources(self, stats: Any) -> None:
        """vLLM's prompt_tokens_cached_by_source: each step's connector hits by cache tier."""
        hits = getattr(getattr(stats, "connector_prefix_cache_stats", None), "hits_by_source", {})
        for source, tokens in (hits or {}).items():
            name = str(getattr(source, "value", source))
            self.hits_by_source[name] = self.hits_by_source.get(name, 0) + tokens

    def run(self, max_steps: int = 2000) -> None:
        import time

        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
            time.sleep(0.001)
        raise RuntimeError("requests did not finish")

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def main(url: str, out_path: str, model_dir: str, mode: str = "") -> int:
    import random

    import vllm

    window, local = WINDOWS.get(mode, 0), LOCAL.get(mode, 0)
    rng = random.Random(3)
    a = [rng.randrange(3, VOCAB) for _ in range(1000)]
    prompts = {"A": a, "B": a[:768] + [rng.randrange(3, VOCAB) for _ in range(200)],
               "C": [rng.randrange(3, VOCAB) for _ in range(600)]}
    if window or local:  # D's load of A's 3 chunks is made to fail
        prompts["D"] = a[:768] + [rng.randrange(3, VOCAB) for _ in range(150)]
    engine = Engine(url, model_dir, window, local)
    engine.corrupt.add("D")
    result: dict[str, Any] = {"vllm": vllm.__version__, "requests": {},
                              "groups": [type(g.kv_cache_spec).__name__
                                         for g in engine.kv_cache_config.kv_cache_groups]}
    for rid, prompt in prompts.items():  # one at a time: B must find A's stored chunks
        engine.add(rid, prompt, 8)
        engine.run()
        result["requests"][rid] = {"tokens": engine.outputs[rid], "cached": engine.cached[rid],
                                   "expected": expected(prompt, 8, window, local)}
    result["failed_recving"] = sorted(engine.failed_recving)
    result["loads"] = engine.loads
    result["hits_by_source"] = engine.hits_by_source
    engine.close()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
