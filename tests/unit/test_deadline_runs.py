"""A retrieve under a load deadline copies runs of chunks (``handlers.deadline_run``), checking
the deadline before each run: small chunks go several to a copy, a chunk of 16 MiB or more goes
alone, and once the deadline passed nothing more is copied."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_core.config import load_config
from lmcache_core.server.handlers import DEADLINE_RUN_BYTES, CacheHandlers, _Blocks, deadline_run

MIB = 1 << 20


def test_runs_hold_about_16_mib_and_never_less_than_a_chunk() -> None:
    assert DEADLINE_RUN_BYTES == 16 * MIB
    assert deadline_run(2 * MIB) == 8
    assert deadline_run(3 * MIB) == 5
    assert deadline_run(16 * MIB) == 1
    assert deadline_run(32 * MIB) == 1  # a Llama-8B chunk: alone, as before
    assert deadline_run(2 * MIB, test_delay=True) == 1  # the test delay is one per chunk
    assert deadline_run(0) == 1


class Copies:
    """``CacheHandlers._scatter`` recording the chunk positions of each copy, each copy taking
    ``copy_s`` on the handler's clock."""

    def __init__(self, clock: list[float], copy_s: float) -> None:
        self.clock, self.copy_s = clock, copy_s
        self.runs: list[list[int]] = []

    def __call__(self, reg: Any, plan: Any, positions: Any, blocks: Any) -> None:
        self.runs.append(list(positions))
        self.clock[0] += self.copy_s


def handlers_with(monkeypatch: pytest.MonkeyPatch, copies: Copies,
                  clock: list[float]) -> CacheHandlers:
    monkeypatch.setattr(CacheHandlers, "_scatter", staticmethod(copies))
    engine = SimpleNamespace(store=SimpleNamespace(), tiers=None)
    return CacheHandlers(load_config(None), engine, SimpleNamespace(),  # type: ignore[arg-type]
                         SimpleNamespace(), started=0.0,  # type: ignore[arg-type]
                         deadline_clock=lambda: clock[0])


def registration(chunk_bytes: int) -> Any:
    return SimpleNamespace(mapped=SimpleNamespace(chunk_bytes=chunk_bytes),
                           copy_stream=SimpleNamespace(synchronize=lambda timeout_s: None))


@pytest.mark.parametrize(("chunk_mib", "runs"), [
    (2, [list(range(8)), list(range(8, 16)), list(range(16, 20))]),
    (32, [[i] for i in range(20)]),
])
def test_a_far_deadline_copies_every_chunk_in_runs(
        monkeypatch: pytest.MonkeyPatch, chunk_mib: int, runs: list[list[int]]) -> None:
    clock = [0.0]
    copies = Copies(clock, 0.001)
    handlers = handlers_with(monkeypatch, copies, clock)
    plan = SimpleNamespace(found=[object()] * 20)
    blocks = _Blocks(list(range(40)), 2)
    assert handlers._scatter_until(registration(chunk_mib * MIB), plan,  # type: ignore[arg-type]
                                   blocks, deadline=10.0) == 20
    assert copies.runs == runs


def test_a_passed_deadline_stops_before_the_next_run(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    copies = Copies(clock, 0.004)  # each run takes 4 ms
    handlers = handlers_with(monkeypatch, copies, clock)
    plan = SimpleNamespace(found=[object()] * 20)
    blocks = _Blocks(list(range(40)), 2)
    # the deadline passes during the second run: that run finishes, no third one starts
    assert handlers._scatter_until(registration(2 * MIB), plan,  # type: ignore[arg-type]
                                   blocks, deadline=0.006) == 16
    assert copies.runs == [list(range(8)), list(range(8, 16))]
    clock[0] = 1.0  # a deadline already passed copies nothing
    copies.runs.clear()
    assert handlers._scatter_until(registration(2 * MIB), plan,  # type: ignore[arg-type]
                                   blocks, deadline=0.5) == 0
    assert copies.runs == []
