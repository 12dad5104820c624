"""The ``lmcache`` commands against a real ``lmcache serve``: outputs, exit codes, error lines.

Most runs are subprocesses (``python -m lmcache_cli``), so exit codes, stderr and the no-torch rule
are checked as a user sees them; input errors that need no server use Typer's CliRunner in-process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lmcache_cli import store_bench
from lmcache_cli.config_flags import config_flags
from lmcache_cli.main import app
from lmcache_core import __version__
from lmcache_core.config import leaf_keys
from lmcache_core.errors import LMCacheError
from lmcache_core.transport.client import MessageQueueClient
from tests.harness import wait_until
from tests.integration.cli import ROOT, assert_no_torch, cli
from tests.integration.servers import TINY, ServerProcess

CHUNK = TINY["chunk_size"]
runner = CliRunner()
pytestmark = pytest.mark.server_config(
    # 8 slabs of 1 MiB: the runs of one and of two workers store pieces of two sizes (classes),
    # each in slabs of its own (one 8 MiB slab would make each size evict the other's pieces)
    {"server": {"slab_size": "1MiB"}})


@pytest.fixture(scope="module")
def cfg(server: ServerProcess) -> str:
    return str(server.config_path)


@pytest.fixture(scope="module")
def bench(server: ServerProcess, cfg: str, module_tmp: Path) -> dict[str, Any]:
    """One small CPU store-bench run (its JSON report), and the prompts it stored."""
    tokens = module_tmp / "stored.json"
    result = cli("store-bench", "-c", cfg, "--gpus", "cpu", "--chunks", "4", "--rounds", "2",
                 "--warmup", "1", "--lookups", "3", "--tokens-out", str(tokens), "--json")
    assert result.code == 0, result.err
    return {"report": result.json(), "tokens": tokens, "err": result.err}


# ---------------------------------------------------------------------- everywhere


def test_version_and_every_help_has_an_example() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"lmcache {__version__}"
    for command in ("serve", "ping", "lookup", "inspect-chunks", "store-bench"):
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "Example: lmcache " + command in result.output, result.output
        assert "--config" in result.output and "--url" in result.output


def test_shell_completion_is_offered() -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert "--install-completion" in result.output and "--show-completion" in result.output


def test_unknown_flag_is_a_usage_error() -> None:
    assert runner.invoke(app, ["ping", "--nope"]).exit_code == 2
    assert runner.invoke(app, ["ping", "--count", "0"]).exit_code == 2


@pytest.mark.parametrize("command", [["ping"], ["lookup", "--tokens", "-"], ["inspect-chunks"],
                                     ["store-bench", "--gpus", "cpu"], ["serve"]])
def test_bad_config_is_one_line_and_exit_2(command: list[str], module_tmp: Path) -> None:
    bad = module_tmp / "bad.yaml"
    bad.write_text("model:\n  num_layerz: 2\n")
    result = cli(*command, "-c", str(bad), stdin="[1, 2]")
    assert result.code == 2
    assert "model.num_layerz: unknown key" in result.one_error_line()


@pytest.mark.parametrize("command", [["ping"], ["lookup", "--tokens", "-"], ["inspect-chunks"],
                                     ["store-bench", "--gpus", "cpu"]])
def test_unreachable_server_is_one_line_and_exit_1(command: list[str], module_tmp: Path) -> None:
    url = f"ipc://{module_tmp}/nobody.sock"
    result = cli(*command, "--url", url, env={"LMCACHE_TIMEOUTS_CONNECT_S": "0.3"},
                 stdin="[1, 2]")
    assert result.code == 1
    assert f"no lmcache server answered at {url}" in result.one_error_line()


# ---------------------------------------------------------------------- ping


def test_ping_json_count_and_no_torch(server: ServerProcess, cfg: str) -> None:
    result = cli("ping", "-c", cfg, "--count", "3", "--json", importtime=True)
    assert result.code == 0, result.err
    assert_no_torch(result)
    data = json.loads(result.out)
    assert data["ok"] is True and data["count"] == 3 and data["chunk_size"] == CHUNK
    assert 0 < data["rtt_ms_min"] <= data["rtt_ms_median"] <= data["rtt_ms_max"]


def test_ping_table_and_url_from_environment(server: ServerProcess) -> None:
    result = cli("ping", env={"LMCACHE_URL": server.url})
    assert result.code == 0 and result.out.startswith(f"ok {server.url}: rtt"), result.err


def test_ping_unreachable_json_says_why(module_tmp: Path) -> None:
    result = cli("ping", "--url", f"ipc://{module_tmp}/nobody.sock", "--timeout", "0.3", "--json")
    assert result.code == 1
    data = json.loads(result.out)
    assert data["ok"] is False and "no lmcache server answered" in data["error"]


# ---------------------------------------------------------------------- lookup


@pytest.mark.parametrize(("content", "expected"), [
    (None, "no such file"),
    ("[1, 2", "not valid JSON (line 1, column 6)"),
    ("[1, -1]", "prompt, position 1: -1 is not a token id"),
    ("[[1], [2, 4294967296]]", "prompt 1, position 1: 4294967296 is not a token id"),
    ("[1, 2.5]", "position 1: 2.5 is not a token id"),
    ('[1, "7"]', 'position 1: "7" is not a token id'),
    ("[true]", "position 0: true is not a token id"),
    ('{"tokens": [1]}', "expected a list of token ids, a list of such lists, or"),
    ('{"prompts": []}', '"prompts" is empty'),
    ('{"prompts": [[1]], "world_size": 0}', '"world_size" must be a positive integer, got 0'),
    ('{"prompts": [[1]], "model": 3}', '"model" must be a non-empty string'),
    ('{"prompts": [[1]], "extra": 1}', "got an object with keys"),
    ('"hello"', "got a string"),
])
def test_lookup_bad_tokens_file_is_one_line_and_exit_2(content: str | None, expected: str,
                                                       tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(app, ["lookup", "--tokens", str(path), "--url", "ipc:///nonexistent"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), result.stderr
    assert expected in lines[0]


def test_lookup_misses_json_and_no_torch(server: ServerProcess, cfg: str) -> None:
    prompts = {"prompts": [list(range(7, 7 + 3 * CHUNK + 5)), [1, 2, 3]]}
    result = cli("lookup", "-c", cfg, "--tokens", "-", "--json", stdin=json.dumps(prompts),
                 importtime=True)
    assert result.code == 0, result.err
    assert_no_torch(result)
    data = json.loads(result.out)
    assert data["model"] == TINY["model"]["name"] and data["chunk_size"] == CHUNK
    first, second = data["prompts"]
    assert (first["tokens"], first["full_chunks"], first["hit_chunks"]) == (3 * CHUNK + 5, 3, 0)
    assert first["lookup_ms"] > 0
    assert (second["full_chunks"], second["hit_chunks"], second["lookup_ms"]) == (0, 0, None)


def test_lookup_finds_what_store_bench_stored_and_leaves_no_locks(
        bench: dict[str, Any], cfg: str) -> None:
    stored = json.loads(bench["tokens"].read_text())["prompts"]
    assert len(stored) == 3 and all(len(p) == 4 * CHUNK for p in stored)  # warm-up + 2 rounds
    result = cli("lookup", "-c", cfg, "--tokens", str(bench["tokens"]), "--json")
    assert result.code == 0, result.err
    rows = result.json()["prompts"]
    assert [(r["full_chunks"], r["hit_chunks"], r["hit_tokens"]) for r in rows] == [
        (4, 4, 4 * CHUNK)] * 3
    table = cli("lookup", "-c", cfg, "--tokens", str(bench["tokens"]))
    assert table.code == 0 and "hit chunks" in table.out and "100%" in table.out
    other = cli("lookup", "-c", cfg, "--tokens", str(bench["tokens"]), "--model", "other",
                "--json")
    assert [r["hit_chunks"] for r in other.json()["prompts"]] == [0, 0, 0]
    wider = cli("lookup", "-c", cfg, "--tokens", str(bench["tokens"]), "--world-size", "2",
                "--json")
    # TP=1 pieces hold every head: each of two ranks reads its half of them
    assert [r["hit_chunks"] for r in wider.json()["prompts"]] == [4, 4, 4]
    odd = cli("lookup", "-c", cfg, "--tokens", str(bench["tokens"]), "--world-size", "3",
              "--json")
    assert [r["hit_chunks"] for r in odd.json()["prompts"]] == [0, 0, 0]  # 4 heads / 3 ranks
    summary = cli("inspect-chunks", "-c", cfg, "--json").json()["summary"]
    assert summary["locks_held"] == 0


def test_two_cpu_workers_store_as_world_size_2_and_lookup_follows_the_tokens_file(
        server: ServerProcess, cfg: str, module_tmp: Path) -> None:
    """The config says world size 1, store-bench runs 2 workers (ranks 0 and 1 of world size 2):
    it says so, its tokens file carries the model and world size, and lookup uses them."""
    tokens = module_tmp / "two-ranks.json"
    result = cli("store-bench", "-c", cfg, "--gpus", "cpu", "--cpu-workers", "2", "--chunks", "2",
                 "--rounds", "1", "--warmup", "0", "--lookups", "1", "--tokens-out", str(tokens))
    assert result.code == 0, result.err
    assert "world size 2 (one rank per worker; the config says 1)" in " ".join(result.out.split())
    data = json.loads(tokens.read_text())
    assert (data["model"], data["world_size"]) == (TINY["model"]["name"], 2)
    found = cli("lookup", "-c", cfg, "--tokens", str(tokens), "--json").json()
    assert found["world_size"] == 2 and [r["hit_chunks"] for r in found["prompts"]] == [2]
    # the flag wins: one rank of world size 1 reads both ranks' pieces; 3 ranks cannot split
    # the 4 heads
    forced = cli("lookup", "-c", cfg, "--tokens", str(tokens), "--world-size", "1", "--json")
    assert forced.json()["world_size"] == 1
    assert [r["hit_chunks"] for r in forced.json()["prompts"]] == [2]
    odd = cli("lookup", "-c", cfg, "--tokens", str(tokens), "--world-size", "3", "--json")
    assert [r["hit_chunks"] for r in odd.json()["prompts"]] == [0]
    assert cli("inspect-chunks", "-c", cfg, "--json").json()["summary"]["locks_held"] == 0


def test_tier_sections_import_neither_torch_nor_redis(server: ServerProcess, module_tmp: Path) -> None:
    """A config with disk: and remote: sections (as the server's may have) is checked without
    importing the tiers: ping, lookup and inspect-chunks still import neither torch nor redis."""
    config = yaml.safe_load(server.config_path.read_text())
    config["disk"] = {"path": str(module_tmp / "disk"), "max_size": "1GiB"}
    config["remote"] = {"url": "redis+cluster://127.0.0.1:7000", "key_prefix": "cli"}
    tiered = module_tmp / "tiered.yaml"
    tiered.write_text(yaml.safe_dump(config))
    prompts = json.dumps([list(range(3, 3 + 2 * CHUNK))])
    for args in (["ping"], ["lookup", "--tokens", "-"], ["inspect-chunks"]):
        result = cli(*args, "-c", str(tiered), "--json", stdin=prompts, importtime=True)
        assert result.code == 0, (args, result.err[-2000:])
        assert_no_torch(result)
    config["remote"]["url"] = "http://127.0.0.1:7000"
    tiered.write_text(yaml.safe_dump(config))
    bad = cli("ping", "-c", str(tiered))  # the url is still checked
    assert bad.code == 2 and "remote.url" in bad.one_error_line(), bad.err


# ---------------------------------------------------------------------- store-bench


def test_store_bench_report(bench: dict[str, Any]) -> None:
    report = bench["report"]
    assert report["ok"] is True and report["world_size"] == 1 and report["chunks"] == 4
    assert "no CUDA" not in bench["err"]  # --gpus cpu was asked for: no note
    (worker,) = report["workers"]
    chunk_bytes = report["chunk_bytes"]
    assert chunk_bytes == 2 * 2 * CHUNK * 4 * 32 * 2  # K+V, 2 layers, 4 heads x 32 dim, fp16
    assert worker["device"] == "cpu" and worker["mismatched_bytes"] == 0
    assert worker["verified_bytes"] == 3 * 4 * chunk_bytes  # every round, warm-up included
    for key in ("store_gbps", "retrieve_gbps", "raw_gather_gbps", "raw_scatter_gbps",
                "store_p50_ms", "store_p99_ms", "retrieve_p50_ms", "lookup_p50_ms",
                "store_vs_raw", "retrieve_vs_raw"):
        assert worker[key] > 0, key
    assert worker["store_p50_ms"] <= worker["store_p99_ms"]
    assert report["total"]["verified_bytes"] == worker["verified_bytes"]


def test_store_bench_table_and_the_cpu_default(server: ServerProcess, cfg: str) -> None:
    if store_bench._cuda_devices():
        pytest.skip("CUDA is visible: the default is the GPUs")
    result = cli("store-bench", "-c", cfg, "--chunks", "2", "--rounds", "1", "--warmup", "0",
                 "--lookups", "1")
    assert result.code == 0, result.err
    assert result.err.strip().splitlines()[0] == (
        "no CUDA device found: running on CPU (as --gpus cpu)")
    for text in ("store GB/s", "raw gather GB/s", "store / raw", "retrieve / raw",
                 "lookup p50 / p99 ms", "ok: every byte matched"):
        assert text in result.out


@pytest.mark.parametrize(("args", "expected"), [
    (["--gpus", "0,x"], "expected GPU indices like 0,1"),
    (["--gpus", "0,0"], "listed once"),
    (["--chunks", "100000"], "lower --chunks"),
    (["--block-size", "3"], "does not divide the server's chunk size"),
])
def test_store_bench_bad_usage_exit_2(args: list[str], expected: str, cfg: str) -> None:
    result = cli("store-bench", "-c", cfg, *args)
    assert result.code == 2
    assert expected in result.one_error_line()


def test_store_bench_more_than_the_server_pool_exit_2(server: ServerProcess) -> None:
    """llama8b's chunk of the server's 64 tokens is 8 MiB for one worker: one fits the 8 MiB pool
    (an extent of its 1 MiB units), 16 do not. Split over 8 workers, 1 MiB each, 16 chunks x 8
    workers do not fit either."""
    llama = ("store-bench", "-c", str(ROOT / "configs/llama8b.yaml"), "--url", server.url)
    result = cli(*llama, "--gpus", "cpu")
    assert result.code == 2
    assert ("1 worker(s) x 16 chunks = 16 chunks of 8388608 bytes, but the server's pool "
            "(8388608 bytes) holds about 1: lower --chunks") in result.one_error_line()
    split = cli(*llama, "--gpus", "cpu", "--cpu-workers", "8")
    assert split.code == 2
    assert ("8 worker(s) x 16 chunks = 128 chunks of 1048576 bytes, but the server's pool "
            "(8388608 bytes) holds about 8: lower --chunks") in split.one_error_line()


def test_store_bench_gpu_missing_exit_2(cfg: str) -> None:
    if store_bench._cuda_devices():
        pytest.skip("CUDA is visible")
    result = cli("store-bench", "-c", cfg, "--gpus", "0")
    assert result.code == 2 and "GPU 0 is not visible" in result.one_error_line()


def test_store_bench_exit_1_when_bytes_differ(monkeypatch: pytest.MonkeyPatch, cfg: str) -> None:
    """The verdict, without corrupting a real server: the workers' results are faked."""
    def fake_run(specs: list[Any], show_progress: bool) -> tuple[dict[int, Any], dict[int, str]]:
        rnd = {name: [0.001, 0.002] for name in ("store", "retrieve", "gather", "scatter")}
        result = {"rounds": [rnd], "lookup_ops": [0.0002], "lookup_hits_ok": True,
                  "lookup_hits_min": 2, "verified_bytes": 100, "mismatched_bytes": 3,
                  "already_present": 0, "problems": ["round 0: 3 of 100 bytes differ"],
                  "torch_threads": 1}
        return {0: result}, {}

    monkeypatch.setattr(store_bench, "_run_workers", fake_run)
    result = runner.invoke(app, ["store-bench", "-c", cfg, "--gpus", "cpu", "--chunks", "2",
                                 "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["workers"][0]["mismatched_bytes"] == 3


def test_store_bench_parent_needs_no_torch_and_a_worker_error_exits_1(cfg: str) -> None:
    """The parent (checks, spawning, report) without torch; the workers are faked in-process."""
    code = (
        "import sys\n"
        "from lmcache_cli import store_bench\n"
        "from lmcache_cli.main import app\n"
        "store_bench._run_workers = lambda specs, show_progress: ({}, {0: 'boom: it broke'})\n"
        "try:\n"
        f"    app(['store-bench', '-c', {cfg!r}, '--gpus', 'cpu', '--chunks', '2'])\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert proc.stdout.strip().splitlines()[-1] == "exit 1 False", proc.stdout + proc.stderr
    assert "worker 0: boom: it broke" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------- inspect-chunks


def test_inspect_chunks_json_filters_and_sorts(bench: dict[str, Any], cfg: str) -> None:
    result = cli("inspect-chunks", "-c", cfg, "--json", importtime=True)
    assert result.code == 0, result.err
    assert_no_torch(result)
    data = result.json()
    summary = data["summary"]
    assert summary["total"] >= 12 and summary["pool_bytes"] == 8 * 2**20
    assert (summary["slab_bytes"], summary["slabs"]) == (2**20, 8)
    assert 0 < summary["bytes_used"] <= summary["pool_bytes_allocated"] <= summary["pool_bytes"]
    chunk = data["chunks"][0]
    assert set(chunk) >= {"chunk_hash", "model_name", "layout", "head_lo", "head_hi", "tier",
                          "nbytes", "locks", "hits", "age_s"}
    assert len(bytes.fromhex(chunk["chunk_hash"])) == 32
    assert (chunk["model_name"], chunk["layout"]) == (TINY["model"]["name"], "float16:2x4x32")
    # heads 0-4 from one worker, 0-2 or 2-4 from the two-worker run (world size 2)
    assert (chunk["head_lo"], chunk["head_hi"]) in {(0, 4), (0, 2), (2, 4)}
    assert 0 < summary["pool_use"] <= 1 and summary["hit_rate"] is not None
    [model] = data["models"]
    assert model["model_name"] == TINY["model"]["name"] and model["layouts"] == ["float16:2x4x32"]
    assert model["pieces"] == summary["pieces_in_pool"] and model["bytes_used"] == summary["bytes_used"]
    assert model["quota_bytes"] is None
    by_hits = cli("inspect-chunks", "-c", cfg, "--json", "--sort", "hits", "--limit", "5").json()
    hits = [c["hits"] for c in by_hits["chunks"]]
    assert len(hits) == 5 and hits == sorted(hits, reverse=True)
    none = cli("inspect-chunks", "-c", cfg, "--json", "--model", "no-such-model").json()
    assert none["chunks"] == [] and none["summary"]["total"] == 0


def test_inspect_chunks_table(bench: dict[str, Any], cfg: str) -> None:
    result = cli("inspect-chunks", "-c", cfg, "--limit", "3", "--sort", "size")
    assert result.code == 0, result.err
    for text in ("hash", "model", "layout", "heads", "0-4", "float16:2x4x32", "tier", "size",
                 "locks", "hits", "age", "3 of ", "piece(s) shown", "allocated", "slabs free",
                 "share", "quota", "hit rate"):
        assert text in result.out, result.out
    assert runner.invoke(app, ["inspect-chunks", "--sort", "weight"]).exit_code == 2


def test_inspect_chunks_into_a_pipe_is_never_cut(bench: dict[str, Any], cfg: str) -> None:
    """Into a file or a CI log (stdout a pipe, no COLUMNS), rich would fit the table into 80
    columns and cut its cells ("floa…"): the console renders piped output at full width."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS" and not k.startswith("LMCACHE_")}
    proc = subprocess.run([sys.executable, "-m", "lmcache_cli", "inspect-chunks", "-c", cfg,
                           "--limit", "3"], capture_output=True, text=True, cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "float16:2x4x32" in proc.stdout and "…" not in proc.stdout, proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) > 80  # wider than it would be cut


# ---------------------------------------------------------------------- serve


def test_every_config_key_has_a_serve_flag() -> None:
    assert {f.key for f in config_flags()} | {"server.url"} == set(leaf_keys())


def test_serve_print_config_merges_file_set_and_flags(cfg: str) -> None:
    result = cli("serve", "-c", cfg, "--print-config", "--set", "server.workers=7",
                 "--set", "timeouts.lock_ttl_s=9.5", "--workers", "3", "--pool-size", "16MiB",
                 "--model-use-mla", "--model-dtype", "bfloat16", "--url", "tcp://127.0.0.1:7000",
                 env={"LMCACHE_TIMEOUTS_LOOKUP_MS": "77"})
    assert result.code == 0, result.err
    merged = yaml.safe_load(result.out)
    assert merged["server"]["workers"] == 3  # the flag beats --set
    assert merged["server"]["pool_size"] == 16 * 2**20
    assert merged["server"]["url"] == "tcp://127.0.0.1:7000"
    assert merged["timeouts"] == {**TINY["timeouts"], "lock_ttl_s": 9.5, "lookup_ms": 77,
                                  "load_ms": 2000, "lookup_wait_us": 2000}  # the defaults
    assert merged["model"]["use_mla"] is True and merged["model"]["dtype"] == "bfloat16"
    assert merged["model"]["name"] == TINY["model"]["name"]


def test_serve_mappings_and_lists_are_given_as_yaml(cfg: str) -> None:
    result = cli("serve", "-c", cfg, "--print-config", "--set", "server.quotas={tiny: 4MiB}",
                 "--tenant-quotas", "{acme: {salt: s1, size: 1MiB}, other: {salt: s2, size: 2048}}")
    assert result.code == 0, result.err
    merged = yaml.safe_load(result.out)
    assert merged["server"]["quotas"] == {"tiny": 4 * 2**20}
    assert merged["server"]["tenant_quotas"] == {"acme": {"salt": "s1", "size": 2**20},
                                                 "other": {"salt": "s2", "size": 2048}}


@pytest.mark.parametrize(("args", "expected"), [
    (["--set", "server.quotas={tiny: [}"], "--set server.quotas={tiny: [}: not YAML"),
    (["--set", "server.quotas=4MiB"], "expected a YAML mapping, e.g. '{name: 10GiB}'"),
    (["--tenant-quotas", "[1, 2]"], "--tenant-quotas [1, 2]: expected a YAML mapping"),
    (["--set", "server.quotas={tiny: lots}"], "server.quotas"),
    (["--set", "nope=1"], "unknown config key 'nope'"),
    (["--set", "server.workers"], "expected key=value"),
    (["--set", "server.workers=many"], "--set server.workers=many: expected an integer"),
    (["--set", "model.use_mla=perhaps"], "expected true or false"),
    (["--chunk-size", "0"], "chunk_size: Expected `int` >= 1"),
    (["--pool-size", "32"], "server.pool_size: 32 bytes is"),
    (["--pool-size", "1KiB", "--set", "server.slab_size=1MiB"], "smaller than one slab"),
])
def test_serve_bad_overrides_exit_2(args: list[str], expected: str, cfg: str) -> None:
    result = runner.invoke(app, ["serve", "-c", cfg, "--print-config", *args])
    assert result.exit_code == 2, result.output
    assert expected in result.stderr, result.stderr


def test_serve_flag_of_the_wrong_type_exit_2(cfg: str) -> None:
    assert runner.invoke(app, ["serve", "-c", cfg, "--workers", "many"]).exit_code == 2
    assert runner.invoke(app, ["serve", "-c", cfg, "--model-dtype", "int4"]).exit_code == 2


def test_serve_runs_with_flags_and_exits_0_on_sigterm(module_tmp: Path, cfg: str) -> None:
    url = f"ipc://{module_tmp}/flags.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache_cli", "serve", "-c", cfg, "--url", url, "--workers", "1",
         "--set", "timeouts.lock_ttl_s=5", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"})
    try:
        def answers(client: MessageQueueClient) -> bool:
            assert proc.poll() is None, proc.communicate()[0]
            with contextlib.suppress(LMCacheError):  # a ping per try (not a CLI process each)
                return client.wait_until_reachable(0.5) is not None
            return False

        with MessageQueueClient(url, connect_timeout_s=0.5) as client:
            wait_until(lambda: answers(client), 120, "the server did not answer")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert "ready" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_cannot_bind_exit_1(cfg: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("serve", "-c", cfg, "--url", f"tcp://127.0.0.1:{port}")
    assert result.code == 1
    assert "Address already in use" in result.one_error_line()
