"""``lmcache bench serve`` against a stub OpenAI-compatible server that really listens on 127.0.0.1
(``openai_stub.py``): TTFT and ITL from the stub's known delays, chat histories that grow with the
streamed answers, the Poisson schedule from the seed, failures counted by reason, exit codes,
``--json``, ``--compare`` and ``--plot``, the hit ratio of a real lmcache server, and no torch.

Runs are in-process (Typer's CliRunner) except where the process itself is what is checked (its
imports). Every bound on time is generous: at least 10x what the stub's delays make it."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from lmcache_cli.bench_serve_workload import poisson_arrivals
from lmcache_cli.main import app
from lmcache_core.keys import chain_hashes
from lmcache_core.protocol import messages as m
from lmcache_core.transport.client import MessageQueueClient
from tests.integration.openai_stub import OpenAIStub, StubRequest
from tests.integration.servers import ServerProcess, WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def bench(*args: str) -> Result:
    return runner.invoke(app, ["bench", "serve", *args])


def bench_json(*args: str, code: int = 0) -> dict[str, Any]:
    result = bench(*args, "--json")
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def one_error_line(result: Result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def small(*extra: str) -> tuple[str, ...]:
    return ("--prompt-tokens", "5", "--output-tokens", "4", "--output-spread", "0", "--seed", "1",
            *extra)


# ---------------------------------------------------------------------- figures, histories


def test_ttft_and_itl_come_from_the_streams_and_json_has_every_figure() -> None:
    with OpenAIStub(first_token_s=0.2, token_gap_s=0.05) as stub:
        data = bench_json("--url", stub.url, "--workload", "distinct", "--requests", "4",
                          "--concurrency", "2", *small())
    assert stub.max_in_flight <= 2 and len(stub.requests) == 4
    body = stub.requests[0].body
    assert (body["model"], body["stream"], body["temperature"], body["max_tokens"]) == (
        "stub-model", True, 0, 4)
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert data["model"] == "stub-model" and data["url"] == stub.url
    assert (data["requests"], data["ok"], data["failed"], data["failures"]) == (4, 4, 0, {})
    assert (data["workload"], data["concurrency"], data["rate"], data["seed"]) == (
        "distinct", 2, None, 1)
    assert data["ignore_eos"] and data["include_usage"]
    assert 0.2 <= data["overall"]["ttft_s"]["p50"] < 2.0
    # the stub writes chunks 50 ms apart; the client reads them as they arrive, so one gap may
    # come out a little shorter than the next (0.0498 s seen on a busy machine): half as a floor
    assert 0.025 <= data["overall"]["itl_s"]["p50"] < 0.5
    assert data["output_tokens"] == 16 and data["requests_per_s"] > 0
    assert data["prompt_tokens_from"] == "words"  # the stub sent no usage
    assert data["prompt_tokens"] == 4 * 5 and data["lmcache"] is None
    assert [t["turn"] for t in data["turns"]] == [0]
    for record in data["records"]:
        assert set(record) == {"index", "user", "turn", "prompt_words", "prompt_tokens",
                               "max_tokens", "output_tokens", "scheduled_s", "start_s", "end_s",
                               "ttft_s", "itl", "ok", "disconnected", "error", "detail",
                               "answer_digest"}
        assert record["ok"] and record["error"] is None and record["output_tokens"] == 4
        assert 0.2 <= record["ttft_s"] < 2.0 and record["itl"]["count"] == 3
        assert 0.025 <= record["itl"]["p50_s"] < 0.5 and record["scheduled_s"] is None
        assert 0 <= record["start_s"] < record["end_s"] <= data["duration_s"]


def test_chat_turns_send_the_history_with_the_answers_streamed_back() -> None:
    with OpenAIStub(usage=True) as stub:
        data = bench_json("--url", stub.url, "--users", "3", "--turns", "3", "--concurrency", "2",
                          *small())
    assert data["ok"] == 9 and [t["turn"] for t in data["turns"]] == [0, 1, 2]
    by_prompt = {r.prompt: r for r in stub.requests}
    for request in stub.requests:
        turns = request.prompt.count("User: ")
        assert request.prompt.endswith("\nAssistant:") and request.answer
        if turns == 1:
            continue
        # the previous turn of the same user: its prompt and the answer the stub streamed
        previous = [r for r in stub.requests if r.prompt.count("User: ") == turns - 1
                    and request.prompt.startswith(r.prompt + r.answer + "\nUser: ")]
        assert len(previous) == 1, request.prompt
        assert previous[0].finished is not None and previous[0].finished <= request.arrived
        assert by_prompt[previous[0].prompt] is previous[0]
    assert sorted(r.prompt.count("User: ") for r in stub.requests) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    # usage was asked for and sent: prompt tokens are the server's (the stub counts 2 a word)
    assert data["prompt_tokens_from"] == "usage"
    assert all(r["prompt_tokens"] == 2 * r["prompt_words"] for r in data["records"])
    assert sorted(r["prompt_words"] for r in data["records"]) == sorted(
        len(r.prompt.split()) for r in stub.requests)


def test_disconnected_requests_are_closed_after_their_first_token_and_counted_apart() -> None:
    """--disconnect: the requests the seed marks are closed by the client after their first
    token text (the server sees the connection go), counted neither ok nor failed; a cut chat
    turn's answer stays out of the next turn's prompt. Every record carries its answer's
    digest, for comparing the answers of two runs."""
    with OpenAIStub(token_gap_s=0.05) as stub:
        data = bench_json("--url", stub.url, "--workload", "distinct", "--requests", "8",
                          "--disconnect", "0.5", "--concurrency", "8",
                          *small("--output-tokens", "8"))
    gone = [r for r in stub.requests if r.client_gone]
    assert 0 < data["disconnected"] < 8 and len(gone) == data["disconnected"]
    assert (data["ok"], data["failed"], data["ok"] + data["disconnected"]) == (
        8 - data["disconnected"], 0, 8)
    cut = [r for r in data["records"] if r["disconnected"]]
    assert all(not r["ok"] and r["error"] is None and r["output_tokens"] == 1 for r in cut)
    digests = {hashlib.blake2b(r.answer.encode(), digest_size=8).hexdigest()
               for r in stub.requests if not r.client_gone}
    assert digests == {r["answer_digest"] for r in data["records"] if r["ok"]}
    with OpenAIStub() as stub:
        data = bench_json("--url", stub.url, "--users", "2", "--turns", "2", "--disconnect", "1",
                          *small("--output-tokens", "8"))
    assert data["disconnected"] == 4
    first = {r.prompt for r in stub.requests if r.prompt.count("User: ") == 1}
    for request in stub.requests:
        if request.prompt.count("User: ") == 2:
            previous = request.prompt.split("\nUser: ")[0]
            assert previous in first  # the history: the first prompt, without its cut answer


def test_replicas_take_a_users_turns_in_turn() -> None:
    """Several --url: replicas of one model; a chat user's next turn goes to the next replica
    (round robin by user and turn), so only a cache they share spares recomputing its history."""
    with OpenAIStub() as first, OpenAIStub() as second:
        data = bench_json("--url", first.url, "--url", second.url, "--users", "2", "--turns", "3",
                          *small())
    assert data["ok"] == 6 and data["url"] == f"{first.url}, {second.url}"
    on_first = sorted(r.prompt.count("User: ") for r in first.requests)
    on_second = sorted(r.prompt.count("User: ") for r in second.requests)
    # user 0: turns 0, 2 on the first replica and 1 on the second; user 1 the other way round
    assert on_first == [1, 2, 3] and on_second == [1, 2, 3]
    for stub in (first, second):
        users = {r.prompt.split("\n")[0] for r in stub.requests}
        assert len(users) == 2  # both users' conversations are on both replicas


def test_docs_questions_share_their_document() -> None:
    with OpenAIStub() as stub:
        data = bench_json("--url", stub.url, "--workload", "docs", "--docs", "2", "--doc-tokens",
                          "50", "--questions", "3", *small())
    assert data["turn_name"] == "question" and [t["requests"] for t in data["turns"]] == [2, 2, 2]
    documents = {r.prompt.split("\n\nQuestion: ")[0] for r in stub.requests}
    assert len(documents) == 2 and len({r.prompt for r in stub.requests}) == 6


def test_prompts_file_is_sent_as_written(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "first of ann", "user": "ann", "max_tokens": 3}\n'
                    '{"prompt": "bob alone", "max_tokens": 2}\n'
                    '{"prompt": "second of ann", "user": "ann", "turn": 1, "max_tokens": 5}\n')
    with OpenAIStub() as stub:
        data = bench_json("--url", stub.url, "--prompts", str(path), "--concurrency", "4")
    got = {r.prompt: r for r in stub.requests}
    assert set(got) == {"first of ann", "bob alone", "second of ann"}
    assert [got[p].body["max_tokens"] for p in ("first of ann", "bob alone", "second of ann")] == [
        3, 2, 5]
    first, second = got["first of ann"], got["second of ann"]
    assert first.finished is not None and first.finished <= second.arrived  # one user: in order
    assert [(r["user"], r["turn"], r["output_tokens"]) for r in data["records"]] == [
        ("ann", 0, 3), ("line 2", 0, 2), ("ann", 1, 5)]
    assert data["workload"] == "file"


# ---------------------------------------------------------------------- schedule


def test_rate_sends_on_the_seeded_schedule_not_paced_by_answers() -> None:
    # The stub answers nothing until all 6 requests are in: a client pacing its sends by the
    # answers would never send them all.
    runs = []
    for _ in range(2):
        with OpenAIStub(hold_until=6) as stub:
            data = bench_json("--url", stub.url, "--workload", "distinct", "--requests", "6",
                              "--rate", "40", *small("--seed", "5"))
        assert data["ok"] == 6 and data["concurrency"] is None and data["rate"] == 40
        assert all(r.finished is not None for r in stub.requests)
        first_answer = min(r.finished for r in stub.requests if r.finished is not None)
        assert max(r.arrived for r in stub.requests) <= first_answer
        runs.append((data, sorted(r.prompt for r in stub.requests)))
    (first, prompts), (second, prompts_again) = runs
    schedule = [r["scheduled_s"] for r in first["records"]]
    assert schedule == pytest.approx(poisson_arrivals(6, 40.0, 5), abs=1e-6)
    assert schedule == [r["scheduled_s"] for r in second["records"]] and prompts == prompts_again
    assert all(r["start_s"] >= r["scheduled_s"] - 1e-3 for r in first["records"])
    assert schedule != pytest.approx(poisson_arrivals(6, 40.0, 6), abs=1e-6)


# ---------------------------------------------------------------------- failures


def test_failures_are_counted_by_reason_and_exit_1() -> None:
    script = ("http500", "cut", "no_done", "malformed", "stall")
    with OpenAIStub(script=script) as stub:
        data = bench_json("--url", stub.url, "--workload", "distinct", "--requests", "8",
                          "--concurrency", "8", "--timeout", "0.5", *small(), code=1)
    assert data["failures"] == {"http 500": 1, "connection lost": 1, "no [DONE]": 1,
                                "malformed stream": 1, "timeout": 1}
    assert (data["ok"], data["failed"]) == (3, 5) and len(stub.requests) == 8
    errors = {r["error"]: r for r in data["records"] if not r["ok"]}
    stalled = errors["timeout"]
    assert 0.5 <= stalled["end_s"] - stalled["start_s"] < 5.0
    assert "stub: internal error" in errors["http 500"]["detail"]
    assert "not JSON" in errors["malformed stream"]["detail"]
    assert errors["no [DONE]"]["output_tokens"] == 2  # what came before the end is counted


def test_a_stream_that_never_ends_fails_by_the_whole_request_deadline() -> None:
    # Each piece comes well within --timeout: only --request-timeout ends the trickle, and only
    # the line bound ends the line that never ends (it would otherwise fill the client's memory).
    with OpenAIStub(script=("trickle", "long_line"), token_gap_s=0.02) as stub:
        data = bench_json("--url", stub.url, "--workload", "distinct", "--requests", "3",
                          "--concurrency", "3", "--timeout", "5", "--request-timeout", "1",
                          *small(), code=1)
    assert data["failures"] == {"timeout": 1, "malformed stream": 1} and data["ok"] == 1, data
    assert data["request_timeout_s"] == 1.0 and len(stub.requests) == 3
    errors = {r["error"]: r for r in data["records"] if not r["ok"]}
    trickled = errors["timeout"]
    assert "--request-timeout" in trickled["detail"] and trickled["output_tokens"] > 1
    assert 1.0 <= trickled["end_s"] - trickled["start_s"] < 10.0
    assert "a line of over 1048576 bytes" in errors["malformed stream"]["detail"]


def test_unreachable_endpoint_fails_every_request_with_its_reason() -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = bench("--url", url, "--model", "m", "--workload", "distinct", "--requests", "3",
                   "--timeout", "5", *small())
    assert result.exit_code == 1, result.output
    assert "failed: 3 of 3 (connect error: 3)" in result.stdout and "Traceback" not in result.output
    assert "0 of 3 request(s) ok" in result.stdout
    # no --model: the model list is asked first, and that failing is one line, exit 1
    result = bench("--url", url, "--timeout", "5", *small())
    assert result.exit_code == 1
    assert "GET " + url + "/models" in one_error_line(result)


def test_a_refused_extension_field_is_dropped_and_said() -> None:
    with OpenAIStub(refuse=("ignore_eos",)) as stub:
        result = bench("--url", stub.url, "--workload", "distinct", "--requests", "4", *small())
    assert result.exit_code == 0, result.output
    assert stub.refused >= 1 and len(stub.requests) == 4
    assert not any("ignore_eos" in r.body for r in stub.requests)
    assert "note: the server refused ignore_eos" in result.stdout


@pytest.mark.parametrize(("args", "expected"), [
    ([], "--url is required"),
    (["--url", "ftp://x/v1"], "expected http://host:port/v1"),
    (["--url", "http://127.0.0.1:99999/v1"], "--url"),
    (["--url", "http://h/v1", "a.json"], "only with --compare"),
    (["--compare"], "--compare needs saved runs"),
    (["--compare", "--json", "a.json"], "--json does not apply"),
    (["--url", "http://h/v1", "--lmcache-url", "http://x"], "server.url"),
    (["--url", "http://h/v1", "--plot", "/no/such/dir/t.png"], None),
])
def test_bad_usage_is_one_line_and_exit_2(args: list[str], expected: str | None,
                                          tmp_path: Path) -> None:
    result = bench(*args)
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert expected is None or expected in line, line


def test_a_bad_prompts_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "x", "max_token": 3}\n')
    result = bench("--url", f"http://127.0.0.1:{closed_port()}/v1", "--prompts", str(path))
    assert result.exit_code == 2
    assert "line 2: Object contains unknown field `max_token`" in one_error_line(result)


# ---------------------------------------------------------------------- saved runs, plots


def _saved_runs(tmp_path: Path) -> list[Path]:
    paths = []
    for name, delay in (("slow", 0.05), ("fast", 0.0)):
        with OpenAIStub(first_token_s=delay) as stub:
            result = bench("--url", stub.url, "--users", "2", "--turns", "2", *small(), "--json")
        assert result.exit_code == 0, result.output
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(result.stdout)
    return paths


def test_compare_saved_runs(tmp_path: Path) -> None:
    slow, fast = _saved_runs(tmp_path)
    result = bench("--compare", str(slow), str(fast))
    assert result.exit_code == 0, result.output
    for text in ("TTFT p50 / p90 ms per turn", "slow", "fast", "requests/s", "hit ratio"):
        assert text in result.stdout, result.stdout
    broken = tmp_path / "broken.json"
    broken.write_text('{"url": 3}')
    result = bench("--compare", str(slow), str(broken))
    assert result.exit_code == 2 and "not a run saved with" in one_error_line(result)


def test_plot_without_matplotlib_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    # exit 2 before anything is sent (a run to a closed port would exit 1)
    result = bench("--url", f"http://127.0.0.1:{closed_port()}/v1", "--model", "m", "--plot",
                   "ttft.png")
    assert result.exit_code == 2
    assert "pip install 'lmcache-toolkit[plot]'" in one_error_line(result)


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    slow, fast = _saved_runs(tmp_path)
    png = tmp_path / "compare.png"
    result = bench("--compare", str(slow), str(fast), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with OpenAIStub() as stub:
        result = bench("--url", stub.url, "--users", "2", "--turns", "2", *small(), "--plot",
                       str(tmp_path / "run.png"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------- lmcache, imports


def _engine_beside_lmcache(client: MessageQueueClient, worker: WorkerProcess, chunk: int
                          ) -> tuple[Callable[[StubRequest], None], dict[str, int]]:
    """A stub hook doing what vLLM with lmcache does per prompt: look its chunks up, then store
    them; the hits and misses it saw are counted."""
    lock = threading.Lock()  # the stub answers on several threads; the client and worker are one
    seen = {"lookups": 0, "hits": 0, "misses": 0}

    def hook(request: StubRequest) -> None:
        tokens = [zlib.crc32(word.encode()) % 50000 for word in request.prompt.split()]
        full = len(tokens) // chunk * chunk
        hashes = chain_hashes(tokens[:full], chunk)
        with lock:
            reply = client.request(m.LookupRequest(model_name="tiny", world_size=1,
                                                   lookup_id=f"q{request.number}",
                                                   chunk_hashes=hashes, lock=False))
            seen["lookups"] += 1
            seen["hits"] += reply.hit_chunks
            seen["misses"] += len(hashes) - reply.hit_chunks
            stored = worker("store", req=f"s{request.number}", keys=tokens[:full],
                            blocks=list(range(full // 16)))
            assert stored["finished"], stored

    return hook, seen


def test_hit_ratio_of_the_lmcache_server_over_the_run(
        make_server: Callable[..., ServerProcess], make_worker: Callable[..., WorkerProcess]) -> None:
    server = make_server()
    worker = make_worker(server.url)
    with MessageQueueClient(server.url) as client:
        client.request(m.LookupRequest(model_name="tiny", world_size=1, lookup_id="before",
                                       chunk_hashes=chain_hashes(list(range(64)), 64), lock=False))
        hook, seen = _engine_beside_lmcache(client, worker, chunk=64)  # the lookup above: not counted
        with OpenAIStub(hook=hook) as stub:
            data = bench_json("--url", stub.url, "--users", "2", "--turns", "3", "--lmcache-url",
                              server.url, *small("--prompt-tokens", "70"))
    figures = data["lmcache"]
    assert (figures["lookups"], figures["hit_chunks"], figures["miss_chunks"]) == (
        6, seen["hits"], seen["misses"])
    assert seen["hits"] > 0 and 0 < figures["hit_ratio"] < 1  # later turns hit their history
    assert figures["hit_ratio"] == round(seen["hits"] / (seen["hits"] + seen["misses"]), 4)
    result = runner.invoke(app, ["bench", "serve", "--url", stub.url, "--model", "m",
                                 "--lmcache-url", "ipc:///nonexistent/x", *small()],
                           env={"LMCACHE_TIMEOUTS_CONNECT_S": "0.2"})
    assert result.exit_code == 1 and "no lmcache server answered" in one_error_line(result)


def test_no_torch_imported_and_the_piped_report_is_plain() -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS" and not k.startswith("LMCACHE_")}
    command = [sys.executable, "-X", "importtime", "-m", "lmcache_cli", "bench", "serve"]
    helped = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=60, stdin=subprocess.DEVNULL)
    with OpenAIStub() as stub:
        ran = subprocess.run([*command, "--url", stub.url, "--users", "2", "--turns", "2",
                              *small()], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=60, stdin=subprocess.DEVNULL)
    for proc in (helped, ran):
        assert proc.returncode == 0, proc.stderr[-2000:]
        modules = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()
                   if line.startswith("import time:")}
        assert "typer" in modules and not {"torch", "numpy", "redis"} & modules
    assert "Example: lmcache bench serve" in helped.stdout
    assert "TTFT p50" in ran.stdout and "…" not in ran.stdout  # piped: full width, no bar
    assert "\r" not in ran.stdout + ran.stderr.replace("import time:", "")
