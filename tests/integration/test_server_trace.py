"""``scripts/server_trace.py``: a real server run through it serves as ``lmcache serve`` does and
writes every request, handler and copy to its trace (the tool ``profile_hit --server-trace``
reads), with times on the clock of the process that asked."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from scripts import server_trace
from tests.integration.servers import TINY, ServerProcess, WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
CHUNK = TINY["chunk_size"]


class TracedServer(ServerProcess):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, name="traced")
        self.trace = tmp / "server.trace"

    def command(self) -> list[str]:
        return [str(ROOT / "scripts" / "server_trace.py"), str(self.trace), "serve", "-c",
                str(self.config_path)]


def test_a_traced_server_serves_and_traces_each_request_and_copy(
        tmp_path: Path, make_worker: Callable[..., WorkerProcess]) -> None:
    server = TracedServer(tmp_path)
    started = time.perf_counter()
    try:
        server.start()
        worker = make_worker(server.url)
        blocks = list(range(2 * CHUNK // 16))  # 2 chunks of the worker's 16-token blocks
        keys = [(31 * i) % 32000 for i in range(2 * CHUNK)]
        worker("fill", blocks=blocks, seed=5)
        stored = worker("digest", blocks=blocks)["digest"]
        assert worker("store", req="s", keys=keys, blocks=blocks)["finished"]
        worker("zero", blocks=blocks)
        result = worker("retrieve", req="r", keys=keys, blocks=blocks)
        assert result["finished"] and not result["failed"], result
        assert worker("digest", blocks=blocks)["digest"] == stored
        assert server.stop() == 0
    finally:
        server.kill()
    lines = server.trace.read_text().splitlines()
    kinds = Counter(line.split()[0] for line in lines)
    assert kinds["store"] >= 1 and kinds["retrieve"] >= 1 and kinds["scatter"] >= 1, kinds
    assert kinds["dispatch"] >= kinds["store"] + kinds["retrieve"] and kinds["send"] >= 1, kinds
    tail = server_trace.TraceTail(server.trace)
    events = tail.new_events()
    assert len(events) == len(lines)
    assert tail.new_events() == []  # read once: only lines written since come next
    # one clock for both processes: every event lies between this test's start and now
    assert all(started <= start <= time.perf_counter() for start, _ in events)
    scatter = next(text for _, text in events if text.startswith("server scatter"))
    assert "ms cpu" in scatter and "queued" in scatter and "thread" in scatter, scatter
