#!/usr/bin/env python3
"""Benchmark the remote tiers (Redis, and Mooncake Store where its extra is installed) against plain
redis-py and a raw copy of the same bytes, in the same run; print GB/s and ratios.

- store: chunks committed to an engine with a remote tier, until its writer has SET them all
  (write-behind: blake3 checksum + record header + pipelined SETs) vs redis-py ``SET`` of the same
  bytes, one call per chunk (default client, and with redis-py's own packer as the tier uses);
- retrieve: a second engine (empty memory) tiered ``lookup`` of the whole prefix (one pipelined
  STRLEN, pipelined GETs, checksum, copy into pool slots), then that plus the copy out of the slots
  (what a retrieve adds) vs redis-py ``GET`` of the same keys, one call per chunk;
- a lookup that goes to Redis and finds nothing (the STRLEN round trip and the engine around it) vs
  redis-py ``EXISTS`` of the same keys in one pipeline, and vs one ``PING``;
- a memory-only ``lookup`` of 64 chunks x 2 ranks with no tier attached (the fast path);
- Mooncake Store: the same store (until written) and lookup + load through a ``MooncakeTier``
  (a master, a metadata server and two nodes of its own: engine A writes, engine B reads, each
  with its memory pool registered and a segment in the pool), taking turns with the Redis tier's
  rounds, beside the raw copy of the same bytes into pool slots (``copy_``, one torch thread)
  and the transport alone (``batch_put_from``/``batch_get_into``, placed as the tier's: the first
  copy in A's own segment, or at random with ``--spread``).

Starts its own ``redis-server`` (no persistence) on a free port unless ``--url`` is given, and
its own ``mooncake_master`` (loopback, free ports) unless ``--no-mooncake``.
Usage: python scripts/bench/bench_tiers.py [--chunk-mib 4] [--chunks 16] [--rounds 5] [--url redis://...]
       [--replicas N] [--spread] [--no-mooncake]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import torch  # noqa: E402
from redis.connection import Encoder, PythonRespSerializer  # noqa: E402

from lmcache_core.engine import CacheEngine, GroupTarget  # noqa: E402
from lmcache_core.keys import ChunkKey, opaque_layout, world_heads  # noqa: E402
from lmcache_core.storage.mooncake_tier import MooncakeTier  # noqa: E402 (imports mooncake when made)
from lmcache_core.storage.pool import MemoryPool  # noqa: E402
from lmcache_core.storage.remote import RedisTier  # noqa: E402
from lmcache_core.storage.remote_tier import RemoteTier  # noqa: E402

MODEL = "bench"
#: No KV shape here: one rank's opaque layout, so each chunk is one piece of heads [0, 1).
LAYOUT = opaque_layout(1)
HEADS = (0, 1)
RANGES = world_heads(LAYOUT, 1)
TARGET = [GroupTarget(LAYOUT, RANGES)]  # a single-layout model: one group


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url = args.url or start_redis(procs)
        master = None if args.no_mooncake else start_mooncake(procs)
        run(args, url, master)
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait(5)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="bytes per chunk, in MiB")
    parser.add_argument("--chunks", type=int, default=16, help="chunks per store/retrieve round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=300, help="repetitions of each lookup figure")
    parser.add_argument("--url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--no-mooncake", action="store_true",
                        help="leave Mooncake Store out (it is left out anyway when not installed)")
    parser.add_argument("--replicas", type=int, default=1, help="Mooncake replicas of each chunk")
    parser.add_argument("--spread", action="store_true",
                        help="Mooncake: replicas placed at random (remote.mooncake.prefer_local "
                             "false), not the first in the writer's own segment")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """Until something accepts on 127.0.0.1:``port`` (fails past ``timeout_s``, or if ``proc``
    exits)."""
    name = Path(str(proc.args[0])).name if isinstance(proc.args, list) else str(proc.args)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.01)
    raise SystemExit(f"{name} did not listen on {port} within {timeout_s:g} s")


def start_redis(procs: list[subprocess.Popen[bytes]]) -> str:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    procs.append(subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", tempfile.mkdtemp(prefix="bench-redis-")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_listening(port, procs[-1])
    return f"redis://127.0.0.1:{port}"


def start_mooncake(procs: list[subprocess.Popen[bytes]]) -> tuple[str, str] | None:
    """``(master HOST:PORT, metadata url)`` of a master and a metadata server of its own, on
    loopback; None (said) where the mooncake extra is not installed."""
    here = Path(sys.executable).parent
    binaries = [shutil.which(name) or str(here / name)
                for name in ("mooncake_master", "mooncake_http_metadata_server")]
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        print(f"Mooncake Store left out: {exc} (pip install lmcache-toolkit[mooncake])")
        return None
    if not all(Path(b).exists() for b in binaries):
        print("Mooncake Store left out: mooncake_master is not installed")
        return None
    port, metadata_port, metrics_port = free_port(), free_port(), free_port()
    procs.append(subprocess.Popen(
        [binaries[1], "--host", "127.0.0.1", "--port", str(metadata_port), "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_listening(metadata_port, procs[-1])
    procs.append(subprocess.Popen(
        [binaries[0], f"--rpc_port={port}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=false", "--metrics_host=127.0.0.1",
         f"--metrics_port={metrics_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    wait_listening(port, procs[-1])
    return f"127.0.0.1:{port}", f"http://127.0.0.1:{metadata_port}/metadata"


def interleaved(fns: Sequence[Callable[[], object]], rounds: int,
                after: Callable[[], object] | None = None) -> list[float]:
    """Best time of each function, the functions taking turns each round (so load on this shared
    machine hits them alike); ``after`` runs untimed after each round."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
        if after is not None:
            after()
    return best


def median_us(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


class TierRounds:
    """One remote tier's rounds: engine A stores the chunks (timed until its writer has written
    them all), engine B (memory cleared) looks the last stored prefix up, loading it into its
    pool, then copies it out (a retrieve)."""

    def __init__(self, make_tier: Callable[[MemoryPool], RemoteTier], data: list[torch.Tensor],
                 keys: Callable[[], list[ChunkKey]]) -> None:
        nbytes, n = data[0].numel(), len(data)
        self.data, self.keys, self.n = data, keys, n
        pool_a, pool_b = (MemoryPool.slots(nbytes, n, pin=False) for _ in range(2))
        self.tier_a, self.tier_b = make_tier(pool_a), make_tier(pool_b)
        self.engine_a = CacheEngine(pool_a, 256, remote=self.tier_a)
        self.engine_b = CacheEngine(pool_b, 256, remote=self.tier_b)
        for engine in (self.engine_a, self.engine_b):
            assert engine.tiers is not None
            engine.tiers.start()  # its writer, writing the pieces behind the stores
        deadline = time.monotonic() + 60
        while self.tier_a.down or self.tier_b.down:  # a Mooncake node joins behind its start
            if time.monotonic() > deadline:
                raise SystemExit("the tier never came up")
            time.sleep(0.01)
        self.stored: list[list[ChunkKey]] = []
        self.reply_s: list[float] = []
        self.load_s: list[float] = []
        self.out = torch.empty(nbytes, dtype=torch.uint8)

    def store(self) -> None:
        store = self.engine_a.store
        store.clear(force=True)
        ks = self.keys()
        start = time.perf_counter()
        plan = store.begin_store(ks, self.data[0].numel())
        for i, _, view in plan.writes:
            view.copy_(self.data[i])
        store.finish_store(plan)
        self.reply_s.append(time.perf_counter() - start)
        assert self.tier_a.flush(60), "writer did not finish"
        self.stored.append(ks)

    def forget_old(self) -> None:
        """Drop all but the last round's chunks from the store (its memory stays flat)."""
        while len(self.stored) > 1:
            for key in self.stored.pop(0):
                self.tier_a._delete(key)

    def retrieve(self) -> None:
        store = self.engine_b.store
        store.clear(force=True)
        hashes = [k.chunk_hash for k in self.stored[-1]]
        start = time.perf_counter()
        hits = self.engine_b.lookup(MODEL, TARGET, hashes, "bench", tier_timeout_s=60)
        self.load_s.append(time.perf_counter() - start)
        assert hits == self.n, f"{hits} of {self.n} hit"
        plan = store.begin_retrieve(MODEL, LAYOUT, HEADS, hashes, "bench")
        for _, ((view, _, _),) in plan.found:
            self.out.copy_(view)
        store.finish_retrieve(plan)

    def check(self) -> None:
        """B's copy of the first chunk is byte-exact; nothing was dropped, failed or corrupt."""
        store = self.engine_b.store
        check = store.begin_retrieve(MODEL, LAYOUT, HEADS, [self.stored[-1][0].chunk_hash])
        assert torch.equal(check.found[0][1][0][0], self.data[0]), "bytes differ"
        store.finish_retrieve(check)
        a, b = self.tier_a.stats(), self.tier_b.stats()
        assert a.write_dropped == a.write_failed == b.corrupt == b.errors == 0, (a, b)

    def placement(self) -> str:
        """Where the last round's replicas are (Mooncake): on the writer's node (a local copy) or
        the reader's (moved over TCP)."""
        tier_a, tier_b = self.tier_a, self.tier_b
        assert isinstance(tier_a, MooncakeTier) and isinstance(tier_b, MooncakeTier)
        names = [tier_a.name_of(k) for k in self.stored[-1]]
        replicas = tier_a._client().batch_get_replica_desc(names)
        nodes = {tier_a.node: "A (the writer: a local copy)", tier_b.node: "B (over TCP)"}
        where = [nodes.get(r.get_memory_descriptor().buffer_descriptor.transport_endpoint, "?")
                 for name in names for r in replicas.get(name, ())]
        return ", ".join(f"{where.count(node)} replica(s) on {node}" for node in nodes.values())

    def stop(self) -> None:
        self.tier_a.stop()
        self.tier_b.stop()


class RawMooncake:
    """The transport alone, the floor of the Mooncake tier: node A's client ``batch_put_from`` of
    the same bytes (a registered buffer, placed as the tier's are), node B's ``batch_get_into``
    of them into a registered buffer of its own; no engine, records or checksums."""

    def __init__(self, rounds: TierRounds, data: list[torch.Tensor], replicas: int) -> None:
        import mooncake.store as store

        nbytes, n = data[0].numel(), len(data)
        tier_a, tier_b = rounds.tier_a, rounds.tier_b
        assert isinstance(tier_a, MooncakeTier) and isinstance(tier_b, MooncakeTier)
        self.a, self.b = tier_a._client(), tier_b._client()
        self.src, self.dst = torch.cat(data), torch.empty(n * nbytes, dtype=torch.uint8)
        assert self.a.register_buffer(self.src.data_ptr(), self.src.numel()) == 0
        assert self.b.register_buffer(self.dst.data_ptr(), self.dst.numel()) == 0
        self.names = [f"raw:{i}" for i in range(n)]
        self.sizes = [nbytes] * n
        self.config = store.ReplicateConfig()
        self.config.replica_num = replicas
        if tier_a.prefer_local:
            self.config.preferred_segment = tier_a.node
        self.nbytes = nbytes

    def put(self) -> None:
        ptrs = [self.src.data_ptr() + i * self.nbytes for i in range(len(self.names))]
        codes = self.a.batch_put_from(self.names, ptrs, self.sizes, self.config)
        assert codes == [0] * len(codes), codes

    def forget(self) -> None:
        self.a.batch_remove(self.names, True)

    def get(self) -> None:
        ptrs = [self.dst.data_ptr() + i * self.nbytes for i in range(len(self.names))]
        assert self.b.batch_get_into(self.names, ptrs, self.sizes) == self.sizes


def run(args: argparse.Namespace, url: str, master: tuple[str, str] | None) -> None:
    nbytes = int(args.chunk_mib * 2**20)
    n = args.chunks
    total = nbytes * n
    raw = redis.Redis.from_url(url)
    data = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8) for _ in range(n)]
    blobs = [d.numpy().tobytes() for d in data]
    counter = iter(range(10**9))

    def keys() -> list[ChunkKey]:
        round_id = next(counter)
        return [ChunkKey(MODEL, LAYOUT, *HEADS, round_id.to_bytes(8, "big") + i.to_bytes(24, "big"))
                for i in range(n)]

    print(f"Redis {raw.info()['redis_version']} at {url}; {n} chunks x {args.chunk_mib:g} MiB = "
          f"{total / 2**20:.0f} MiB per round, best of {args.rounds}")
    tiers = {"Redis": TierRounds(lambda _pool: RedisTier(url, queue_size=4 * n, timeout_ms=5000),
                                 data, keys)}
    if master is not None:
        # A node holds one copy at most of each chunk of the two rounds live at a time (the new one
        # before the old is dropped) and of the raw floor's, below the master's eviction
        # watermark (90 %).
        segment = 3 * total * 10 // 9 + 64 * 2**20

        def mooncake(pool: MemoryPool) -> RemoteTier:
            return MooncakeTier(master[0], master[1], memory=(pool.address, pool.nbytes),
                                segment_bytes=segment, replicas=args.replicas,
                                prefer_local=not args.spread, queue_size=4 * n, timeout_ms=5000)

        tiers["Mooncake Store"] = TierRounds(mooncake, data, keys)
        print(f"Mooncake Store at {master[0]}: two nodes (tcp), segments of {segment >> 20} MiB, "
              f"{args.replicas} replica(s), "
              + ("placed at random" if args.spread else "the first in the writer's segment"))

    # ---- store
    def raw_set() -> None:
        for i, blob in enumerate(blobs):
            raw.set(f"raw:{i}", blob)

    packer = redis.Redis.from_url(url, command_packer=PythonRespSerializer(
        6000, Encoder("utf-8", "strict", False).encode))

    def raw_set_py() -> None:
        for i, blob in enumerate(blobs):
            packer.set(f"raw:{i}", blob)

    copy_views = list(torch.empty(n * nbytes, dtype=torch.uint8).split(nbytes))

    def raw_copy() -> None:  # the bytes into memory: what any store or load of them costs at least
        for view, chunk in zip(copy_views, data, strict=True):
            view.copy_(chunk)

    def forget_old() -> None:  # keeps the stores' memory flat: every round writes as much anew
        raw.delete(*[f"raw:{i}" for i in range(n)])
        for rounds in tiers.values():
            rounds.forget_old()

    names = list(tiers)
    mc_raw = (RawMooncake(tiers["Mooncake Store"], data, args.replicas)
              if "Mooncake Store" in tiers else None)

    def raw_put() -> None:
        if mc_raw is not None:
            mc_raw.put()

    def forget_all() -> None:
        forget_old()
        if mc_raw is not None:
            mc_raw.forget()

    best = interleaved([raw_copy, raw_set, raw_set_py, raw_put] + [tiers[t].store for t in names],
                       args.rounds, forget_all)
    raw_copy_s, raw_set_s, raw_set_py_s, raw_put_s, tier_set = (best[0], best[1], best[2], best[3],
                                                                best[4:])
    if mc_raw is not None:
        mc_raw.put()  # for the reads
    for i, blob in enumerate(blobs):
        raw.set(f"raw:{i}", blob)
    for name, tier_s in zip(names, tier_set, strict=True):
        print(f"{name}:")
        report("store (until written)", total, tier_s, raw_set_s, "redis-py SET per chunk")
        report("", total, tier_s, raw_set_py_s, "same, redis-py's own packer")
        report("", total, tier_s, raw_copy_s, "raw copy into pool slots")
        if name == "Mooncake Store":
            report("", total, tier_s, raw_put_s, "Mooncake batch_put_from alone")
        print(f"  (the store itself returned in {min(tiers[name].reply_s) * 1e3:.2f} ms: writes go "
              f"behind)")

    # ---- retrieve
    def raw_get() -> None:
        for i in range(n):
            raw.get(f"raw:{i}")

    def raw_mc_get() -> None:
        if mc_raw is not None:
            mc_raw.get()

    best = interleaved([raw_get, raw_mc_get] + [tiers[t].retrieve for t in names], args.rounds)
    raw_get_s, raw_mc_get_s, tier_get = best[0], best[1], best[2:]
    for name, tier_s in zip(names, tier_get, strict=True):
        rounds = tiers[name]
        rounds.check()
        print(f"{name}:")
        report("lookup + load into memory", total, min(rounds.load_s), raw_get_s,
               "redis-py GET per chunk")
        report("", total, min(rounds.load_s), raw_copy_s, "raw copy into pool slots")
        if name == "Mooncake Store":
            report("", total, min(rounds.load_s), raw_mc_get_s, "Mooncake batch_get_into alone")
        report("retrieve (the above + copy out)", total, tier_s, raw_get_s, "redis-py GET per chunk")
    if "Mooncake Store" in tiers:
        print(f"  ({tiers['Mooncake Store'].placement()})")
    if len(names) == 2:
        (redis_store, mc_store), (redis_load, mc_load) = tier_set, [
            min(tiers[t].load_s) for t in names]
        print(f"Mooncake Store / Redis tier: store {redis_store / mc_store:.2f}x, lookup + load "
              f"{redis_load / mc_load:.2f}x, retrieve {tier_get[0] / tier_get[1]:.2f}x")

    # ---- lookup that asks Redis (and finds nothing)
    redis_rounds = tiers["Redis"]
    engine_b, tier_b = redis_rounds.engine_b, redis_rounds.tier_b
    missing = [ChunkKey(MODEL, LAYOUT, *HEADS, b"\xee" * 24 + i.to_bytes(8, "big"))
               for i in range(n)]
    hashes = [k.chunk_hash for k in missing]
    rkeys = [tier_b.remote_key(k) for k in missing]

    def raw_exists() -> None:
        pipe = raw.pipeline(transaction=False)
        for rkey in rkeys:
            pipe.exists(rkey)
        pipe.execute()

    tier_lookup = median_us(lambda: engine_b.lookup(MODEL, TARGET, hashes, "miss",
                                                    tier_timeout_s=5), args.lookups)
    raw_lookup = median_us(raw_exists, args.lookups)
    ping = median_us(raw.ping, args.lookups)
    print(f"lookup of {n} chunks that goes to Redis: {tier_lookup:8.1f} us   redis-py pipelined "
          f"EXISTS x{n}: {raw_lookup:6.1f} us   ratio {tier_lookup / raw_lookup:.2f}x   "
          f"(PING {ping:.1f} us)")
    if "Mooncake Store" in tiers:
        mc = tiers["Mooncake Store"].engine_b
        mc_lookup = median_us(lambda: mc.lookup(MODEL, TARGET, hashes, "miss", tier_timeout_s=5),
                              args.lookups)
        print(f"lookup of {n} chunks that goes to Mooncake Store: {mc_lookup:8.1f} us")

    # ---- memory-only fast path (no tier)
    plain = CacheEngine(MemoryPool.slots(64, 256, pin=False), 256)
    chain = [bytes([i, 7]) * 16 for i in range(64)]
    two = opaque_layout(2)
    for lo, hi in world_heads(two, 2):
        plain.store.finish_store(plain.store.begin_store(
            [ChunkKey(MODEL, two, lo, hi, c) for c in chain], 8))
    both = [GroupTarget(two, world_heads(two, 2))]
    fast = min(median_us(lambda: plain.lookup(MODEL, both, chain, "f"), args.lookups)
               for _ in range(3))
    print(f"memory lookup, no tier, 64 chunks x 2 ranks: {fast:.1f} us")

    for name, rounds in tiers.items():
        rounds.stop()
        print(f"stats {name} A:", rounds.tier_a.stats())
        print(f"stats {name} B:", rounds.tier_b.stats())


def report(what: str, nbytes: int, tier_s: float, raw_s: float, floor: str) -> None:
    gbs = nbytes / tier_s / 1e9
    raw_gbs = nbytes / raw_s / 1e9
    print(f"{what:34s} tier {gbs:6.2f} GB/s   {floor}: {raw_gbs:6.2f} GB/s   "
          f"ratio {gbs / raw_gbs:.2f}x")


if __name__ == "__main__":
    main()
