"""The real processes tests run beside them: ``lmcache serve`` (``FaultyServer``: one with a fault
injected, ``faulty_server.py``), a stand-in vLLM worker (``kv_worker.py``), ``redis-server`` and a
Mooncake Store master (``MooncakeMaster``). Tests get them from the factory fixtures in
``tests/conftest.py`` (``make_server``, ``module_server``, ``make_worker``, ``make_redis``,
``mooncake_master``), which stop them afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from lmcache_core.config import LMCacheConfig, load_config
from lmcache_core.errors import LMCacheError
from lmcache_core.transport.client import MessageQueueClient
from tests import forkserver
from tests.harness import wait_until

TINY = {
    "model": {"name": "tiny", "num_layers": 2, "num_kv_heads": 4, "head_dim": 32, "dtype": "float16"},
    "world_size": 1,
    "chunk_size": 64,
    "server": {"pool_size": "8MiB", "workers": 2, "reap_timeout_s": 60,
               "max_keys_per_request": 1000,
               "http_url": "http://127.0.0.1:0"},  # any free port: servers run side by side
    "timeouts": {"connect_s": 2, "request_s": 10, "lookup_ms": 1000, "lock_ttl_s": 60},
}


def tiny_config(tmp: Path, **overrides: Any) -> LMCacheConfig:
    """TINY as the config of an in-process ``CacheServer``, dotted ``overrides`` on top: its
    socket ``ipc://<tmp>/srv.sock``, its HTTP listener off unless ``server.http_url`` says."""
    tiny: dict[str, Any] = TINY
    flat: dict[str, Any] = {f"{section}.{key}": value for section in ("model", "server", "timeouts")
                            for key, value in tiny[section].items()}
    flat.update({"chunk_size": TINY["chunk_size"], "server.url": f"ipc://{tmp}/srv.sock",
                 "server.http_url": "off", **overrides})
    return load_config(overrides=flat)


class ServerProcess:
    """An ``lmcache serve`` child process on an ipc:// socket in a temp dir."""

    def __init__(self, tmp: Path, overrides: dict | None = None, name: str = "srv") -> None:
        config = _merge(TINY, overrides or {})
        config["server"].setdefault("url", f"ipc://{tmp}/{name}.sock")
        self.url = config["server"]["url"]
        self.config_path = tmp / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / f"{name}.log"
        self.proc: forkserver.Child | subprocess.Popen[str] | None = None

    def command(self) -> list[str]:
        """What the child runs (the interpreter's arguments)."""
        return ["-m", "lmcache_cli", "serve", "-c", str(self.config_path)]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "COLUMNS": "200"}

    def spawn(self) -> None:
        """Start the process, without waiting for it to answer."""
        with self.log_path.open("ab") as log:
            self.proc = forkserver.spawn(self.command(), stdout=log.fileno(),
                                         stderr=subprocess.STDOUT, env=self.environment())

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        self.spawn()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.kill()  # a server that never answered must not outlive the test
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        with MessageQueueClient(self.url, connect_timeout_s=0.5) as client:
            wait_until(lambda: self._answers(client), timeout_s,
                       lambda: f"the server did not answer:\n{self.log()}")

    def _answers(self, client: MessageQueueClient) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
        try:
            client.wait_until_reachable(0.5)
        except LMCacheError:
            return False
        return True

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


_FAULTY = Path(__file__).with_name("faulty_server.py")


class FaultyServer(ServerProcess):
    """``faulty_server.py``: ``trigger()`` arms the housekeeper's fault (it dies at the next tick),
    so the server can come up first however long that takes."""

    def __init__(self, tmp: Path, fault: str) -> None:
        super().__init__(tmp, {"server": {"workers": 1}})
        self.fault = fault
        self.trigger_path = tmp / f"{fault}.trigger"

    def trigger(self) -> None:
        self.trigger_path.touch()

    def command(self) -> list[str]:
        return [str(_FAULTY), self.fault, "serve", "-c", str(self.config_path)]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "LMCACHE_TEST_FAULT_TRIGGER": str(self.trigger_path)}

    def start(self, timeout_s: float = 120.0) -> FaultyServer:
        if self.fault == "loop":  # the loop dies on its first request: a readiness ping included
            self.spawn()
            return self
        super().start(timeout_s)
        return self

    def exit_code_within(self, timeout_s: float) -> tuple[int, float]:
        assert self.proc is not None
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the server did not exit within {timeout_s}s:\n{self.log()}")
        return code, time.monotonic() - start


def _merge(base: dict, extra: dict) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class WorkerProcess:
    """A ``kv_worker.py`` child: a stand-in vLLM worker driven by JSON lines. ``fresh``: a new
    interpreter, a child of this process (not the fork server's), e.g. to stay a zombie."""

    def __init__(self, url: str, *, rank: int = 0, world_size: int = 1, num_blocks: int = 64,
                 block_size: int = 16, model: str = "tiny", layers: int = 2, heads: int = 4,
                 head_dim: int = 32, dtype: str = "float16", mla: bool = False,
                 fresh: bool = False, script: str = "kv_worker.py", **extra: object) -> None:
        """``script``: the stand-in to run (``hybrid_worker.py`` takes ``extra``'s ``groups``
        and ``layers_per_group``)."""
        import json

        spec = {"url": url, "rank": rank, "world_size": world_size, "num_blocks": num_blocks,
                "block_size": block_size, "model": model, "layers": layers, "heads": heads,
                "head_dim": head_dim, "dtype": dtype, "mla": mla, **extra}
        script_path = Path(__file__).with_name(script)
        self.proc = forkserver.spawn([str(script_path), json.dumps(spec)], fresh=fresh,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.hello = self._read(120)
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
        for name in self.hello.get("shm_names", [self.hello["shm_name"]]):
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")


def process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (R, S, T (stopped), Z (zombie), ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def freeze(pid: int) -> None:
    """SIGSTOP and wait until the process really is stopped (kill() returns before that)."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: process_state(pid) == "T", 5, f"process {pid} did not stop")


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """``freeze`` the process for the body, then SIGCONT it, however the body ends."""
    freeze(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


# ---------------------------------------------------------------- redis-server


def _free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (port + 10000, so <= 65535)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster:
            return port
        if port + 10000 <= 65535 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a redis cluster node")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisServer:
    """One ``redis-server`` child on 127.0.0.1, a free port, a temp dir, no persistence;
    ``stop``/``start`` restart it on the same port (data lost)."""

    def __init__(self, binary: str, workdir: Path, cluster: bool = False) -> None:
        self.binary = binary
        self.workdir = workdir
        self.cluster = cluster
        self.port = _free_port(cluster)
        self.url = f"redis{'+cluster' if cluster else ''}://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no"]
        if self.cluster:  # a one-node cluster holding every slot
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        log = self.workdir / f"redis-{self.port}.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)

        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited:\n{log.read_text(errors='replace')[-2000:]}")
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                return False

        wait_until(answers, 10, lambda: f"redis-server did not start:\n"
                                        f"{log.read_text(errors='replace')[-2000:]}")
        if self.cluster:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            wait_until(lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"),
                       10, "the cluster never became ok")
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)


def redis_binary() -> str:
    """The ``redis-server`` binary; the test is skipped without one (failed when ``CI`` is set)."""
    binary = shutil.which("redis-server") or ("/usr/bin/redis-server"
                                              if os.path.exists("/usr/bin/redis-server") else None)
    if binary is None:
        message = "redis-server is not installed (scripts/setup --dev installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


# ---------------------------------------------------------------- Mooncake Store


class MooncakeMaster:
    """A ``mooncake_master`` on 127.0.0.1 (free ports) and its HTTP metadata server: Mooncake's
    standalone one (``mooncake_http_metadata_server --host 127.0.0.1``), since the master's
    co-located one listens on every interface whatever its host flag says. ``stop``/``start``
    restart the master alone, on the same port (its index lost, as a real restart loses it).
    ``client_ttl`` 2 s: a killed node's segment (and its replicas) is dropped that soon."""

    def __init__(self, binaries: tuple[str, str], workdir: Path) -> None:
        self.binary, self.metadata_binary = binaries
        self.workdir = workdir
        self.port, self.metadata_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.url = f"mooncake://127.0.0.1:{self.port}"
        self.metadata_url = f"http://127.0.0.1:{self.metadata_port}/metadata"
        self.proc: subprocess.Popen[bytes] | None = None
        self.metadata: subprocess.Popen[bytes] | None = None

    def start(self) -> MooncakeMaster:
        if self.metadata is None or self.metadata.poll() is not None:
            self.metadata = self._spawn("metadata", [
                self.metadata_binary, "--host", "127.0.0.1", "--port", str(self.metadata_port),
                "--log-level", "WARNING"])
            self._wait_listening(self.metadata, self.metadata_port, "metadata")
        self.proc = self._spawn("master", [
            self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=false", "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}", "--client_ttl=2"])
        self._wait_listening(self.proc, self.port, "master")
        return self

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.workdir / f"mooncake-{name}-{self.port}.log").open("ab") as out:
            return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def _wait_listening(self, proc: subprocess.Popen[bytes], port: int, name: str) -> None:
        log = self.workdir / f"mooncake-{name}-{self.port}.log"

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake {name} exited:\n{log.read_text(errors='replace')[-2000:]}")
            return not _bindable(port)

        wait_until(listening, 20, lambda: f"mooncake {name} did not start:\n"
                                          f"{log.read_text(errors='replace')[-2000:]}")

    def active_clients(self) -> int:
        """Nodes the master counts as alive (``master_active_clients`` of its metrics): a killed
        one until ``client_ttl`` passed, and its segment with it."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("master_active_clients "):
                return int(float(line.split()[1]))
        raise AssertionError(f"no master_active_clients in the master's metrics:\n{text[:2000]}")

    def stop(self) -> None:
        """Kill the master (the metadata server stays)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def close(self) -> None:
        self.stop()
        if self.metadata is not None and self.metadata.poll() is None:
            self.metadata.kill()
            self.metadata.wait(5)


def mooncake_binaries() -> tuple[str, str]:
    """``mooncake_master`` and ``mooncake_http_metadata_server`` (the ``mooncake`` extra's), after
    checking ``mooncake.store`` imports; the test is skipped naming what is missing (failed when
    ``CI`` is set)."""
    here = Path(sys.executable).parent
    found = [shutil.which(name) or (str(here / name) if (here / name).exists() else None)
             for name in ("mooncake_master", "mooncake_http_metadata_server")]
    problem = ""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        problem = (f"mooncake.store cannot be imported ({exc}): pip install lmcache-toolkit[mooncake] "
                   f"and, on Debian, apt-get install libibverbs1 librdmacm1 (scripts/setup --dev "
                   f"does both)")
    if not problem and None in found:
        problem = ("mooncake_master or mooncake_http_metadata_server is not installed (pip install "
                   "lmcache-toolkit[mooncake]; scripts/setup --dev installs it)")
    if problem:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    master, metadata = found
    assert master is not None and metadata is not None
    return master, metadata
