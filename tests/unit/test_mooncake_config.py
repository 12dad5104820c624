"""The remote tier's choice of store by ``remote.url`` (``mooncake://`` for Mooncake Store, its
settings in ``remote.mooncake``), and a Mooncake config without the extra installed: a ConfigError
naming what to install (tests/integration/test_mooncake_tier.py runs the tier itself)."""

from __future__ import annotations

import sys

import pytest

from lmcache_core.config import load_config
from lmcache_core.errors import ConfigError
from lmcache_core.storage.mooncake_tier import store_module


def test_a_mooncake_url_chooses_mooncake_store_with_its_defaults() -> None:
    remote = load_config(overrides={"remote.url": "mooncake://10.0.0.1:50051"}).remote
    assert remote is not None and remote.kind == "mooncake"
    assert remote.mooncake is not None
    assert (remote.mooncake.protocol, remote.mooncake.replicas) == ("tcp", 1)
    assert remote.mooncake.segment_bytes == 2**30
    redis = load_config(overrides={"remote.url": "redis://127.0.0.1:6379"}).remote
    assert redis is not None and redis.kind == "redis" and redis.mooncake is None


def test_mooncake_settings_from_the_environment() -> None:
    config = load_config(environ={"LMCACHE_REMOTE_URL": "mooncake://h:1",
                                  "LMCACHE_REMOTE_MOONCAKE_REPLICAS": "2",
                                  "LMCACHE_REMOTE_MOONCAKE_SEGMENT_SIZE": "64MiB"})
    assert config.remote is not None and config.remote.mooncake is not None
    assert (config.remote.mooncake.replicas, config.remote.mooncake.segment_bytes) == (2, 64 * 2**20)


@pytest.mark.parametrize(("overrides", "names"), [
    ({"remote.url": "mooncake://h"}, "remote.url"),  # no port
    ({"remote.url": "mooncake://h:1/x"}, "remote.url"),
    ({"remote.url": "redis://h:1", "remote.mooncake.replicas": 2}, "only with a mooncake:// url"),
    ({"remote.url": "mooncake://h:1", "remote.ttl_s": 60}, "remote.ttl_s: Redis only"),
    ({"remote.url": "mooncake://h:1", "remote.cluster": True}, "remote.cluster: Redis only"),
    ({"remote.url": "mooncake://h:1", "remote.mooncake.protocol": "udp"}, "remote.mooncake.protocol"),
    ({"remote.url": "mooncake://h:1", "remote.mooncake.segment_size": 0}, "segment_size"),
    ({"remote.url": "mooncake://h:1", "remote.mooncake.replicas": 0}, "remote.mooncake.replicas"),
])
def test_bad_mooncake_settings_are_refused_naming_the_key(overrides: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        load_config(overrides=overrides)


def test_without_the_extra_the_error_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")  # (what store_module sets: kept to this test)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if not installed: import fails
    with pytest.raises(ConfigError, match=r"lmcache-toolkit\[mooncake\].*libibverbs1 librdmacm1"):
        store_module()
