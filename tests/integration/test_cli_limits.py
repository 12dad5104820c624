"""The ``lmcache`` entry point on configs and flags that used to end in a traceback or pass when
they should not: one ``error:`` line and exit 2 (bad usage), as any other bad config."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cli import cli

NOWHERE = "ipc:///tmp/lmcache-cli-limits-nowhere.sock"  # never bound: nothing answers there


def test_a_config_that_is_not_utf8_is_one_line_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe bad")
    result = cli("ping", "-c", str(path), "--url", NOWHERE)
    assert result.code == 2, result.err
    assert "not a UTF-8 text file" in result.one_error_line()


@pytest.mark.parametrize("size", ["99999999TiB", "100000TiB"])
def test_serve_with_a_pool_the_machine_cannot_hold_is_one_line_exit_2(tmp_path: Path,
                                                                     size: str) -> None:
    result = cli("serve", "-c", "configs/tiny.yaml", "--url", f"ipc://{tmp_path}/s.sock",
                 "--http-url", "off", "--no-prefault", "--pool-size", size)
    assert result.code == 2, result.err
    assert "server.pool_size: " in result.one_error_line()


@pytest.mark.parametrize("timeout", ["inf", "1e20", "86401"])
def test_ping_timeout_has_an_upper_bound(timeout: str) -> None:
    result = cli("ping", "--url", NOWHERE, "--timeout", timeout)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err and "--timeout" in result.err


@pytest.mark.parametrize("interval", ["inf", "1e20", "86401"])
def test_stats_interval_has_an_upper_bound(interval: str) -> None:
    result = cli("stats", "--url", NOWHERE, "--json", "--interval", interval)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err and "--interval" in result.err


@pytest.mark.parametrize(("env", "text"), [
    ({"LMCACHE_TIMEOUTS_CONNECT_S": ".inf"}, ""),
    ({}, "timeouts:\n  connect_s: .inf\n"),
    ({}, "timeouts:\n  connect_s: 1.0e+20\n"),
])
def test_config_timeouts_have_an_upper_bound(tmp_path: Path, env: dict[str, str],
                                             text: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    result = cli("ping", "-c", str(path), "--url", NOWHERE, env=env)
    assert result.code == 2, result.err
    assert "timeouts.connect_s: " in result.one_error_line()


@pytest.mark.parametrize("how", ["env", "flag"])
def test_a_bad_section_is_not_hidden_by_the_url(tmp_path: Path, how: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("server: 5\n")
    args = ["--url", NOWHERE] if how == "flag" else []
    env = {"LMCACHE_URL": NOWHERE} if how == "env" else {}
    result = cli("ping", "-c", str(path), "--timeout", "0.1", *args, env=env)
    assert result.code == 2, result.err
    assert "server: Expected `object`, got `int`" in result.one_error_line()


def test_bad_sizes_name_the_key() -> None:
    result = cli("ping", "--url", NOWHERE, env={"LMCACHE_SERVER_POOL_SIZE": "abc"})
    assert result.code == 2, result.err
    assert "server.pool_size: not a size: 'abc'" in result.one_error_line()


@pytest.mark.parametrize(("option", "value"), [("--seed", str(2**70)), ("--threads", "99999"),
                                               ("--cpu-workers", "100000")])
def test_store_bench_counts_have_an_upper_bound(option: str, value: str) -> None:
    result = cli("store-bench", "--gpus", "cpu", "--url", NOWHERE, option, value)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err and option in result.err
