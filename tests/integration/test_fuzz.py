"""Hostile frames against a real ``lmcache serve`` (issue 10): nothing may stop it answering.

* ``test_fuzz_frames``: 20,000 generated frames (``fuzz_frames.py``: valid requests from the message
  structs, mutated) in batches from raw DEALER sockets; after every batch a real ping must answer within
  1 s. A real worker is registered, and a third of the requests use what the server knows (its instance
  id, its segment, block ids in range), so stores, retrieves and registrations reach the copy code.
  Every request under zmq's hard cap must get a reply (docs/protocol.md: "every request gets one") and none an
  INTERNAL error; the server's RSS may not grow by more than ``RSS_GROWTH_BOUND`` after warm-up; no
  traceback in its log; afterwards the worker's store and retrieve still copy every byte exactly. A
  failing batch is saved and replayed case by case on a fresh server to name the frame that did it.
* ``test_ping_beside_one_bad_request``: for each of the heaviest single requests we know, pings sent
  while it is being served must each answer within 50 ms (one retry for noise on a loaded machine).
* ``test_regression``: the frames that once broke the server (``fuzz_regressions.py``), every run.

``LMCACHE_FUZZ_SEED`` and ``LMCACHE_FUZZ_FRAMES`` override the seed and the frame count (to replay a CI
failure, or to fuzz longer by hand); the seed is printed with the summary line.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import math
import os
import random
import re
import secrets
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect
import pytest
import zmq

from lmcache_core.errors import LMCacheError
from lmcache_core.protocol import RequestType, decode_request
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.codec import Limits, encode, encode_request
from lmcache_core.protocol.lmcache_wire import dialect_op, is_failure_op
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.fuzz_frames import (
    Case,
    FuzzLimits,
    Hints,
    chunked,
    default_seed,
    generate_cases,
    valid_corpus,
    worst_cases,
)
from tests.integration.fuzz_regressions import REGRESSIONS, Regression, RegressionContext
from tests.integration.servers import ServerProcess, WorkerProcess

FRAMES = int(os.environ.get("LMCACHE_FUZZ_FRAMES", "20000"))
BATCH = 500
PEERS = 3  # DEALER sockets sharing each batch, so the ROUTER interleaves several peers
WARMUP_BATCHES = 4  # RSS is measured from here on (allocator arenas and zmq buffers grown by then)
PING_BOUND_S = 1.0
BESIDE_BOUND_S = 0.050
REPLY_TIMEOUT_S = 5.0  # for a batch's replies, and for one worst-case request's reply
#: What may legitimately grow after warm-up: allocator arenas and zmq buffers after the largest
#: request (<= 4 MiB, the hard cap), the touched pages of the 8 MiB pool, the index of at most 1024
#: disk chunks (64 MiB of 64 KiB chunks), a few mapped registrations of the worker's 1 MiB segment.
#: 64 MiB covers that with room; a leak of 4 KiB per request over 20,000 requests (80 MiB) fails it.
RSS_GROWTH_BOUND = 64 * 2**20
MESSAGE_BOUND = 1024  # characters of one ErrorReply message (issue 10 asks for ~200 and a count)
LOG_GROWTH_PER_FRAME = 1024  # bytes of server log per rejected request, on average
RUN_BUDGET_S = 180.0  # the fuzz run stops (and fails) past this; 20,000 frames take ~5 s here
FUZZ_LIMITS = FuzzLimits(max_request_bytes=2**20, max_keys_per_request=4096)
DEFAULT_LIMITS = FuzzLimits(Limits().max_request_bytes, Limits().max_keys_per_request)
PING_FRAMES_UID = itertools.count(10**9)
ERROR_TAG = msgspec.inspect.type_info(m.ErrorReply).tag  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the server and its vital signs


def start_server(tmp: Path, limits: FuzzLimits, name: str) -> ServerProcess:
    """A TINY server with these limits and a disk tier (lookups then run on the worker pool and
    touch the disk index: more to break)."""
    overrides = {
        "server": {"max_request_bytes": limits.max_request_bytes,
                   "max_keys_per_request": limits.max_keys_per_request},
        "disk": {"path": str(tmp / f"{name}-disk"), "max_size": "64MiB"},
    }
    return ServerProcess(tmp, overrides, name=name).start()


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` (0 once it has exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


def tracebacks(log: str, context: int = 14) -> list[str]:
    """Each traceback in a server log, with the lines before it (what was logged) and after."""
    lines = log.splitlines()
    return ["\n".join(lines[max(0, i - 2):i + context]) for i, line in enumerate(lines)
            if "Traceback" in line]


def classify(frames: list[bytes]) -> tuple[str, str]:
    """``("error:<code>" | "ok:<kind>" | "malformed:<why>", error message)`` of one reply."""
    if len(frames) != 3:
        return f"malformed:{len(frames)} frames", ""
    try:
        value = msgspec.msgpack.decode(frames[2])
    except (msgspec.DecodeError, RecursionError):
        return "malformed:undecodable", ""
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        return "malformed:untagged", ""
    if value["kind"] == ERROR_TAG:
        return f"error:{value.get('code')}", str(value.get("message", ""))
    return f"ok:{value['kind']}", ""


class Peer:
    """A raw DEALER: sends any frames (the project's client refuses garbage) and counts replies."""

    def __init__(self, context: zmq.Context[Any], url: str) -> None:
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(REPLY_TIMEOUT_S * 1000))  # a send never hangs
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(url)
        self.outstanding = 0
        self.by_uid: dict[bytes, Case] = {}

    def send(self, case: Case) -> None:
        self.sock.send_multipart(case.frames)
        self.outstanding += case.expects_reply  # every frame but a stream's credit
        if len(self.by_uid) > 4 * BATCH:
            self.by_uid.clear()
        self.by_uid[case.frames[0]] = case

    def receive_ready(self) -> list[tuple[list[bytes], Case | None]]:
        """Every reply already queued, with the case whose uid frame it echoes (if known)."""
        out = []
        while self.sock.get(zmq.EVENTS) & zmq.POLLIN:
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            case = self.by_uid.get(frames[0]) if frames else None
            # Whose reply this is comes from its echoed op frame, not from the uid: uids repeat, and
            # a reply of ours taken for LMCache's (sent later with the same uid) was never counted.
            dialect = lmcache_reply(frames)
            if case is not None and case.lmcache != dialect:
                case = None
            self.outstanding -= 1
            out.append((frames, case))
        return out

    def close(self) -> None:
        self.sock.close(0)


def lmcache_reply(frames: list[bytes]) -> bool:
    """Whether a reply is LMCache's dialect: its op echoed, or a failure naming another op."""
    return len(frames) > 1 and (dialect_op(frames[1]) is not None or is_failure_op(frames[1]))


def classify_any(frames: list[bytes]) -> tuple[str, str]:
    """``classify``, and ``lmcache:reply`` / ``lmcache:failure`` for LMCache's replies."""
    if not lmcache_reply(frames):
        return classify(frames)
    if is_failure_op(frames[1]):
        return "lmcache:failure", msgspec.msgpack.decode(frames[1])
    return "lmcache:reply", ""


def send_over_cap(context: zmq.Context[Any], url: str, case: Case) -> None:
    """A message over zmq's MAXMSGSIZE makes the server drop the connection, with every message
    queued behind it: send it on a socket of its own, and expect no reply."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)  # close() hands the message over before dropping the socket
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    try:
        sock.connect(url)
        sock.send_multipart(case.frames)
    finally:
        sock.close()


def raw_ping(peer: Peer, timeout_s: float) -> float | None:
    """Seconds for one ping round trip on ``peer`` (other replies arriving meanwhile are dropped),
    or None if no reply came within ``timeout_s``."""
    uid = next(PING_FRAMES_UID)
    frames = encode_request(uid, RequestType.PING, [m.PingRequest()])
    start = time.perf_counter()
    peer.sock.send_multipart(frames)
    deadline = start + timeout_s
    while (left := deadline - time.perf_counter()) > 0:
        if not peer.sock.poll(max(1, int(left * 1000))):
            break
        reply = peer.sock.recv_multipart()
        if reply and reply[0] == frames[0]:
            return time.perf_counter() - start
    return None


def responsive(server: ServerProcess, timeout_s: float = PING_BOUND_S) -> bool:
    if server.proc is None or server.proc.poll() is not None:
        return False
    context: zmq.Context[Any] = zmq.Context.instance()
    peer = Peer(context, server.url)
    try:
        return raw_ping(peer, timeout_s) is not None
    finally:
        peer.close()


# ---------------------------------------------------------------- the fuzz run


@dataclass
class FuzzReport:
    seed: int
    sent: int = 0
    over_cap: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    silent: int = 0
    pings_ms: list[float] = field(default_factory=list)
    failed_pings: int = 0
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (ms between replies, case)
    longest_message: tuple[int, str] = (0, "")
    internal_errors: list[str] = field(default_factory=list)
    rss_warm: int = 0
    rss_end: int = 0
    rss_max: int = 0
    log_growth: int = 0
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    def note_reply(self, frames: list[bytes], case: Case | None, gap_s: float) -> None:
        outcome, message = classify_any(frames)
        self.outcomes[outcome] += 1
        label = case.describe() if case is not None else f"(uid frame {frames[0][:40]!r})"
        if len(message) > self.longest_message[0]:
            self.longest_message = (len(message), label)
        if outcome == "error:internal" and len(self.internal_errors) < 10:
            self.internal_errors.append(f"{label}\n      -> {message[:300]}")
        item = (gap_s * 1000, label)
        if len(self.slowest) < 8:
            heapq.heappush(self.slowest, item)
        else:
            heapq.heappushpop(self.slowest, item)

    def summary(self) -> str:
        replies = " ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items()))
        max_ping = max(self.pings_ms, default=float("nan"))
        return (f"fuzz seed={self.seed}: {self.sent} frames sent ({self.over_cap} over the hard cap, "
                f"no reply expected); replies: {replies}; silent={self.silent}; "
                f"pings={len(self.pings_ms)} failed={self.failed_pings} max {max_ping:.1f} ms; "
                f"rss +{(self.rss_end - self.rss_warm) / 2**20:.1f} MiB after warm-up "
                f"(max {self.rss_max / 2**20:.0f} MiB); longest error message "
                f"{self.longest_message[0]} chars; log +{self.log_growth / 2**20:.1f} MiB; "
                f"wall {self.wall_s:.1f} s")

    def details(self) -> str:
        slow = "\n".join(f"    {ms:8.1f} ms  {label}" for ms, label in sorted(self.slowest, reverse=True))
        return f"  slowest replies (gap before them):\n{slow}"


class FuzzRun:
    """Sends the cases batch by batch through ``PEERS`` DEALERs and checks the server after each."""

    def __init__(self, server: ServerProcess, limits: FuzzLimits, report: FuzzReport, save_dir: Path) -> None:
        assert server.proc is not None
        self.server, self.limits, self.report, self.save_dir = server, limits, report, save_dir
        self.pid = server.proc.pid
        self.context: zmq.Context[Any] = zmq.Context()
        self.peers = [Peer(self.context, server.url) for _ in range(PEERS)]
        self.client = MessageQueueClient(server.url, self.context, request_timeout_s=PING_BOUND_S,
                                         connect_timeout_s=PING_BOUND_S)
        self.failing_batches: list[list[Case]] = []

    def run(self, cases: Iterator[Case]) -> None:
        start = time.monotonic()
        log_start = self.server.log_path.stat().st_size
        deaf = 0
        for n, batch in enumerate(chunked(cases, BATCH)):
            self.send(batch)
            self.collect(time.monotonic() + REPLY_TIMEOUT_S)
            deaf = 0 if self.ping(n, batch) else deaf + 1
            rss = rss_bytes(self.pid)
            self.report.rss_max = max(self.report.rss_max, rss)
            if n == WARMUP_BATCHES - 1 or not self.report.rss_warm:
                self.report.rss_warm = rss
            if self.server.proc is not None and self.server.proc.poll() is not None:
                self.report.problems.append(f"the server exited ({self.server.proc.returncode}) "
                                            f"during batch {n}")
                break
            if deaf >= 2:
                self.report.problems.append(f"the server stopped answering pings (batch {n})")
                break
            if time.monotonic() - start > RUN_BUDGET_S:
                self.report.problems.append(f"the run passed its {RUN_BUDGET_S:.0f} s budget "
                                            f"after {self.report.sent} frames")
                break
        self.collect(time.monotonic() + 2.0)
        self.report.silent = sum(p.outstanding for p in self.peers)
        self.report.rss_end = rss_bytes(self.pid)
        self.report.log_growth = self.server.log_path.stat().st_size - log_start
        self.report.wall_s = time.monotonic() - start

    def send(self, batch: list[Case]) -> None:
        for i, case in enumerate(batch):
            self.report.sent += 1
            if case.size > self.limits.hard_cap:
                self.report.over_cap += 1
                send_over_cap(self.context, self.server.url, case)
                continue
            try:
                self.peers[i % PEERS].send(case)
            except zmq.Again:
                self.report.problems.append(f"a send blocked for {REPLY_TIMEOUT_S} s: {case.describe()}")
                return

    def collect(self, deadline: float) -> None:
        """Receive until every peer has its replies, or ``deadline``."""
        poller = zmq.Poller()
        for peer in self.peers:
            poller.register(peer.sock, zmq.POLLIN)
        last = time.monotonic()
        while any(p.outstanding > 0 for p in self.peers):
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                return
            for peer in self.peers:
                for frames, case in peer.receive_ready():
                    now = time.monotonic()
                    self.report.note_reply(frames, case, now - last)
                    last = now

    def ping(self, n: int, batch: list[Case]) -> bool:
        """A real ping through the project's client; False (and the batch saved) if it was late."""
        start = time.perf_counter()
        try:
            self.client.ping(timeout_s=PING_BOUND_S)
        except LMCacheError as exc:
            self.report.failed_pings += 1
            self.failed(n, batch, f"ping after batch {n} failed ({exc})")
            return False
        elapsed_ms = (time.perf_counter() - start) * 1000
        self.report.pings_ms.append(elapsed_ms)
        if elapsed_ms > PING_BOUND_S * 1000:
            self.failed(n, batch, f"ping after batch {n} took {elapsed_ms:.0f} ms")
        return True

    def failed(self, n: int, batch: list[Case], what: str) -> None:
        path = save_cases(self.save_dir / f"batch-{n}.msgpack", batch)
        self.report.problems.append(f"{what}; its cases: {path}")
        self.failing_batches.append(batch)

    def close(self) -> None:
        self.client.close()
        for peer in self.peers:
            peer.close()
        self.context.destroy(linger=0)


def save_cases(path: Path, cases: list[Case]) -> Path:
    """The cases of a failing batch (msgpack ``[[kind, [frame, ...]], ...]``), to replay by hand."""
    path.write_bytes(encode([[c.kind, list(c.frames)] for c in cases]))
    return path


def pinpoint(tmp: Path, batch: list[Case]) -> str:
    """Replay a failing batch one case at a time on a fresh server, a ping after each: the first
    case after which the ping fails or is late (what to add to ``fuzz_regressions.py``)."""
    server = start_server(tmp, FUZZ_LIMITS, "pinpoint")
    context: zmq.Context[Any] = zmq.Context()
    peer, pinger = Peer(context, server.url), Peer(context, server.url)
    try:
        for case in batch:
            if case.size > FUZZ_LIMITS.hard_cap:
                send_over_cap(context, server.url, case)
            else:
                peer.send(case)
                if peer.sock.poll(int(PING_BOUND_S * 1000)):  # its reply first: a ping could overtake it
                    peer.receive_ready()
            took = raw_ping(pinger, PING_BOUND_S)
            if took is None or took > PING_BOUND_S / 2:
                late = "no ping reply" if took is None else f"ping {took * 1000:.0f} ms"
                return f"{late} right after {case.describe()}\n      frames: {case.expr()}"
        return "no single case of the batch reproduces it (an interaction, or load)"
    finally:
        context.destroy(linger=0)
        server.kill()


def test_valid_cases_are_valid_and_cover_every_op() -> None:
    """The generator's 'valid' requests decode as the server decodes them, every op is in the corpus
    (new ops are fuzzed without touching the generator), and a seed gives the same cases."""
    corpus = valid_corpus(1, 20)
    assert {r.op for r in corpus} == set(RequestType)
    limits = Limits(2**40, 2**40)  # valid as to types and bounds; the size limits are another matter
    for request in corpus:
        decoded = decode_request(encode_request(5, request.op, [request.payload]), limits)
        assert decoded.op == request.op and decoded.payload == request.payload
    first = list(generate_cases(3, 300, FUZZ_LIMITS, corpus_per_op=5))
    assert first == list(generate_cases(3, 300, FUZZ_LIMITS, corpus_per_op=5))
    assert len({c.kind for c in first}) >= 12


WORKER_BLOCKS = 64  # WorkerProcess's default KV cache: 64 blocks of 16 tokens, 4 heads x 32, fp16
BLOCKS_PER_CHUNK = 4  # TINY's 64-token chunks
FUZZ_INSTANCES = (1, 2, 3)  # ids the fuzzed registrations take (never the worker's own)
#: Block counts a fuzzed registration may claim. At most 1024 on purpose: an aliased view (stride 0)
#: copied whole by some path would then cost <= 8 MiB, never a huge allocation on a shared CI host.
#: (Larger claims are the regression cases' job, one request at a time.)
FUZZ_NUM_BLOCKS = (8, 64, 1024)


def worker_hints(worker: WorkerProcess) -> Hints:
    """Values the server knows, from a registered worker: requests using them reach the copies."""
    return Hints(values={
        "instance_id": (worker.hello["instance_id"], *FUZZ_INSTANCES), "model_name": ("tiny",),
        "world_size": (1,), "kv_rank": (0,), "block_size": (16,), "lookup_id": ("fuzz-a", "fuzz-b"),
        "shm_name": (worker.hello["shm_name"],), "pid": (worker.proc.pid,),
        "hostname": (socket.gethostname(),),
    }, repair=repair, skip_ops=frozenset({RequestType.UNREGISTER_KV_CACHE}))


def repair(payload: dict[str, Any], rng: random.Random) -> None:
    fit_block_ids(payload, rng)
    if isinstance(payload.get("layers"), list) and payload["layers"]:
        fit_layers(payload, rng)


def fit_block_ids(payload: dict[str, Any], rng: random.Random) -> None:
    """As many block ids as the chunks need, inside the worker's cache (mutations then break them)."""
    hashes = payload.get("chunk_hashes")
    if isinstance(hashes, list) and "block_ids" in payload:
        del hashes[WORKER_BLOCKS // BLOCKS_PER_CHUNK:]
        payload["block_ids"] = [rng.randrange(WORKER_BLOCKS) for _ in range(BLOCKS_PER_CHUNK * len(hashes))]


def fit_layers(payload: dict[str, Any], rng: random.Random) -> None:
    """A registration of the worker's real segment (its pid, so ownership checks pass) under a fuzz
    instance id, with layer geometry that is right, aliased (zero strides), or off by a little."""
    payload["instance_id"] = rng.choice(FUZZ_INSTANCES)
    shape = [2, rng.choice(FUZZ_NUM_BLOCKS), 16, 4, 32]
    dense = [math.prod(shape[i + 1:]) for i in range(5)]
    stride = rng.choice((dense, [0] * 5, [0, 0, *dense[2:]], [0, *dense[1:]], dense[::-1],
                         [rng.randrange(0, 4096) for _ in range(5)]))
    layer_bytes = math.prod(shape) * 2
    template = payload["layers"][0] if isinstance(payload["layers"][0], dict) else {}
    payload["layers"] = [{
        **template, "kind": "shm", "dtype": rng.choice(("float16", "float16", "bfloat16", "float32", "int8")),
        "shape": shape, "stride": stride, "segment_nbytes": 0, "cuda": None,
        "offset_bytes": rng.choice((i * layer_bytes, 0, 2 * 2**20 - 2, i * layer_bytes + 1)),
    } for i in range(rng.choice((1, 2, 2, 2, 3)))]


def round_trip_ok(worker: WorkerProcess, deadline_s: float = 10.0) -> str | None:
    """None if a store and a retrieve through the worker still copy every byte exactly, else why not.
    Retried until ``deadline_s``: the fuzz may have unregistered the worker (it registers again)."""
    blocks, back = list(range(0, 8)), list(range(8, 16))
    toks = [7 + i for i in range(2 * 64)]
    worker("fill", blocks=blocks, seed=5)
    want = worker("digest", blocks=blocks)["digest"]
    why = ["never tried"]
    attempts = itertools.count()

    def copied() -> bool:
        n = next(attempts)
        stored = worker("store", req=f"s{n}", keys=toks, blocks=blocks)
        worker("zero", blocks=back)
        got = worker("retrieve", req=f"r{n}", keys=toks, blocks=back)
        if stored["finished"] and not stored["failed"] and got["finished"] and not got["failed"]:
            why[0] = "" if worker("digest", blocks=back)["digest"] == want else "retrieved bytes differ"
            return True
        why[0] = f"store {stored}, retrieve {got}"
        return False

    with contextlib.suppress(AssertionError):  # not within deadline_s: why[0] says why
        wait_until(copied, deadline_s)
    return why[0] or None


@pytest.mark.timeout(RUN_BUDGET_S + 120)
def test_fuzz_frames(tmp_path: Path) -> None:
    seed = default_seed()
    server = start_server(tmp_path, FUZZ_LIMITS, "srv")
    worker: WorkerProcess | None = None
    report = FuzzReport(seed)
    run = FuzzRun(server, FUZZ_LIMITS, report, tmp_path)
    try:
        worker = WorkerProcess(server.url)
        run.run(generate_cases(seed, FRAMES, FUZZ_LIMITS, worker_hints(worker)))
        alive = responsive(server)
        broken_copy = round_trip_ok(worker) if alive else "not tried"
    finally:
        run.close()
        if worker is not None:
            worker.kill()
        server.kill()
    print(report.summary())
    print(report.details())
    problems = list(report.problems)
    if run.failing_batches:
        problems.append("pinpointed: " + pinpoint(tmp_path, run.failing_batches[0]))
    if not alive:
        problems.append("the server did not answer a ping at the end")
    if broken_copy:
        problems.append(f"a real store and retrieve after the fuzz failed: {broken_copy}")
    if report.sent < FRAMES:
        problems.append(f"only {report.sent} of {FRAMES} frames were sent")
    if report.silent:
        problems.append(f"{report.silent} request(s) under the hard cap got no reply within "
                        f"{REPLY_TIMEOUT_S} s")
    if any(k.startswith("malformed") for k in report.outcomes):
        problems.append("malformed replies: " + str({k: v for k, v in report.outcomes.items()
                                                     if k.startswith("malformed")}))
    if report.internal_errors:
        problems.append("INTERNAL errors (an exception no handler expected):\n    "
                        + "\n    ".join(report.internal_errors))
    if report.rss_end - report.rss_warm > RSS_GROWTH_BOUND:
        problems.append(f"RSS grew {(report.rss_end - report.rss_warm) / 2**20:.0f} MiB after warm-up "
                        f"(bound {RSS_GROWTH_BOUND / 2**20:.0f} MiB)")
    if report.longest_message[0] > MESSAGE_BOUND:
        problems.append(f"an error message of {report.longest_message[0]} characters "
                        f"(bound {MESSAGE_BOUND}): {report.longest_message[1]}")
    if report.log_growth > LOG_GROWTH_PER_FRAME * max(1, report.sent):
        problems.append(f"the log grew {report.log_growth / 2**20:.1f} MiB for {report.sent} frames")
    problems += [f"traceback in {server.log_path}:\n{tb}" for tb in tracebacks(server.log())[:5]]
    assert not problems, f"seed {seed}:\n" + "\n".join(f"- {p}" for p in problems)


# ---------------------------------------------------------------- one bad request at a time


class LiveServer:
    """A default-limits server shared by a module, restarted when a test left it dead or deaf, so a
    request that kills it fails its own test and not every test after it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server: ServerProcess | None = None
        self.starts = 0

    def get(self) -> ServerProcess:
        if self.server is not None and responsive(self.server):
            return self.server
        if self.server is not None:
            self.server.kill()
        self.starts += 1
        self.server = start_server(self.tmp, DEFAULT_LIMITS, f"srv{self.starts}")
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.kill()


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("fuzz"))
    yield live
    live.close()


@dataclass
class Beside:
    """Pings sent while one bad request was being served."""

    pings_s: list[float | None]
    reply_s: float | None  # when the bad request's reply came (None: not within the timeout)
    outcome: str
    message: str
    rss_growth: int

    @property
    def worst_ping_s(self) -> float:
        return max((p if p is not None else float("inf") for p in self.pings_s), default=float("inf"))

    def describe(self) -> str:
        pings = [f"{p * 1000:.1f}" if p is not None else "none" for p in self.pings_s]
        shown = ", ".join(pings[:8]) + (f", ... ({len(pings)} pings)" if len(pings) > 8 else "")
        reply = f"{self.reply_s * 1000:.0f} ms" if self.reply_s is not None else "none"
        return (f"ping ms [{shown}], its reply {reply} ({self.outcome}), "
                f"rss {self.rss_growth / 2**20:+.1f} MiB")


def ping_beside(server: ServerProcess, case: Case, limits: FuzzLimits) -> Beside:
    """Send ``case``, then ping on another socket, one ping after the other, until its reply is in
    (at most ``REPLY_TIMEOUT_S``; 0.3 s for a case that gets no reply), then once more."""
    assert server.proc is not None
    context: zmq.Context[Any] = zmq.Context.instance()
    bad, pinger = Peer(context, server.url), Peer(context, server.url)
    expect_reply = case.size <= limits.hard_cap and case.expects_reply
    try:
        assert raw_ping(pinger, PING_BOUND_S) is not None, "the server did not answer before the case"
        rss_before = rss_bytes(server.proc.pid)
        start = time.perf_counter()
        if expect_reply:
            bad.send(case)
        else:
            send_over_cap(context, server.url, case)
        pings: list[float | None] = []
        reply: tuple[list[bytes], float] | None = None
        window = REPLY_TIMEOUT_S if expect_reply else 0.3
        while reply is None and time.perf_counter() - start < window:
            pings.append(raw_ping(pinger, PING_BOUND_S))
            got = bad.receive_ready() if expect_reply else []
            if got:
                reply = (got[0][0], time.perf_counter() - start)
        pings.append(raw_ping(pinger, PING_BOUND_S))
        outcome, message = classify_any(reply[0]) if reply else ("no reply", "")
        return Beside(pings, reply[1] if reply else None, outcome, message,
                      rss_bytes(server.proc.pid) - rss_before)
    finally:
        bad.close()
        pinger.close()


WORST = worst_cases(DEFAULT_LIMITS)


@pytest.mark.parametrize("case", WORST, ids=[c.kind for c in WORST])
def test_ping_beside_one_bad_request(live_server: LiveServer, case: Case) -> None:
    """Pings beside the worst requests are answered within PING_BOUND_S (1 s: beside a 16 MiB
    request on a busy 2-core machine the worst ping took 0.5 s; a loop that decoded the request
    itself, or waited on it, stalls for its whole handling or never answers)."""
    ping_beside_within(live_server, case, PING_BOUND_S)


@pytest.mark.perf
@pytest.mark.parametrize("case", WORST, ids=[c.kind for c in WORST])
def test_ping_beside_one_bad_request_is_fast(live_server: LiveServer, case: Case) -> None:
    """The same, bounded at BESIDE_BOUND_S (50 ms): real latency, for a quiet machine (perf)."""
    ping_beside_within(live_server, case, BESIDE_BOUND_S)


def ping_beside_within(live_server: LiveServer, case: Case, bound_s: float) -> None:
    server = live_server.get()
    first = ping_beside(server, case, DEFAULT_LIMITS)
    tries = [first]
    if first.worst_ping_s > bound_s:  # one retry: this machine is shared and has 2 cores
        tries.append(ping_beside(server, case, DEFAULT_LIMITS))
    print(f"{case.kind}: " + " | retry: ".join(t.describe() for t in tries))
    last = tries[-1]
    assert server.proc is not None and server.proc.poll() is None, (
        f"the server exited:\n{server.log()[-3000:]}")
    assert last.worst_ping_s <= bound_s, (
        f"{case.describe()}: a ping beside it took > {bound_s * 1000:.0f} ms: "
        + " | retry: ".join(t.describe() for t in tries))
    if case.size <= DEFAULT_LIMITS.hard_cap and case.expects_reply:
        assert last.reply_s is not None, f"{case.describe()}: no reply within {REPLY_TIMEOUT_S} s"
        assert not last.outcome.startswith(("malformed", "error:internal")), (case.describe(), last.outcome,
                                                                             last.message[:300])
    assert len(last.message) <= MESSAGE_BOUND, f"{len(last.message)}-character error message"
    # the message buffer, the decoded payload and a reply: a few times the request, never more
    assert last.rss_growth <= 4 * DEFAULT_LIMITS.max_request_bytes, last.describe()


def trusted_echo(sent: tuple[bytes, ...], reply: list[bytes]) -> str | None:
    """Why ``reply`` echoes what the server could not trust of ``sent`` (None: it does not). A
    uid goes back only as the msgpack int sent, an op only as the msgpack str or int sent (or
    LMCache's failure naming another op); a nil stands in for either otherwise."""
    nil = encode(None)

    def one(frame: bytes, kind: type | tuple[type, ...]) -> bool:
        with contextlib.suppress(Exception):
            value = msgspec.msgpack.decode(frame)
            return isinstance(value, kind) and not isinstance(value, bool)
        return False

    uid, op = reply[0], reply[1] if len(reply) > 1 else b""
    if uid != nil and not (uid == sent[0] and one(uid, int)):
        return f"uid frame {uid[:40]!r}"
    if op != nil and not is_failure_op(op) and not (
            len(sent) > 1 and op == sent[1] and one(op, (str, int))):
        return f"op frame {op[:40]!r}"
    return None


ECHO_KINDS = ("garbage", "unknown_op", "bad_uid", "frame_count", "lying_frame", "deep_frame")


def test_every_frame_is_answered_at_once_echoing_nothing_untrusted(live_server: LiveServer) -> None:
    """Hostile frames of the kinds that reach the head decoder (random frames, unknown ops, bad
    uids, wrong frame counts), one in flight per socket so each reply is its request's: each is
    answered (except a stream's credit) within the reply timeout, and its reply carries nothing
    of a frame the server could not read (random frames in the op's place were echoed whole,
    ahead of a nil uid)."""
    server = live_server.get()
    cases = [c for c in generate_cases(default_seed(), 4000, DEFAULT_LIMITS)
             if c.kind.endswith(ECHO_KINDS) and c.size <= DEFAULT_LIMITS.hard_cap]
    assert len(cases) > 500
    context: zmq.Context[Any] = zmq.Context.instance()
    idle = [Peer(context, server.url) for _ in range(16)]
    live: dict[Any, tuple[Peer, Case, float]] = {}
    problems: list[str] = []
    todo = iter(cases)
    try:
        while (case := next(todo, None)) is not None or live:
            while case is not None and idle:
                peer = idle.pop()
                peer.sock.send_multipart(case.frames)
                if case.expects_reply:
                    live[peer.sock] = (peer, case, time.monotonic())
                else:
                    idle.append(peer)
                case = next(todo, None) if idle else case
            if case is not None:
                todo = itertools.chain([case], todo)
            poller = zmq.Poller()
            for sock in live:
                poller.register(sock, zmq.POLLIN)
            ready = dict(poller.poll(100))
            for sock in list(live):
                peer, sent, started = live[sock]
                if sock in ready:
                    why = trusted_echo(sent.frames, sock.recv_multipart())
                    if why is not None and len(problems) < 10:
                        problems.append(f"{sent.describe()}: its reply echoes its {why}")
                elif time.monotonic() - started < REPLY_TIMEOUT_S:
                    continue
                else:
                    problems.append(f"{sent.describe()}: no reply within {REPLY_TIMEOUT_S} s")
                    peer.close()
                    peer = Peer(context, server.url)
                del live[sock]
                idle.append(peer)
    finally:
        for peer in idle + [p for p, _, _ in live.values()]:
            peer.close()
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- regressions


@dataclass(frozen=True)
class ForeignSegment:
    name: str
    nbytes: int
    digest: str

    @property
    def path(self) -> Path:
        return Path("/dev/shm") / self.name

    def intact(self) -> bool:
        with contextlib.suppress(OSError):
            return hashlib.sha256(self.path.read_bytes()).hexdigest() == self.digest
        return False


def make_segment(name: str) -> ForeignSegment:
    """A 128 KiB /dev/shm segment (two 64 KiB layers of TINY) holding a known pattern."""
    data = bytes(range(256)) * 512
    fd = os.open(Path("/dev/shm") / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return ForeignSegment(name, len(data), hashlib.sha256(data).hexdigest())


@pytest.fixture
def foreign_segment() -> Iterator[ForeignSegment]:
    """A /dev/shm segment of "another program": the test's, not named like ours."""
    segment = make_segment(f"otherapp-fuzz-{os.getpid()}-{secrets.token_hex(4)}")
    yield segment
    with contextlib.suppress(OSError):
        segment.path.unlink()


@pytest.fixture
def own_segment() -> Iterator[ForeignSegment]:
    """A segment named as lmcache names this process's own (``lmcache-<word>-<pid>-<pid ns>-<hex>``),
    so a registration of it with this pid passes the ownership checks."""
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = 0
    segment = make_segment(f"lmcache-fuzz-{os.getpid()}-{pid_ns}-{secrets.token_hex(6)}")
    yield segment
    with contextlib.suppress(OSError):
        segment.path.unlink()


def exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    return child.pid


def unregister_quietly(server: ServerProcess, case: Case) -> None:
    """Drop the registration a regression case may have made (if the server wrongly accepted it)."""
    with contextlib.suppress(LMCacheError, msgspec.DecodeError, KeyError, TypeError):
        instance_id = msgspec.msgpack.decode(case.frames[2])["instance_id"]
        with MessageQueueClient(server.url, request_timeout_s=2.0) as client:
            client.request(m.UnregisterKVCacheRequest(instance_id=instance_id))


@pytest.mark.parametrize("regression", REGRESSIONS, ids=[r.name for r in REGRESSIONS])
def test_regression(live_server: LiveServer, foreign_segment: ForeignSegment,
                    own_segment: ForeignSegment, regression: Regression) -> None:
    server = live_server.get()
    context = RegressionContext(DEFAULT_LIMITS.max_request_bytes, foreign_segment.name,
                                foreign_segment.nbytes, exited_pid(), socket.gethostname(),
                                own_segment.name, own_segment.nbytes, os.getpid())
    case = Case(regression.name, tuple(regression.build(context)))
    log_before = len(server.log())
    result = ping_beside(server, case, DEFAULT_LIMITS)
    print(f"{regression.name}: {result.describe()}")
    if regression.touches_foreign_shm:
        # The housekeeper runs every second: give it time to reap (and unlink). Kept sleep: what
        # is checked after it must not have happened; a slow machine can only hide it.
        time.sleep(2.5)
    if case.frames[1] == encode(RequestType.REGISTER_KV_CACHE.value):
        unregister_quietly(server, case)
    assert server.proc is not None and server.proc.poll() is None, (
        f"{regression.name} (once: {regression.broke}): the server exited\n{server.log()[-3000:]}")
    assert responsive(server), f"{regression.name} (once: {regression.broke}): the server stopped answering"
    assert result.worst_ping_s <= PING_BOUND_S, f"{regression.name}: {result.describe()}"
    assert result.reply_s is not None, f"{regression.name}: no reply within {REPLY_TIMEOUT_S} s"
    assert result.outcome.startswith("error:"), (
        f"{regression.name} must be refused, got {result.outcome}" + (
            " (it mapped another program's shared memory)" if regression.touches_foreign_shm else ""))
    if regression.codes:
        assert result.outcome.removeprefix("error:") in regression.codes, (result.outcome, result.message)
    assert len(result.message) <= MESSAGE_BOUND, f"{len(result.message)}-character error message"
    if regression.touches_foreign_shm:
        assert foreign_segment.intact(), f"{foreign_segment.path} was changed or removed by the server"
    log = server.log()[log_before:]
    assert len(log) < 64 * 1024, f"one request grew the log by {len(log)} bytes"
    assert not tracebacks(log), f"traceback in the server log:\n{tracebacks(log)[0]}"
