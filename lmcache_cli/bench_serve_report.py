"""``lmcache bench serve``'s report: the figures of a run (TTFT and ITL percentiles per turn and
overall, throughput, failures by reason, the lmcache server's hit ratio over the run), each
request's record, and the tables that show them, or several saved runs side by side.

The report is a typed struct (:class:`RunReport`): ``--json`` prints it, ``--compare`` reads saved
ones back (a file of another shape is refused with the field that is wrong).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import TYPE_CHECKING

import msgspec

from lmcache_cli.bench_serve_client import IGNORE_EOS, INCLUDE_USAGE
from lmcache_cli.common import console, percentile

if TYPE_CHECKING:
    from lmcache_cli.bench_serve_run import RunResult, Sent
    from lmcache_core.stats import EngineStats


class Percentiles(msgspec.Struct, kw_only=True):
    """Seconds; None when there was nothing to measure."""

    p50: float | None
    p90: float | None
    p99: float | None


class GroupFigures(msgspec.Struct, kw_only=True):
    """The requests of one turn (``turn``), or of the whole run (``turn`` None)."""

    turn: int | None
    requests: int
    ok: int
    failed: int
    prompt_words_mean: float | None  # of the prompts sent (a chat turn's whole history)
    ttft_s: Percentiles  # of the requests that succeeded
    itl_s: Percentiles  # of every gap between chunks of those requests, pooled


class ItlSummary(msgspec.Struct, kw_only=True):
    count: int
    mean_s: float | None
    p50_s: float | None
    p90_s: float | None
    max_s: float | None


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request: who sent it, its size, its timing from the run's start, how it ended."""

    index: int
    user: int | str
    turn: int
    prompt_words: int
    prompt_tokens: int | None  # the server's count (usage), when it sent one
    max_tokens: int
    output_tokens: int  # the server's count (usage), else the chunks that carried text
    scheduled_s: float | None  # its arrival in the Poisson schedule (--rate)
    start_s: float
    end_s: float
    ttft_s: float | None
    itl: ItlSummary
    ok: bool
    disconnected: bool = False  # closed by the client after its first token text (--disconnect)
    error: str | None
    detail: str
    #: blake2b-64 of the answer text as streamed (the cut part, when disconnected): two runs of
    #: one seed against two servers gave the same answer where their digests agree.
    answer_digest: str = ""


class LMCacheFigures(msgspec.Struct, kw_only=True):
    """The lmcache server's lookups between the reads before and after the run."""

    url: str
    lookups: int
    hit_chunks: int
    miss_chunks: int
    hit_ratio: float | None


class RunReport(msgspec.Struct, kw_only=True):
    url: str
    model: str
    workload: str  # chat, docs, distinct, or file
    workload_detail: str
    turn_name: str  # what a turn is called: "turn", "question"
    seed: int
    concurrency: int | None
    rate: float | None
    timeout_s: float
    request_timeout_s: float | None = None  # None in runs saved before it was an option
    ignore_eos: bool  # whether the server took the field (else answers may end early)
    include_usage: bool
    duration_s: float
    requests: int
    ok: int
    failed: int
    disconnected: int = 0  # closed by the client on purpose (--disconnect): neither ok nor failed
    failures: dict[str, int]  # by reason
    requests_per_s: float  # requests that succeeded, per second of the run
    prompt_tokens: int
    prompt_tokens_from: str  # "usage", "words" (estimated: a word ~ a token), or "usage and words"
    prompt_tokens_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    overall: GroupFigures
    turns: list[GroupFigures]
    lmcache: LMCacheFigures | None
    notes: list[str]
    records: list[RequestRecord]


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def _percentiles(values: list[float]) -> Percentiles:
    return Percentiles(**{f"p{q}": _round(percentile(values, q / 100)) for q in (50, 90, 99)})


def group_figures(turn: int | None, sent: list[Sent]) -> GroupFigures:
    ok = [s.completion for s in sent if s.completion.ok]
    return GroupFigures(
        turn=turn, requests=len(sent), ok=len(ok), failed=sum(s.completion.failed for s in sent),
        prompt_words_mean=_round(sum(s.prompt_words for s in sent) / len(sent), 1) if sent else None,
        ttft_s=_percentiles([c.ttft_s for c in ok if c.ttft_s is not None]),
        itl_s=_percentiles([gap for c in ok for gap in c.itl_s]))


def record(sent: Sent, started: float) -> RequestRecord:
    c, r = sent.completion, sent.request
    gaps = c.itl_s
    return RequestRecord(
        index=r.index, user=r.user, turn=r.turn, prompt_words=sent.prompt_words,
        prompt_tokens=c.prompt_tokens, max_tokens=r.max_tokens,
        output_tokens=c.completion_tokens if c.completion_tokens is not None else c.chunks,
        scheduled_s=_round(sent.scheduled_s), start_s=round(c.started - started, 6),
        end_s=round(c.ended - started, 6), ttft_s=_round(c.ttft_s),
        itl=ItlSummary(count=len(gaps), mean_s=_round(sum(gaps) / len(gaps)) if gaps else None,
                       p50_s=_round(percentile(gaps, 0.5)), p90_s=_round(percentile(gaps, 0.9)),
                       max_s=_round(max(gaps)) if gaps else None),
        ok=c.ok, disconnected=c.disconnected, error=c.error, detail=c.detail,
        answer_digest=hashlib.blake2b(c.text.encode(), digest_size=8).hexdigest())


def lmcache_figures(url: str, before: EngineStats, after: EngineStats) -> LMCacheFigures:
    hits = after.lookup_hit_chunks - before.lookup_hit_chunks
    misses = after.lookup_miss_chunks - before.lookup_miss_chunks
    return LMCacheFigures(url=url, lookups=after.lookups - before.lookups, hit_chunks=hits,
                          miss_chunks=misses,
                          hit_ratio=round(hits / (hits + misses), 4) if hits + misses > 0 else None)


def build_report(result: RunResult, *, url: str, workload: str, workload_detail: str,
                 turn_name: str, seed: int, concurrency: int | None, rate: float | None,
                 timeout_s: float, request_timeout_s: float, lmcache: LMCacheFigures | None,
                 notes: list[str]) -> RunReport:
    sent = result.sent
    duration = max(result.ended - result.started, 1e-9)
    ok = [s for s in sent if s.completion.ok]
    counted = [s.completion.prompt_tokens for s in ok if s.completion.prompt_tokens is not None]
    estimated = [s.prompt_words for s in ok if s.completion.prompt_tokens is None]
    source = "usage and words" if counted and estimated else ("words" if estimated else "usage")
    records = [record(s, result.started) for s in sent]
    output_tokens = sum(rec.output_tokens for rec in records if rec.ok)
    prompt_tokens = sum(counted) + sum(estimated)
    by_turn: dict[int, list[Sent]] = {}
    for s in sent:
        by_turn.setdefault(s.request.turn, []).append(s)
    failures = Counter(s.completion.error for s in sent if s.completion.error is not None)
    return RunReport(
        url=url, model=result.model, workload=workload, workload_detail=workload_detail,
        turn_name=turn_name, seed=seed, concurrency=concurrency, rate=rate, timeout_s=timeout_s,
        request_timeout_s=request_timeout_s,
        ignore_eos=IGNORE_EOS in result.sent_extras,
        include_usage=INCLUDE_USAGE in result.sent_extras,
        duration_s=round(duration, 6), requests=len(sent), ok=len(ok),
        failed=sum(s.completion.failed for s in sent),
        disconnected=sum(s.completion.disconnected for s in sent),
        failures=dict(failures.most_common()),
        requests_per_s=round(len(ok) / duration, 3),
        prompt_tokens=prompt_tokens, prompt_tokens_from=source,
        prompt_tokens_per_s=round(prompt_tokens / duration, 1),
        output_tokens=output_tokens, output_tokens_per_s=round(output_tokens / duration, 1),
        overall=group_figures(None, sent),
        turns=[group_figures(turn, by_turn[turn]) for turn in sorted(by_turn)],
        lmcache=lmcache, notes=[*notes, *result.notes], records=records)


# ---------------------------------------------------------------------- tables


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def _figure_cells(group: GroupFigures) -> list[str]:
    failed = f"[red]{group.failed}[/]" if group.failed else "0"
    words = "-" if group.prompt_words_mean is None else f"{group.prompt_words_mean:,.0f}"
    return [str(group.requests), failed, words, _ms(group.ttft_s.p50), _ms(group.ttft_s.p90),
            _ms(group.ttft_s.p99), _ms(group.itl_s.p50), _ms(group.itl_s.p90)]


def render(report: RunReport) -> None:
    """The report as a user reads it: a table per turn and overall, then throughput, failures,
    the lmcache hit ratio and notes."""
    from rich.markup import escape
    from rich.table import Table

    console.print(f"{escape(report.model)} at {escape(report.url)} · {escape(report.workload_detail)}",
                  highlight=False)
    table = Table()
    # narrow headers: the table fits 80 columns with times up to 99,999.9 ms
    for name in (report.turn_name, "sent", "failed", "words", "TTFT p50", "p90", "p99", "ITL p50",
                 "p90"):
        table.add_column(name, justify="left" if name == report.turn_name else "right")
    if len(report.turns) > 1:
        for group in report.turns:
            table.add_row(str(group.turn), *_figure_cells(group))
        table.add_section()
    table.add_row("all", *_figure_cells(report.overall), style="bold")
    console.print(table)
    console.print("times in ms; words: the mean prompt length sent (a chat turn's whole history)",
                  style="dim", highlight=False)
    estimated = {"words": " (estimated from words: the server sent no usage)",
                 "usage and words": " (partly estimated from words)"}.get(report.prompt_tokens_from, "")
    console.print(f"{report.ok} of {report.requests} request(s) ok in {report.duration_s:.1f} s · "
                  f"{report.requests_per_s:,.2f} requests/s · prompt tokens/s "
                  f"{report.prompt_tokens_per_s:,.0f}{estimated} · output tokens/s "
                  f"{report.output_tokens_per_s:,.0f} · "
                  f"{schedule_text(report.concurrency, report.rate)} · seed {report.seed}",
                  highlight=False)
    if report.disconnected:
        console.print(f"disconnected by the client on purpose: {report.disconnected} of "
                      f"{report.requests} (--disconnect; counted neither ok nor failed)",
                      highlight=False)
    if report.failures:
        reasons = ", ".join(f"{escape(reason)}: {count}" for reason, count in report.failures.items())
        console.print(f"[bold red]failed: {report.failed} of {report.requests}[/] ({reasons})",
                      highlight=False)
    lm = report.lmcache
    if lm is not None:
        ratio = "-" if lm.hit_ratio is None else f"{100 * lm.hit_ratio:.1f}%"
        console.print(f"lmcache {escape(lm.url)}: hit ratio {ratio} over the run "
                      f"({lm.hit_chunks:,} of {lm.hit_chunks + lm.miss_chunks:,} chunks looked up, "
                      f"{lm.lookups:,} lookups)", highlight=False)
    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


def schedule_text(concurrency: int | None, rate: float | None) -> str:
    """``concurrency 4``, ``Poisson arrivals at 2/s`` (``, at most 8 in flight``)."""
    if rate is None:
        return f"concurrency {concurrency}"
    cap = f", at most {concurrency} in flight" if concurrency else ""
    return f"Poisson arrivals at {rate:g}/s{cap}"


def render_comparison(runs: list[tuple[str, RunReport]]) -> None:
    """TTFT p50 / p90 per turn of each saved run, a column per run, and their throughput."""
    from rich.markup import escape
    from rich.table import Table

    turn_name = runs[0][1].turn_name
    console.print(f"TTFT p50 / p90 ms per {turn_name}", highlight=False)
    table = Table()
    table.add_column(turn_name)
    for name, _ in runs:
        table.add_column(escape(name), justify="right")
    turns = sorted({group.turn for _, run in runs for group in run.turns if group.turn is not None})
    for turn in turns:
        cells = []
        for _, run in runs:
            group = next((g for g in run.turns if g.turn == turn), None)
            cells.append("-" if group is None else f"{_ms(group.ttft_s.p50)} / {_ms(group.ttft_s.p90)}")
        table.add_row(str(turn), *cells)
    table.add_section()
    table.add_row("all", *(f"{_ms(run.overall.ttft_s.p50)} / {_ms(run.overall.ttft_s.p90)}"
                           for _, run in runs), style="bold")
    table.add_row("requests/s", *(f"{run.requests_per_s:,.2f}" for _, run in runs))
    table.add_row("failed", *(str(run.failed) for _, run in runs))
    table.add_row("hit ratio", *("-" if run.lmcache is None or run.lmcache.hit_ratio is None
                                 else f"{100 * run.lmcache.hit_ratio:.1f}%" for _, run in runs))
    console.print(table)


def load_report(data: bytes) -> RunReport:
    """A run saved with ``--json``; raises ``msgspec.ValidationError``/``DecodeError``."""
    return msgspec.json.decode(data, type=RunReport)
