"""``lmcache bench serve``: a serving benchmark client for any OpenAI-compatible endpoint (``vllm
serve``, with or without lmcache behind it): streamed completions under real concurrency, TTFT and
ITL per turn, throughput, failures by reason, and the lmcache server's hit ratio over the run.

This module parses the options, builds the workload (``bench_serve_workload``), runs it
(``bench_serve_run`` over ``bench_serve_client``), and shows the report (``bench_serve_report``,
``bench_serve_plot``). httpx and those modules are imported only when the command runs, so other
commands do not pay for them; nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit, urlunsplit

import typer

from lmcache_cli.bench_serve_workload import LengthSpread, PlannedRequest, Workload
from lmcache_cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    JsonOption,
    config_from,
    connect,
    console,
    err_console,
    fail,
    print_json,
)

if TYPE_CHECKING:
    from lmcache_cli.bench_serve_report import LMCacheFigures, RunReport
    from lmcache_cli.bench_serve_run import EndpointSettings, RunResult
    from lmcache_core.protocol.messages import ServerInfoReply
    from lmcache_core.transport.client import MessageQueueClient

DEFAULT_CONCURRENCY = 4
MAX_SEED = 2**53


def serve(
    url: Annotated[list[str] | None, typer.Option(
        "--url", help="The OpenAI-compatible API base, e.g. http://127.0.0.1:8000/v1 (/v1 is added "
        "to a url without a path). Several: replicas of one model, a chat user's turns sent to "
        "them in turn (round robin by user and turn).", show_default=False)] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="Model name to request (default: the first GET /v1/models lists).",
        show_default=False)] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="OPENAI_API_KEY", help="Bearer token, if the server wants one.",
        show_default=False)] = None,
    workload: Annotated[Workload, typer.Option(
        "--workload", "-w", case_sensitive=False,
        help="chat: --users x --turns, each turn sends the history and a new message; docs: "
        "--docs documents asked --questions questions each; distinct: --requests prompts with "
        "nothing in common.")] = Workload.chat,
    users: Annotated[int, typer.Option("--users", min=1, help="chat: conversations.")] = 8,
    turns: Annotated[int, typer.Option("--turns", min=1, help="chat: turns per conversation.")] = 4,
    prompt_tokens: Annotated[int, typer.Option(
        "--prompt-tokens", min=1, help="chat: words of each new message; distinct: of each prompt "
        "(a word is about a token).")] = 200,
    docs: Annotated[int, typer.Option("--docs", min=1, help="docs: documents.")] = 4,
    doc_tokens: Annotated[int, typer.Option("--doc-tokens", min=1,
                                            help="docs: words of each document.")] = 2000,
    questions: Annotated[int, typer.Option(
        "--questions", min=1, help="docs: questions asked of each document.")] = 4,
    requests: Annotated[int, typer.Option("--requests", "-n", min=1,
                                          help="distinct: prompts to send.")] = 32,
    prompts: Annotated[Path | None, typer.Option(
        "--prompts", metavar="FILE.jsonl", help='Send these prompts instead of a workload: one JSON '
        'object a line, {"prompt": ..., "user": ..., "turn": ..., "max_tokens": ...} (all but '
        'prompt optional); lines of one user are sent one after another.',
        show_default=False)] = None,
    output_tokens: Annotated[int, typer.Option(
        "--output-tokens", min=1, help="Mean answer length (max_tokens; ignore_eos where the "
        "server takes it).")] = 64,
    output_spread: Annotated[float, typer.Option(
        "--output-spread", min=0.0, max=1.0, help="Answer lengths are drawn uniformly from mean x "
        "(1 ± spread): equal lengths make waves of requests that start and end together.")] = 0.5,
    disconnect: Annotated[float, typer.Option(
        "--disconnect", min=0.0, max=1.0, metavar="FRACTION",
        help="This fraction of requests (drawn from the seed) is closed by the client after its "
        "first token text, as users who leave mid-answer: the server must abort them. Counted "
        "apart; a cut chat turn's answer stays out of its user's history.")] = 0.0,
    concurrency: Annotated[int | None, typer.Option(
        "--concurrency", min=1, help=f"Requests in flight (default {DEFAULT_CONCURRENCY}; "
        "with --rate, a cap on them, default none).", show_default=False)] = None,
    rate: Annotated[float | None, typer.Option(
        "--rate", min=0.001, help="Poisson arrivals at this many requests/s, on "
        "times drawn from the seed (not paced by the answers).", show_default=False)] = None,
    seed: Annotated[int | None, typer.Option(
        "--seed", min=0, max=MAX_SEED, help="Seed of the prompts, answer lengths and arrival "
        "times (default: random, printed; give it to repeat a run exactly).",
        show_default=False)] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.001, help="Seconds any one wait may take (connecting, "
        "the first token, each later chunk); past it the request fails.")] = 120.0,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", min=0.001, help="Seconds one whole request may take, from its send "
        "to the end of its stream; past it the request fails (a stream that trickles forever).")
    ] = 600.0,
    lmcache_url: Annotated[str | None, typer.Option(
        "--lmcache-url", metavar="URL", help="An lmcache server (tcp://... or ipc://...) to read "
        "the lookup hit ratio over the run from.", show_default=False)] = None,
    as_json: JsonOption = False,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.png", help="Draw TTFT per turn into a PNG (needs matplotlib: pip "
        "install 'lmcache-toolkit\\[plot]').", show_default=False)] = None,
    compare: Annotated[bool, typer.Option(
        "--compare", help="Compare saved runs (RUNS, files of --json output) instead of running: "
        "a table, and with --plot their TTFT side by side.")] = False,
    runs: Annotated[list[Path] | None, typer.Argument(
        metavar="RUNS", help="Saved runs for --compare.", show_default=False)] = None,
) -> None:
    """Benchmark an OpenAI-compatible server under load: streamed completions, TTFT per turn.

    Sends a workload with --concurrency requests in flight (or Poisson arrivals at --rate), measures
    time to first token and inter-token latency of every request, and prints them per turn and
    overall with requests/s, prompt tokens/s and failures by reason; --lmcache-url adds the lmcache
    server's hit ratio over the run. Exit 1 when any request failed (after the report).

    Example: [cyan]lmcache bench serve --url http://127.0.0.1:8000/v1 --users 16 --turns 4[/]

    Example: [cyan]lmcache bench serve --url http://gpu1:8000/v1 --lmcache-url tcp://gpu1:5555[/]

    Example: [cyan]lmcache bench serve --url http://gpu1:8000/v1 --url http://gpu1:8001/v1 --seed 3[/]

    Example: [cyan]lmcache bench serve --url http://gpu1:8000/v1 -w docs --rate 2 --seed 7 --json > a.json[/]

    Example: [cyan]lmcache bench serve --compare a.json b.json --plot ttft.png[/]
    """
    if plot is not None:
        _check_plot(plot)
    if compare:
        _compare(runs or [], plot, as_json)
        return
    if runs:
        fail(f"unexpected argument {str(runs[0])!r}: saved runs are read only with --compare",
             EXIT_USAGE)
    if not url:
        fail("--url is required: the OpenAI-compatible API base, e.g. http://127.0.0.1:8000/v1",
             EXIT_USAGE)
    from lmcache_cli.bench_serve_report import build_report, render, schedule_text
    from lmcache_cli.bench_serve_run import EndpointSettings
    from lmcache_cli.bench_serve_workload import disconnects, poisson_arrivals

    settings = EndpointSettings(base_urls=tuple(_api_base(u) for u in url), model=model,
                                api_key=api_key, timeout_s=timeout,
                                request_timeout_s=request_timeout)
    where = ", ".join(settings.base_urls)
    if seed is None:
        seed = secrets.randbelow(2**31)
    lengths = LengthSpread(output_tokens, output_spread)
    plan, name, detail, turn_name = _plan(workload, prompts, lengths, seed, users=users,
                                          turns=turns, prompt_words=prompt_tokens, docs=docs,
                                          doc_words=doc_tokens, questions=questions,
                                          requests=requests)
    if disconnect:
        plan = disconnects(plan, disconnect, seed)
    if rate is None and concurrency is None:
        concurrency = DEFAULT_CONCURRENCY
    arrivals = poisson_arrivals(len(plan), rate, seed) if rate is not None else None
    low, high = lengths.bounds()
    detail += f", answers of {low}-{high} tokens" if high > low else f", answers of {low} tokens"
    if not as_json:
        console.print(f"bench serve {where}: {detail}; {len(plan)} requests, "
                      f"{schedule_text(concurrency, rate)}, seed {seed}", highlight=False,
                      markup=False)

    notes: list[str] = []
    lmcache = None
    with contextlib.ExitStack() as stack:
        if lmcache_url is not None:  # an lmcache server that does not answer: exit 1 before the run
            client, _ping = stack.enter_context(connect(config_from(None, {"server.url": lmcache_url})))
            before = client.server_info()
        result = _run(settings, plan, concurrency, arrivals, show_progress=not as_json)
        if lmcache_url is not None:
            lmcache = _lmcache_figures(client, lmcache_url, before, notes)

    report = build_report(result, url=where, workload=name, workload_detail=detail,
                          turn_name=turn_name, seed=seed, concurrency=concurrency, rate=rate,
                          timeout_s=timeout, request_timeout_s=request_timeout,
                          lmcache=lmcache, notes=notes)
    if as_json:
        print_json(report)
    else:
        render(report)
    if plot is not None:
        _draw(plot, [(name, report)])
    if report.failed:
        raise typer.Exit(EXIT_FAILURE)


def _api_base(url: str) -> str:
    """The API base: ``http(s)://host[:port]/path``, ``/v1`` when the url has no path; exit 2
    for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        fail(f"--url {url!r}: expected http://host:port/v1 (or https://)", EXIT_USAGE)
    try:
        parts.port  # noqa: B018 - a port out of range or not a number raises here
    except ValueError as exc:
        fail(f"--url {url!r}: {exc}", EXIT_USAGE)
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _plan(workload: Workload, prompts: Path | None, lengths: LengthSpread, seed: int, *,
          users: int, turns: int, prompt_words: int, docs: int, doc_words: int, questions: int,
          requests: int) -> tuple[list[PlannedRequest], str, str, str]:
    """The requests, the workload's name, a line that says what it is, and what a turn is called."""
    from lmcache_cli import bench_serve_workload as wl

    if prompts is not None:
        try:
            plan = wl.file_plan(prompts, lengths, seed)
        except wl.PromptsFileError as exc:
            fail(str(exc), EXIT_USAGE)
        return plan, "file", f"{prompts.name}: {len(plan)} prompts", "turn"
    if workload is Workload.chat:
        return (wl.chat_plan(users, turns, prompt_words, lengths, seed), "chat",
                f"chat: {users} users x {turns} turns of {prompt_words}-word messages", "turn")
    if workload is Workload.docs:
        return (wl.docs_plan(docs, doc_words, questions, lengths, seed), "docs",
                f"docs: {docs} documents of {doc_words} words x {questions} questions", "question")
    return (wl.distinct_plan(requests, prompt_words, lengths, seed), "distinct",
            f"distinct: {requests} prompts of {prompt_words} words", "turn")


def _run(settings: EndpointSettings, plan: list[PlannedRequest], concurrency: int | None,
         arrivals: list[float] | None, show_progress: bool) -> RunResult:
    """Run the plan on an asyncio loop, with a progress bar on a terminal."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lmcache_cli.bench_serve_client import EndpointError
    from lmcache_cli.bench_serve_run import Sent, run

    progress = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                        console=err_console, transient=True,
                        disable=not (show_progress and err_console.is_terminal))
    task = progress.add_task("requests", total=len(plan), failed=0)
    failed = 0

    def advance(sent: Sent) -> None:
        nonlocal failed
        failed += sent.completion.failed
        progress.update(task, advance=1, failed=failed)

    try:
        with progress:
            return asyncio.run(run(settings, plan, concurrency, arrivals, advance))
    except EndpointError as exc:
        fail(str(exc), EXIT_FAILURE)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _lmcache_figures(client: MessageQueueClient, url: str, before: ServerInfoReply,
                     notes: list[str]) -> LMCacheFigures | None:
    """The hit ratio between ``before`` and a read now; None (with a note) when the server did not
    answer or restarted meanwhile, so the report still comes."""
    from lmcache_cli.bench_serve_report import lmcache_figures
    from lmcache_core.errors import LMCacheError

    try:
        after = client.server_info()
    except LMCacheError as exc:
        notes.append(f"no hit ratio: the lmcache server did not answer after the run ({exc})")
        return None
    if after.pid != before.pid:
        notes.append("no hit ratio: the lmcache server restarted during the run")
        return None
    return lmcache_figures(url, before.stats.engine, after.stats.engine)


# ---------------------------------------------------------------------- plots, saved runs


def _check_plot(path: Path) -> None:
    """Before any run: matplotlib is there and the PNG's folder exists (else exit 2)."""
    from lmcache_cli.bench_serve_plot import MISSING, pyplot

    try:
        pyplot()
    except ImportError:
        fail(MISSING, EXIT_USAGE)
    if not path.parent.is_dir():
        fail(f"--plot {path}: no folder {path.parent}", EXIT_USAGE)


def _draw(path: Path, runs: list[tuple[str, RunReport]]) -> None:
    from lmcache_cli.bench_serve_plot import plot_ttft

    try:
        plot_ttft(runs, path)
    except OSError as exc:
        fail(f"--plot {path}: {exc}", EXIT_FAILURE)
    err_console.print(f"TTFT per {runs[0][1].turn_name} drawn in {path}", highlight=False,
                      markup=False)


def _compare(paths: list[Path], plot: Path | None, as_json: bool) -> None:
    import msgspec

    from lmcache_cli.bench_serve_report import load_report, render_comparison

    if as_json:
        fail("--json does not apply to --compare (the saved runs are JSON already)", EXIT_USAGE)
    if not paths:
        fail("--compare needs saved runs: lmcache bench serve --compare a.json b.json", EXIT_USAGE)
    runs: list[tuple[str, RunReport]] = []
    names = [p.stem for p in paths]
    for path, name in zip(paths, names, strict=True):
        try:
            report = load_report(path.read_bytes())
        except OSError as exc:
            fail(f"--compare {path}: cannot read it ({exc.strerror or exc})", EXIT_USAGE)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            fail(f"--compare {path}: not a run saved with lmcache bench serve --json ({exc})",
                 EXIT_USAGE)
        runs.append((name if names.count(name) == 1 else str(path), report))
    render_comparison(runs)
    if plot is not None:
        _draw(plot, runs)
