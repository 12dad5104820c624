"""Config files and values that used to crash or mislead: non-UTF-8 files, unbounded timeouts,
size errors naming the section instead of the key, a bad section hidden by an override."""

from __future__ import annotations

import pytest

from lmcache_core.config import LMCacheConfig, load_config
from lmcache_core.config_parse import MAX_TIMEOUT_S
from lmcache_core.errors import ConfigError


def _error(tmp_path, text: str | bytes, environ: dict[str, str] | None = None,
           overrides: dict[str, object] | None = None) -> str:
    path = tmp_path / "c.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, environ=environ or {})
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    message = _error(tmp_path, b"\xff\xfe bad")
    assert message.startswith(str(tmp_path / "c.yaml")) and "not a UTF-8 text file" in message


TIMEOUT_KEYS = [("timeouts", "connect_s"), ("timeouts", "request_s"), ("timeouts", "lookup_ms"),
                ("timeouts", "lock_ttl_s"), ("timeouts", "load_ms"), ("server", "reap_timeout_s"),
                ("server", "test_copy_delay_ms"), ("remote", "retry_interval_s"),
                ("remote", "timeout_ms"), ("remote", "ttl_s")]


@pytest.mark.parametrize(("section", "key"), TIMEOUT_KEYS)
@pytest.mark.parametrize("value", [".inf", "1.0e+20", "100000000000000000000"])
def test_timeouts_have_an_upper_bound(tmp_path, section, key, value):
    extra = "  url: redis://127.0.0.1:6379\n" if section == "remote" else ""
    message = _error(tmp_path, f"{section}:\n{extra}  {key}: {value}\n")
    assert f"{section}.{key}: " in message, message


def test_timeouts_up_to_a_day_load(tmp_path):
    path = tmp_path / "c.yaml"
    day_ms = int(MAX_TIMEOUT_S * 1000)
    path.write_text(f"timeouts:\n  connect_s: {MAX_TIMEOUT_S}\n  lookup_ms: {day_ms}\n"
                    f"  load_ms: {day_ms}\n")
    config = load_config(path, environ={})
    assert config.timeouts.connect_s == MAX_TIMEOUT_S and config.timeouts.lookup_ms == day_ms
    with pytest.raises(ConfigError, match=r"\$LMCACHE_TIMEOUTS_CONNECT_S: timeouts.connect_s: "):
        load_config(None, environ={"LMCACHE_TIMEOUTS_CONNECT_S": ".inf"})
    with pytest.raises(ConfigError, match=r"timeouts\.request_s: "):
        load_config(None, {"timeouts.request_s": MAX_TIMEOUT_S * 2}, environ={})


@pytest.mark.parametrize(("text", "environ", "needle"), [
    ("", {"LMCACHE_SERVER_POOL_SIZE": "abc"}, "server.pool_size: not a size: 'abc'"),
    ("server:\n  pool_size: lots\n", {}, "server.pool_size: not a size: 'lots'"),
    ("server:\n  max_pinned: -5\n", {}, "server.max_pinned: size must not be negative, got -5"),
    ("server:\n  max_pinned: lots\n", {}, "server.max_pinned: not a size"),
    ("server:\n  slab_size: lots\n", {}, "server.slab_size: not a size: 'lots'"),
    ("server:\n  slab_size: -64\n", {}, "server.slab_size: size must not be negative, got -64"),
    ("server:\n  url: http://x\n", {}, "server.url: must start with tcp:// or ipc://"),
    ("", {"LMCACHE_URL": "udp://x"}, "server.url: must start with tcp:// or ipc://"),
])
def test_bad_server_values_name_the_key(tmp_path, text, environ, needle):
    assert needle in _error(tmp_path, text, environ)


@pytest.mark.parametrize("text", ["server: 5\n", "server: [1]\n", "timeouts: fast\n",
                                  "model: llama\n"])
@pytest.mark.parametrize(("environ", "overrides"), [
    ({}, {}),
    ({"LMCACHE_URL": "ipc:///tmp/x"}, {}),
    ({"LMCACHE_SERVER_WORKERS": "3", "LMCACHE_TIMEOUTS_CONNECT_S": "1",
      "LMCACHE_MODEL_NAME": "m"}, {}),
    ({}, {"server.url": "ipc:///tmp/x", "timeouts.connect_s": 1.0, "model.name": "m"}),
])
def test_an_override_does_not_hide_a_bad_section(tmp_path, text, environ, overrides):
    section = text.split(":")[0]
    message = _error(tmp_path, text, environ, overrides)
    assert f": {section}: Expected `object`" in message, message


def test_an_empty_section_still_takes_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server:\ndisk:\n")
    config = load_config(path, {"disk.path": str(tmp_path)}, environ={"LMCACHE_URL": "ipc:///x"})
    assert config.server.url == "ipc:///x" and config.disk is not None
    assert config.server.workers == LMCacheConfig().server.workers
