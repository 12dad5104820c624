"""``KVEventPublisher``: publishes the chunks this server stored and removed, as vLLM's KV events.

Cache-aware routers (llm-d, Dynamo, ...) index the KV events vLLM publishes; this sends the same
messages, so such a router can index this server's tiers too. One job: take what the engine and the
tiers report through the ``KVEventSink`` interface (``lmcache_core.events``), batch it, encode it,
publish it, and answer replay requests.

* **Reporting** (``stored``/``removed``) only appends to a bounded deque under a small lock: callers
  hold the engine's lock, so nothing here may do I/O or wait. When more than ``max_pending_keys``
  keys wait, the oldest reports are dropped and counted (``events_dropped``).
* **Publishing** runs on one supervised thread: every ``interval_s`` (20 ms) it takes what waits,
  builds one ``KVEventBatch`` per model and sends each on the PUB socket as ``[topic, seq, payload]``
  (topic ``kv@<host>@<model>``, seq an 8-byte big-endian counter from 0, one per batch). It keeps the
  last ``replay_batches`` batches for replay.
* **Replay**: a ROUTER socket answers a request carrying a start seq (8 bytes, big-endian) with every
  kept batch from that seq on, then an end marker (seq -1, empty payload), as vLLM's
  ``ZmqEventPublisher`` does. Its waiting for requests is the thread's timed wait.

The payload is vLLM's ``KVEventBatch(ts, events, data_parallel_rank)`` (msgpack, an array) with
``BlockStored``/``BlockRemoved`` events. ``fmt`` picks vLLM's generation: ``map`` (vLLM since mid
2026, e.g. the 0.32 this project tests with: events are maps tagged by ``"type"``, replay replies
``[topic, seq, payload]``) or ``array`` (older vLLM: events are arrays, tag first; replay replies
``[seq, payload]``). What our chunks lack is sent as vLLM sends "unknown": ``token_ids`` empty,
``parent_block_hash``/``lora_id``/``lora_name`` None; ``block_size`` is the chunk size; the model is
in the topic; a hash is the low 64 bits of the chunk hash as an int (vLLM's default form).

Events are per chunk hash per model: the tiers report pieces (``ChunkKey``: a head range of a chunk
of one layout), and the layout and head range are not sent, so the pieces of one chunk in one report
(several ranks' head ranges, or several layouts) are one hash in its event.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import zmq

from lmcache_core.errors import BindError
from lmcache_core.keys import ChunkKey
from lmcache_core.stats import EventStats
from lmcache_core.transport.ipc_files import claim

if TYPE_CHECKING:
    from lmcache_core.config import LMCacheConfig
    from lmcache_core.supervision import Supervisor

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.02
MAX_PENDING_KEYS = 100_000  # reported keys waiting for the next batch; beyond it the oldest go
REPLAY_BATCHES = 10_000  # as vLLM's buffer_steps
PUB_HWM = 100_000  # as vLLM's: messages a slow subscriber may fall behind before it loses some
MAX_REPLAYS_PER_TICK = 16  # so a flood of replay requests cannot hold back publishing
MAX_REPLAY_REQUEST_BYTES = 1024  # a request is a few frames of at most 8 bytes
END_SEQ = (-1).to_bytes(8, "big", signed=True)
STORED, REMOVED = "stored", "removed"
Format = Literal["map", "array"]
#: One report: (STORED or REMOVED, medium, keys).
Record = tuple[str, str, Sequence[ChunkKey]]


# ---------------------------------------------------------------- vLLM's messages
# Field order and tags as in vllm/distributed/kv_events.py. msgspec decoders ignore the trailing
# fields (array) or keys (map) they do not know, so newer and older vLLM decoders both read these.

class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


def wire_hash(chunk_hash: bytes) -> int:
    """A chunk hash as vLLM publishes a block hash by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``):
    the low 64 bits of its big-endian value. So in vLLM's hash mode, where a chunk is named by its
    last block's hash, our event carries the very int vLLM's own event has for that block."""
    return int.from_bytes(chunk_hash[-8:], "big")


def as_array(event: msgspec.Struct) -> list[Any]:
    """An event in older vLLM's form (``array_like=True``): the tag, then the fields in order."""
    return [type(event).__name__, *msgspec.structs.astuple(event)]


def build_batches(records: Sequence[Record], block_size: int, ts: float
                  ) -> dict[str, KVEventBatch]:
    """One batch per model, its events in report order.

    A store's report becomes one ``BlockStored`` (its keys are one prefix, in order, which routers
    that build prefix trees rely on); consecutive removals of one medium merge into one
    ``BlockRemoved``. A hash repeated in one event (one chunk's pieces: several head ranges or
    layouts) is sent once.
    """
    runs: dict[str, list[_Run]] = {}
    for kind, medium, keys in records:
        for model, hashes in _hashes_by_model(keys).items():
            model_runs = runs.setdefault(model, [])
            last = model_runs[-1] if model_runs else None
            if kind == REMOVED and last is not None and last[:2] == (REMOVED, medium):
                last[2].append(hashes)
            else:
                model_runs.append((kind, medium, [hashes]))
    return {model: KVEventBatch(ts, [_event(run, block_size) for run in model_runs])
            for model, model_runs in runs.items()}


#: Reports of one model that become one event: (kind, medium, their hashes report by report).
_Run = tuple[str, str, list[list[int]]]


def _event(run: _Run, block_size: int) -> BlockStored | BlockRemoved:
    kind, medium, parts = run
    if kind == STORED:
        return BlockStored(parts[0], None, [], block_size, None, medium, None)
    return BlockRemoved(list(dict.fromkeys(h for part in parts for h in part)), medium)


def _hashes_by_model(keys: Sequence[ChunkKey]) -> dict[str, list[int]]:
    """Each model's chunk hashes in ``keys``, in order, each once (pieces collapse to their chunk:
    only the model name and the chunk hash of a key are read)."""
    out: dict[str, dict[int, None]] = {}
    for key in keys:
        out.setdefault(key.model_name, {})[wire_hash(key.chunk_hash)] = None
    return {model: list(hashes) for model, hashes in out.items()}


# ---------------------------------------------------------------- what waits for the next batch

class PendingEvents:
    """Reports since the last batch, bounded: past ``max_keys`` keys the oldest reports go (counted)."""

    def __init__(self, max_keys: int = MAX_PENDING_KEYS) -> None:
        self.max_keys = max_keys
        self.dropped = 0  # keys whose reports were dropped
        self._lock = threading.Lock()
        self._records: deque[Record] = deque()
        self._keys = 0

    def add(self, kind: str, medium: str, keys: Sequence[ChunkKey]) -> None:
        """Note a report (cheap, never blocks: callers hold the engine's lock)."""
        if not keys:
            return
        with self._lock:
            self._records.append((kind, medium, keys))
            self._keys += len(keys)
            while self._keys > self.max_keys and len(self._records) > 1:  # the newest always stays
                old = self._records.popleft()[2]
                self._keys -= len(old)
                self.dropped += len(old)

    def take(self) -> deque[Record]:
        """Everything noted so far, oldest first; what is noted next goes to the next batch."""
        with self._lock:
            records, self._records = self._records, deque()
            self._keys = 0
        return records

    def __len__(self) -> int:
        return self._keys


# ---------------------------------------------------------------- the publisher

class KVEventPublisher:
    """A ``KVEventSink`` that publishes what it is told on a ZMQ PUB socket, with replay."""

    def __init__(self, url: str, replay_url: str, *, block_size: int, fmt: Format = "map",
                 context: zmq.Context[Any] | None = None, interval_s: float = FLUSH_INTERVAL_S,
                 max_pending_keys: int = MAX_PENDING_KEYS, replay_batches: int = REPLAY_BATCHES,
                 host: str | None = None) -> None:
        self.url = url
        self.replay_url = replay_url
        self.block_size = block_size
        self.fmt = fmt
        self.interval_s = interval_s
        self.pending = PendingEvents(max_pending_keys)
        self._context = context or zmq.Context.instance()
        self._topic_prefix = f"kv@{host or socket.gethostname()}@"
        self._ring: deque[tuple[int, bytes, bytes]] = deque(maxlen=replay_batches)  # seq, topic, payload
        self._seq = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.Socket[Any] | None = None
        self._supervisor: Supervisor | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._logged_dropped = 0
        self._last_drop_log = 0.0
        self.n = EventStats()  # its section of SERVER_INFO (only the publisher's thread adds)

    @classmethod
    def from_config(cls, config: LMCacheConfig,
                    context: zmq.Context[Any] | None = None) -> KVEventPublisher | None:
        """The publisher ``server.events_url`` asks for, or None when it is off."""
        urls = config.server.events_urls
        if urls is None:
            return None
        return cls(*urls, block_size=config.chunk_size, fmt=config.server.events_format,
                   context=context)

    # ------------------------------------------------------------ KVEventSink (any thread, no I/O)

    def stored(self, keys: Sequence[ChunkKey], medium: str) -> None:
        self.pending.add(STORED, medium, keys)

    def removed(self, keys: Sequence[ChunkKey], medium: str) -> None:
        self.pending.add(REMOVED, medium, keys)

    # ------------------------------------------------------------ lifecycle

    def start(self, supervisor: Supervisor) -> None:
        """Bind both sockets (BindError naming the key if one cannot) and start publishing."""
        self._pub, self.url = self._bind(zmq.PUB, self.url, "events_url")
        try:
            self._replay, self.replay_url = self._bind(zmq.ROUTER, self.replay_url, "events_replay_url")
        except BindError:
            self._close()
            raise
        self._supervisor = supervisor
        self._thread = supervisor.spawn("lmcache-events", self._run)
        logger.info("KV events on %s (replay on %s, vLLM %s format)", self.url, self.replay_url,
                    self.fmt)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Publish what is still pending, then close the sockets (within ``timeout_s``). Idempotent."""
        thread = self._thread
        if thread is None:
            self._close()
            return
        if self._supervisor is not None:
            self._supervisor.retire(thread)
        self._stopping.set()
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("the KV event publisher did not stop within %.1fs", timeout_s)

    def stats(self) -> EventStats:
        """Its section of SERVER_INFO, read now (``pending`` counts what it dropped)."""
        return self.n.copy(dropped=self.pending.dropped, pending=len(self.pending))

    def _bind(self, kind: int, url: str, key: str) -> tuple[zmq.Socket[Any], str]:
        sock = self._context.socket(kind)
        if kind == zmq.PUB:
            sock.setsockopt(zmq.SNDHWM, PUB_HWM)
            sock.setsockopt(zmq.LINGER, 1000)  # so the last batch still leaves after a stop
        else:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, (self._ring.maxlen or 0) + 2)  # a whole replay fits
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST_BYTES)
        try:
            if url.startswith("ipc://"):  # libzmq would silently take a live publisher's path
                Path(url[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
                claim(Path(url[len("ipc://"):]), f"server.{key}: socket",
                      "is another lmcache serve publishing there?")
            sock.bind(url)
        except BindError:
            sock.close(0)
            raise
        except zmq.ZMQError as exc:
            sock.close(0)
            raise BindError(f"server.{key}: cannot listen on {url}: {exc.strerror}") from None
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        return sock, endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._pub = self._replay = None

    # ------------------------------------------------------------ the publisher thread

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._serve_replays(self.interval_s)  # the timed wait between batches
                self.publish_pending()
            self.publish_pending()  # what the last requests reported before the stop
        finally:
            self._close()

    def publish_pending(self) -> int:
        """Send what was reported since the last call, one batch per model; how many batches.
        (Only the publisher thread calls it, and tests before ``start``'s thread exists.)"""
        self._log_drops()
        records = self.pending.take()
        if not records:
            return 0
        batches = build_batches(records, self.block_size, time.time())
        for model, batch in batches.items():
            if self.fmt == "array":
                batch.events = [as_array(event) for event in batch.events]
            self._send(self._topic_prefix.encode() + model.encode(), self._encode(batch))
        return len(batches)

    def _send(self, topic: bytes, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._ring.append((seq, topic, payload))
        self.n.batches += 1
        if self._pub is not None:
            # A PUB socket never blocks: a subscriber past the high-water mark loses messages (it
            # sees the gap in seq and replays).
            self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    def _log_drops(self) -> None:
        dropped = self.pending.dropped
        now = time.monotonic()
        if dropped > self._logged_dropped and now - self._last_drop_log >= 10.0:
            logger.warning("KV events: dropped %d reported chunk(s) (%d in all): the publisher fell "
                           "behind", dropped - self._logged_dropped, dropped)
            self._logged_dropped, self._last_drop_log = dropped, now

    # ------------------------------------------------------------ replay

    def _serve_replays(self, timeout_s: float) -> None:
        replay = self._replay
        if replay is None or not replay.poll(int(timeout_s * 1000)):
            return
        for _ in range(MAX_REPLAYS_PER_TICK):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._answer(replay, frames)

    def _answer(self, replay: zmq.Socket[Any], frames: list[bytes]) -> None:
        """Send the kept batches from the requested seq on, then the end marker. vLLM's requests
        come from REQ (or DEALER) sockets: ``[identity, b"", start seq]``; a malformed request
        gets the end marker alone, so that its sender does not wait for nothing."""
        envelope, body = frames[:1], frames[1:]
        if body and body[0] == b"":
            envelope, body = frames[:2], frames[2:]
        start = int.from_bytes(body[0], "big") if len(body) == 1 and len(body[0]) == 8 else None
        if start is None:
            self.n.bad_replays += 1
        else:
            self.n.replays += 1
            for seq, topic, payload in self._ring:
                if seq >= start:
                    self._reply(replay, envelope, topic, seq.to_bytes(8, "big"), payload)
        self._reply(replay, envelope, b"", END_SEQ, b"")

    def _reply(self, replay: zmq.Socket[Any], envelope: list[bytes], topic: bytes, seq: bytes,
               payload: bytes) -> None:
        frames = [topic, seq, payload] if self.fmt == "map" else [seq, payload]
        # A ROUTER drops what a gone or full peer cannot take; it never blocks here.
        with contextlib.suppress(zmq.Again):
            replay.send_multipart(envelope + frames, zmq.NOBLOCK)
