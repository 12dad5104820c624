"""The connector's CUDA events (issue 16, findings 1 and 8), with fake events and a fake adapter.

Needs vLLM importable (the connector subclasses its base) but no GPU: ``torch.cuda.Event`` and
``current_stream`` are replaced. Each store/retrieve gets its own event, recorded on the KV
device's current stream, and the connector keeps it until the server answered (the adapter keeps
only the handle bytes, so without that the event would be destroyed before the server opens it).
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_core.integration.vllm import lmcache_connector as lc
from lmcache_core.transport.future import MessagingFuture

BPC = 2


class FakeEvent:
    made: list[weakref.ref[FakeEvent]] = []

    def __init__(self, interprocess: bool = False) -> None:
        assert interprocess
        self.recorded_on: list[Any] = []
        FakeEvent.made.append(weakref.ref(self))

    def record(self, stream: Any = None) -> None:
        self.recorded_on.append(stream)


class FakeWorker:
    """Stands in for LMCacheMPWorkerAdapter: keeps only the futures, like the real one keeps only
    the handle bytes (never the event)."""

    def __init__(self) -> None:
        self.stores: dict[str, list[MessagingFuture[Any]]] = {}
        self.retrieves: dict[str, list[MessagingFuture[Any]]] = {}
        self.streams: list[Any] = []

    def _submit(self, book: dict[str, list[MessagingFuture[Any]]], ids: list[str],
                event: Any) -> None:
        self.streams.append(event.recorded_on[-1])
        future: MessagingFuture[Any] = MessagingFuture()
        for rid in ids:
            book.setdefault(rid, []).append(future)

    def batched_submit_store_requests(self, ids: list[str], ops: Any, event: Any) -> None:
        self._submit(self.stores, ids, event)

    def batched_submit_retrieve_requests(self, ids: list[str], ops: Any, event: Any) -> None:
        self._submit(self.retrieves, ids, event)

    def store_futures(self, rid: str) -> list[MessagingFuture[Any]]:
        return list(self.stores.get(rid, []))

    def retrieve_futures(self, rid: str) -> list[MessagingFuture[Any]]:
        return list(self.retrieves.get(rid, []))

    def answer_all(self) -> None:
        for book in (self.stores, self.retrieves):
            for futures in book.values():
                for f in futures:
                    if not f.query():
                        f.set_result("ok")

    def get_finished(self, finished: set[str]) -> tuple[None, None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch) -> Any:
    FakeEvent.made.clear()
    monkeypatch.setattr(lc.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(lc.torch.cuda, "current_stream", lambda device=None: ("stream", device))
    kv = SimpleNamespace(kv_connector_extra_config={"url": "tcp://127.0.0.1:1"},
                         kv_load_failure_policy="recompute", is_kv_producer=True)
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv, model_config=SimpleNamespace(model="tiny", use_mla=False),
        parallel_config=SimpleNamespace(world_size=1, rank=0, tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16),
        device_config=SimpleNamespace(device_type="cuda"))
    connector = lc.LMCacheConnector(vllm_config, KVConnectorRole.WORKER, None)
    connector._worker = FakeWorker()  # type: ignore[assignment]
    connector._views = SimpleNamespace(blocks_per_vllm_block=1)  # type: ignore[assignment]
    connector._bpc = BPC
    connector._kv_device = torch.device("cuda", 1)  # not the current device: named explicitly
    return connector


def _meta(stores: tuple[str, ...] = (), loads: tuple[str, ...] = ()) -> Any:
    meta = lc.LMCacheConnectorMetadata()
    meta.stores = [lc.TransferSpec(r, [b"h" * 32], list(range(BPC))) for r in stores]
    meta.loads = [lc.TransferSpec(r, [b"h" * 32], list(range(BPC))) for r in loads]
    return meta


def _live_events() -> int:
    gc.collect()
    return sum(1 for ref in FakeEvent.made if ref() is not None)


def test_store_event_lives_until_answered_and_is_recorded_on_the_kv_stream(conn: Any) -> None:
    conn.bind_connector_metadata(_meta(stores=("a",)))
    conn.wait_for_save()
    assert conn._worker.streams == [("stream", torch.device("cuda", 1))]
    assert _live_events() == 1 and len(conn._events) == 1  # only the connector holds it
    conn.get_finished(set())
    assert len(conn._events) == 1  # no reply yet: still held
    conn._worker.answer_all()
    conn.get_finished(set())
    assert len(conn._events) == 0


def test_each_step_gets_its_own_event_while_earlier_ones_are_pending(conn: Any) -> None:
    for step in range(3):
        conn.bind_connector_metadata(_meta(stores=(f"s{step}",), loads=(f"l{step}",)))
        conn.start_load_kv(SimpleNamespace())
        conn.wait_for_save()
    assert _live_events() == 6  # never one shared event re-recorded under a pending wait
    events = [e for ref in FakeEvent.made if (e := ref()) is not None]
    assert all(len(e.recorded_on) == 1 for e in events)
    conn._worker.answer_all()
    conn.get_finished(set())
    conn.bind_connector_metadata(_meta(stores=("again",)))
    conn.wait_for_save()
    assert len(FakeEvent.made) == 6  # an answered event is reused
    assert len(conn._events) == 1


def test_cpu_workers_send_no_event(conn: Any) -> None:
    conn._device_type = "cpu"
    conn.bind_connector_metadata(_meta(stores=("a",)))
    conn._worker.batched_submit_store_requests = lambda ids, ops, event: setattr(
        conn, "_sent_event", event)
    conn.wait_for_save()
    assert conn._sent_event is None and not FakeEvent.made
