"""A vLLM-worker stand-in for integration tests, run as its own process.

It allocates KV caches in shared memory, registers them through ``LMCacheMPWorkerAdapter`` and
obeys JSON-line commands on stdin, answering one JSON line each on stdout:
  {"cmd": "fill", "blocks": [...], "seed": 1}            random bytes into those blocks
  {"cmd": "zero", "blocks": [...]}
  {"cmd": "digest", "blocks": [...]}                     -> {"digest": hex} over the blocks, in order
  {"cmd": "fill_model"|"check_model", "blocks": [...], "seed": 1}
      the blocks as one seeded cache of *all* the model's heads would hold them, this rank's head
      slice (MLA: the whole latent); check -> {"equal": bool}: so ranks of any TP size compare
  {"cmd": "store"|"retrieve", "req": id, "keys": tokens-or-hex-hashes, "blocks": [...]}
      -> {"finished": bool, "failed": reason-or-null}     (waits for get_finished, bounded)
      a store may add "ttl_s", "pin", "priority" (retention); it answers "pin_refused" too
  {"cmd": "submit_retrieve", "req": id, "keys": [...], "blocks": [...]}   (does not wait)
  {"cmd": "wait_for_retrieves", "wait_s": s} -> {"answered": bool, "retrieves": [...]}
      the adapter's wait_for_retrieves, then get_finished's finished retrieves at once
  {"cmd": "batch_store", "reqs": [...], "keys": [[...]...], "blocks": [[...]...]}
      may add "salts": [...] (each request's cache_salt)
  {"cmd": "quit"}
The spec's ``cpu_attn``: the caches are vLLM's CPU backend's 4-D tensors (``[blocks, heads,
block_size, 2 * head_dim]``, K rows then V rows per head), which the adapter registers in the
``cpu_attn`` layout; the commands see them as the kernel reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from blake3 import blake3

from lmcache_core.client.transfers import LoadStoreOp
from lmcache_core.client.worker import LMCacheMPWorkerAdapter
from lmcache_core.kv.share import allocate_shared_kv_caches, release_shared_kv_caches

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo's tests
from tests.harness import wait_until

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def main() -> None:
    spec = json.loads(sys.argv[1])
    nb, bs, heads, dim = spec["num_blocks"], spec["block_size"], spec["heads"], spec["head_dim"]
    shape = [2, nb, bs, heads, dim]
    if spec.get("mla"):
        shape = [nb, bs, dim]
    elif spec.get("cpu_attn"):  # vLLM's CPU backend's tensors, registered as they are
        shape = [nb, heads, bs, 2 * dim]
    global SPEC
    SPEC = spec
    caches, segment = allocate_shared_kv_caches(spec["layers"], shape, DTYPES[spec["dtype"]])
    adapter = LMCacheMPWorkerAdapter(spec["url"], None, spec["model"], spec["world_size"],
                                     spec["rank"], spec["block_size"], heartbeat_interval_s=1.0)
    adapter.register_kv_caches(caches)
    layers = list(caches.values())
    if spec.get("cpu_attn"):  # the commands below read K and V per token, as the CPU kernel does
        layers = [t.as_strided((2, nb, bs, heads, dim), (bs * dim, heads * bs * 2 * dim, dim,
                                                         bs * 2 * dim, 1)) for t in layers]
    reply({"ready": True, "chunk_size": adapter.chunk_size, "instance_id": adapter.instance_id,
           "shm_name": segment.name})
    serve(adapter, lambda command: handle(adapter, layers, command))
    del segment


def serve(adapter: LMCacheMPWorkerAdapter, respond: Callable[[dict], dict]) -> None:
    """Answer each command line with ``respond``'s reply until "quit", then shut down."""
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        reply(respond(command))
    adapter.shutdown()
    release_shared_kv_caches()
    reply({"bye": True})


SPEC: dict = {}


def model_slice(layer: torch.Tensor, index: int, seed: int, n_blocks: int) -> torch.Tensor:
    """What this rank's cache holds in ``n_blocks`` blocks of a seeded cache of all heads."""
    gen = torch.Generator().manual_seed(seed * 1000 + index)
    if SPEC.get("mla"):
        full = torch.randint(-100, 100, (n_blocks, SPEC["block_size"], SPEC["head_dim"]),
                             generator=gen)
        return full.to(layer.dtype)
    heads = SPEC["heads"]
    full = torch.randint(-100, 100, (2, n_blocks, SPEC["block_size"], heads * SPEC["world_size"],
                                     SPEC["head_dim"]), generator=gen)
    lo = SPEC["rank"] * heads
    return full[..., lo:lo + heads, :].to(layer.dtype)


def handle(adapter: LMCacheMPWorkerAdapter, layers: list[torch.Tensor], c: dict) -> dict:
    cmd = c["cmd"]
    if cmd in ("fill_model", "check_model"):
        equal = True
        for index, layer in enumerate(layers):
            want = model_slice(layer, index, c["seed"], len(c["blocks"]))
            if cmd == "fill_model":
                if SPEC.get("mla"):
                    layer[c["blocks"]] = want
                else:
                    layer[:, c["blocks"]] = want
            else:
                got = layer[c["blocks"]] if SPEC.get("mla") else layer[:, c["blocks"]]
                equal = equal and torch.equal(got, want)
        return {"ok": True, "equal": equal}
    if cmd == "fill":
        gen = torch.Generator().manual_seed(c["seed"])
        for layer in layers:
            view = layer[:, c["blocks"]]
            layer[:, c["blocks"]] = torch.randint(-100, 100, view.shape, generator=gen).to(layer.dtype)
        return {"ok": True}
    if cmd == "zero":
        for layer in layers:
            if SPEC.get("mla"):
                layer[c["blocks"]] = 0
            else:
                layer[:, c["blocks"]] = 0
        return {"ok": True}
    if cmd == "digest":
        hasher = blake3()
        for layer in layers:
            hasher.update(layer[:, c["blocks"]].contiguous().view(torch.uint8).numpy().tobytes())
        return {"digest": hasher.hexdigest()}
    if cmd in ("store", "retrieve"):
        op = LoadStoreOp(block_hashes=keys(c["keys"]), block_ids=c["blocks"],
                         cache_salt=c.get("salt"), ttl_s=c.get("ttl_s"), pin=c.get("pin", False),
                         priority=c.get("priority", 0))
        submit = adapter.submit_store_request if cmd == "store" else adapter.submit_retrieve_request
        submit(c["req"], op, None)
        futures = adapter.store_futures(c["req"]) if cmd == "store" else []
        result = wait(adapter, [c["req"]], cmd)
        if futures:
            replies = [f.result(0) for f in futures if f.exception(0) is None]
            result["pin_refused"] = sum(r.pin_refused for r in replies)
        return result
    if cmd == "set_load_deadline":  # RetrieveRequest.deadline_ms of the next retrieves
        adapter.load_deadline_ms = c["ms"]
        return {"ok": True}
    if cmd == "batch_store":
        salts = c.get("salts") or [None] * len(c["keys"])
        ops = [LoadStoreOp(block_hashes=keys(k), block_ids=b, cache_salt=salt)
               for k, b, salt in zip(c["keys"], c["blocks"], salts, strict=True)]
        adapter.batched_submit_store_requests(c["reqs"], ops, None)
        return wait(adapter, c["reqs"], "store")
    if cmd == "get_finished":
        stores, retrieves = adapter.get_finished(set(c["engine_finished"]))
        return {"stores": sorted(stores or []), "retrieves": sorted(retrieves or []),
                "stores_none": stores is None, "retrieves_none": retrieves is None}
    if cmd == "await_stores":  # block until the request's store replies are in (harness only)
        for future in adapter.store_futures(c["req"]):
            future.exception(20)
        return {"ok": True}
    if cmd == "submit_store":  # submit without waiting (for get_finished ordering tests)
        adapter.submit_store_request(c["req"], LoadStoreOp(keys(c["keys"]), c["blocks"]), None)
        return {"ok": True}
    if cmd == "submit_retrieve":  # submit without waiting (for wait_for_retrieves tests)
        adapter.submit_retrieve_request(c["req"], LoadStoreOp(keys(c["keys"]), c["blocks"]), None)
        return {"ok": True}
    if cmd == "wait_for_retrieves":  # the adapter's wait, then one get_finished right after it
        answered = adapter.wait_for_retrieves(c["wait_s"])
        _, retrieves = adapter.get_finished(set())
        return {"answered": answered, "retrieves": sorted(retrieves or [])}
    return {"error": f"unknown command {cmd}"}


def keys(raw: list) -> list:
    return [bytes.fromhex(k) for k in raw] if raw and isinstance(raw[0], str) else raw


def wait(adapter: LMCacheMPWorkerAdapter, reqs: list[str], kind: str) -> dict:
    pending = set(reqs)

    def finished() -> bool:
        stores, retrieves = adapter.get_finished(set(reqs) if kind == "store" else set())
        pending.difference_update((stores or set()) if kind == "store" else (retrieves or set()))
        return not pending

    with contextlib.suppress(AssertionError):  # not within 20 s: answered as not finished
        wait_until(finished, 20)
    failures = adapter.failed_stores if kind == "store" else adapter.failed_retrieves
    return {"finished": not pending, "failed": {r: failures.get(r) for r in reqs if r in failures},
            "load_errors": sorted(adapter.get_block_ids_with_load_errors())}


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
    # Everything is released: skip the interpreter's teardown, where torch deregisters its
    # kernels one by one (0.5-1 s of CPU per worker, several seconds on a busy machine).
    sys.stdout.flush()
    os._exit(0)
