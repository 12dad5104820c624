"""Run one vLLM engine (in-process, CPU) through a list of steps; write what it generated as JSON.

Usage: python scripts/bench/engine_runner.py SPEC.json OUT.json

Run as its own process per engine (vLLM keeps process-global state). SPEC:
``{"model": dir, "connector": {"url": ..., "extra": {...}} | null, "prefix_caching": bool,
"kv_connector": {"name": ..., "extra": {...}} | null (another connector, by vLLM's name),
"num_blocks": int | null, "max_model_len": int | null, "llm_args": {...} (more ``LLM`` keyword
arguments, e.g. ``mamba_cache_mode``), "trace_loads": bool (record the worker's
``get_transfer_results`` calls made with a load in flight, in ``load_trace``), "server_pid": int | null,
"server_url": str | null, "steps": [...]}`` where a step is one of

- ``{"op": "generate", "name", "prompts": [[ids]], "max_tokens", "salt"?, "kill_server_after_s"?,
  "kv_transfer_params"?, "logprobs"?}`` (greedy; records tokens, num_cached_tokens and wall time,
  and with ``logprobs: k`` each position's top ``k`` as ``[[token, logprob], ...]``; optionally
  SIGKILLs the server from a timer while the batch runs; ``kv_transfer_params`` go to every
  request of the step, e.g. ``{"lmcache.pin": true}``);
- ``{"op": "ttft", "name", "prompts": [[ids]], "salt"?, "flush_mib"?}``: one prompt at a time, one
  output token, wall time each (the time to first token of an in-process engine); a name used
  again adds to that name's samples; ``flush_mib``: before each prompt (untimed), read and write
  a buffer of that many MiB, so the prompt starts with the CPU's caches cold (a benchmark's KV of
  a few MiB otherwise stays in L3 from the step before, which no real prefix hit gets);
- ``{"op": "reset_prefix_cache"}``: empty vLLM's own prefix cache (not the connector's server);
- ``{"op": "stats", "name"}``: the server's counters;
- ``{"op": "pause", "s"}``: wait (a benchmark lets background stores finish between rounds);
- ``{"op": "fault", "kind": "corrupt_loads" | "drop_window" | "drop_window_tail" | null}``: make
  every load ask for a chunk the server does not have (so it fails and vLLM must recompute); or
  store a hybrid model's chunks without their sliding-window (or chunked-local) pieces
  (``drop_window``: every chunk's; ``drop_window_tail``: each store's last chunk's), as if the
  server had evicted those pieces while the full-attention ones remain; or stop doing so;
- ``{"op": "restart_server", "name"}``: SIGTERM the server (``server_pid``), start ``lmcache serve
  -c <server_config>`` again (same url, log appended to ``server_log``), and wait until this
  engine's worker has registered with it again by itself; records the time that took and this
  process's shared-memory names before and after. The runner stops that server when it ends.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CONNECTOR_MODULE = "lmcache_core.integration.vllm.lmcache_connector"
FAULTS: dict[str, Any] = {"kind": None, "corrupted": 0, "windows_dropped": 0}
#: The worker's get_transfer_results calls made while a load was in flight (``trace_loads``).
LOAD_TRACE: list[dict[str, Any]] = []
RESTARTED: list[subprocess.Popen[bytes]] = []  # servers this runner started (stopped at its end)


def _install_fault_hook() -> None:
    """Wrap the connector's build_connector_meta so a test can make loads fail on purpose."""
    from lmcache_core.integration.vllm import lmcache_connector as lc

    original = lc.LMCacheConnector.build_connector_meta

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        meta = original(self, scheduler_output)
        if FAULTS["kind"] == "corrupt_loads":
            for spec in meta.loads:
                if spec.chunk_hashes:
                    spec.chunk_hashes[-1] = os.urandom(32)  # a chunk the server never saw
                    FAULTS["corrupted"] += 1
        elif FAULTS["kind"] in ("drop_window", "drop_window_tail"):
            for spec in meta.stores:
                _drop_window_pieces(self, spec, tail_only=FAULTS["kind"] == "drop_window_tail")
        return meta

    lc.LMCacheConnector.build_connector_meta = build_connector_meta  # type: ignore[method-assign]


def _install_load_trace() -> None:
    """Record each worker-side ``get_transfer_results`` made with a load in flight: whether the
    step computed nothing (metadata ``idle``), whether it waited (``wait_for_retrieves`` calls),
    how long it took and whether it reported a load."""
    from lmcache_core.integration.vllm import lmcache_connector as lc
    from lmcache_core.integration.vllm import vllm_multi_process_adapter as vma

    waits = [0]
    original_wait = vma.LMCacheMPWorkerAdapter.wait_for_retrieves

    def wait_for_retrieves(self: Any, timeout_s: float) -> bool:
        waits[0] += 1
        return original_wait(self, timeout_s)

    original = lc.LMCacheConnector.get_transfer_results

    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        in_flight = self._worker is not None and bool(self._worker._retrieves)
        idle = bool(getattr(self._connector_metadata, "idle", False))
        waits[0] = 0
        start = time.perf_counter()
        out = original(self, finished_req_ids)
        if in_flight:
            LOAD_TRACE.append({"idle": idle, "waits": waits[0],
                               "took_s": time.perf_counter() - start,
                               "reported": sorted(out.finished_recving)})
        return out

    vma.LMCacheMPWorkerAdapter.wait_for_retrieves = wait_for_retrieves  # type: ignore[method-assign]
    lc.LMCacheConnector.get_transfer_results = get_transfer_results  # type: ignore[method-assign]


def _drop_window_pieces(connector: Any, spec: Any, tail_only: bool) -> None:
    """Null the sliding (and chunked-local) groups' block ids of a store's chunks (all, or its
    last one): the adapter skips a group's chunk whose ids hold the null block, so only the other
    groups' pieces land."""
    if spec.group_block_ids is None or not spec.chunk_hashes:
        return
    for group, ids in zip(connector._groups, spec.group_block_ids, strict=True):
        if group.kind in ("sliding", "local"):
            first = len(ids) - len(ids) // len(spec.chunk_hashes) if tail_only else 0
            ids[first:] = [0] * (len(ids) - first)
            FAULTS["windows_dropped"] += 1


def _server_stats(url: str) -> dict[str, Any]:
    """The server's figures by their flat names (as ``lmcache stats --json`` gives them)."""
    from lmcache_core.stats import flat_all
    from lmcache_core.transport.client import MessageQueueClient

    with MessageQueueClient(url, connect_timeout_s=2.0) as client:
        reply = client.server_info(timeout_s=5.0)
    return flat_all(reply.stats)


def _wait_until(done: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``done`` until it holds (seconds it took); TimeoutError naming ``what`` after timeout_s."""
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what} within {timeout_s}s")
        time.sleep(0.05)
    return time.monotonic() - start


def _exited(pid: int) -> bool:
    """Gone, or a zombie (the old server is the test's child, which waits for it only later).
    Reaped between the open and the read, the read raises ProcessLookupError: gone too."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _own_segments() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("lmcache-")
                  and f"-{os.getpid()}-" in n)


def _restart_server(spec: dict[str, Any]) -> dict[str, Any]:
    from lmcache_core.transport.client import MessageQueueClient

    before = _own_segments()
    os.kill(spec["server_pid"], signal.SIGTERM)
    _wait_until(lambda: _exited(spec["server_pid"]), 20, "the server did not stop")
    with open(spec["server_log"], "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache_cli", "serve", "-c",
                                 spec["server_config"]], stdout=log, stderr=subprocess.STDOUT)
    RESTARTED.append(proc)
    with MessageQueueClient(spec["server_url"], connect_timeout_s=30.0) as client:
        client.wait_until_reachable(30.0)
    took = _wait_until(lambda: _server_stats(spec["server_url"])["registered_instances"] >= 1, 30,
                       "the worker did not register again")
    return {"server_pid": proc.pid, "reregistered_s": took, "segments_before": before,
            "segments_after": _own_segments()}


def _stop_restarted() -> list[int | None]:
    for proc in RESTARTED:
        proc.send_signal(signal.SIGTERM)
    codes = []
    for proc in RESTARTED:
        try:
            codes.append(proc.wait(15))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(None)
    return codes


def _kill(pid: int, start: float, killed_at: list[float]) -> None:
    os.kill(pid, signal.SIGKILL)
    killed_at.append(time.perf_counter() - start)


def flush_cpu_caches(mib: int) -> None:
    """Read and write ``mib`` MiB (a few times the last-level cache), evicting what the caches
    held: the KV the step before touched among it. On this thread alone (numpy, not torch): a
    torch op would wake the engine's OpenMP team, whose threads then spin for milliseconds
    after it (libgomp's default wait policy), taking a core from whatever runs next."""
    if mib > 0:
        import numpy as np

        buffer = _flush_buffer(mib)
        np.add(buffer, 1, out=buffer)


@functools.cache
def _flush_buffer(mib: int) -> Any:
    """The buffer ``flush_cpu_caches`` walks, made once per size."""
    import numpy as np

    return np.zeros(mib << 20, dtype=np.uint8)


def reset_prefix_cache(llm: Any) -> None:
    """Empty vLLM's prefix cache. Blocks of finished requests whose stores were in flight stay
    held until an engine step sees the stores done, and a reset fails while any block is held:
    so a one-token request drives steps until it succeeds (at most 50)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for _ in range(50):
        if llm.reset_prefix_cache():
            return
        llm.generate([TokensPrompt(prompt_token_ids=[3])],
                     SamplingParams(temperature=0.0, max_tokens=1, detokenize=False),
                     use_tqdm=False)
    raise RuntimeError("vLLM did not reset its prefix cache: its blocks stayed held")


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    out: dict[str, Any] = {"results": {}, "stats": {}, "faults": FAULTS}
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv_config = None
    if spec.get("kv_connector"):  # another connector by name (vLLM's LMCacheMPConnector, ...)
        kv_config = KVTransferConfig(kv_connector=spec["kv_connector"]["name"], kv_role="kv_both",
                                     kv_connector_extra_config=spec["kv_connector"]["extra"])
    elif spec.get("connector"):
        _install_fault_hook()
        if spec.get("trace_loads"):
            _install_load_trace()
            out["load_trace"] = LOAD_TRACE
        kv_config = KVTransferConfig(
            kv_connector="LMCacheConnector", kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"url": spec["connector"]["url"],
                                       **spec["connector"].get("extra", {})})
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=spec.get("max_model_len", 4096),
              enable_prefix_caching=bool(spec.get("prefix_caching")),
              num_gpu_blocks_override=spec.get("num_blocks"), kv_transfer_config=kv_config, seed=0,
              **spec.get("llm_args", {}))
    out["startup_s"] = time.perf_counter() - t0
    # The KV cache groups, where the engine core runs in this process (an engine core of its
    # own, VLLM_ENABLE_V1_MULTIPROCESSING=1 as LMCache's connector needs, keeps them there).
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is not None:
        out["kv_cache_groups"] = [type(g.kv_cache_spec).__name__
                                  for g in core.scheduler.kv_cache_config.kv_cache_groups]

    def prompts(step: dict[str, Any]) -> list[Any]:
        extra = {"cache_salt": step["salt"]} if step.get("salt") else {}
        return [TokensPrompt(prompt_token_ids=list(p), **extra) for p in step["prompts"]]

    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            kv_params = step.get("kv_transfer_params")
            params = SamplingParams(temperature=0.0, max_tokens=step["max_tokens"],
                                    ignore_eos=True, detokenize=False,
                                    logprobs=step.get("logprobs"),
                                    extra_args=({"kv_transfer_params": dict(kv_params)}
                                                if kv_params else None))
            timer = None
            killed_at: list[float] = []
            start = time.perf_counter()
            if step.get("kill_server_after_s") is not None and spec.get("server_pid"):
                timer = threading.Timer(step["kill_server_after_s"], _kill,
                                        (spec["server_pid"], start, killed_at))
                timer.start()
            outputs = llm.generate(prompts(step), params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if timer is not None:
                timer.join()
            out["results"][step["name"]] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "cached": [o.num_cached_tokens for o in outputs],
                "elapsed_s": elapsed,
                "killed_at_s": killed_at[0] if killed_at else None,
            }
            if step.get("logprobs"):
                out["results"][step["name"]]["logprobs"] = [
                    [sorted(([t, lp.logprob] for t, lp in position.items()),
                            key=lambda pair: -pair[1]) for position in o.outputs[0].logprobs or []]
                    for o in outputs]
        elif op == "ttft":
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                    detokenize=False)
            got = out["results"].setdefault(step["name"], {"ttft_s": [], "tokens": [], "cached": []})
            for prompt in prompts(step):
                flush_cpu_caches(int(step.get("flush_mib", 0)))
                start = time.perf_counter()
                (output,) = llm.generate([prompt], params, use_tqdm=False)
                got["ttft_s"].append(time.perf_counter() - start)
                got["tokens"].append(list(output.outputs[0].token_ids))
                got["cached"].append(output.num_cached_tokens)
        elif op == "reset_prefix_cache":
            reset_prefix_cache(llm)
        elif op == "pause":  # let a connector's background stores finish (benchmarks)
            time.sleep(step["s"])
        elif op == "stats":
            out["stats"][step["name"]] = _server_stats(spec["server_url"])
        elif op == "fault":
            FAULTS["kind"] = step["kind"]
        elif op == "restart_server":
            out["results"][step["name"]] = _restart_server(spec)
        else:
            raise ValueError(f"unknown step {op!r}")
        with open(out_path, "w") as f:  # partial results survive a later crash
            json.dump(out, f)

    # Shut the engine down (the connector unregisters); never hang the test on it.
    watchdog = threading.Timer(60.0, os._exit, (3,))
    watchdog.daemon = True
    watchdog.start()
    t1 = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()  # the worker's and the scheduler's connectors too
    out["shutdown_s"] = time.perf_counter() - t1
    out["restarted_server_exits"] = _stop_restarted()
    out["segments_at_end"] = _own_segments()
    with open(out_path, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown of vLLM's threads


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
