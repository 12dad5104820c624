"""One ``lmcache store-bench`` worker process (started with spawn, one per GPU or CPU worker).

It does what a vLLM worker does: allocates a KV cache shaped from the config (shared memory on CPU,
CUDA tensors on GPU), registers it through the worker client (``lmcache_core.client.worker``), then
per round stores N chunks, looks them up (a locking LOOKUP, like the scheduler client), retrieves
them into cleared blocks and compares every byte. The store/retrieve requests are the worker
client's own messages, sent on its connection (``send``, ``call``) and waited for one at a time so
each op's latency is exact. Next to every store and retrieve it times the raw copy of the same
blocks with plain torch (``index_select(out=)`` gather into chunk buffers, ``index_copy_`` scatter
back), alternating which goes first: the floor the server's copies are compared with, measured
under the same load.

Torch is imported inside :func:`worker_main` only: the parent imports this module for
:class:`WorkerSpec` without paying for torch.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_core.protocol.messages import KVLayoutName

BARRIER_TIMEOUT_S = 300.0
SEGMENT_PREFIX = "lmcache-bench"  # /dev/shm/lmcache-bench-<worker pid>-<random>


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker needs; pickled to the spawned process."""

    index: int
    gpu: int | None  # None: CPU worker over shared memory
    url: str
    model_name: str
    world_size: int
    kv_rank: int
    num_layers: int
    num_kv_heads: int  # this rank's share
    head_dim: int
    dtype: str
    use_mla: bool
    chunk_size: int
    block_size: int
    chunks: int
    rounds: int
    warmup: int
    batch: int
    lookups: int
    seed: int
    connect_timeout_s: float
    request_timeout_s: float
    threads: int | None = None  # torch threads; None: torch's default

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def chunk_bytes(self) -> int:
        from lmcache_core.config import DTYPE_BYTES

        planes, width = (1, self.head_dim) if self.use_mla else (2, self.num_kv_heads * self.head_dim)
        return self.num_layers * planes * self.chunk_size * width * DTYPE_BYTES[self.dtype]


def round_tokens(seed: int, round_index: int, num_tokens: int) -> list[int]:
    """The prompt of one round: the same on every worker (TP ranks store shards of one prefix)."""
    rng = random.Random(f"lmcache-store-bench-{seed}-{round_index}")
    return [rng.randrange(1, 128_000) for _ in range(num_tokens)]


@dataclass
class WorkerResult:
    index: int
    device: str
    kv_rank: int
    chunk_bytes: int
    torch_threads: int
    rounds: list[dict[str, list[float]]] = field(default_factory=list)  # op name -> seconds
    lookup_ops: list[float] = field(default_factory=list)
    lookup_hits_ok: bool = True
    lookup_hits_min: int = -1
    verified_bytes: int = 0
    mismatched_bytes: int = 0
    already_present: int = 0
    problems: list[str] = field(default_factory=list)


def worker_main(spec: WorkerSpec, queue: Any, barrier: Any) -> None:
    """Process entry: run, and send ("result", index, dict) or ("error", index, line) on ``queue``."""
    try:
        result = _run(spec, queue, barrier)
        queue.put(("result", spec.index, asdict(result)))
    except BaseException as exc:  # report everything: the parent shows one line per worker
        with contextlib.suppress(Exception):
            barrier.abort()
        from lmcache_core.errors import LMCacheError

        if isinstance(exc, LMCacheError):
            line = str(exc)
        elif type(exc).__name__ == "BrokenBarrierError":
            line = "stopped: another worker failed"
        else:
            line = f"{type(exc).__name__}: {exc}"
            if os.environ.get("LMCACHE_BENCH_TRACEBACK"):
                line += "\n" + traceback.format_exc()
        queue.put(("error", spec.index, line))


class _Bench:
    """The tensors and the adapter of one worker."""

    def __init__(self, spec: WorkerSpec) -> None:
        import torch

        from lmcache_core.kv.copy import stack_layers
        from lmcache_core.kv.layout import block_view, merge_leading
        from lmcache_core.kv.tensors import parse_dtype

        self.spec = spec
        self.torch = torch
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        self.device = torch.device(spec.device)
        if spec.gpu is not None:
            torch.cuda.set_device(spec.gpu)
        self.dtype = parse_dtype(spec.dtype)
        bpc = spec.blocks_per_chunk
        self.region = spec.chunks * bpc  # region A: blocks 0..region-1; region B: the next ones
        num_blocks = max(2 * self.region, 3)  # 2 blocks would make a flash_attn shape ambiguous
        if spec.use_mla:
            shape = [num_blocks, spec.block_size, spec.head_dim]
        else:
            shape = [2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim]
        self.segment = None
        if spec.gpu is None:
            from lmcache_core.kv.share import allocate_shared_kv_caches

            self.caches, self.segment = allocate_shared_kv_caches(
                spec.num_layers, shape, self.dtype, name_prefix=SEGMENT_PREFIX)
        else:
            big = torch.zeros((spec.num_layers, *shape), dtype=self.dtype, device=self.device)
            self.caches = {f"layer_{i}": big[i] for i in range(spec.num_layers)}
        stacked = stack_layers(list(self.caches.values()))
        assert stacked is not None
        # the same zero-copy view the server copies through: [L * planes, NB, block row] when the
        # layers are evenly spaced (else [L, planes, NB, row]); blocks are picked along block_dim
        layout: KVLayoutName = "mla" if spec.use_mla else "flash_attn"
        unmerged = block_view(stacked, layout, leading=1)
        self.stacked = merge_leading(unmerged)
        self.block_dim = 2 - (unmerged.dim() - self.stacked.dim())
        int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        self.as_int = self.stacked.view(int_dtype[self.dtype.itemsize])  # bits, not floats: NaN
        self.a_ids = [torch.arange(i * bpc, (i + 1) * bpc, device=self.device)
                      for i in range(spec.chunks)]
        buf_shape = list(self.stacked.shape)
        buf_shape[self.block_dim] = bpc
        pin = spec.gpu is not None
        self.bufs = torch.empty((spec.chunks, *buf_shape), dtype=self.dtype, pin_memory=pin)
        self.staging = (torch.empty(buf_shape, dtype=self.dtype, device=self.device)
                        if spec.gpu is not None else None)

    # ------------------------------------------------------------------ data

    def fill(self, round_index: int) -> None:
        """Region A: random bytes first, then shifted by one per round; region B: zeros."""
        torch = self.torch
        with torch.no_grad():
            a = self.as_int.narrow(self.block_dim, 0, self.region)
            if round_index == 0:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(self.spec.seed * 1009 + self.spec.index)
                raw = a.view(torch.uint8)
                for layer in range(raw.shape[0]):  # one layer at a time bounds the temporary
                    raw[layer].copy_(torch.randint(0, 256, raw[layer].shape, dtype=torch.uint8,
                                                   device=self.device, generator=gen))
            else:
                a.add_(1)  # every item changes, so a stale chunk from an earlier round fails
            self.clear_b()

    def clear_b(self) -> None:
        self.as_int.narrow(self.block_dim, self.region, self.region).zero_()
        self.sync()

    def sync(self) -> None:
        if self.spec.gpu is not None:
            self.torch.cuda.synchronize(self.device)

    def verify(self) -> tuple[int, int]:
        """(bytes compared, bytes that differ) between region A and region B."""
        a = self.as_int.narrow(self.block_dim, 0, self.region)
        b = self.as_int.narrow(self.block_dim, self.region, self.region)
        nbytes = a.numel() * a.element_size()
        if self.torch.equal(a, b):
            return nbytes, 0
        diff = a.contiguous().view(self.torch.uint8) != b.contiguous().view(self.torch.uint8)
        return nbytes, int(diff.sum())

    # ------------------------------------------------------------------ raw copies

    def raw_gather(self, i: int) -> None:
        torch = self.torch
        if self.staging is None:
            torch.index_select(self.stacked, self.block_dim, self.a_ids[i], out=self.bufs[i])
        else:
            torch.index_select(self.stacked, self.block_dim, self.a_ids[i], out=self.staging)
            self.bufs[i].copy_(self.staging, non_blocking=True)
            self.sync()

    def raw_scatter(self, i: int) -> None:
        """Chunk buffer ``i`` back into chunk ``i``'s region-A blocks (the bytes they hold)."""
        if self.staging is None:
            self.stacked.index_copy_(self.block_dim, self.a_ids[i], self.bufs[i])
        else:
            self.staging.copy_(self.bufs[i], non_blocking=True)
            self.stacked.index_copy_(self.block_dim, self.a_ids[i], self.staging)
            self.sync()


def _run(spec: WorkerSpec, queue: Any, barrier: Any) -> WorkerResult:
    import torch
    import zmq

    from lmcache_core.client.worker import LMCacheMPWorkerAdapter
    from lmcache_core.keys import chain_hashes
    from lmcache_core.protocol import messages as m
    from lmcache_core.protocol import ops as wire_ops

    bench = _Bench(spec)
    result = WorkerResult(spec.index, spec.device, spec.kv_rank, spec.chunk_bytes,
                          torch.get_num_threads())
    adapter = LMCacheMPWorkerAdapter(
        spec.url, zmq.Context(), spec.model_name, spec.world_size, spec.kv_rank, spec.block_size,
        connect_timeout_s=spec.connect_timeout_s, request_timeout_s=spec.request_timeout_s)
    try:
        adapter.register_kv_caches(bench.caches)
        bpc = spec.blocks_per_chunk
        wait = spec.request_timeout_s + 1.0
        batches = [list(range(i, min(i + spec.batch, spec.chunks)))
                   for i in range(0, spec.chunks, spec.batch)]

        def a_blocks(batch: list[int]) -> list[int]:
            return [b for i in batch for b in range(i * bpc, (i + 1) * bpc)]

        def timed_op(ops: list[float], fn: Any, *args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            ops.append(time.perf_counter() - t0)
            return out

        def store(payload: m.StoreRequest) -> m.StoreReply:
            """One store on the worker's connection; wait for its reply (raises its error)."""
            return adapter.send(wire_ops.STORE, payload).result(wait)

        def retrieve(payload: m.RetrieveRequest) -> m.RetrieveReply:
            """One retrieve on the worker's connection; wait for its reply (raises its error)."""
            return adapter.send(wire_ops.RETRIEVE, payload).result(wait)

        def raw(copy: Any, batch: list[int]) -> None:
            with torch.no_grad():
                for i in batch:
                    copy(i)

        barrier.wait(BARRIER_TIMEOUT_S)
        for r in range(spec.warmup + spec.rounds):
            timed = r >= spec.warmup
            raw_first = r % 2 == 1  # alternate, so neither side always finds the blocks cached
            tokens = round_tokens(spec.seed, r, spec.chunks * spec.chunk_size)
            hashes = chain_hashes(tokens, spec.chunk_size)
            lookup_id = f"store-bench-{adapter.instance_id}-{r}"
            bench.fill(r)
            ops: dict[str, list[float]] = {n: [] for n in ("store", "retrieve", "gather", "scatter")}

            # store region A's blocks, one request per batch; each next to a raw gather of the
            # same blocks (into chunk buffers), so both see the same load on a busy machine
            barrier.wait(BARRIER_TIMEOUT_S)
            for batch in batches:
                payload = m.StoreRequest(
                    instance_id=adapter.instance_id, chunk_hashes=[hashes[i] for i in batch],
                    block_ids=a_blocks(batch), request_ids=[lookup_id])
                if raw_first:
                    timed_op(ops["gather"], raw, bench.raw_gather, batch)
                reply = timed_op(ops["store"], store, payload)
                if not raw_first:
                    timed_op(ops["gather"], raw, bench.raw_gather, batch)
                if reply.skipped_full:
                    raise RuntimeError(f"the server's pool is full of locked chunks: "
                                       f"{reply.skipped_full} chunk(s) not stored")
                result.already_present += reply.already_present if timed else 0
                queue.put(("progress", spec.index, 2 * len(batch)))

            # lookup once every rank has stored; the first one locks, as the scheduler's does
            barrier.wait(BARRIER_TIMEOUT_S)
            for k in range(spec.lookups):
                request = m.LookupRequest(model_name=spec.model_name, world_size=spec.world_size,
                                          lookup_id=lookup_id, chunk_hashes=hashes, lock=k == 0)
                hit = timed_op(ops.setdefault("lookup", []), adapter.call, wire_ops.LOOKUP,
                              request).hit_chunks
                if result.lookup_hits_min < 0 or hit < result.lookup_hits_min:
                    result.lookup_hits_min = hit
                if hit != spec.chunks:
                    result.lookup_hits_ok = False

            # retrieve into region B (cleared), releasing the lookup's locks; each next to a raw
            # scatter of the same chunk buffers back into region A (the same bytes: A is unchanged)
            bench.clear_b()
            barrier.wait(BARRIER_TIMEOUT_S)
            for batch in batches:
                payload_r = m.RetrieveRequest(
                    instance_id=adapter.instance_id, chunk_hashes=[hashes[i] for i in batch],
                    block_ids=[bench.region + b for b in a_blocks(batch)],
                    lookup_id=lookup_id, request_ids=[lookup_id])
                if raw_first:
                    timed_op(ops["scatter"], raw, bench.raw_scatter, batch)
                reply_r = timed_op(ops["retrieve"], retrieve, payload_r)
                if not raw_first:
                    timed_op(ops["scatter"], raw, bench.raw_scatter, batch)
                if reply_r.missing:
                    result.problems.append(
                        f"round {r}: {len(reply_r.missing)} chunk(s) missing on retrieve")
                queue.put(("progress", spec.index, 2 * len(batch)))
            adapter.call(wire_ops.END_SESSION, m.LookupIdRequest(lookup_id=lookup_id))
            bench.sync()
            checked, bad = bench.verify()
            result.verified_bytes += checked
            result.mismatched_bytes += bad
            if bad:
                result.problems.append(f"round {r}: {bad} of {checked} bytes differ after retrieve")
            if timed:
                result.lookup_ops += ops.pop("lookup", [])
                result.rounds.append(ops)
        return result
    finally:
        adapter.shutdown()
        if bench.segment is not None:
            from lmcache_core.kv.share import release_shared_kv_caches

            release_shared_kv_caches(bench.segment)
