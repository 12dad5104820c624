"""``lmcache bench serve``'s pure parts: the workloads' plans, answer lengths and Poisson arrivals
drawn from the seed, the prompts file, the SSE lines of a completion stream, the report's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_cli import bench_serve_workload as wl
from lmcache_cli.bench_serve_client import DONE, Completion, MalformedStream, chunk_text, parse_event
from lmcache_cli.bench_serve_report import build_report, lmcache_figures
from lmcache_cli.bench_serve_run import RunResult, Sent
from lmcache_cli.common import percentile
from lmcache_core.stats import EngineStats

LENGTHS = wl.LengthSpread(64, 0.5)


def test_chat_turns_interleave_users_and_follow_the_users_previous_turn() -> None:
    plan = wl.chat_plan(users=3, turns=2, message_words=5, lengths=LENGTHS, seed=1)
    assert [(r.user, r.turn) for r in plan] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert [r.after for r in plan] == [None, None, None, 0, 1, 2]
    assert all(r.chat and r.words == 5 and set(r.text.split()) <= set(wl.WORDS) for r in plan)
    history = wl.chat_prompt("", plan[0].text) + " an answer"
    second = wl.chat_prompt(history, plan[3].text)
    assert second.startswith(history + "\n") and second.endswith(plan[3].text + wl.ASSISTANT_HEADER)


def test_docs_rounds_ask_every_document_then_again_with_new_questions() -> None:
    plan = wl.docs_plan(docs=2, doc_words=300, questions=3, lengths=LENGTHS, seed=1)
    assert [(r.user, r.turn) for r in plan] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    for doc in (0, 1):
        prompts = [r.text for r in plan if r.user == doc]
        heads = {p.split(wl.QUESTION_HEADER)[0] for p in prompts}
        assert len(heads) == 1 and len(next(iter(heads)).split()) == 301  # "Document:" + words
        assert len(set(prompts)) == 3  # each question differs
    assert plan[0].text.split(wl.QUESTION_HEADER)[0] != plan[1].text.split(wl.QUESTION_HEADER)[0]


def test_distinct_prompts_share_no_prefix() -> None:
    plan = wl.distinct_plan(requests=50, prompt_words=40, lengths=LENGTHS, seed=2)
    assert len({tuple(r.text.split()[:4]) for r in plan}) == 50
    assert {r.user for r in plan} == set(range(50)) and {r.after for r in plan} == {None}


def test_answer_lengths_vary_within_the_spread_and_follow_the_seed() -> None:
    lengths = [r.max_tokens for r in wl.distinct_plan(200, 3, wl.LengthSpread(100, 0.5), seed=3)]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 20
    assert lengths == [r.max_tokens for r in wl.distinct_plan(200, 3, wl.LengthSpread(100, 0.5), 3)]
    assert lengths != [r.max_tokens for r in wl.distinct_plan(200, 3, wl.LengthSpread(100, 0.5), 4)]
    assert {r.max_tokens for r in wl.distinct_plan(20, 3, wl.LengthSpread(8, 0.0), 3)} == {8}
    assert wl.LengthSpread(1, 1.0).draw(wl.stream(0, "lengths")) >= 1


def test_poisson_arrivals_are_drawn_from_the_seed_alone() -> None:
    times = wl.poisson_arrivals(2000, rate=5.0, seed=7)
    assert times == wl.poisson_arrivals(2000, rate=5.0, seed=7)
    assert times != wl.poisson_arrivals(2000, rate=5.0, seed=8)
    assert times[0] == 0.0 and times == sorted(times)
    mean_gap = times[-1] / (len(times) - 1)
    assert 0.18 < mean_gap < 0.22  # 1 / rate; 2000 gaps: the standard error is 2 %
    # the prompts do not change with the rate: their stream is another
    assert wl.distinct_plan(5, 9, LENGTHS, seed=7) == wl.distinct_plan(5, 9, LENGTHS, seed=7)


def test_prompts_file_lines_users_turns_and_lengths(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello there", "user": "ann"}, {"prompt": "lone"},
             {"prompt": "again", "user": "ann", "max_tokens": 7}, {"prompt": "x", "turn": 5}]
    path.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n"
                    + "\n".join(json.dumps(line) for line in lines[2:]) + "\n")
    plan = wl.file_plan(path, LENGTHS, seed=1)
    assert [(r.user, r.turn, r.after, r.text) for r in plan] == [
        ("ann", 0, None, "hello there"), ("line 2", 0, None, "lone"), ("ann", 1, 0, "again"),
        ("line 5", 5, None, "x")]
    assert plan[2].max_tokens == 7 and not any(r.chat for r in plan)


@pytest.mark.parametrize(("content", "expected"), [
    ('{"prompt": "a"}\n{"prompt": 3}\n', "line 2: Expected `str`, got `int` - at `$.prompt`"),
    ('{"text": "a"}\n', "line 1: Object contains unknown field `text`"),
    ('{"prompt": "a", "max_tokens": 0}\n', "line 1: max_tokens must be at least 1"),
    ('{"prompt": "  "}\n', "line 1: the prompt is empty"),
    ('{"prompt": "a", "turn": -1}\n', "line 1: turn must not be negative"),
    ("not json\n", "line 1: not a JSON object"),
    ("\n\n", "no prompts in it"),
    (None, "cannot read it"),
])
def test_a_bad_prompts_file_names_its_line(tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(wl.PromptsFileError, match=r"--prompts .*p\.jsonl") as info:
        wl.file_plan(path, LENGTHS, seed=1)
    assert expected in str(info.value)


def test_sse_lines() -> None:
    assert parse_event('data: {"choices": [{"text": "hi"}]}') == {"choices": [{"text": "hi"}]}
    assert parse_event("data: [DONE]") == DONE and parse_event("data:[DONE]") == DONE
    assert parse_event("") is None and parse_event(": keep-alive") is None
    assert parse_event("event: message") is None
    for bad in ("data: {oops", "data: [1, 2]", "data: "):
        with pytest.raises(MalformedStream):
            parse_event(bad)
    assert chunk_text({"choices": [{"text": " tok"}]}) == " tok"
    assert chunk_text({"choices": [], "usage": {"prompt_tokens": 3}}) == ""
    assert chunk_text({"choices": [{"text": None, "finish_reason": "length"}]}) == ""
    for bad_chunk in ({"object": "x"}, {"choices": [{"text": 5}]}):
        with pytest.raises(MalformedStream):
            chunk_text(bad_chunk)


def test_percentile_interpolates() -> None:
    assert percentile([], 0.5) is None and percentile([3.0], 0.99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile(list(range(101)), 0.9) == pytest.approx(90.0)


def _sent(index: int, turn: int, ttft: float | None, gaps: list[float], error: str | None = None,
          prompt_tokens: int | None = None) -> Sent:
    request = wl.PlannedRequest(index=index, user=index, turn=turn, text="a b c", max_tokens=4)
    completion = Completion(started=10.0 + index, ended=11.0 + index, ttft_s=ttft, itl_s=gaps,
                            chunks=len(gaps) + (ttft is not None), prompt_tokens=prompt_tokens,
                            error=error, detail=error or "")
    return Sent(request, 3, None, completion)


def test_report_figures_per_turn_and_overall() -> None:
    sent = [_sent(0, 0, 0.4, [0.01, 0.03]), _sent(1, 0, 0.2, [0.02]),
            _sent(2, 1, 0.1, [0.01], prompt_tokens=9), _sent(3, 1, None, [], error="timeout")]
    result = RunResult(model="m", sent=sent, started=10.0, ended=14.0,
                       sent_extras=frozenset({"ignore_eos"}), notes=["n"])
    report = build_report(result, url="http://h/v1", workload="chat", workload_detail="d",
                          turn_name="turn", seed=1, concurrency=2, rate=None, timeout_s=1.0,
                          request_timeout_s=60.0, lmcache=None, notes=[])
    assert (report.requests, report.ok, report.failed, report.failures) == (4, 3, 1, {"timeout": 1})
    assert report.overall.ttft_s.p50 == pytest.approx(0.2)
    assert report.overall.itl_s.p50 == pytest.approx(0.015)  # every gap of the ok requests, pooled
    assert [(t.turn, t.requests, t.failed) for t in report.turns] == [(0, 2, 0), (1, 2, 1)]
    assert report.turns[0].ttft_s.p50 == pytest.approx(0.3)
    assert report.requests_per_s == pytest.approx(0.75)  # 3 ok in 4 s
    assert report.prompt_tokens == 3 + 3 + 9 and report.prompt_tokens_from == "usage and words"
    assert report.ignore_eos and not report.include_usage and report.notes == ["n"]
    record = report.records[0]
    assert (record.start_s, record.end_s, record.output_tokens) == (0.0, 1.0, 3)
    assert (record.itl.count, record.itl.max_s) == (2, 0.03)
    assert report.records[3].error == "timeout" and not report.records[3].ok


def test_hit_ratio_is_the_difference_of_the_counters() -> None:
    before = EngineStats(lookups=5, lookup_hit_chunks=10, lookup_miss_chunks=10)
    after = EngineStats(lookups=9, lookup_hit_chunks=16, lookup_miss_chunks=12)
    figures = lmcache_figures("tcp://x", before, after)
    assert (figures.lookups, figures.hit_chunks, figures.miss_chunks) == (4, 6, 2)
    assert figures.hit_ratio == 0.75
    assert lmcache_figures("tcp://x", after, after).hit_ratio is None
