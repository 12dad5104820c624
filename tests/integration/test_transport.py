"""MessageQueueClient / MessageQueueServer over real tcp:// and ipc:// sockets."""

import queue
import threading
import time

import msgspec
import pytest
import zmq

from lmcache_core.errors import (
    ConnectionClosedError,
    LMCacheTimeoutError,
    ServerError,
    ServerUnreachableError,
    UnknownOperationError,
)
from lmcache_core.protocol import RequestType, ops
from lmcache_core.protocol import messages as m
from lmcache_core.transport import MessageQueueClient, MessageQueueServer, Route
from lmcache_core.transport.routes import AfterReply
from tests.harness import wait_until


def _ping(_p, _c):
    return m.PingReply(version="t", chunk_size=16, uptime_s=0.0, pid=0)


@pytest.fixture
def release():
    return threading.Event()


@pytest.fixture(params=["tcp", "ipc"])
def queue_server(request, tmp_path, release):
    """The transport alone, in this process: a ``MessageQueueServer`` on tcp:// and on ipc://
    serving three routes these tests control (a store held until ``release``, a handler that
    raises), not an ``lmcache serve`` (the suite's ``server``)."""
    def slow_store(p, _c):
        release.wait(5)
        return m.StoreReply(stored=len(p.chunk_hashes))

    def boom(_p, _c):
        raise RuntimeError("kaboom")

    url = "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/s.sock"
    srv = MessageQueueServer(url, workers=2)
    srv.start({
        RequestType.PING: Route(_ping),
        RequestType.STORE: Route(slow_store, blocking=True),
        RequestType.CLEAR: Route(boom),
    })
    yield srv
    release.set()
    srv.stop(1.0)


def test_round_trip_and_a_slow_store_does_not_delay_ping(queue_server, release):
    with MessageQueueClient(queue_server.bound_url) as client:
        assert client.wait_until_reachable(2).chunk_size == 16
        store = client.request_async(m.StoreRequest(
            instance_id=1, chunk_hashes=[b"x"], block_ids=[0]))
        # The store is held until ``release``: a ping queued behind it would never answer.
        client.wait_until_reachable(10)
        assert not store.query()
        release.set()
        assert store.result(2) == m.StoreReply(stored=1)


def test_errors_come_back_typed_and_the_server_keeps_serving(queue_server):
    with MessageQueueClient(queue_server.bound_url) as client:
        with pytest.raises(ServerError, match=r"RuntimeError: kaboom"):
            client.request_async(m.ClearRequest()).result(2)
        with pytest.raises(UnknownOperationError):
            client.request_async(m.LookupRequest(
                model_name="m", world_size=1, lookup_id="a", chunk_hashes=[])).result(2)
        assert client.wait_until_reachable(2)
    assert queue_server.counters.errors == 2


def test_raw_garbage_gets_error_replies(queue_server):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(queue_server.bound_url)
    try:
        for frames in ([b"\x05", msgspec.msgpack.encode(24)],          # LMCache noop, not ours
                       [b"\x06", b"\xc1", b""],
                       [b"\x07", msgspec.msgpack.encode("lmc.ping"), b"not msgpack"]):
            sock.send_multipart(frames)
            reply = sock.recv_multipart()
            # The op frame goes back only when it is a msgpack str or int (b"\xc1" is no msgpack).
            echoed = frames[1] if frames[1] != b"\xc1" else msgspec.msgpack.encode(None)
            assert reply[:2] == [frames[0], echoed]
            error = msgspec.msgpack.decode(reply[2], type=m.ErrorReply)
            assert error.code in {"bad_request", "unknown_op"}
    finally:
        sock.close(0)
    with MessageQueueClient(queue_server.bound_url) as client:
        assert client.wait_until_reachable(2)


def test_an_untrusted_uid_is_never_echoed(queue_server):
    """A uid frame the server cannot read as one msgpack int (oversized, a str, no msgpack) gets
    its error reply at once with a nil in the uid's place, never the client's bytes back."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(queue_server.bound_url)
    try:
        for uid in (msgspec.msgpack.encode(b"u" * 2**16), msgspec.msgpack.encode("a uid"), b"\xc1"):
            sock.send_multipart([uid, msgspec.msgpack.encode("lmc.ping"), msgspec.msgpack.encode({})])
            reply = sock.recv_multipart()
            assert reply[:2] == [msgspec.msgpack.encode(None), msgspec.msgpack.encode("lmc.ping")]
            assert msgspec.msgpack.decode(reply[2], type=m.ErrorReply).code == "bad_request"
    finally:
        sock.close(0)


def test_many_requests_in_flight(queue_server):
    with MessageQueueClient(queue_server.bound_url) as client:
        futures = [client.request_async(m.PingRequest()) for _ in range(2000)]
        assert all(f.result(5).chunk_size == 16 for f in futures)


def test_unreachable_and_timeouts():
    with MessageQueueClient("tcp://127.0.0.1:9", request_timeout_s=0.2) as client:
        start = time.perf_counter()
        future = client.request_async(m.PingRequest())
        with pytest.raises(LMCacheTimeoutError):
            future.result(5)  # the client's own deadline fails it, well before 5 s
        assert time.perf_counter() - start < 2.0  # 10x that deadline
        with pytest.raises(ServerUnreachableError, match=r"127\.0\.0\.1:9"):
            client.wait_until_reachable(0.2)


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
def test_requests_in_flight_fail_at_once_when_the_server_goes_and_later_ones_reach_the_next(
        scheme, tmp_path):
    """A server that exits (here a bare ROUTER that reads and never answers, then closes) takes
    its requests with it: the client fails them as soon as the connection closes, not at their
    30 s deadline, and sends on to whichever server listens next on the url."""
    ctx = zmq.Context.instance()
    url = f"ipc://{tmp_path}/gone.sock" if scheme == "ipc" else "tcp://127.0.0.1:*"
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(url)
    url = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    with MessageQueueClient(url, request_timeout_s=30) as client:
        waited = client.request_async(m.PingRequest())
        polled = client.submit(ops.PING, m.PingRequest(), polled=True)
        assert router.poll(5000) and len(router.recv_multipart()) >= 3  # both were sent
        start = time.monotonic()
        router.close(0)
        for future in (waited, polled):
            with pytest.raises(ServerUnreachableError, match=r"connection .* closed"):
                future.result(10)
        assert time.monotonic() - start < 10  # ms in practice; the deadline is 30 s
        server = MessageQueueServer(url)
        server.start({RequestType.PING: Route(_ping)})
        try:
            assert client.wait_until_reachable(10).chunk_size == 16
        finally:
            server.stop(1.0)


def test_close_fails_pending_and_later_requests():
    client = MessageQueueClient("tcp://127.0.0.1:9", request_timeout_s=30)
    future = client.request_async(m.PingRequest())
    callbacks = []
    future.add_done_callback(lambda f: callbacks.append(f.query()))
    client.close()
    with pytest.raises(ConnectionClosedError):
        future.result(1)
    assert callbacks == [True]
    with pytest.raises(ConnectionClosedError):
        client.request_async(m.PingRequest()).result(1)


def test_stop_finishes_in_flight_work(tmp_path, release):
    def slow(p, _c):
        time.sleep(0.3)
        return m.StoreReply(stored=1)

    srv = MessageQueueServer("tcp://127.0.0.1:0")
    srv.start({RequestType.STORE: Route(slow, blocking=True), RequestType.PING: Route(_ping)})
    with MessageQueueClient(srv.bound_url) as client:
        future = client.request_async(m.StoreRequest(
            instance_id=1, chunk_hashes=[b"x"], block_ids=[0]))
        client.wait_until_reachable(2)
        srv.stop(5)
        assert future.result(2) == m.StoreReply(stored=1)


def test_long_requests_queued_together_reach_the_workers_together(release):
    """Requests read in one batch are handed to the workers together: the first one's handler
    runs with the second already taken off the socket, however long the loop takes to read it (a
    copy worker that had started would starve the loop of the GIL meanwhile; see
    ``MessageQueueServer._receive``). A wire ahead of ours, which claims nothing, notes how
    many jobs the workers had been handed when the loop reads the second store."""
    held, seen, claims, handed = threading.Event(), [], [], []

    class Handed(queue.SimpleQueue):  # the workers' queue, counting what the loop puts on it
        def put(self, item, block=True, timeout=None):
            handed.append(item)
            super().put(item, block, timeout)

    class Noting:
        name = "noting"

        def claim(self, _frames):
            claims.append(len(handed))  # the ping, the first store, the second store
            return None

    def slow_ping(_p, _c):
        held.set()
        release.wait(5)  # the loop is held here while the two stores are queued behind it
        return _ping(_p, _c)

    def store(p, _c):
        seen.append(srv.in_flight)
        return m.StoreReply(stored=len(p.chunk_hashes))

    # inproc: a send puts the message in the server's pipe before it returns (no I/O thread),
    # so both stores are queued when the loop is let go
    context = zmq.Context.instance()
    srv = MessageQueueServer("inproc://lmcache-batch-hand-over", context=context, workers=3)
    srv._jobs = Handed()  # (before start: the workers take jobs from it)
    srv.start({RequestType.STORE: Route(store, blocking=True),
               RequestType.PING: Route(slow_ping)}, wires=[Noting()])
    try:
        with MessageQueueClient(srv.bound_url, context) as client:
            ping = client.request_async(m.PingRequest())
            assert held.wait(5)
            stores = [client.request_async(m.StoreRequest(
                instance_id=1, chunk_hashes=[b"x"], block_ids=[0])) for _ in range(2)]
            assert srv.counters.requests == 1  # the stores wait on the socket
            release.set()
            assert ping.result(5).chunk_size == 16
            assert [f.result(5) for f in stores] == [m.StoreReply(stored=1)] * 2
        assert claims == [0, 0, 0]  # nothing handed over while the batch was being read
        assert seen[0] == 2  # both routed before the first handler ran
    finally:
        release.set()
        srv.stop(1.0)


def test_a_flood_of_long_requests_is_bounded_and_pings_still_answer(release):
    """Requests queued for the workers are bounded in bytes (4 requests of the largest size): a
    client sending faster than the workers serve gets BUSY replies instead of growing the server."""
    from lmcache_core.errors import ServerBusyError
    from lmcache_core.protocol import Limits

    def slow_store(p, _c):
        release.wait(5)
        return m.StoreReply(stored=len(p.chunk_hashes))

    srv = MessageQueueServer("tcp://127.0.0.1:0", workers=1,
                             limits=Limits(max_request_bytes=64 * 1024))
    srv.start({RequestType.STORE: Route(slow_store, blocking=True), RequestType.PING: Route(_ping)})
    big = m.StoreRequest(instance_id=1, chunk_hashes=[b"h" * 32], block_ids=list(range(10_000)))
    try:
        with MessageQueueClient(srv.bound_url) as client:
            stores = [client.request_async(big) for _ in range(12)]
            # the stores are held until ``release``: a ping queued behind them would never answer
            client.wait_until_reachable(10)
            # the loop answered BUSY on receipt, before the ping's reply: those are done
            busy = [f for f in stores if f.query()]
            assert busy and all(isinstance(f.exception(0), ServerBusyError) for f in busy)
            size = len(msgspec.msgpack.encode(big))  # ~30 KB: 8 of them fit in 4 x 64 KiB
            assert srv.in_flight == (4 * 64 * 1024) // size == len(stores) - len(busy)
            release.set()
            served = [f.result(5) for f in stores if f not in busy]
            assert served and all(r == m.StoreReply(stored=1) for r in served)
    finally:
        release.set()
        srv.stop(1.0)


def test_polled_requests_wake_no_thread_yet_resolve_and_expire(queue_server, release):
    """``polled=True`` (the scheduler adapter's lookups): the caller's ``poll_replies`` takes the
    reply on its own thread; unpolled, the I/O thread still fails it at its deadline; and while the
    I/O thread watches the socket for another request, it resolves polled replies too."""
    with MessageQueueClient(queue_server.bound_url) as client:
        client.wait_until_reachable(2)
        futures = [client.submit(ops.PING, m.PingRequest(), polled=True)
                   for _ in range(32)]
        def answered() -> bool:
            if all(f.query() for f in futures):
                return True
            client.poll_replies()
            return False

        wait_until(answered)
        assert all(f.result(0).chunk_size == 16 for f in futures)
        # nobody polls: the deadline still fails it (the I/O thread), without a reply getting lost
        store = client.submit(ops.STORE, m.StoreRequest(
            instance_id=1, chunk_hashes=[b"x"], block_ids=[0]), timeout_s=0.2, polled=True)
        with pytest.raises(LMCacheTimeoutError):
            store.result(2)
        release.set()
        # an unattended request makes the I/O thread watch the socket: it settles polled ones too
        polled = client.submit(ops.PING, m.PingRequest(), polled=True)
        other = client.request_async(m.PingRequest())
        assert other.result(2).chunk_size == 16 and polled.result(2).chunk_size == 16
        assert client.in_flight == 0


def test_a_sleeping_call_wakes_when_another_thread_sends_past_its_reply(
        queue_server, release, monkeypatch):
    """ZMQ_FD is edge-triggered and any socket call may take the edge: a thread that sends while
    a caller sleeps in ``wait`` on that fd, its reply already queued, must see that someone wakes
    it (it slept until its own timeout: seconds)."""
    from lmcache_core.transport import client as client_module

    monkeypatch.setattr(client_module, "_IDLE_WAKE_S", 60.0)  # the I/O thread's own look: later
    with MessageQueueClient(queue_server.bound_url) as client:
        client.wait_until_reachable(2)
        took: list[float] = []

        def slow_call() -> None:  # sleeps in wait(): the store is held by ``release``
            start = time.monotonic()
            client.call(ops.STORE, m.StoreRequest(instance_id=1, chunk_hashes=[b"x"],
                                                  block_ids=[0]), 20.0)
            took.append(time.monotonic() - start)

        caller = threading.Thread(target=slow_call)
        caller.start()
        wait_until(lambda: client.in_flight)  # its request is out (it then waits for the reply)
        # Past its brief hold of the socket, asleep in wait(). (Kept sleeps, here and below: they
        # set up the race; on a slow machine it may not happen, and the test passes without it.)
        time.sleep(0.05)
        with client._lock:  # as a sender would: the reply arrives and a socket call takes the edge
            release.set()
            wait_until(lambda: int(client._socket.getsockopt(zmq.EVENTS)) & int(zmq.POLLIN),
                       what="the reply never came")
            time.sleep(0.05)  # the caller, unable to receive, is back asleep on a quiet fd
        # another thread's send (its deadline is past the I/O thread's next look: that wakes nobody)
        client.submit(ops.PING, m.PingRequest(), 100.0, polled=True)
        caller.join(3.0)
        assert not caller.is_alive() and took and took[0] < 3.0


def test_a_watched_polled_request_is_settled_without_polling(queue_server, release, monkeypatch):
    """``watch``: a polled request nobody polls any more (a lookup with a release chained behind
    it) is settled as soon as its reply arrives, not at the I/O thread's next look."""
    from lmcache_core.transport import client as client_module

    monkeypatch.setattr(client_module, "_IDLE_WAKE_S", 60.0)
    with MessageQueueClient(queue_server.bound_url) as client:
        client.wait_until_reachable(2)
        store = client.submit(ops.STORE, m.StoreRequest(
            instance_id=1, chunk_hashes=[b"x"], block_ids=[0]), timeout_s=100.0, polled=True)
        client.watch(store)
        release.set()
        # no poll and no waiter receiving (result() would receive on this thread): the I/O thread
        wait_until(store.query, 3.0)
        assert store.result(0) == m.StoreReply(stored=1)
        client.watch(store)  # done already: nothing to do
        assert client.in_flight == 0


def test_a_polled_request_waited_on_is_received_by_its_waiter(queue_server, release, monkeypatch):
    """A polled request's future (a release the scheduler adapter sends) is taken by whoever waits
    on it: ``result`` receives on the waiting thread, without the I/O thread watching the socket
    (its own look is pushed an hour away here, so only the waiter can settle it)."""
    from lmcache_core.transport import client as client_module

    monkeypatch.setattr(client_module, "_IDLE_WAKE_S", 3600.0)
    with MessageQueueClient(queue_server.bound_url) as client:
        client.wait_until_reachable(2)
        ping = client.submit(ops.PING, m.PingRequest(), timeout_s=3600.0, polled=True)
        assert ping.result(5).chunk_size == 16
        store = client.submit(ops.STORE, m.StoreRequest(
            instance_id=1, chunk_hashes=[b"x"], block_ids=[0]), timeout_s=3600.0, polled=True)
        with pytest.raises(LMCacheTimeoutError):
            store.result(0.05)  # held by ``release``: the driven wait still ends at its timeout
        release.set()
        assert store.exception(5) is None and client.in_flight == 0


def test_future_semantics():
    from lmcache_core.transport.future import MessagingFuture

    seen = []
    future: MessagingFuture[int] = MessagingFuture("t")
    future.add_done_callback(lambda f: seen.append(f.result(0)))
    future.add_done_callback(lambda f: 1 / 0)  # logged, does not stop the others
    future.add_done_callback(lambda f: seen.append("second"))
    assert not future.query()
    with pytest.raises(LMCacheTimeoutError):
        future.result(0)
    with pytest.raises(LMCacheTimeoutError):
        future.result(0.01)
    setter = threading.Timer(0.05, future.set_result, args=(7,))
    setter.start()
    assert future.result(2) == 7 and future.exception(0) is None
    setter.join(2)  # the callbacks run on the settling thread, after the waiters are woken
    assert seen == [7, "second"]
    future.set_result(8)  # settled once
    future.set_exception(RuntimeError("late"))
    assert future.result(0) == 7
    future.add_done_callback(lambda f: seen.append("after"))  # already done: at once
    assert seen[-1] == "after"
    failed = MessagingFuture.failed(ServerError("x"))
    assert failed.query() and isinstance(failed.exception(0), ServerError)
    with pytest.raises(ServerError):
        failed.result(0)
    assert MessagingFuture.completed(3).result() == 3


def test_call_later_runs_on_the_io_thread_once_due(queue_server):
    """``call_later`` runs its function on the client's I/O thread, not before the delay has
    passed; one still due when the client closes is dropped."""
    ran: list[tuple[str, float]] = []
    with MessageQueueClient(queue_server.bound_url, name="io-under-test") as client:
        start = time.monotonic()
        client.call_later(0.05, lambda: ran.append((threading.current_thread().name,
                                                    time.monotonic() - start)))
        client.call_later(3600.0, lambda: ran.append(("never", 0.0)))
        wait_until(lambda: ran, 5.0, "call_later never ran")
        assert ran[0][0] == "io-under-test" and ran[0][1] >= 0.05
    assert len(ran) == 1


@pytest.mark.parametrize("blocking", [True, False])
def test_work_after_a_reply_starts_once_the_reply_is_sent_and_its_failure_costs_nothing_else(
        tmp_path, blocking):
    """``AfterReply``: ``then`` runs on the loop thread after the reply went out. Here ``then``
    waits for the client to have the reply: run before the send, it would wait in vain and the
    client would get nothing. A ``then`` that raises is logged; the server keeps serving."""
    client_has_reply = threading.Event()
    seen: list[bool] = []

    def then() -> None:
        seen.append(client_has_reply.wait(30))

    def broken_then() -> None:
        raise RuntimeError("follow-up bug")

    def store(p, _c):
        return AfterReply(m.StoreReply(stored=len(p.chunk_hashes)),
                          then if p.instance_id == 1 else broken_then)

    srv = MessageQueueServer(f"ipc://{tmp_path}/s.sock", workers=1)
    srv.start({RequestType.PING: Route(_ping), RequestType.STORE: Route(store, blocking=blocking)})
    try:
        with MessageQueueClient(srv.bound_url) as client:
            reply = client.request_async(m.StoreRequest(
                instance_id=1, chunk_hashes=[b"x", b"y"], block_ids=[0, 1])).result(20)
            assert reply == m.StoreReply(stored=2)
            client_has_reply.set()
            wait_until(lambda: seen == [True])
            assert client.request_async(m.StoreRequest(
                instance_id=2, chunk_hashes=[b"z"], block_ids=[0])).result(20).stored == 1
            assert client.wait_until_reachable(10)  # the broken follow-up stopped nothing
    finally:
        client_has_reply.set()
        srv.stop(1.0)
    assert srv.counters.errors == 0  # a follow-up's failure is not the request's
