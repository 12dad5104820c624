"""A hybrid-model vLLM-worker stand-in (Gemma-3-like KV-cache groups), run as its own process.

It allocates one shared-memory segment of ``len(groups) * layers_per_group`` flash-attn layers,
registers them through ``LMCacheMPWorkerAdapter.register_kv_caches(..., groups=...)`` (group g
holds layers g, g + G, g + 2G, ..., as vLLM interleaves Gemma-3's) and obeys JSON-line commands on
stdin, answering one JSON line each on stdout. ``tables`` is one block-id list per group (vLLM's
per-group block table; 0 is the null block):
  {"cmd": "fill_model", "tables": [...], "seed": 1}    logical block j of each group's table
      gets block j of one seeded cache of *all* the model's heads, this rank's head slice
  {"cmd": "check_model", "tables": [...], "seed": 1, "positions": [[j...] per group]}
      -> {"equal": bool, "null_untouched": bool}: those logical blocks hold exactly that, and
      the null block 0 of every layer is still all zero
  {"cmd": "zero", "tables": [...]}                     (block 0 too)
  {"cmd": "all_zero", "tables": [...]} -> {"zero": bool}: those blocks of every layer are zero
  {"cmd": "store"|"retrieve", "req": id, "keys": tokens, "tables": [...]}
      -> {"finished", "failed", "load_errors", "failed_recving"}  (waits, bounded)
  {"cmd": "quit"}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from lmcache_core.client.groups import KVCacheGroupSpec
from lmcache_core.client.transfers import LoadStoreOp
from lmcache_core.client.worker import LMCacheMPWorkerAdapter
from lmcache_core.errors import LMCacheError
from lmcache_core.kv.share import allocate_shared_kv_caches, release_shared_kv_caches

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo's tests
from tests.integration import kv_worker
from tests.integration.kv_worker import reply

SPEC: dict = {}


def main() -> None:
    spec = json.loads(sys.argv[1])
    SPEC.update(spec)
    groups = spec["groups"]  # [{"kind": ..., "window_tokens": ...}, ...]
    count = len(groups)
    per_group = spec["layers_per_group"]
    shape = [2, spec["num_blocks"], spec["block_size"], spec["heads"], spec["head_dim"]]
    mamba = [group["kind"] == "mamba" for group in groups]
    names = [[f"model.layers.{g + count * i}.{'mixer' if mamba[g] else 'attn'}"
              for i in range(per_group)] for g in range(count)]
    attention = [name for g, group in enumerate(names) if not mamba[g] for name in group]
    caches, segment = allocate_shared_kv_caches(len(attention), shape, torch.float16,
                                                layer_names=attention)
    states = [name for g, group in enumerate(names) if mamba[g] for name in group]
    if states:  # vLLM 0.32's form: one int8 tensor per Mamba layer, a state block per row
        state_caches, state_segment = allocate_shared_kv_caches(
            len(states), [spec["num_blocks"], 1, 1, STATE_BYTES], torch.int8, layer_names=states)
        caches.update(state_caches)
    specs = [KVCacheGroupSpec(layer_names=names[g], kind=group["kind"],
                              block_size=group.get("block_size", spec["block_size"]),
                              window_tokens=group.get("window_tokens", 0))
             for g, group in enumerate(groups)]
    adapter = LMCacheMPWorkerAdapter(spec["url"], None, spec["model"], spec["world_size"],
                                     spec["rank"], spec["block_size"], heartbeat_interval_s=1.0)
    try:
        adapter.register_kv_caches(caches, groups=specs)
    except LMCacheError as exc:
        reply({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        adapter.shutdown()
        release_shared_kv_caches()
        return
    # a Mamba layer viewed as [1, num_blocks, ...]: blocks on dim 1, as the attention layers'
    layers = [[caches[name].unsqueeze(0) if mamba[g] else caches[name]
               for name in group.layer_names] for g, group in enumerate(specs)]
    reply({"ready": True, "chunk_size": adapter.chunk_size, "shm_name": segment.name,
           "shm_names": [segment.name] + ([state_segment.name] if states else []),
           "instance_ids": adapter.group_instance_ids,
           "pieces": [list(p) for p in adapter.group_pieces or []]})
    kv_worker.serve(adapter, lambda command: handle(adapter, layers, command))
    del segment
    if states:
        del state_segment


#: Logical blocks of the seeded cache (tables are at most this long).
LOGICAL_BLOCKS = 32
#: Bytes of one Mamba layer's state block (conv and ssm state together, as vLLM 0.32 pads them).
STATE_BYTES = 96


def model_blocks(layer_index: int, seed: int, mamba: bool = False) -> torch.Tensor:
    """This rank's head slice of the logical blocks of a seeded all-heads cache (of a Mamba
    layer: this rank's own seeded state blocks, ``[1, blocks, 1, 1, STATE_BYTES]``)."""
    if mamba:
        gen = torch.Generator().manual_seed(seed * 1000 + layer_index + 7919 * SPEC["rank"])
        return torch.randint(-100, 100, (1, LOGICAL_BLOCKS, 1, 1, STATE_BYTES), generator=gen,
                             dtype=torch.int8)
    gen = torch.Generator().manual_seed(seed * 1000 + layer_index)
    heads = SPEC["heads"]
    full = torch.randint(-100, 100, (2, LOGICAL_BLOCKS, SPEC["block_size"],
                                     heads * SPEC["world_size"], SPEC["head_dim"]), generator=gen)
    lo = SPEC["rank"] * heads
    return full[..., lo:lo + heads, :].to(torch.float16)


def handle(adapter: LMCacheMPWorkerAdapter, layers: list[list[torch.Tensor]], c: dict) -> dict:
    cmd = c["cmd"]
    tables = c.get("tables", [])
    if cmd == "fill_model":
        for g, (group_layers, table) in enumerate(zip(layers, tables, strict=True)):
            for i, layer in enumerate(group_layers):
                want = model_blocks(g * 100 + i, c["seed"], group_layers[i].dtype == torch.int8)
                real = [j for j, block in enumerate(table) if block]
                layer[:, [table[j] for j in real]] = want[:, real]
        return {"ok": True}
    if cmd == "check_model":
        equal = True
        for g, (group_layers, table, positions) in enumerate(
                zip(layers, tables, c["positions"], strict=True)):
            for i, layer in enumerate(group_layers):
                want = model_blocks(g * 100 + i, c["seed"], group_layers[i].dtype == torch.int8)
                got = layer[:, [table[j] for j in positions]]
                equal = equal and torch.equal(got, want[:, positions])
        null_untouched = all(not layer[:, 0].any() for group in layers for layer in group)
        return {"equal": equal, "null_untouched": null_untouched}
    if cmd == "zero":
        for group_layers, table in zip(layers, tables, strict=True):
            for layer in group_layers:
                layer[:, sorted(set(table) | {0})] = 0
        return {"ok": True}
    if cmd == "all_zero":
        zero = all(not layer[:, table].any()
                   for group_layers, table in zip(layers, tables, strict=True)
                   for layer in group_layers)
        return {"zero": zero}
    if cmd in ("store", "retrieve"):
        op = LoadStoreOp(block_hashes=c["keys"], block_ids=[], group_block_ids=tables)
        submit = adapter.submit_store_request if cmd == "store" else adapter.submit_retrieve_request
        submit(c["req"], op, None)
        return wait(adapter, c["req"], cmd)
    return {"error": f"unknown command {cmd}"}


def wait(adapter: LMCacheMPWorkerAdapter, request_id: str, kind: str) -> dict:
    """``kv_worker.wait`` for one request, with its failure reason and the per-request failures."""
    result = kv_worker.wait(adapter, [request_id], kind)
    result["failed"] = result["failed"].get(request_id)
    result["failed_recving"] = sorted(adapter.take_failed_retrieves())
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # all released: skip torch's slow interpreter teardown (as kv_worker does)
