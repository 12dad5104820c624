"""Fixtures of the integration tests that more than one module uses (the suite's own are in
``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from lmcache_core.server.app import CacheServer
from tests.integration.dialect import kv_server_with


@pytest.fixture
def kv_server(short_tmp: Path
              ) -> Iterator[tuple[CacheServer, list[np.ndarray], list[msgspec.msgpack.Ext]]]:
    """An in-process server, and two NHD layers in LMCache-named shared memory of this process
    (``/lmcache_kv_<pid>_<n>``) as its ``cpu_shm`` descriptors (``dialect.kv_server_with``)."""
    yield from kv_server_with(short_tmp)
