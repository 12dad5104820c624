"""The worker client: a vLLM worker's KV caches shared with ``lmcache serve``, its stores and retrieves.

``LMCacheMPWorkerAdapter`` lives in each GPU (or CPU) worker: it shares the worker's KV caches with
the server once (``register_kv_caches``; a hybrid model's KV-cache groups each as its own
registration, :mod:`.groups`), keeps them registered across server restarts (a heartbeat), then
submits batched store and retrieve requests (:class:`.transfers.LoadStoreOp`) and reports which
requests finished, with vLLM's connector semantics (see ``get_finished``). ``KVCache`` and
``wrap_kv_caches`` describe the KV tensors a registration shares.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import zmq

from lmcache_core.client.connection import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    LOGGER_NAME,
    Connection,
)
from lmcache_core.client.groups import (
    KVCacheGroupSpec,
    Part,
    bundle_parts,
    group_caches,
    group_pieces,
    load_skip,
    piece_blocks,
    split_parts,
)
from lmcache_core.client.transfers import (
    LoadStoreOp,
    RequestTransfers,
    Transfer,
    all_answered,
    event_handle,
    store_hash_mode,
    transfer_failure,
    unloaded_blocks,
)
from lmcache_core.errors import LMCacheError
from lmcache_core.keys import GroupPiece, tenant_tag
from lmcache_core.protocol import messages as m
from lmcache_core.protocol.ops import RETRIEVE, STORE, Op
from lmcache_core.transport.future import MessagingFuture

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(LOGGER_NAME)
Q = TypeVar("Q", bound=m.Message)
P = TypeVar("P", bound=m.Reply)
#: One registration the worker holds: its instance id, its layers, its group (None: all layers).
Registration = tuple[int, dict[str, Any], m.KVGroup | None]
#: How many failed requests' reasons ``failed_stores`` and ``failed_retrieves`` each keep.
MAX_FAILURES_KEPT = 1024


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


def new_instance_id() -> int:
    """A KV cache registration's id, from the OS's random source: never from ``random``, which
    vLLM seeds alike in every engine (``seed=0``), so that two engines registered the same id
    and the second took over the first's registration (its stores then read, and its loads
    wrote, the other engine's KV cache)."""
    return secrets.randbits(63)


class LMCacheMPWorkerAdapter:
    """A vLLM worker's side: register KV caches once, then batched stores and retrieves.

    ``get_finished`` follows vLLM's connector contract: a request's stores are reported once they
    completed AND the engine finished the request (late completions are reported on a later call);
    retrieves are reported when done, successful or not. Failures are logged with the server's reason
    and the latest ``MAX_FAILURES_KEPT`` are kept in ``failed_stores`` / ``failed_retrieves`` (a
    long-running worker misses routinely: they never grow past that); ``get_block_ids_with_load_errors``
    names the blocks a failed retrieve did not fill, so the engine recomputes them.

    Registered with KV-cache groups (a hybrid model: ``register_kv_caches(..., groups=...)``),
    each group is its own registration and each op carries per-group block ids
    (``LoadStoreOp.group_block_ids``); a request's retrieve is all or nothing across its groups:
    failed if any group's failed, reported per request by ``take_failed_retrieves`` (vLLM refuses
    block-level load errors for multi-group models: ``get_block_ids_with_load_errors`` stays
    empty then).
    """

    def __init__(self, server_url: str, context: zmq.Context[Any], model_name: str,
                 world_size: int, kv_rank: int, vllm_block_size: int, *,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 heartbeat_interval_s: float = DEFAULT_HEARTBEAT_S,
                 load_deadline_ms: int | None = None) -> None:
        self._conn = Connection(server_url, context, model_name, world_size, kv_rank,
                                vllm_block_size, connect_timeout_s, request_timeout_s,
                                f"lmcache-worker-{kv_rank}")
        #: Each retrieve's deadline (``RetrieveRequest.deadline_ms``): None for the server's
        #: ``timeouts.load_ms``, 0 for none.
        self.load_deadline_ms = load_deadline_ms
        #: The connection's ``MessageQueueClient`` (LMCache's adapters name theirs so too).
        self.mq_client = self._conn.mq_client
        self.chunk_size = self._conn.chunk_size
        self.instance_id = new_instance_id()
        self.registered: KVCache | None = None
        #: With groups: each group's registration (``registered`` is the first's).
        self.registered_groups: list[KVCache] = []
        self.groups: list[KVCacheGroupSpec] | None = None
        self.group_pieces: list[GroupPiece] | None = None
        self.group_instance_ids: list[int] = []
        #: The layout fingerprint the server files each registration's chunks under (one per
        #: group), from its replies: what the engine's keys name beside the model.
        self.layouts: list[str] = []
        self._registrations: list[Registration] = []
        #: Whether the server honours ``StoreRequest.copy_by_ns`` (its registration replies say
        #: so; an older server refuses the field, so it is not sent there).
        self._copy_by = False
        self._failed_recving: dict[str, None] = {}  # in failure order, bounded
        self._stores: dict[str, RequestTransfers] = {}
        self._retrieves: dict[str, RequestTransfers] = {}
        self._engine_finished: set[str] = set()
        self.failed_stores: dict[str, str] = {}
        self.failed_retrieves: dict[str, str] = {}
        self._load_error_blocks: set[int] = set()
        self._heartbeat_interval_s = heartbeat_interval_s
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, Any], *,
                           groups: Sequence[KVCacheGroupSpec] | None = None) -> None:
        """Share the worker's per-layer KV tensors with the server (once; again replaces them).

        ``groups``: a hybrid model's KV-cache groups (vLLM's ``kv_cache_groups``, in order), each
        registered on its own, with its layers, under its own instance id
        (``group_instance_ids``; the first is ``instance_id``). A refused group (e.g. a chunk size
        that is no multiple of its block size) unregisters those registered before it."""
        if groups is None:
            registrations: list[Registration] = [(self.instance_id, dict(kv_caches), None)]
            pieces = None
        else:
            pieces = group_pieces(self.chunk_size, groups)
            ids = [self.instance_id] + [new_instance_id() for _ in groups[1:]]
            registrations = [(iid, layers, spec.descriptor(i, len(groups))) for i, (iid, layers, spec)
                             in enumerate(zip(ids, group_caches(kv_caches, groups), groups,
                                              strict=True))]
        wrapped, self.layouts = self._register_all(registrations)
        self.registered, self.registered_groups = wrapped[0], wrapped if groups else []
        self.groups = list(groups) if groups is not None else None
        self.group_pieces = pieces
        self.group_instance_ids = [iid for iid, _, _ in registrations] if groups else []
        self._registrations = registrations
        if self._heartbeat is None and self._heartbeat_interval_s > 0:
            self._heartbeat = threading.Thread(target=self._beat, name="lmcache-heartbeat",
                                               daemon=True)
            self._heartbeat.start()

    def _register_all(self, registrations: list[Registration]) -> tuple[list[KVCache], list[str]]:
        """Register each; on a refusal, unregister those registered before it and raise. Returns
        the caches and the layout fingerprint the server gave each."""
        wrapped: list[KVCache] = []
        layouts: list[str] = []
        copy_by: list[bool] = []
        for instance_id, layers, group in registrations:
            cache, request = self._registration_request(layers, instance_id, group)
            try:
                reply = self.mq_client.request(request)
            except BaseException:
                for done, _, _ in registrations[:len(wrapped)]:
                    self._unregister(done)
                raise
            wrapped.append(cache)
            layouts.append(reply.layout)
            copy_by.append(reply.copy_by)
        self._copy_by = all(copy_by)
        return wrapped, layouts

    def _registration_request(self, kv_caches: dict[str, torch.Tensor], instance_id: int,
                              group: m.KVGroup | None = None
                              ) -> tuple[KVCache, m.RegisterKVCacheRequest]:
        """The caches described afresh: on GPU each call exports new CUDA IPC handles, each with
        its own reference count (the server opening a handle sent before would release a count
        that the earlier opening already released)."""
        wrapped = wrap_kv_caches(kv_caches)
        expected = self._conn.vllm_block_size if group is None else (
            1 if group.kind == "mamba" else group.block_size)  # Mamba: rows of state blocks
        if wrapped.block_size != expected:
            what = (f"KV cache group {group.index} was declared with block_size={expected}"
                    if group is not None else
                    f"the adapter was built for vllm_block_size={expected}")
            raise ValueError(f"the KV caches have {wrapped.block_size}-token blocks but {what}")
        request = m.RegisterKVCacheRequest(
            instance_id=instance_id, model_name=self._conn.model_name,
            world_size=self._conn.world_size, kv_rank=self._conn.kv_rank,
            block_size=wrapped.block_size, layout=wrapped.layout, layers=wrapped.layers,
            pid=os.getpid(), hostname=socket.gethostname(), group=group)
        return wrapped, request

    def _beat(self) -> None:
        """Ping with our instance ids so the server knows this worker is alive (and keeps its
        maps); a server that restarted no longer knows them, and gets the KV caches registered
        again."""
        interval = self._heartbeat_interval_s
        while not self._stop.wait(interval):
            for instance_id, _, _ in list(self._registrations):
                ping = m.PingRequest(instance_id=instance_id)
                try:
                    reply = self.mq_client.request_async(ping, interval).result(interval + 1.0)
                except LMCacheError:  # the server is down: the next beat tries again
                    break
                if reply.registered is False and not self._stop.is_set():
                    self._register_again()
                    break

    def _register_again(self) -> None:
        """Register with a server that forgot us, with freshly exported handles (finding 6)."""
        try:
            copy_by = []
            for instance_id, layers, group in self._registrations:
                _, request = self._registration_request(layers, instance_id, group)
                copy_by.append(self.mq_client.request(request).copy_by)
            self._copy_by = all(copy_by)  # the server that restarted may be another version
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
        """One store request for the whole chunks of several vLLM requests (one per distinct
        retention among them: ``LoadStoreOp.ttl_s``, ``pin``, ``priority``; per tenant: each
        carries the ``keys.tenant_tag`` of its ops' ``cache_salt``, never the salt; and per
        hash mode, ``store_hash_mode``)."""
        if len(request_ids) != len(ops):
            raise ValueError(f"{len(request_ids)} request ids but {len(ops)} ops")
        groups: dict[tuple[tuple[float | None, bool, int], str, m.HashMode], list[int]] = {}
        for i, op in enumerate(ops):
            key = (op.retention, tenant_tag(op.cache_salt), store_hash_mode(op))
            groups.setdefault(key, []).append(i)
        handle = event_handle(event)
        # The server copies nothing past half the timeout this waits for its reply: a store given
        # up on lets vLLM reuse a preempted or finished request's blocks (StoreRequest.copy_by_ns)
        copy_by_ns = (time.monotonic_ns() + int(self.mq_client.request_timeout_s * 1e9) // 2
                      if self._copy_by else 0)
        for ((ttl_s, pin, priority), tenant, hash_mode), members in groups.items():
            ids = [request_ids[i] for i in members]
            for instance_id, hashes, blocks in self._parts([ops[i] for i in members], False):
                payload = m.StoreRequest(instance_id=instance_id, chunk_hashes=hashes,
                                         block_ids=blocks, event_handle=handle, request_ids=ids,
                                         ttl_s=ttl_s, pin=pin, priority=priority, tenant=tenant,
                                         hash_mode=hash_mode, copy_by_ns=copy_by_ns)
                self._submit(STORE, payload, ids, blocks, self._stores)

    def batched_submit_retrieve_requests(self, request_ids: list[str], ops: list[LoadStoreOp],
                                         event: Any) -> None:
        """One retrieve request for several vLLM requests; each releases its own lookup's locks.

        With one vLLM request the lookup id is that request's id; several requests in one batch
        are sent one retrieve each (a retrieve releases the locks of one lookup); with groups,
        the groups' pieces (``split_parts``) packed into ``RETRIEVE_REQUESTS`` requests
        (``bundle_parts``), all under the request's lookup id (its lookup locked every group's
        chunks; each retrieve releases the locks of the chunks it reads)."""
        if len(request_ids) != len(ops):
            raise ValueError(f"{len(request_ids)} request ids but {len(ops)} ops")
        handle = event_handle(event)
        for request_id, op in zip(request_ids, ops, strict=True):
            parts, end = self._retrieve_parts(op)
            skips = self._load_skips(parts, end)
            if skips is None:
                self._fail(request_id, "a block the load needs is vLLM's null block 0 (out of "
                           "the window)", self._retrieves)
                continue
            bundles = ([list(zip(parts, skips, strict=True))] if self.group_pieces is None
                       else bundle_parts(split_parts(parts, skips)))
            for bundle in bundles:
                ((instance_id, hashes, blocks), skip), *more = bundle
                payload = m.RetrieveRequest(
                    instance_id=instance_id, chunk_hashes=hashes, block_ids=blocks,
                    event_handle=handle, lookup_id=request_id, request_ids=[request_id],
                    deadline_ms=self.load_deadline_ms, skip_blocks=skip,
                    more=[m.RetrievePart(instance_id=i, chunk_hashes=h, block_ids=b,
                                         skip_blocks=k) for (i, h, b), k in more])
                all_blocks = blocks + [b for (_, _, part), _ in more for b in part]
                self._submit(RETRIEVE, payload, [request_id], all_blocks, self._retrieves)

    def _load_skips(self, parts: list[Part], end: int) -> list[int] | None:
        """Each part's leading null blocks left unwritten (``groups.load_skip``; ``end``:
        the request's chunk the load ends at); None when a block a group needs is null. vLLM's
        null block exists with groups (HMA) only: a single-group cache's block 0 is real."""
        if self.group_pieces is None:
            return [0] * len(parts)
        skips = [load_skip(blocks, piece, end)
                 for (_, _, blocks), piece in zip(parts, self.group_pieces, strict=True)]
        return None if None in skips else [s for s in skips if s is not None]

    def _parts(self, ops: list[LoadStoreOp], retrieve: bool) -> list[Part]:
        """The request(s) these ops make: one of every whole chunk's blocks, or with groups one
        per group of the blocks its pieces hold (``groups.piece_blocks``)."""
        if self.group_pieces is None:
            return [(self.instance_id, *self._flatten(ops))]
        parts: list[Part] = [(iid, [], []) for iid in self.group_instance_ids]
        for op in ops:
            self._add_group_parts(parts, op, retrieve)
        return parts

    def _retrieve_parts(self, op: LoadStoreOp) -> tuple[list[Part], int]:
        """``_parts`` of one retrieve, and the request's chunk it ends at."""
        if self.group_pieces is None:
            return self._parts([op], True), 0
        parts: list[Part] = [(iid, [], []) for iid in self.group_instance_ids]
        return parts, self._add_group_parts(parts, op, True)

    def _add_group_parts(self, parts: list[Part], op: LoadStoreOp, retrieve: bool) -> int:
        """Add each group's chunks and blocks of ``op`` to its part; the request's chunk the op
        ends at."""
        pieces = self.group_pieces
        assert pieces is not None
        per_group = op.group_block_ids
        if per_group is None or len(per_group) != len(pieces):
            raise ValueError(f"this worker registered {len(pieces)} KV cache groups: each op "
                             f"needs group_block_ids, one list per group")
        hashes = self._conn.chunk_hashes(op.block_hashes, op.cache_salt)
        n = min([len(hashes)] + [len(ids) // piece.blocks_per_chunk
                                 for ids, piece in zip(per_group, pieces, strict=True)])
        for (_, part_hashes, part_blocks), ids, piece in zip(parts, per_group, pieces,
                                                             strict=True):
            chunks, blocks = piece_blocks(ids, n, piece, retrieve=retrieve,
                                          first_chunk=op.first_chunk)
            part_hashes += [hashes[c] for c in chunks]
            part_blocks += blocks
        return op.first_chunk + n

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

    def _fail(self, request_id: str, reason: str, book: dict[str, RequestTransfers]) -> None:
        """Record a transfer of ``request_id`` that failed before anything was sent."""
        failed: MessagingFuture[Any] = MessagingFuture.failed(LMCacheError(reason))
        book.setdefault(request_id, RequestTransfers()).transfers.append(
            Transfer(failed, [request_id], []))

    def _submit(self, op: Op[Q, Any], payload: Q, request_ids: list[str],
                blocks: list[int], book: dict[str, RequestTransfers]) -> None:
        if self.registered is None:
            raise RuntimeError("register_kv_caches must be called before store/retrieve")
        if blocks:
            future: MessagingFuture[Any] = self.mq_client.submit(op, payload)
        else:  # nothing whole to move: complete at once, no round trip
            empty = m.StoreReply(stored=0) if op is STORE else m.RetrieveReply(
                retrieved=0)
            future = MessagingFuture.completed(empty)
        transfer = Transfer(future, list(request_ids), blocks)
        for request_id in request_ids:
            book.setdefault(request_id, RequestTransfers()).transfers.append(transfer)

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

    def _settle(self, request_id: str, book: dict[str, RequestTransfers],
                failures: dict[str, str]) -> bool:
        """True when every transfer of the request is done; records the first failure."""
        state = book[request_id]
        if not all(t.future.query() for t in state.transfers):
            return False
        for transfer in state.transfers:
            reason = transfer_failure(transfer)
            if reason is not None:
                failures.pop(request_id, None)  # re-inserted: the newest go last
                failures[request_id] = reason
                if len(failures) > MAX_FAILURES_KEPT:
                    del failures[next(iter(failures))]  # the oldest
                if book is self._retrieves:
                    self._failed_recving[request_id] = None
                    if len(self._failed_recving) > MAX_FAILURES_KEPT:
                        del self._failed_recving[next(iter(self._failed_recving))]
                    if self.group_pieces is None:  # multi-group: per request only
                        self._load_error_blocks.update(
                            unloaded_blocks(transfer, self._conn.blocks_in_chunk))
                logger.warning("%s of request %s failed: %s",
                               "store" if book is self._stores else "retrieve", request_id, reason)
                break
        return True

    def wait_for_retrieves(self, timeout_s: float) -> bool:
        """Block until every retrieve of some request in flight has been answered (True; at once
        when one already has), or ``timeout_s`` passed, or none is in flight (False). For a caller
        with nothing else to do until a load lands (vLLM's step that computes nothing): its
        replies are received on this thread (``MessageQueueClient.wait``), no polling loop."""
        pending = list(self._retrieves.values())
        if not pending:
            return False
        if any(all_answered(state) for state in pending):
            return True
        woken: MessagingFuture[None] = MessagingFuture("a retrieve answered")

        def check_of(state: RequestTransfers) -> Callable[[MessagingFuture[Any]], None]:
            def check(_future: MessagingFuture[Any]) -> None:
                if all_answered(state):
                    woken.set_result(None)  # once; a later call is a no-op
            return check

        for state in pending:
            check = check_of(state)
            for transfer in state.transfers:
                if not transfer.future.query():  # one done since is called back at once
                    transfer.future.add_done_callback(check)
        return self.mq_client.wait(woken, timeout_s)

    def settle_retrieves(self, request_ids: Collection[str], timeout_s: float) -> set[str]:
        """Wait, within ``timeout_s`` for all, until the retrieves of ``request_ids`` are
        answered (receiving on this thread), and settle them here rather than in
        ``get_finished``, which then never reports them: loads their caller reads in its own
        step (vLLM's synchronous loads). What they failed to fill goes to
        ``get_block_ids_with_load_errors`` as always. Returns the requests not answered in time,
        no longer tracked either: their blocks are the caller's to report unloaded."""
        deadline = time.monotonic() + timeout_s
        late: set[str] = set()
        for request_id in request_ids:
            state = self._retrieves.get(request_id)
            if state is None:
                continue
            for transfer in state.transfers:
                if not transfer.future.query():
                    self.mq_client.wait(transfer.future, max(0.0, deadline - time.monotonic()))
            if all_answered(state):
                self._settle(request_id, self._retrieves, self.failed_retrieves)
            else:
                late.add(request_id)
            del self._retrieves[request_id]
        return late

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

    def take_failed_retrieves(self) -> set[str]:
        """The requests whose retrieve failed (in any group), each reported finished by
        ``get_finished`` by now: returned once, then forgotten (the latest
        ``MAX_FAILURES_KEPT``). vLLM's ``KVConnectorTransferResults.failed_recving``."""
        failed, self._failed_recving = set(self._failed_recving), {}
        return failed

    def num_blocks_per_chunk(self) -> int:
        return self._conn.num_blocks_per_chunk()

    # ------------------------------------------------------------------ the caller's own requests

    def call(self, op: Op[Q, P], payload: Q, timeout_s: float | None = None) -> P:
        """Send one request of ``op`` on this worker's connection and wait for its reply (the
        server's error raised), for requests outside this API, e.g. ``lmcache store-bench``'s
        own lookups: ``MessageQueueClient.call``, which takes a quick reply on this thread."""
        return self.mq_client.call(op, payload, timeout_s)

    def send(self, op: Op[Q, P], payload: Q, timeout_s: float | None = None
             ) -> MessagingFuture[P]:
        """Send one request of ``op`` on this worker's connection without waiting (e.g.
        ``lmcache store-bench``'s own stores and retrieves, each timed to its reply): the future
        resolves to the reply or raises the server's error (``MessageQueueClient.submit``)."""
        return self.mq_client.submit(op, payload, timeout_s)

    def _unregister(self, instance_id: int) -> None:
        try:
            self.mq_client.request(m.UnregisterKVCacheRequest(instance_id=instance_id),
                                   self.mq_client.connect_timeout_s)
        except LMCacheError as exc:
            logger.warning("unregistering from %s failed: %s", self.mq_client.server_url, exc)

    def shutdown(self) -> None:
        """Unregister (so the server unmaps at once), stop the heartbeat, close the socket."""
        self._stop.set()
        if self.registered is not None:
            for instance_id, _, _ in self._registrations:
                self._unregister(instance_id)
            self.registered = None
        if self._heartbeat is not None:
            self._heartbeat.join(1.0)
        self.mq_client.close()
