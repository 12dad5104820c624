"""``scripts/bench/server_trace.py``: a real server run through it serves as ``lmcache serve`` does
and writes every request, handler and copy to its trace (the file ``profile_hit --server-trace``
reads), with times on the clock of the process that asked. The tool runs as a process; the trace
is read here by its documented format, ``EVENT START END THREAD CPU QUEUED DETAIL``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from tests.integration.servers import TINY, ServerProcess, WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
CHUNK = TINY["chunk_size"]


class TracedServer(ServerProcess):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, name="traced")
        self.trace = tmp / "server.trace"

    def command(self) -> list[str]:
        return [str(ROOT / "scripts" / "bench" / "server_trace.py"), str(self.trace), "serve", "-c",
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
    events = [line.split(" ", 6) for line in lines]
    assert all(len(fields) == 7 for fields in events), lines
    # one clock for both processes: every event lies between this test's start and now
    now = time.perf_counter()
    assert all(started <= float(start) <= float(end) <= now for _, start, end, *_ in events)
    scatter = next(fields for fields in events if fields[0] == "scatter")
    _, _, _, thread, cpu, queued, chunks = scatter
    assert int(thread) > 0 and float(cpu) >= 0 and int(chunks) >= 1, scatter
    assert float(queued) >= 0 or queued == "nan", scatter  # nan: a kernel without schedstat
