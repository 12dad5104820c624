from pathlib import Path

import pytest

from lmcache_core.config import LMCacheConfig, env_name, leaf_keys, load_config, parse_size
from lmcache_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    llama = load_config(ROOT / "configs/llama8b.yaml")
    assert (llama.model.num_layers, llama.model.num_kv_heads, llama.model.head_dim) == (32, 8, 128)
    assert llama.chunk_size == 256 and llama.world_size == 1
    assert llama.chunk_bytes == 32 * 2**20
    tiny = load_config(ROOT / "configs/tiny.yaml")
    assert tiny.server.pool_bytes >= tiny.chunk_bytes


def test_defaults_without_file():
    assert load_config(None, environ={}) == LMCacheConfig()


@pytest.mark.parametrize(("text", "needle"), [
    ("chunk_size: [1\n", "YAML syntax error (line"),
    ("chunk_sise: 3\n", "chunk_sise: unknown key"),
    ("server:\n  workerz: 2\n", "server.workerz: unknown key"),
    ("chunk_size: abc\n", "chunk_size: Expected `int`"),
    ("chunk_size: 0\n", "chunk_size: Expected `int` >= 1"),
    ("server:\n  pool_size: 32\n", "server.pool_size: 32 bytes is too small"),
    ("server:\n  pool_size: 1MiB\n  slab_size: 2MiB\n",
     "server.pool_size: 1048576 bytes is smaller than one slab"),
    ("server:\n  slab_size: 100\n", "multiple of 64"),
    ("server:\n  quotas: {m: lots}\n", "server.quotas: not a size"),
    ("server:\n  tenant_quotas: {a: {salt: s, size: lots}}\n",
     "server.tenant_quotas.a.size: not a size"),
    ("server:\n  tenant_quotas: {a: {salt: s, size: -5}}\n",
     "server.tenant_quotas.a.size: size must not be negative"),
    ("server:\n  tenant_quotas: {a: {salt: '', size: 1GiB}}\n",
     "server.tenant_quotas.a: salt must be a non-empty cache_salt"),
    ("server:\n  tenant_quotas: {'': {salt: s, size: 1GiB}}\n",
     "server.tenant_quotas: a tenant's label must not be empty"),
    ("server:\n  tenant_quotas: {a: {salt: s, size: 1}, b: {salt: s, size: 2}}\n",
     "server.tenant_quotas.b: the same salt as tenant_quotas.a"),
    ("server:\n  tenant_quotas: {a: 1GiB}\n", "server.tenant_quotas[...]: Expected `object`"),
    ("server:\n  tenant_quotas: {a: {salt: s, size: 1, max: 2}}\n", "unknown"),
    ("server:\n  pool_size: lots\n", "not a size"),
    ("server:\n  url: http://x\n", "must start with tcp:// or ipc://"),
    ("- 1\n- 2\n", "top level must be a mapping"),
])
def test_bad_files_name_file_and_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert message.startswith(str(path)) and needle in message and "\n" not in message


def test_missing_file():
    with pytest.raises(ConfigError, match="no such config file"):
        load_config("/nonexistent/x.yaml")


def test_precedence_file_env_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\nserver:\n  url: tcp://127.0.0.1:7000\n")
    env = {"LMCACHE_CHUNK_SIZE": "128", "LMCACHE_TIMEOUTS_LOOKUP_MS": "50"}
    config = load_config(path, environ=env)
    assert config.chunk_size == 128 and config.timeouts.lookup_ms == 50
    assert config.server.url == "tcp://127.0.0.1:7000"
    config = load_config(path, {"chunk_size": 32, "server.url": None}, environ=env)
    assert config.chunk_size == 32
    assert load_config(None, environ={"LMCACHE_URL": "ipc:///tmp/a"}).server.url == "ipc:///tmp/a"
    with pytest.raises(ConfigError, match=r"\$LMCACHE_CHUNK_SIZE"):
        load_config(path, environ={"LMCACHE_CHUNK_SIZE": "-4"})


def test_sizes_and_names():
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("512 MiB") == 512 * 2**20
    assert parse_size(100) == 100 and parse_size("2GB") == 2 * 10**9
    with pytest.raises(ValueError):
        parse_size("-1")
    assert "server.url" in leaf_keys() and "timeouts.lock_ttl_s" in leaf_keys()
    assert env_name("timeouts.lookup_ms") == "LMCACHE_TIMEOUTS_LOOKUP_MS"


def test_tiers_are_off_by_default_and_optional(tmp_path):
    default = load_config(None, environ={})
    assert default.disk is None and default.remote is None
    path = tmp_path / "tiers.yaml"
    path.write_text("disk:\n  path: /tmp/lmc\n  max_size: 2GiB\n  write_through: true\n"
                    "remote:\n  url: valkey://cache:6379\n  timeout_ms: 300\n")
    config = load_config(path, environ={})
    assert config.disk is not None and config.disk.max_bytes == 2 * 2**30 and config.disk.write_through
    assert config.remote is not None and config.remote.url == "valkey://cache:6379"
    env = {"LMCACHE_REMOTE_URL": "redis+cluster://a:7000", "LMCACHE_DISK_PATH": "/d"}
    config = load_config(None, environ=env)
    assert config.remote is not None and config.remote.url == "redis+cluster://a:7000"
    assert config.disk is not None and config.disk.path == "/d"
    assert {"disk.path", "remote.url", "remote.timeout_ms"} <= set(leaf_keys())


@pytest.mark.parametrize(("text", "needle"), [
    ("disk:\n  max_size: 1GiB\n", "disk.path: missing required key"),
    ("disk:\n  path: /x\n  max_size: lots\n", "disk.max_size: not a size"),
    ("disk:\n  path: /x\n  max_size: 0\n", "disk.max_size: must be positive"),
    ("disk:\n  path: /x\n  sise: 1\n", "disk.sise: unknown key"),
    ("remote:\n  url: http://x\n", "remote.url: scheme 'http'"),
    ("remote:\n  url: redis://x\n  key_prefix: 'a:b'\n", "remote.key_prefix: must be"),
    ("remote:\n  url: redis://x\n  timeout_ms: 0\n", "remote.timeout_ms: Expected `int` >= 1"),
    ("remote:\n  url: redis://x\n  timeout_ms: 3000\n", "remote.timeout_ms: 3000 ms must be shorter"),
])
def test_bad_tier_settings_name_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value).startswith(str(path)) and needle in str(info.value)


def test_the_server_needs_no_model_and_takes_slabs_and_quotas(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("server:\n  pool_size: 1GiB\n  slab_size: 64MiB\n"
                    "  quotas:\n    meta-llama/Llama-3.1-8B: 256MiB\n    small: 1000\n")
    config = load_config(path)
    assert config.server.slab_bytes == 64 * 2**20
    assert config.server.quota_bytes == {"meta-llama/Llama-3.1-8B": 256 * 2**20, "small": 1000}
    assert load_config(None).server.slab_bytes is None  # auto: the pool picks it


def test_tenant_quotas_are_labelled_salts_and_sizes(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("server:\n  tenant_quotas:\n    team-a: {salt: s3cret-a, size: 256MiB}\n"
                    "    team-b:\n      salt: 'salt with spaces'\n      size: 1000\n")
    config = load_config(path, environ={})
    assert config.server.tenant_quota_bytes == {"team-a": ("s3cret-a", 256 * 2**20),
                                                "team-b": ("salt with spaces", 1000)}
    assert load_config(None, environ={}).server.tenant_quota_bytes == {}
    env = {"LMCACHE_SERVER_TENANT_QUOTAS": "{team-c: {salt: x, size: 2GiB}}"}
    assert load_config(None, environ=env).server.tenant_quota_bytes == {"team-c": ("x", 2 * 2**30)}
