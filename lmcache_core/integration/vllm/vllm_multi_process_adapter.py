"""The seed's vLLM adapters: the scheduler's lookups and the workers' stores/retrieves over ZMQ.

``LMCacheMPSchedulerAdapter`` lives in vLLM's scheduler process: it submits one lookup per request and
polls its future without ever blocking. ``LMCacheMPWorkerAdapter`` lives in each GPU (or CPU) worker:
it shares the worker's KV caches with the server once, then submits batched store/retrieve requests
and reports which requests finished, with vLLM's connector semantics (see ``get_finished``).

Names and signatures follow LMCache's ``vllm_multi_process_adapter`` so code written for it ports by
changing ``lmcache`` to ``lmcache_core`` in the import.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import zmq

from lmcache_core.errors import (
    LMCacheError,
    LMCacheTimeoutError,
    ServerUnreachableError,
)
from lmcache_core.keys import chain_hashes, salt_prefix, striding_block_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.ops import RequestType
from lmcache_core.transport.client import MessageQueueClient
from lmcache_core.transport.future import MessagingFuture

if TYPE_CHECKING:
    import torch

__all__ = [
    "KVCache",
    "LMCacheMPSchedulerAdapter",
    "LMCacheMPWorkerAdapter",
    "LoadStoreOp",
    "MessageQueueClient",
    "MessagingFuture",
    "RequestType",
    "get_lmcache_chunk_size",
    "send_lmcache_request",
    "striding_block_hashes",
    "wrap_kv_caches",
]

logger = logging.getLogger(__name__)
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_LOOKUP_TIMEOUT_S = 2.0
DEFAULT_HEARTBEAT_S = 5.0
#: A pending ``check_lookup_result`` looks at the socket at most this often: a scheduler sweeping
#: its N waiting requests then pays one socket poll (~2 us, a system call), not N; a reply is seen
#: at most this much later.
LOOKUP_POLL_INTERVAL_S = 10e-6


class KVCache(NamedTuple):
    """A worker's KV caches as the server needs to see them: layout, block size, descriptors."""

    layout: m.KVLayoutName
    block_size: int
    layers: list[m.TensorDescriptor]


def wrap_kv_caches(kv_caches: dict[str, torch.Tensor]) -> KVCache:
    """Describe per-layer KV tensors for registration (CUDA IPC handles or shared-memory names).

    CPU tensors that are not in shared memory yet are moved there in place."""
    from lmcache_core.kv.share import describe_kv_caches

    layout, block_size, layers = describe_kv_caches(kv_caches)
    return KVCache(layout, block_size, layers)


def send_lmcache_request(mq_client: MessageQueueClient, request_type: RequestType,
                         payloads: list[Any]) -> MessagingFuture[Any]:
    """Send one request; the future resolves to its reply struct or raises the server's error."""
    return mq_client.submit_request(request_type, payloads)


def get_lmcache_chunk_size(mq_client: MessageQueueClient) -> int:
    """Ask the server its chunk size; ``ServerUnreachableError`` naming the url if it is silent."""
    future = mq_client.submit_request(RequestType.GET_CHUNK_SIZE, [m.NoArgs()],
                                      timeout_s=mq_client.connect_timeout_s)
    try:
        reply: m.ChunkSizeReply = future.result(mq_client.connect_timeout_s + 1.0)
    except LMCacheTimeoutError:
        raise ServerUnreachableError(
            f"no lmcache server answered at {mq_client.server_url} within "
            f"{mq_client.connect_timeout_s:g}s (start one with: lmcache serve -c <config.yaml>)"
        ) from None
    return reply.chunk_size


@dataclass
class LoadStoreOp:
    """The blocks of one request to store or retrieve.

    ``block_hashes``: vLLM block hashes, one per block (each chunk is named by its last block's
    hash), or the request's token ids from token 0 (hashed into chunks). ``block_ids``: the vLLM
    blocks, from the same start. Only whole chunks are stored or retrieved; a partial tail is left.
    ``cache_salt``: the request's salt, which seeds the chain in token mode (requests with
    different salts never share chunks); ignored in hash mode (vLLM's block hashes include it).
    """

    block_hashes: list[bytes]
    block_ids: list[int]
    cache_salt: str | None = None


def _chunk_hashes(block_hashes: Sequence[Any], blocks_in_chunk: int, chunk_size: int,
                  cache_salt: str | None = None) -> list[bytes]:
    """Chunk hashes from vLLM block hashes (strided) or from token ids (prefix-chain hashed,
    from the salt's seed)."""
    if not block_hashes:
        return []
    if isinstance(block_hashes[0], int):
        return chain_hashes(block_hashes, chunk_size, salt_prefix(cache_salt))
    return [bytes(h) for h in striding_block_hashes(block_hashes, blocks_in_chunk)]


class _Connection:
    """What both adapters share: the client, the chunk size and the block arithmetic."""

    def __init__(self, server_url: str, context: zmq.Context[Any], model_name: str,
                 world_size: int, kv_rank: int, vllm_block_size: int,
                 connect_timeout_s: float, request_timeout_s: float, name: str) -> None:
        if not 0 <= kv_rank < world_size:
            raise ValueError(f"kv_rank {kv_rank} must be in [0, world_size={world_size})")
        self.model_name = model_name
        self.world_size = world_size
        self.kv_rank = kv_rank
        self.vllm_block_size = vllm_block_size
        self.mq_client = MessageQueueClient(server_url, context, request_timeout_s=request_timeout_s,
                                            connect_timeout_s=connect_timeout_s, name=name)
        try:
            self.chunk_size = get_lmcache_chunk_size(self.mq_client)
            if vllm_block_size <= 0 or self.chunk_size % vllm_block_size:
                raise ValueError(
                    f"the lmcache chunk size {self.chunk_size} (server {server_url}) is not a "
                    f"multiple of the vLLM block size {vllm_block_size}")
        except BaseException:
            self.mq_client.close()
            raise
        self.blocks_in_chunk = self.chunk_size // vllm_block_size

    def chunk_hashes(self, block_hashes: Sequence[Any], cache_salt: str | None = None
                     ) -> list[bytes]:
        return _chunk_hashes(block_hashes, self.blocks_in_chunk, self.chunk_size, cache_salt)

    def num_blocks_per_chunk(self) -> int:
        return self.blocks_in_chunk


class LMCacheMPSchedulerAdapter:
    """Prefix lookups for vLLM's scheduler: submit once per request, poll without blocking."""

    def __init__(self, server_url: str, context: zmq.Context[Any], model_name: str,
                 world_size: int, kv_rank: int, vllm_block_size: int, *,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 min_hit_tokens: int = 0) -> None:
        self._conn = _Connection(server_url, context, model_name, world_size, kv_rank,
                                 vllm_block_size, connect_timeout_s, request_timeout_s,
                                 "lmcache-scheduler")
        self.mq_client = self._conn.mq_client
        self.chunk_size = self._conn.chunk_size
        self.lookup_timeout_s = lookup_timeout_s
        #: Loads shorter than this many tokens are declined (see ``check_lookup_result``).
        self.min_hit_tokens = min_hit_tokens
        self.declined_lookups = 0
        self._lookups: dict[str, MessagingFuture[Any]] = {}
        self._last_poll = 0.0

    def maybe_submit_lookup_request(self, request_id: str, block_hashes: list[bytes],
                                    cache_salt: str | None = None) -> None:
        """Send this request's lookup unless one is already in flight or answered; returns at once.

        ``block_hashes``: vLLM block hashes, or the prompt's token ids (then ``cache_salt`` seeds
        their chain, as for the request's stores and retrieves)."""
        if request_id in self._lookups:
            return
        hashes = self._conn.chunk_hashes(block_hashes, cache_salt)
        if not hashes:  # shorter than one chunk: nothing can hit, no round trip
            self._lookups[request_id] = MessagingFuture.completed(m.LookupReply(hit_chunks=0))
            return
        request = m.LookupRequest(model_name=self._conn.model_name,
                                  world_size=self._conn.world_size, lookup_id=request_id,
                                  chunk_hashes=hashes, lock=True)
        # polled: check_lookup_result takes the reply on the scheduler's thread (no I/O thread hop)
        self._lookups[request_id] = self.mq_client.submit_request(
            RequestType.LOOKUP, [request], timeout_s=self.lookup_timeout_s, polled=True)

    def check_lookup_result(self, request_id: str, num_computed_tokens: int = 0) -> int | None:
        """Matched tokens once the answer is in (chunks every rank holds x chunk size), else None.

        Never blocks. A failed or timed-out lookup counts as 0 hits (the engine recomputes).
        With ``min_hit_tokens``, a hit whose load (the tokens past ``num_computed_tokens``, what
        the engine already has) would be shorter is declined: 0 from now on for this request,
        and the server's locks on it are released at once (not at the request's end)."""
        future = self._lookups.get(request_id)
        if future is None:
            return 0
        if not future.query():
            now = time.perf_counter()
            if now - self._last_poll < LOOKUP_POLL_INTERVAL_S:
                return None
            self._last_poll = now
            self.mq_client.poll_replies()  # take arrived replies now, without a thread hop
            if not future.query():
                return None
        try:
            reply: m.LookupReply = future.result(0)
        except LMCacheError as exc:
            logger.warning("lookup for %s failed, recomputing: %s", request_id, exc)
            return 0
        hit = reply.hit_chunks * self.chunk_size
        if 0 < hit - num_computed_tokens < self.min_hit_tokens:
            self._decline(request_id)
            return 0
        return hit

    def _decline(self, request_id: str) -> None:
        """Forget a hit not worth loading and release its locks now (one message, not waited)."""
        self._lookups[request_id] = MessagingFuture.completed(m.LookupReply(hit_chunks=0))
        self.declined_lookups += 1
        self.free_lookup_locks(request_id)

    def num_blocks_per_chunk(self) -> int:
        return self._conn.num_blocks_per_chunk()

    def cleanup_lookup_result(self, request_id: str) -> None:
        """Forget the lookup's result (the server's locks stay until retrieve or end_session)."""
        self._lookups.pop(request_id, None)

    def free_lookup_locks(self, request_id: str) -> MessagingFuture[Any]:
        """Release what the request's lookup still locks (e.g. on abort), without waiting."""
        return self._release(RequestType.FREE_LOOKUP_LOCKS, request_id,
                             self._lookups.get(request_id))

    def end_session(self, request_id: str) -> MessagingFuture[Any]:
        """The request is done: forget its lookup and release what it still locks on the server."""
        return self._release(RequestType.END_SESSION, request_id,
                             self._lookups.pop(request_id, None))

    def _release(self, op: RequestType, request_id: str,
                 lookup: MessagingFuture[Any] | None) -> MessagingFuture[Any]:
        """Send ``op`` now, or, while the request's lookup is still in flight, once it has landed:
        sent earlier, the release could reach the server first (a lookup on a tiered server runs on
        its worker pool) and the lookup's locks would then outlive the request until their TTL."""
        if lookup is not None and not lookup.query():
            released: MessagingFuture[Any] = MessagingFuture(f"{op.value} for {request_id}")
            lookup.add_done_callback(lambda _f: _chain(self._release(op, request_id, None), released))
            return released
        future = self.mq_client.submit_request(op, [m.LookupIdRequest(lookup_id=request_id)])
        future.add_done_callback(lambda f: _log_failure(f, f"{op.value} for {request_id}"))
        return future

    def close(self) -> None:
        self.mq_client.close()

    shutdown = close


def _chain(source: MessagingFuture[Any], target: MessagingFuture[Any]) -> None:
    """Resolve ``target`` with ``source``'s outcome once it has one."""
    def settle(done: MessagingFuture[Any]) -> None:
        exc = done.exception(0)
        if exc is None:
            target.set_result(done.result(0))
        else:
            target.set_exception(exc)

    source.add_done_callback(settle)


def _log_failure(future: MessagingFuture[Any], what: str) -> None:
    exc = future.exception(0)
    if exc is not None:
        logger.warning("%s failed: %s", what, exc)


def _event_handle(event: Any) -> bytes:
    """The IPC handle of a worker's CUDA event; ``None`` (CPU) means there is nothing to wait on."""
    if event is None:
        return b""
    from lmcache_core.kv.cuda_events import export_event

    return export_event(event)


@dataclass
class _Transfer:
    """One store or retrieve request in flight, covering one or more vLLM requests."""

    future: MessagingFuture[Any]
    request_ids: list[str]
    block_ids: list[int]


@dataclass
class _RequestState:
    transfers: list[_Transfer] = field(default_factory=list)
    failure: str | None = None


class LMCacheMPWorkerAdapter:
    """A vLLM worker's side: register KV caches once, then batched stores and retrieves.

    ``get_finished`` follows vLLM's connector contract: a request's stores are reported once they
    completed AND the engine finished the request (late completions are reported on a later call);
    retrieves are reported when done, successful or not. Failures are logged with the server's reason
    and kept in ``failed_stores`` / ``failed_retrieves``; ``get_block_ids_with_load_errors`` names
    the blocks a failed retrieve did not fill, so the engine recomputes them.
    """

    def __init__(self, server_url: str, context: zmq.Context[Any], model_name: str,
                 world_size: int, kv_rank: int, vllm_block_size: int, *,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 heartbeat_interval_s: float = DEFAULT_HEARTBEAT_S,
                 load_deadline_ms: int | None = None) -> None:
        self._conn = _Connection(server_url, context, model_name, world_size, kv_rank,
                                 vllm_block_size, connect_timeout_s, request_timeout_s,
                                 f"lmcache-worker-{kv_rank}")
        #: Each retrieve's deadline (``RetrieveRequest.deadline_ms``): None for the server's
        #: ``timeouts.load_ms``, 0 for none.
        self.load_deadline_ms = load_deadline_ms
        self.mq_client = self._conn.mq_client
        self.chunk_size = self._conn.chunk_size
        self.instance_id = random.getrandbits(63)
        self.registered: KVCache | None = None
        self._kv_caches: dict[str, torch.Tensor] | None = None
        self._stores: dict[str, _RequestState] = {}
        self._retrieves: dict[str, _RequestState] = {}
        self._engine_finished: set[str] = set()
        self.failed_stores: dict[str, str] = {}
        self.failed_retrieves: dict[str, str] = {}
        self._load_error_blocks: set[int] = set()
        self._heartbeat_interval_s = heartbeat_interval_s
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Share the worker's per-layer KV tensors with the server (once; again replaces them)."""
        wrapped, request = self._registration_request(kv_caches)
        self.mq_client.call(RequestType.REGISTER_KV_CACHE, request, m.RegisterKVCacheReply)
        self.registered = wrapped
        self._kv_caches = dict(kv_caches)
        if self._heartbeat is None and self._heartbeat_interval_s > 0:
            self._heartbeat = threading.Thread(target=self._beat, name="lmcache-heartbeat",
                                               daemon=True)
            self._heartbeat.start()

    def _registration_request(self, kv_caches: dict[str, torch.Tensor]
                              ) -> tuple[KVCache, m.RegisterKVCacheRequest]:
        """The caches described afresh: on GPU each call exports new CUDA IPC handles, each with
        its own reference count (the server opening a handle sent before would release a count
        that the earlier opening already released)."""
        wrapped = wrap_kv_caches(kv_caches)
        if wrapped.block_size != self._conn.vllm_block_size:
            raise ValueError(f"the KV caches have {wrapped.block_size}-token blocks but the adapter "
                             f"was built for vllm_block_size={self._conn.vllm_block_size}")
        request = m.RegisterKVCacheRequest(
            instance_id=self.instance_id, model_name=self._conn.model_name,
            world_size=self._conn.world_size, kv_rank=self._conn.kv_rank,
            block_size=wrapped.block_size, layout=wrapped.layout, layers=wrapped.layers,
            pid=os.getpid(), hostname=socket.gethostname())
        return wrapped, request

    def _beat(self) -> None:
        """Ping with our instance id so the server knows this worker is alive (and keeps its maps);
        a server that restarted no longer knows it, and gets the KV caches registered again."""
        interval = self._heartbeat_interval_s
        while not self._stop.wait(interval):
            ping = m.PingRequest(instance_id=self.instance_id)
            try:
                reply = self.mq_client.submit_request(RequestType.PING, [ping], interval).result(
                    interval + 1.0)
            except LMCacheError:  # the server is down: the next beat tries again
                continue
            if reply.registered is False and not self._stop.is_set():
                self._register_again()

    def _register_again(self) -> None:
        """Register with a server that forgot us, with freshly exported handles (finding 6)."""
        if self._kv_caches is None:
            return
        try:
            _, request = self._registration_request(self._kv_caches)
            self.mq_client.call(RequestType.REGISTER_KV_CACHE, request, m.RegisterKVCacheReply)
        except LMCacheError as exc:
            logger.warning("re-registering the KV caches with %s failed: %s",
                           self.mq_client.server_url, exc)
            return
        logger.info("the server at %s had forgotten this worker (restarted?): KV caches "
                    "registered again", self.mq_client.server_url)

    # ------------------------------------------------------------------ store / retrieve

    def submit_store_request(self, request_id: str, op: LoadStoreOp, event: Any) -> None:
        self.batched_submit_store_requests([request_id], [op], event)

    def submit_retrieve_request(self, request_id: str, op: LoadStoreOp, event: Any) -> None:
        self.batched_submit_retrieve_requests([request_id], [op], event)

    def batched_submit_store_requests(self, request_ids: list[str], ops: list[LoadStoreOp],
                                      event: Any) -> None:
        """One store request for the whole chunks of several vLLM requests."""
        if len(request_ids) != len(ops):
            raise ValueError(f"{len(request_ids)} request ids but {len(ops)} ops")
        hashes, blocks = self._flatten(ops)
        payload = m.StoreRequest(instance_id=self.instance_id, chunk_hashes=hashes,
                                 block_ids=blocks, event_handle=_event_handle(event),
                                 request_ids=list(request_ids))
        self._submit(RequestType.STORE, payload, request_ids, blocks, self._stores)

    def batched_submit_retrieve_requests(self, request_ids: list[str], ops: list[LoadStoreOp],
                                         event: Any) -> None:
        """One retrieve request for several vLLM requests; each releases its own lookup's locks.

        With one vLLM request the lookup id is that request's id; several requests in one batch
        are sent one retrieve each (a retrieve releases the locks of one lookup)."""
        if len(request_ids) != len(ops):
            raise ValueError(f"{len(request_ids)} request ids but {len(ops)} ops")
        handle = _event_handle(event)
        for request_id, op in zip(request_ids, ops, strict=True):
            hashes, blocks = self._flatten([op])
            payload = m.RetrieveRequest(instance_id=self.instance_id, chunk_hashes=hashes,
                                        block_ids=blocks, event_handle=handle,
                                        lookup_id=request_id, request_ids=[request_id],
                                        deadline_ms=self.load_deadline_ms)
            self._submit(RequestType.RETRIEVE, payload, [request_id], blocks, self._retrieves)

    def _flatten(self, ops: Iterable[LoadStoreOp]) -> tuple[list[bytes], list[int]]:
        """Whole chunks only: each op's chunk hashes and the block ids those chunks cover."""
        hashes: list[bytes] = []
        blocks: list[int] = []
        per_chunk = self._conn.blocks_in_chunk
        for op in ops:
            chunk_hashes = self._conn.chunk_hashes(op.block_hashes, op.cache_salt)
            n = min(len(chunk_hashes), len(op.block_ids) // per_chunk)
            hashes += chunk_hashes[:n]
            blocks += op.block_ids[:n * per_chunk]
        return hashes, blocks

    def _submit(self, op: RequestType, payload: m.Message, request_ids: list[str],
                blocks: list[int], book: dict[str, _RequestState]) -> None:
        if self.registered is None:
            raise RuntimeError("register_kv_caches must be called before store/retrieve")
        if blocks:
            future = self.mq_client.submit_request(op, [payload])
        else:  # nothing whole to move: complete at once, no round trip
            empty = m.StoreReply(stored=0) if op is RequestType.STORE else m.RetrieveReply(
                retrieved=0)
            future = MessagingFuture.completed(empty)
        transfer = _Transfer(future, list(request_ids), blocks)
        for request_id in request_ids:
            book.setdefault(request_id, _RequestState()).transfers.append(transfer)

    # ------------------------------------------------------------------ completion

    def get_finished(self, finished_req_ids_from_engine: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_stores, finished_retrieves)``; ``None`` for an empty set. Never blocks."""
        self._engine_finished |= set(finished_req_ids_from_engine) & set(self._stores)
        stores = {r for r in self._engine_finished if self._settle(r, self._stores, self.failed_stores)}
        for request_id in stores:
            self._engine_finished.discard(request_id)
            del self._stores[request_id]
        retrieves = {r for r in self._retrieves
                     if self._settle(r, self._retrieves, self.failed_retrieves)}
        for request_id in retrieves:
            del self._retrieves[request_id]
        return (stores or None), (retrieves or None)

    def _settle(self, request_id: str, book: dict[str, _RequestState],
                failures: dict[str, str]) -> bool:
        """True when every transfer of the request is done; records the first failure."""
        state = book[request_id]
        if not all(t.future.query() for t in state.transfers):
            return False
        for transfer in state.transfers:
            reason = self._failure(transfer)
            if reason is not None:
                failures[request_id] = reason
                if book is self._retrieves:
                    self._load_error_blocks.update(self._unloaded_blocks(transfer))
                logger.warning("%s of request %s failed: %s",
                               "store" if book is self._stores else "retrieve", request_id, reason)
                break
        return True

    def _unloaded_blocks(self, transfer: _Transfer) -> list[int]:
        """The blocks a failed retrieve left unfilled: those of the chunks its reply names
        missing (not cached, or cut by the deadline), or all of them after an error reply
        (nothing was copied then, or what was is not trusted)."""
        if transfer.future.exception(0) is not None:
            return transfer.block_ids
        reply = transfer.future.result(0)
        if not isinstance(reply, m.RetrieveReply):
            return transfer.block_ids
        per_chunk = self._conn.blocks_in_chunk
        blocks: list[int] = []
        for index in reply.missing:
            chunk = transfer.block_ids[index * per_chunk:(index + 1) * per_chunk]
            if len(chunk) != per_chunk:  # an index the request did not have: trust nothing
                return transfer.block_ids
            blocks += chunk
        return blocks

    @staticmethod
    def _failure(transfer: _Transfer) -> str | None:
        exc = transfer.future.exception(0)
        if exc is not None:
            return f"{type(exc).__name__}: {exc}"
        reply = transfer.future.result(0)
        if isinstance(reply, m.RetrieveReply) and reply.missing:
            if reply.late:
                rest = len(reply.missing) - reply.late
                return (f"{len(reply.missing)} chunk(s) not loaded: {reply.late} past the load "
                        f"deadline" + (f", {rest} no longer cached" if rest else ""))
            return f"{len(reply.missing)} chunk(s) were no longer cached"
        if isinstance(reply, m.StoreReply) and reply.skipped_full:
            return f"{reply.skipped_full} chunk(s) skipped: the server's pool is full of locked chunks"
        return None

    def store_futures(self, request_id: str) -> list[MessagingFuture[Any]]:
        """The futures of the stores still tracked for ``request_id`` (until ``get_finished``
        reports it), e.g. to wait for them before vLLM reuses a preempted request's blocks."""
        state = self._stores.get(request_id)
        return [t.future for t in state.transfers] if state is not None else []

    def retrieve_futures(self, request_id: str) -> list[MessagingFuture[Any]]:
        """The futures of the retrieves still tracked for ``request_id`` (until ``get_finished``
        reports it), e.g. to keep their CUDA event alive until they were answered."""
        state = self._retrieves.get(request_id)
        return [t.future for t in state.transfers] if state is not None else []

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that failed retrieves did not fill (reported once, then forgotten)."""
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def num_blocks_per_chunk(self) -> int:
        return self._conn.num_blocks_per_chunk()

    def shutdown(self) -> None:
        """Unregister (so the server unmaps at once), stop the heartbeat, close the socket."""
        self._stop.set()
        if self.registered is not None:
            try:
                self.mq_client.call(RequestType.UNREGISTER_KV_CACHE,
                                    m.UnregisterKVCacheRequest(instance_id=self.instance_id),
                                    m.OkReply, timeout_s=self.mq_client.connect_timeout_s)
            except LMCacheError as exc:
                logger.warning("unregistering from %s failed: %s", self.mq_client.server_url, exc)
            self.registered = None
        if self._heartbeat is not None:
            self._heartbeat.join(1.0)
        self.mq_client.close()
