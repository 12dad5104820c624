#!/usr/bin/env python3
"""Where the time goes when ``vllm serve`` with this project's connector serves many users at once:
a timeline of a loaded run, summed up per phase.

Runs ``bench_serve.py``'s workload (its chat, then its distinct prompts: nothing to reuse) against
one ``vllm serve`` whose connector is ``TracedLMCacheConnector`` (``connector_trace.py``) and a
``lmcache serve`` started through ``server_trace.py``, both writing every call with its wall, CPU
and queued (runnable, waiting for a core) time, while a thread here pings the server every
``--ping-ms``; the processes' CPU is read from ``/proc`` at each phase's start and end. All on one
clock (``time.perf_counter``: CLOCK_MONOTONIC in every process). Then, per phase:

- **steps**: the engine's steps (``build_connector_meta`` to the next), busy or idle, their length
  and the forward pass's (``start_load_kv``'s end to ``wait_for_save``'s start);
- **lookups**: answered in the call that sent them, or how many steps later (a lookup that misses
  its step delays the request's load by that step);
- **admissions**: a request's wait from the scheduler's first look at it to its admission, and
  the length of the step that admits it (hits past vLLM's own cache apart from misses);
- **loads**: a synchronous load's wait before the forward pass; an asynchronous one's steps and
  ms from the step that sent it to the one that reported it;
- **stores**: chunks, the worker's time submitting them each step, the server's CPU per chunk;
- **server**: CPU per loaded and per stored chunk, the copy threads' and the loop's time queued
  for a core, the loop's longest dispatch;
- **pings**: the server's round trip while a copy runs there, and while none does;
- **cpu**: each process's CPU seconds and share of the run (engine core, API server, lmcache serve,
  the client), against the cores there are.

Usage (the vLLM env that scripts/test-vllm makes; bench_serve's workload options):
  ~/.cache/lmcache-vllm-venv/bin/python scripts/bench/profile_serve.py [--users 16 --turns 4]
      [--work DIR] [--json out.json]
  ... --analyse DIR        (read the traces an earlier run left in DIR, run nothing)

A measuring tool, not a benchmark: the wrappers cost tens of microseconds a call, the pings a
little of the server's loop. ``bench_serve.py`` gives the figures against vLLM alone.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from server_trace import Event, read_events  # noqa: E402  (beside this script)

PHASES = ("chat", "distinct")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- the traces


def requests(value: str | None) -> list[tuple[str, int, bool]]:
    """A ``req:chunks[:s]`` list as (request, chunks, synchronous)."""
    if not value or value == "-":
        return []
    out = []
    for item in value.split(","):
        request, chunks, *sync = item.rsplit(":", 2) if item.endswith(":s") else item.rsplit(":", 1)
        out.append((request, int(chunks), bool(sync)))
    return out


@dataclass
class Traces:
    """A run's traces: the connector's (every process's, merged), the server's, the pings, and
    the phases' windows and CPU snapshots."""

    connector: list[Event]
    server: list[Event]
    pings: list[tuple[float, float]]
    phases: dict[str, Any]

    @classmethod
    def read(cls, folder: Path) -> Traces:
        connector = [e for f in sorted(folder.glob("connector-*.trace"))
                     for e in read_events(f.read_text())]
        server_file = folder / "server.trace"
        server = read_events(server_file.read_text()) if server_file.exists() else []
        pings_file = folder / "pings.trace"
        pings = [(float(a), float(b)) for a, b in
                 (line.split() for line in pings_file.read_text().splitlines() if line.strip())
                 ] if pings_file.exists() else []
        phases = json.loads((folder / "phases.json").read_text())
        return cls(sorted(connector, key=lambda e: e.start), sorted(server, key=lambda e: e.start),
                   sorted(pings), phases)

    def window(self, phase: str) -> tuple[float, float]:
        start, end = self.phases[phase]["window"]
        return float(start), float(end)


# ---------------------------------------------------------------------- the analysis


def _pcts(values: list[float]) -> dict[str, float | int | None]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50": None, "p90": None, "max": None}
    return {"n": len(ordered), "p50": ordered[len(ordered) // 2],
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max": ordered[-1]}


def _after(events: list[Event], starts: list[float], t: float) -> Event | None:
    """The first of ``events`` (sorted by start; ``starts`` their starts) starting at or after
    ``t``."""
    i = bisect.bisect_left(starts, t)
    return events[i] if i < len(events) else None


SCHEDULER_CALLS = ("lookup", "may_load", "alloc", "meta", "finished")
WORKER_CALLS = ("bind", "start_load", "save", "results")


def steps(traces: Traces, start: float, end: float) -> dict[str, Any]:
    """Each step: from its ``build_connector_meta`` to the next; its forward pass, the worker's
    span (``bind`` to ``results``) less the connector's calls in it (the model runner calls
    ``start_load_kv`` before the forward pass only for a synchronous load); the connector's time
    in the worker's and in the scheduler's calls (those that scheduled it)."""
    metas = [e for e in traces.connector if e.name == "meta"]
    meta_ends = [e.end for e in metas]
    # the worker's calls of each step, a bind first
    rounds: list[list[Event]] = []
    for e in traces.connector:
        if e.name == "bind":
            rounds.append([e])
        elif e.name in WORKER_CALLS and rounds:
            rounds[-1].append(e)
    bind_starts = [calls[0].start for calls in rounds]
    scheduler_ms = [0.0] * len(metas)
    for e in traces.connector:
        if e.name in SCHEDULER_CALLS:  # the calls that scheduled the step of the next meta
            i = bisect.bisect_left(meta_ends, e.end)
            if i < len(metas):
                scheduler_ms[i] += e.ms
    step_ms, forward, in_worker, in_scheduler, n_busy, n_idle = [], [], [], [], 0, 0
    for i, meta in enumerate(metas):
        if not start <= meta.start < end:
            continue
        idle = meta.words.get("idle") == "1"
        n_idle += idle
        n_busy += not idle
        if idle:
            continue
        in_scheduler.append(scheduler_ms[i])
        if i + 1 < len(metas):
            step_ms.append((metas[i + 1].start - meta.start) * 1e3)
        j = bisect.bisect_left(bind_starts, meta.end)
        if j == len(rounds) or (i + 1 < len(metas) and bind_starts[j] > metas[i + 1].start):
            continue  # no worker calls of its own in the trace (vLLM steps one at a time here)
        calls = rounds[j]
        bind = calls[0]
        if calls[-1].name != "results":
            continue  # the step's calls are cut short (the end of the trace)
        connector = sum(e.ms for e in calls)
        in_worker.append(connector)
        forward.append((calls[-1].end - bind.start) * 1e3 - connector)
    return {"busy": n_busy, "idle": n_idle, "busy_step_ms": _pcts(step_ms),
            "forward_ms": _pcts(forward), "worker_connector_ms": _pcts(in_worker),
            "scheduler_connector_ms": _pcts(in_scheduler)}


def lookups(traces: Traces, start: float, end: float) -> dict[str, Any]:
    """Each request's lookup calls: answered in the one that sent it, or how many steps later."""
    metas = [e.start for e in traces.connector if e.name == "meta"]
    calls: dict[str, list[Event]] = defaultdict(list)
    for e in traces.connector:
        if e.name in ("lookup", "may_load") and start <= e.start < end:
            calls[e.words.get("req", "?")].append(e)
    in_call, later_steps, first_call_ms, hits = 0, [], [], 0
    for events in calls.values():
        answered = [e for e in events if e.name == "lookup" and e.words.get("hit") != "None"]
        first = events[0]
        first_call_ms.append(first.ms)
        if not answered:
            continue
        answer = answered[0]
        hits += answer.words.get("hit", "0") not in ("0", "None")
        if answer is first or (first.name == "may_load" and first.words.get("yes") == "1"):
            in_call += 1
        else:
            later_steps.append(bisect.bisect_left(metas, answer.start)
                               - bisect.bisect_left(metas, first.start))
    return {"requests": len(calls), "answered_in_the_call": in_call,
            "answered_later": len(later_steps), "steps_later": _pcts([float(s) for s in later_steps]),
            "first_call_ms": _pcts(first_call_ms), "with_a_hit_past_vllm": hits}


def admissions(traces: Traces, start: float, end: float) -> dict[str, Any]:
    """Each request from the scheduler's first look at it (its first lookup call) to its
    admission (``update_state_after_alloc``), and the step that admits it (its meta to the next):
    a request with a hit past vLLM's own cache (``external`` tokens) apart from one without."""
    metas = [e.start for e in traces.connector if e.name == "meta"]
    first: dict[str, Event] = {}
    out: dict[str, dict[str, list[float]]] = {"hit": defaultdict(list), "miss": defaultdict(list)}
    for e in traces.connector:
        request = e.words.get("req", "?")
        if e.name in ("lookup", "may_load"):
            first.setdefault(request, e)
        elif e.name == "alloc" and request in first and start <= first[request].start < end:
            seen = first.pop(request)
            kind = "hit" if e.words.get("external", "0") != "0" else "miss"
            out[kind]["queued_ms"].append((e.start - seen.start) * 1e3)
            i = bisect.bisect_left(metas, e.end)
            if i + 1 < len(metas):
                out[kind]["admitting_step_ms"].append((metas[i + 1] - metas[i]) * 1e3)
    return {kind: {name: _pcts(values) for name, values in figures.items()}
            for kind, figures in out.items()}


def loads(traces: Traces, start: float, end: float) -> dict[str, Any]:
    metas = [e for e in traces.connector if e.name == "meta"]
    meta_starts = [e.start for e in metas]
    results = [e for e in traces.connector if e.name == "results"]
    starts = [e for e in traces.connector if e.name == "start_load"]
    start_times = [e.start for e in starts]
    sync_wait, sync_chunks, async_steps, async_ms, n_sync, n_async = [], 0, [], [], 0, 0
    for meta in metas:
        if not start <= meta.start < end:
            continue
        sent = requests(meta.words.get("loads"))
        sync = [r for r in sent if r[2] and r[1]]
        if sync:
            n_sync += len(sync)
            sync_chunks += sum(r[1] for r in sync)
            load = _after(starts, start_times, meta.end)
            if load is not None:
                sync_wait.append(load.ms)
        for request, chunks, is_sync in sent:
            if is_sync or not chunks:
                continue
            n_async += 1
            done = next((r for r in results if r.start > meta.end
                         and request in r.words.get("recv", "").split(",")), None)
            if done is not None:
                async_ms.append((done.end - meta.start) * 1e3)
                async_steps.append(float(bisect.bisect_left(meta_starts, done.end)
                                         - bisect.bisect_left(meta_starts, meta.start)))
    return {"sync": n_sync, "sync_chunks": sync_chunks, "sync_wait_ms": _pcts(sync_wait),
            "async": n_async, "async_steps": _pcts(async_steps), "async_ms": _pcts(async_ms)}


def stores(traces: Traces, start: float, end: float) -> dict[str, Any]:
    saves = [e for e in traces.connector if e.name == "save" and start <= e.start < end
             and e.words.get("stores", "-") != "-"]
    chunks = sum(c for e in saves for _, c, _ in requests(e.words.get("stores")))
    server = [e for e in traces.server if e.name == "store" and start <= e.start < end]
    server_chunks = sum(e.size for e in server)
    return {"steps_with_stores": len(saves), "chunks": chunks,
            "submit_ms_per_step": _pcts([e.ms for e in saves]),
            "submit_cpu_ms_total": sum(e.cpu_ms for e in saves),
            "server_cpu_ms_per_chunk": (sum(e.cpu_ms for e in server) / server_chunks
                                        if server_chunks else None),
            "server_store_ms": _pcts([e.ms for e in server])}


def server(traces: Traces, start: float, end: float) -> dict[str, Any]:
    events = [e for e in traces.server if start <= e.start < end]
    loop_threads = {e.thread for e in events if e.name == "dispatch"}
    dispatch = [e for e in events if e.name == "dispatch"]
    copies = [e for e in events if e.name in ("store", "retrieve") and e.thread not in loop_threads]
    retrieve = [e for e in events if e.name == "retrieve"]
    hit_chunks = sum(e.size for e in retrieve)
    return {
        "requests": len(dispatch),
        "cpu_ms_per_loaded_chunk": (sum(e.cpu_ms for e in retrieve) / hit_chunks
                                    if hit_chunks else None),
        "retrieve_ms": _pcts([e.ms for e in retrieve]),
        "copy_threads_queued_ms_total": sum(e.queued_ms for e in copies),
        "copy_threads_queued_ms": _pcts([e.queued_ms for e in copies]),
        "loop_queued_ms": _pcts([e.queued_ms for e in dispatch]),
        "loop_dispatch_ms": _pcts([e.ms for e in dispatch]),
        "loop_cpu_ms_total": sum(e.cpu_ms for e in events if e.thread in loop_threads),
        "copy_cpu_ms_total": sum(e.cpu_ms for e in copies),
    }


def pings(traces: Traces, start: float, end: float) -> dict[str, Any]:
    copies = [(e.start, e.end) for e in traces.server if e.name in ("store", "retrieve", "scatter")]
    copy_starts = [s for s, _ in copies]
    during, quiet = [], []
    for sent, answered in traces.pings:
        if not start <= sent < end:
            continue
        # a copy overlapping [sent, answered]: one that started before the answer and ended after
        # the send (copies are short: looking back a second finds any that overlap)
        i = bisect.bisect_right(copy_starts, answered)
        j = bisect.bisect_left(copy_starts, sent - 1.0)
        busy = any(copies[k][1] > sent for k in range(j, i))
        (during if busy else quiet).append((answered - sent) * 1e3)
    return {"while_copying_ms": _pcts(during), "quiet_ms": _pcts(quiet)}


def cpu(traces: Traces, phase: str) -> dict[str, Any]:
    info = traces.phases[phase]
    start, end = traces.window(phase)
    seconds = end - start
    out: dict[str, Any] = {"wall_s": seconds, "cores": os.cpu_count()}
    for name, (before, after) in info["cpu_s"].items():
        used = after - before
        out[name] = {"cpu_s": used, "cores_busy": used / seconds if seconds else None}
    return out


def analyse(traces: Traces) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for phase in PHASES:
        if phase not in traces.phases:
            continue
        start, end = traces.window(phase)
        report[phase] = {
            "bench": traces.phases[phase].get("bench", {}),
            "steps": steps(traces, start, end), "lookups": lookups(traces, start, end),
            "admissions": admissions(traces, start, end),
            "loads": loads(traces, start, end), "stores": stores(traces, start, end),
            "server": server(traces, start, end), "pings": pings(traces, start, end),
            "cpu": cpu(traces, phase)}
    return report


def render(report: dict[str, Any]) -> None:
    def p(d: dict[str, Any]) -> str:
        if not d.get("n"):
            return "none"
        return f"p50 {d['p50']:.2f} p90 {d['p90']:.2f} max {d['max']:.2f} (n {d['n']})"

    def num(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    for phase, r in report.items():
        b = r["bench"]
        print(f"== {phase}: {b.get('summary', '')}")
        s = r["steps"]
        print(f"steps    {s['busy']} busy, {s['idle']} idle; a busy step's ms "
              f"{p(s['busy_step_ms'])}, its forward pass {p(s['forward_ms'])}, the connector's "
              f"calls in the worker {p(s['worker_connector_ms'])}, in the scheduler "
              f"{p(s['scheduler_connector_ms'])}")
        lk = r["lookups"]
        print(f"lookups  {lk['requests']} requests: {lk['answered_in_the_call']} answered in the "
              f"call that sent them, {lk['answered_later']} later (steps {p(lk['steps_later'])}); "
              f"first call ms {p(lk['first_call_ms'])}; {lk['with_a_hit_past_vllm']} hit past "
              "vLLM's own cache")
        for kind, a in r["admissions"].items():
            if a:
                print(f"admitted ({kind}) queued ms {p(a['queued_ms'])}; the admitting step's ms "
                      f"{p(a.get('admitting_step_ms', {}))}")
        ld = r["loads"]
        print(f"loads    {ld['sync']} sync ({ld['sync_chunks']} chunks), the forward's wait ms "
              f"{p(ld['sync_wait_ms'])}; {ld['async']} async: steps {p(ld['async_steps'])}, "
              f"ms {p(ld['async_ms'])}")
        st = r["stores"]
        print(f"stores   {st['chunks']} chunks in {st['steps_with_stores']} steps; the worker's "
              f"submit ms a step {p(st['submit_ms_per_step'])} (cpu "
              f"{st['submit_cpu_ms_total']:.0f} ms in all); server cpu ms a chunk "
              f"{num(st['server_cpu_ms_per_chunk'])}, a store's ms {p(st['server_store_ms'])}")
        sv = r["server"]
        print(f"server   {sv['requests']} requests; cpu ms a loaded chunk "
              f"{num(sv['cpu_ms_per_loaded_chunk'])}, a retrieve's ms {p(sv['retrieve_ms'])}; "
              f"copy threads cpu {sv['copy_cpu_ms_total']:.0f} ms, queued "
              f"{sv['copy_threads_queued_ms_total']:.0f} ms ({p(sv['copy_threads_queued_ms'])}); "
              f"loop cpu {sv['loop_cpu_ms_total']:.0f} ms, queued ms a dispatch "
              f"{p(sv['loop_queued_ms'])}, dispatch ms {p(sv['loop_dispatch_ms'])}")
        pg = r["pings"]
        print(f"pings    while copying {p(pg['while_copying_ms'])}; quiet {p(pg['quiet_ms'])}")
        c = r["cpu"]
        shares = ", ".join(f"{name} {v['cpu_s']:.1f} s ({v['cores_busy']:.2f} cores)"
                           for name, v in c.items() if isinstance(v, dict))
        print(f"cpu      {c['wall_s']:.1f} s on {c['cores']} cores: {shares}")


# ---------------------------------------------------------------------- the run


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S


def descendants(pid: int) -> dict[int, str]:
    """The processes under ``pid`` (children, their children...), each with its name."""
    parents: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.find("(") + 1:text.rfind(")")]
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        parents[ppid].append((int(stat.parent.name), name))
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child, name in parents.get(todo.pop(), []):
            found[child] = name
            todo.append(child)
    return found


def _children_cpu_s() -> float:
    times = os.times()
    return times.children_user + times.children_system


class Pinger(threading.Thread):
    """Pings the server every ``every_s`` and writes each ``sent answered`` pair (perf_counter)."""

    def __init__(self, url: str, path: Path, every_s: float) -> None:
        super().__init__(name="pinger", daemon=True)
        self.url, self.path, self.every_s = url, path, every_s
        self.stop = threading.Event()

    def run(self) -> None:
        from lmcache_core.transport.client import MessageQueueClient

        with MessageQueueClient(self.url, connect_timeout_s=10.0) as client, \
                self.path.open("a", buffering=1) as out:
            while not self.stop.wait(self.every_s):
                sent = time.perf_counter()
                try:
                    client.ping(5.0)
                except Exception:  # a ping lost is a gap in the trace, not a failed profile
                    continue
                out.write(f"{sent:.6f} {time.perf_counter():.6f}\n")


def profile(args: argparse.Namespace, work: Path) -> None:
    from bench_serve import (
        BLOCK,
        MODEL,
        SERVED,
        bench,
        cache_nice,
        chat_args,
        connector_extra,
        distinct_args,
        server_model,
    )
    from connector_trace import ENV
    from serving import LMCacheServe, VLLMServe, our_connector
    from tiny_model import tiny_llama

    model = tiny_llama(MODEL, "bench-serve-llama")
    lmcache = LMCacheServe(work, "lmcache", server_model(), args.chunk_size, args.pool,
                           nice=cache_nice(args))
    lmcache.command = [sys.executable, str(HERE / "server_trace.py"), str(work / "server.trace"),
                       *lmcache.command[3:]]  # in place of "-m lmcache_cli"
    connector = dict(our_connector(lmcache.url, **connector_extra(args)),
                     kv_connector="TracedLMCacheConnector",
                     kv_connector_module_path="connector_trace")
    os.environ[ENV] = str(work)
    engine = VLLMServe(work, "vllm", model, served_name=SERVED, kv_blocks=args.kv_blocks,
                       block_size=BLOCK, max_model_len=min(args.max_model_len,
                                                           (args.kv_blocks - 1) * BLOCK),
                       max_num_seqs=args.max_num_seqs, connector=connector, cores=args.cores,
                       pythonpath=[HERE], nice=args.nice)
    phases: dict[str, Any] = {}
    pinger = None
    try:
        lmcache.start()
        engine.start()
        bench(args, [engine.url], "--workload", "distinct", "--requests", "2", "--prompt-tokens",
              "300", "--output-tokens", "4", "--seed", str(args.seed + 10_000))  # warm-up
        pinger = Pinger(lmcache.url, work / "pings.trace", args.ping_ms / 1000)
        pinger.start()
        assert engine.proc is not None and lmcache.proc is not None
        procs = {f"vllm {name}": pid for pid, name in descendants(engine.proc.pid).items()}
        procs["vllm api server"] = engine.proc.pid
        procs["lmcache serve"] = lmcache.proc.pid
        always = {"vllm api server", "lmcache serve"}
        for phase, extra in (("chat", chat_args(args)), ("distinct", distinct_args(args))):
            if phase == "distinct" and not args.distinct:
                continue
            before = {name: process_cpu_s(pid) for name, pid in procs.items()}
            client_before = _children_cpu_s()  # bench() waits for its client, our child
            start = time.perf_counter()
            report = bench(args, [engine.url], *extra, lmcache_url=lmcache.url)
            end = time.perf_counter()
            after = {name: process_cpu_s(pid) for name, pid in procs.items()}
            # vLLM's idle helpers (resource tracker...) are left out; the two servers never are,
            # however little a short phase asked of them
            cpu_s = {name: (before[name], after[name]) for name in procs
                     if name in always or after[name] - before[name] > 0.05}
            cpu_s["client (lmcache bench serve)"] = (client_before, _children_cpu_s())
            phases[phase] = {"window": [start, end], "cpu_s": cpu_s,
                             "bench": {"summary": summary_line(report),
                                       "requests_per_s": report.get("requests_per_s")}}
            print(f"{phase}: {summary_line(report)}", flush=True)
    finally:
        if pinger is not None:
            pinger.stop.set()
            pinger.join(10)
        engine.close()
        lmcache.close()
        (work / "phases.json").write_text(json.dumps(phases, indent=1))


def summary_line(report: dict[str, Any]) -> str:
    records = [r for r in report.get("records", []) if r.get("ok")]
    reuse = sorted(r["ttft_s"] * 1e3 for r in records if r.get("turn", 0) > 0)
    first = sorted(r["ttft_s"] * 1e3 for r in records if r.get("turn", 0) == 0)

    def p50(values: list[float]) -> str:
        return f"{statistics.median(values):.0f} ms" if values else "-"

    return (f"{len(records)} requests, {report.get('failed', 0)} failed, "
            f"{report.get('requests_per_s', 0):.2f} req/s; TTFT p50 first turns {p50(first)}, "
            f"later turns {p50(reuse)}")


def main() -> int:
    from bench_serve import add_workload_options

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--analyse", type=Path, default=None, metavar="DIR",
                        help="read the traces an earlier run left in DIR; run nothing")
    add_workload_options(parser)
    parser.add_argument("--ping-ms", type=float, default=20.0)
    parser.add_argument("--work", type=Path, default=None, help="traces and logs (default: temp)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args()
    if args.analyse is not None:
        work = args.analyse
    else:
        work = args.work or Path(tempfile.mkdtemp(prefix="profile-serve-"))
        work.mkdir(parents=True, exist_ok=True)
        profile(args, work)
    report = analyse(Traces.read(work))
    render(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"traces: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
