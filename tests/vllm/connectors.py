"""The connector's scheduler side without a server or an engine: ``FakeSchedulerAdapter`` in the
place of the server's adapter (records lookups, answers what a test says), and stand-ins for the
vLLM objects the connector is handed (configs, requests, block lists, scheduler outputs). Needs
vLLM importable (tests/vllm/conftest.py)."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from lmcache_core.integration.vllm import lmcache_connector as lc
from tests.harness import FakeClock

CHUNK, BLOCK = 256, 128
BPC = CHUNK // BLOCK


class FakeSchedulerAdapter:
    """Stands in for LMCacheMPSchedulerAdapter: records lookups, answers what a test says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.chunk_size = CHUNK
        self.lookups: dict[str, list[bytes]] = {}
        self.answers: dict[str, int | None] = {}
        self.freed: list[str] = []
        self.ended: list[str] = []
        self.computed: dict[str, int] = {}  # num_computed_tokens each check passed
        self.kwargs = kwargs
        # What a wait for an answer finds: answers that come in during it, and how long it takes
        # (on the connector's wait clock, a FakeClock the test installs).
        self.arriving: dict[str, int] = {}
        self.waits: list[tuple[str, float]] = []
        self.wait_takes_s = 0.0
        self.clock: FakeClock | None = None

    def num_blocks_per_chunk(self) -> int:
        return BPC

    def maybe_submit_lookup_request(self, request_id: str, block_hashes: list[bytes]) -> None:
        self.lookups.setdefault(request_id, list(block_hashes[BPC - 1::BPC]))

    def check_lookup_result(self, request_id: str, num_computed_tokens: int = 0) -> int | None:
        self.computed[request_id] = num_computed_tokens
        return self.answers.get(request_id)

    def wait_lookup_result(self, request_id: str, timeout_s: float) -> bool:
        self.waits.append((request_id, timeout_s))
        if request_id in self.arriving:
            self.answers[request_id] = self.arriving.pop(request_id)
            return True
        if self.clock is not None:
            self.clock.advance(min(self.wait_takes_s, timeout_s))
        return False

    def cleanup_lookup_result(self, request_id: str) -> None:
        self.lookups.pop(request_id, None)

    def free_lookup_locks(self, request_id: str) -> None:
        self.freed.append(request_id)

    def end_session(self, request_id: str) -> None:
        self.ended.append(request_id)

    def close(self) -> None:
        pass


def vllm_configs(groups: list[Any] | None = None) -> tuple[Any, Any]:
    """vLLM's config and KV cache config as the connector reads them (one full-attention group
    unless ``groups``)."""
    kv = SimpleNamespace(kv_connector_extra_config={"url": "tcp://127.0.0.1:1"},
                         kv_load_failure_policy="fail", is_kv_producer=True)
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv,
        model_config=SimpleNamespace(model="tiny", use_mla=False),
        parallel_config=SimpleNamespace(world_size=1, rank=0, tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK),
        device_config=SimpleNamespace(device_type="cpu"))
    spec = SimpleNamespace(kv_cache_spec=type("FullAttentionSpec", (), {})())
    kv_cache_config = SimpleNamespace(kv_cache_groups=groups if groups is not None else [spec],
                                      kv_cache_tensors=[])
    return vllm_config, kv_cache_config


def vllm_request(rid: str, tokens: list[int], **extra: Any) -> Any:
    return SimpleNamespace(request_id=rid, all_token_ids=list(tokens), status=RequestStatus.WAITING,
                           num_prompt_tokens=len(tokens), cache_salt=None, lora_request=None,
                           mm_features=[], prompt_embeds=None, **extra)


def allocated_blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def scheduler_output(new: Sequence[tuple[str, list[int], int]] = (),
            scheduled: dict[str, int] | None = None,
            cached: Sequence[tuple[str, list[int] | None, int]] = (),
            resumed: AbstractSet[str] = frozenset(), preempted: set[str] | None = None) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                            for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed),
            new_block_ids=[(b,) if b is not None else None for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=scheduled or {}, preempted_req_ids=preempted)


TOKENS = list(range(3, 3 + 1000))  # 3 whole chunks and a tail


def scheduler_connector(monkeypatch: pytest.MonkeyPatch, groups: list[Any] | None = None,
                        **extra_config: Any) -> Any:
    """The connector's scheduler side on a ``FakeSchedulerAdapter`` (``extra_config``: its
    ``kv_connector_extra_config`` beyond the url)."""
    monkeypatch.setattr(lc, "LMCacheMPSchedulerAdapter", FakeSchedulerAdapter)
    vllm_config, kv_cache_config = vllm_configs(groups)
    vllm_config.kv_transfer_config.kv_connector_extra_config.update(extra_config)
    return lc.LMCacheConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
