"""The HTTP listener of ``lmcache serve``: ``/metrics`` scraped with a real HTTP client after real
work (stores, lookups, retrieves, evictions, errors, a reaped worker, a Redis outage), and the
``/healthz`` and ``/readyz`` probes before start, while serving, and after a thread died."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from lmcache_core.protocol import RequestType
from lmcache_core.protocol import messages as m
from lmcache_core.server.app import CacheServer
from lmcache_core.server.http import HttpListener
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.chunks import CHUNK, CHUNK_BYTES, blocks, lookup, tokens
from tests.integration.cli import cli
from tests.integration.servers import (
    FaultyServer,
    RedisServer,
    ServerProcess,
    WorkerProcess,
    tiny_config,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def get(url: str, timeout_s: float = 5) -> tuple[int, str, str]:
    """(status, content type, body) of a GET; 4xx/5xx are answers too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def scrape(base: str) -> Samples:
    status, content_type, text = get(base + "/metrics")
    assert status == 200 and content_type.startswith("text/plain"), (status, content_type)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


# ---------------------------------------------------------------- /metrics after real work


def test_metrics_move_with_stores_lookups_retrieves_evictions_and_errors(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, {"server": {"pool_size": 4 * CHUNK_BYTES}}).start()
    worker = WorkerProcess(srv.url)
    try:
        base = srv.http_url()
        assert base.startswith("http://127.0.0.1:") and not base.endswith(":0")
        before = scrape(base)
        assert value(before, "lmcache_pool_capacity_bytes") == 4 * CHUNK_BYTES
        # 4 chunks of 64 KiB: an auto slab is the whole pool (it is under 128 MiB)
        assert value(before, "lmcache_pool_slabs") == 1
        assert value(before, "lmcache_pool_free_slabs") == 1
        assert value(before, "lmcache_pool_allocated_bytes") == 0
        assert value(before, "lmcache_store_skipped_quota_chunks_total") == 0
        assert ("lmcache_model_used_bytes", frozenset({("model", "tiny")})) not in before
        assert value(before, "lmcache_registered_workers", model="tiny") == 1
        assert value(before, "lmcache_registered_models") == 1
        assert value(before, "lmcache_build_info", version=__import__("lmcache_core").__version__) == 1
        assert value(before, "process_resident_memory_bytes") > 0  # the library's collector
        with MessageQueueClient(srv.url) as client:
            a, b = tokens(4, seed=1), tokens(4, seed=2)
            worker("fill", blocks=blocks(0, 8), seed=5)
            assert worker("store", req="a", keys=a, blocks=blocks(0, 4))["finished"]
            assert lookup(client, a, "ra", lock=True) == 4  # 4 hit chunks
            assert lookup(client, a[:2 * CHUNK] + tokens(2, seed=3)) == 2  # 2 hits, 2 misses
            assert worker("retrieve", req="ra", keys=a, blocks=blocks(4, 4))["finished"]
            assert not worker("store", req="b", keys=b, blocks=blocks(4, 4))["failed"]  # evicts a
            raw = zmq.Context.instance().socket(zmq.DEALER)  # two bad frames: typed error replies
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.RCVTIMEO, 5000)
            raw.connect(srv.url)
            try:
                for frames in ([b"\x01", msgspec.msgpack.encode("lmc.nope"), b"\x80"],
                               [b"\x02", b"not msgpack", b""]):
                    raw.send_multipart(frames)
                    raw.recv_multipart()
            finally:
                raw.close(0)
        after = scrape(base)
    finally:
        worker.close()
        srv.kill()
    assert delta(after, before, "lmcache_stores_total") == 2
    assert delta(after, before, "lmcache_stored_chunks_total") == 8
    assert delta(after, before, "lmcache_stored_bytes_total") == 8 * CHUNK_BYTES
    assert delta(after, before, "lmcache_lookups_total") == 2
    assert delta(after, before, "lmcache_lookup_hit_chunks_total") == 6
    assert delta(after, before, "lmcache_lookup_miss_chunks_total") == 2
    assert delta(after, before, "lmcache_lookup_hit_tokens_total") == 6 * CHUNK
    assert delta(after, before, "lmcache_retrieves_total") == 1
    assert delta(after, before, "lmcache_retrieved_chunks_total") == 4
    assert delta(after, before, "lmcache_retrieved_bytes_total") == 4 * CHUNK_BYTES
    assert delta(after, before, "lmcache_evictions_total") == 4
    assert value(after, "lmcache_pool_chunks") == 4
    assert value(after, "lmcache_pool_used_bytes") == 4 * CHUNK_BYTES
    assert value(after, "lmcache_pool_allocated_bytes") == 4 * CHUNK_BYTES
    assert (value(after, "lmcache_pool_slabs"), value(after, "lmcache_pool_free_slabs")) == (1, 0)
    assert value(after, "lmcache_model_used_bytes", model="tiny") == 4 * CHUNK_BYTES
    assert value(after, "lmcache_model_pieces", model="tiny") == 4
    assert value(after, "lmcache_lookup_locks") == 0  # the retrieve consumed the lookup's locks
    assert delta(after, before, "lmcache_errors_total", code="unknown_op") == 1
    assert delta(after, before, "lmcache_errors_total", code="bad_request") == 1
    assert delta(after, before, "lmcache_requests_total") >= 7
    assert value(after, "lmcache_requests_in_flight") == 0
    for op, count in (("store", 2), ("retrieve", 1), ("lookup", 2)):
        assert delta(after, before, "lmcache_request_duration_seconds_count", op=op) == count
        assert delta(after, before, "lmcache_request_duration_seconds_sum", op=op) > 0
        assert value(after, "lmcache_request_duration_seconds_bucket", op=op, le="+Inf") == \
            value(after, "lmcache_request_duration_seconds_count", op=op)


def test_a_killed_worker_is_reaped_in_the_metrics(tmp_path: Path, make_server) -> None:
    srv = make_server({"server": {"quotas": {"tiny": "1MiB", "big": "2MiB"}}})
    base = srv.http_url()
    worker = WorkerProcess(srv.url)
    first = scrape(base)
    assert value(first, "lmcache_registered_workers", model="tiny") == 1
    assert value(first, "lmcache_model_quota_bytes", model="tiny") == 2**20  # server.quotas
    assert value(first, "lmcache_model_quota_bytes", model="big") == 2 * 2**20
    worker.kill()  # the housekeeper reaps a worker whose process is gone within a second
    wait_until(lambda: value(scrape(base), "lmcache_reaped_workers_total") == 1)
    after = scrape(base)
    assert value(after, "lmcache_registered_models") == 0
    assert ("lmcache_registered_workers", frozenset({("model", "tiny")})) not in after


# ---------------------------------------------------------------- a Redis outage


@pytest.mark.redis
def test_a_redis_outage_shows_in_the_metrics_and_readyz(
        tmp_path: Path, make_redis: Callable[..., RedisServer], make_server, make_worker) -> None:
    redis_server = make_redis()
    remote = {"url": redis_server.url, "timeout_ms": 200, "retry_interval_s": 0.2}
    srv = make_server({"remote": remote})
    worker = make_worker(srv.url)
    base = srv.http_url()
    up = scrape(base)
    assert value(up, "lmcache_remote_up") == 1
    assert value(up, "lmcache_tier_queued_writes", tier="remote") == 0
    status, _, body = get(base + "/readyz")
    assert status == 200 and json.loads(body)["degraded"] == []
    toks = tokens(2, seed=4)
    worker("fill", blocks=blocks(0, 2), seed=1)
    assert worker("store", req="s", keys=toks, blocks=blocks(0, 2))["finished"]
    wait_until(lambda: value(scrape(base), "lmcache_tier_written_chunks_total", tier="remote") == 2)

    redis_server.stop()
    with MessageQueueClient(srv.url) as client:
        assert lookup(client, tokens(1, seed=5)) == 0  # a miss asks Redis, which is gone
    wait_until(lambda: value(scrape(base), "lmcache_remote_up") == 0)
    down = scrape(base)
    assert delta(down, up, "lmcache_remote_outages_total") == 1
    assert delta(down, up, "lmcache_tier_errors_total", tier="remote") >= 1
    status, _, body = get(base + "/readyz")  # still serving from memory: ready, degraded
    assert status == 200, body
    assert json.loads(body)["status"] == "degraded" and json.loads(body)["degraded"] == ["remote"]

    redis_server.start()  # probed every 0.2 s
    wait_until(lambda: value(scrape(base), "lmcache_remote_up") == 1)
    assert json.loads(get(base + "/readyz")[2])["degraded"] == []


# ---------------------------------------------------------------- probes


def test_readyz_is_503_before_start_and_200_after(short_tmp: Path) -> None:
    server = CacheServer(tiny_config(short_tmp, **{"server.http_url": "http://127.0.0.1:0"}))
    assert server.metrics is not None
    # The server's own listener starts with it; to see "before", serve its probes meanwhile.
    early = HttpListener("127.0.0.1", 0, server.metrics.registry,
                         {"/healthz": server.health, "/readyz": server.readiness}, server.supervisor)
    base = early.start()
    try:
        status, content_type, body = get(base + "/readyz")
        assert (status, json.loads(body)) == (503, {"status": "starting"})
        assert content_type.startswith("application/json")
        assert get(base + "/healthz")[0] == 200
        server.start()
        try:
            for url in (base, server.http_url):
                assert url is not None
                status, _, body = get(url + "/readyz")
                assert status == 200, body
                ready = json.loads(body)
                assert ready["status"] == "ready" and ready["url"] == server.url
                assert ready["tiers"] == {"memory": "ok"} and ready["degraded"] == []
                assert json.loads(get(url + "/healthz")[2]) == {"status": "ok"}
            assert get(base + "/nothing-here")[0] == 404
            server.request_stop()
        finally:
            server.stop()
        status, _, body = get(base + "/readyz")
        assert (status, json.loads(body)) == (503, {"status": "stopping"})
    finally:
        early.stop()
    with pytest.raises(urllib.error.URLError):  # both listeners closed
        get(base + "/healthz", timeout_s=2)


class InjectedFault(BaseException):
    """Not an Exception: nothing catches it, like a bug that escapes."""


def test_healthz_is_503_with_the_reason_once_a_thread_died(short_tmp: Path) -> None:
    server = CacheServer(tiny_config(short_tmp, **{"server.http_url": "http://127.0.0.1:0"}))

    def reap() -> list[int]:
        raise InjectedFault("injected into the housekeeper")

    server.registry.reap = reap  # type: ignore[method-assign]
    server.start()
    try:
        assert server.http_url is not None
        assert server.wait(5) and server.failure is not None  # the housekeeper runs every second
        status, _, body = get(server.http_url + "/healthz")
        assert status == 503
        failed = json.loads(body)
        assert failed["status"] == "failed" and "lmcache-housekeeping died" in failed["reason"]
        assert "InjectedFault" in failed["reason"]
        status, _, body = get(server.http_url + "/readyz")
        assert status == 503 and json.loads(body)["status"] == "failed"
    finally:
        server.stop()


def test_a_real_server_whose_thread_dies_fails_healthz_or_exits(tmp_path: Path) -> None:
    server = FaultyServer(tmp_path, "housekeeper").start()
    try:
        base = server.http_url()
        server.trigger()  # dies at the next tick (1 s)
        seen: list[int | str] = []
        while server.proc is not None and server.proc.poll() is None:
            try:
                seen.append(get(base + "/healthz", timeout_s=1)[0])
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                seen.append(type(exc).__name__)  # the listener closed as the process exits
            assert len(seen) < 2000, seen
            time.sleep(0.005)
        code, _ = server.exit_code_within(5)
    finally:
        server.kill()
    assert code == 1
    first_bad = next((i for i, status in enumerate(seen) if status != 200), len(seen))
    assert 200 not in seen[first_bad:], seen  # once it stopped being healthy it never was again
    assert "thread lmcache-housekeeping died" in server.log()


def test_http_url_in_use_is_one_error_line_and_exit_1(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = ServerProcess(tmp_path, {"server": {"http_url": f"http://127.0.0.1:{port}"}})
        with pytest.raises(RuntimeError, match="server exited 1"):
            srv.start(timeout_s=60)  # a hang bound only: it exits in ~1 s
    assert f"cannot listen on http://127.0.0.1:{port} (server.http_url)" in srv.log()
    assert "Traceback" not in srv.log()


def test_off_serves_no_http_and_sigterm_stops_a_server_with_http(tmp_path: Path, make_server) -> None:
    off = make_server({"server": {"http_url": "off"}}, name="off")
    on = make_server(name="on")
    with MessageQueueClient(off.url) as client:
        assert client.server_info().http_url is None
    base = on.http_url()
    assert get(base + "/healthz")[0] == 200
    on_scrapes: list[int] = []
    stop = threading.Event()

    def keep_scraping() -> None:  # scrapes during the stop must not hold it up
        while not stop.is_set():
            try:
                on_scrapes.append(get(base + "/metrics", timeout_s=2)[0])
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError,
                    TimeoutError):  # the stop may cut a reply mid-body (IncompleteRead)
                return

    scraper = threading.Thread(target=keep_scraping)
    scraper.start()
    wait_until(lambda: on_scrapes, what="no scrape answered before the SIGTERM")
    assert on.proc is not None
    os.kill(on.proc.pid, signal.SIGTERM)
    assert on.proc.wait(10) == 0
    stop.set()
    scraper.join(10)
    assert on_scrapes and set(on_scrapes) == {200}


# ---------------------------------------------------------------- the transport's hook


def test_the_transport_observes_every_served_request_and_counts_errors_by_code(tmp_path: Path) -> None:
    from lmcache_core.errors import NotRegisteredError, UnknownOperationError
    from lmcache_core.transport import MessageQueueServer, Route

    observed: list[tuple[RequestType, float, str]] = []

    def not_registered(_p: Any, _c: bytes) -> m.Reply:
        raise NotRegisteredError("no such instance")

    srv = MessageQueueServer(f"ipc://{tmp_path}/t.sock",
                             observe=lambda op, seconds, code: observed.append((op, seconds, code)))
    srv.start({
        RequestType.PING: Route(lambda _p, _c: m.PingReply(version="t", chunk_size=1, uptime_s=0.0,
                                                           pid=0)),
        RequestType.STORE: Route(not_registered, blocking=True),
    })
    try:
        with MessageQueueClient(srv.bound_url) as client:
            client.wait_until_reachable(2)
            with pytest.raises(NotRegisteredError):
                client.request_async(m.StoreRequest(
                    instance_id=1, chunk_hashes=[b"x"], block_ids=[0])).result(2)
            with pytest.raises(UnknownOperationError):  # no route: rejected before any
                client.request_async(m.ClearRequest()).result(2)
    finally:
        srv.stop(1.0)
    assert [(op, code) for op, _, code in observed] == [(RequestType.PING, ""),
                                                         (RequestType.STORE, "not_registered")]
    assert all(0 < seconds < 1 for _, seconds, _ in observed)
    assert {code: n for code, n in srv.counters.errors_by_code.items() if n} == {
        "not_registered": 1, "unknown_op": 1}
    assert srv.counters.errors == 2


def test_pins_show_in_the_metrics(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, {"server": {"pool_size": 4 * CHUNK_BYTES,
                                              "max_pinned": CHUNK_BYTES}}).start()
    worker = WorkerProcess(srv.url)
    try:
        base = srv.http_url()
        before = scrape(base)
        assert value(before, "lmcache_pinned_chunks") == 0
        worker("fill", blocks=blocks(0, 4), seed=7)
        reply = worker("store", req="p", keys=tokens(2, seed=8), blocks=blocks(0, 2), pin=True)
        assert reply["finished"] and reply["pin_refused"] == 1  # the second would pass max_pinned
        after = scrape(base)
    finally:
        worker.close()
        srv.kill()
    assert value(after, "lmcache_pinned_chunks") == 1
    assert value(after, "lmcache_pinned_bytes") == CHUNK_BYTES
    assert delta(after, before, "lmcache_store_pin_refused_chunks_total") == 1


def test_kv_events_show_in_the_metrics_and_server_info(tmp_path: Path) -> None:
    """The publisher's counters (batches, keys dropped from a full queue, replays) were kept but
    shown nowhere; an operator sees them in /metrics and SERVER_INFO (``lmcache stats``)."""
    srv = ServerProcess(tmp_path, {"server": {"events_url": f"ipc://{tmp_path}/ev.sock"}}).start()
    worker = WorkerProcess(srv.url)
    try:
        base = srv.http_url()
        assert value(scrape(base), "lmcache_kv_events_batches_total") == 0
        worker("fill", blocks=blocks(0, 1), seed=3)
        assert worker("store", req="e", keys=tokens(1, seed=4), blocks=blocks(0, 1))["finished"]
        wait_until(lambda: value(scrape(base), "lmcache_kv_events_batches_total") >= 1)
        samples = scrape(base)
        with MessageQueueClient(srv.url) as client:
            stats = client.server_info().stats
    finally:
        worker.close()
        srv.kill()
    assert value(samples, "lmcache_kv_events_dropped_total") == 0
    assert value(samples, "lmcache_kv_events_pending") == 0
    assert stats.events.batches >= 1 and stats.events.dropped == 0


# ---------------------------------------------------------------- every figure of the schema


#: Frames each answered with an error (5, of three codes): the errors the schema test drives.
BAD_FRAMES = [
    [b"\x01", msgspec.msgpack.encode("lmc.nope"), b"\x80"],  # unknown_op
    [b"\x02", msgspec.msgpack.encode("lmc.lookup"), b"\xc1"],  # bad_request: no msgpack
    [b"\x03", msgspec.msgpack.encode("lmc.lookup"), msgspec.msgpack.encode([1, 2])],  # bad_request
    [b"\x04", msgspec.msgpack.encode("lmc.ping")],  # bad_request: two frames
    [b"\x05", msgspec.msgpack.encode("lmc.store"), msgspec.msgpack.encode(
        {"instance_id": 987654321, "chunk_hashes": [b"h" * 32], "block_ids": [0, 1, 2, 3]})],
]


@pytest.mark.redis
def test_every_field_of_every_stats_section_is_in_server_info_lmcache_stats_and_metrics(
        tmp_path: Path, make_redis: Callable[..., RedisServer],
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess]) -> None:
    """A figure is declared once (``lmcache_core.stats``); this walks the schema, so a field added
    to any section is checked here with no other edit: SERVER_INFO sends it, ``lmcache stats
    --json`` prints it by its flat name, ``/metrics`` has its family (and its label's sample). A
    figure that is the total of another family (``total_of``) is driven to a value no other
    family has (5 error replies, 3 KV caches of two engines), so one declared the total of the
    wrong family fails here rather than passing with 0 == 0."""
    from lmcache_core.server.metrics import LABELLED
    from lmcache_core.stats import declared, flat, sections

    redis_server = make_redis()
    srv = make_server({
        "disk": {"path": str(tmp_path / "disk"), "max_size": "64MiB", "write_through": True},
        "remote": {"url": redis_server.url},
        # 1 MiB slabs: 8, 7 of them free (4 MiB ones: 3 free, as many as the KV caches)
        "server": {"events_url": f"ipc://{tmp_path}/ev.sock", "slab_size": "1MiB"}})
    worker = make_worker(srv.url)
    for rank in range(2):  # another engine: TP=2 of another model
        make_worker(srv.url, model="other", rank=rank, world_size=2)
    worker("fill", blocks=blocks(0, 2), seed=6)
    assert worker("store", req="w", keys=tokens(2, seed=9), blocks=blocks(0, 2))["finished"]
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect(srv.url)
    try:
        for frames in BAD_FRAMES:
            raw.send_multipart(frames)
            assert msgspec.msgpack.decode(raw.recv_multipart()[2], type=m.ErrorReply).code
    finally:
        raw.close(0)
    with MessageQueueClient(srv.url) as client:
        wait_until(lambda: value(scrape(srv.http_url()), "lmcache_tier_written_chunks_total",
                                 tier="disk") == 2)
        info = client.server_info()
    samples = scrape(srv.http_url())
    printed = cli("stats", "--url", srv.url, "--json")
    assert printed.code == 0, printed.err
    counters = printed.json()["counters"]
    assert value(samples, "lmcache_stores_total") == info.stats.engine.stores == 1
    assert (info.stats.transport.errors, info.stats.workers.registered_instances) == (5, 3)
    # Every family a total could name, and the sum of its samples.
    families = {figure.family for _, struct in sections() for figure in declared(struct)}
    families |= {f"lmcache_{name}" for name, family in LABELLED.items() if family.kind != "histogram"}
    sums = {family: sum(v for (sample, _), v in samples.items() if sample == family)
            for family in families}
    checked = 0
    for name, struct in sections():
        section = getattr(info.stats, name)
        assert isinstance(section, struct), name  # every component configured: every section sent
        assert set(flat(section)) <= set(counters), name
        for figure in declared(struct):
            checked += 1
            family = {labels: v for (sample, labels), v in samples.items() if sample == figure.family}
            assert family, f"stats.{name}.{figure.field}: no {figure.family} in /metrics"
            field = getattr(section, figure.field)
            if figure.tier:
                assert frozenset({("tier", struct.tier)}) in family, figure
            elif figure.label:
                assert {frozenset({(figure.label, key)}) for key in field} <= set(family), figure
            elif figure.total_of:
                assert field > 0 and sum(family.values()) == field, figure  # its family's sum
                # ... and no other family's: a total of the wrong family cannot match by chance
                assert sorted(f for f, total in sums.items() if total == field) == [figure.family], (
                    figure, sums)
            else:
                assert frozenset() in family, figure
    assert checked == sum(len(declared(struct)) for _, struct in sections()) > 60
