"""Start real ``lmcache serve`` processes for tests, and stop them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lmcache_core.errors import LMCacheError
from lmcache_core.transport.client import MessageQueueClient

TINY = {
    "model": {"name": "tiny", "num_layers": 2, "num_kv_heads": 4, "head_dim": 32, "dtype": "float16"},
    "world_size": 1,
    "chunk_size": 64,
    "server": {"pool_size": "8MiB", "workers": 2, "reap_timeout_s": 60,
               "max_keys_per_request": 1000,
               "http_url": "http://127.0.0.1:0"},  # any free port: servers run side by side
    "timeouts": {"connect_s": 2, "request_s": 10, "lookup_ms": 1000, "lock_ttl_s": 60},
}


class ServerProcess:
    """An ``lmcache serve`` child process on an ipc:// socket in a temp dir."""

    def __init__(self, tmp: Path, overrides: dict | None = None, name: str = "srv") -> None:
        config = _merge(TINY, overrides or {})
        config["server"].setdefault("url", f"ipc://{tmp}/{name}.sock")
        self.url = config["server"]["url"]
        self.config_path = tmp / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> ServerProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache_cli", "serve", "-c", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with MessageQueueClient(self.url, connect_timeout_s=0.5) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
                try:
                    client.wait_until_reachable(0.5)
                    return
                except LMCacheError:
                    continue
        raise RuntimeError(f"server did not answer within {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def http_url(self) -> str:
        """The bound url of the server's HTTP listener (/metrics, /healthz, /readyz)."""

        with MessageQueueClient(self.url, connect_timeout_s=2) as client:
            info = client.server_info()
        assert info.http_url is not None, "the server's http_url is off"
        return info.http_url

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def _merge(base: dict, extra: dict) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class WorkerProcess:
    """A ``kv_worker.py`` child: a stand-in vLLM worker driven by JSON lines."""

    def __init__(self, url: str, *, rank: int = 0, world_size: int = 1, num_blocks: int = 64,
                 block_size: int = 16, model: str = "tiny", layers: int = 2, heads: int = 4,
                 head_dim: int = 32, dtype: str = "float16", mla: bool = False) -> None:
        import json

        spec = {"url": url, "rank": rank, "world_size": world_size, "num_blocks": num_blocks,
                "block_size": block_size, "model": model, "layers": layers, "heads": heads,
                "head_dim": head_dim, "dtype": dtype, "mla": mla}
        script = Path(__file__).with_name("kv_worker.py")
        self.proc = subprocess.Popen([sys.executable, str(script), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read(30)
        if not self.hello.get("ready"):
            raise RuntimeError(f"worker failed to start: {self.hello}")

    def __call__(self, cmd: str, timeout_s: float = 30, **args: object) -> dict:
        import json

        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict:
        import json
        import selectors

        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise TimeoutError(f"worker gave no answer within {timeout_s}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.proc.wait(5)})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, TimeoutError, OSError):
                self("quit", timeout_s=10)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would; then remove the shared memory it could not (unless a server
        reaped it and did so already)."""
        self.proc.kill()
        self.proc.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{self.hello['shm_name']}")


def freeze(pid: int) -> None:
    """SIGSTOP and wait until the process really is stopped (kill() returns before that)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    stat = Path(f"/proc/{pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.001)
