"""The vLLM releases the connector is tested on are one table (``connector_versions.TESTED``):
docs/vllm.md's compatibility matrix and ``pyproject.toml``'s ``vllm`` extra say what it says, and a
vLLM outside its range gets one warning line (tests/vllm's harness tests check that each release
the table names really ran; tests/vllm/test_connector_logic.py that the connector warns)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcache_core.integration.vllm import connector_versions as cv
from lmcache_core.integration.vllm.connector_versions import TESTED, minor, untested_warning

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("real_engine", "harness", "hybrid", "lmcache_dialect")


def _matrix() -> dict[str, tuple[bool, ...]]:
    """docs/vllm.md's matrix: release -> a mark per column (✓ or —)."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text[text.index("## vLLM versions"):]
    rows: dict[str, tuple[bool, ...]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 1 + len(COLUMNS) and re.fullmatch(r"\d+\.\d+\.\d+", cells[0]):
            assert all(c in {"✓", "—"} for c in cells[1:]), line
            rows[cells[0]] = tuple(c == "✓" for c in cells[1:])
    return rows


def test_the_docs_matrix_is_the_table() -> None:
    assert _matrix() == {t.version: tuple(getattr(t, c) for c in COLUMNS) for t in TESTED}


def test_the_vllm_extra_names_the_tested_range() -> None:
    (spec,) = re.findall(r'(?m)^vllm = \["([^"]*)"\]$', (ROOT / "pyproject.toml").read_text())
    match = re.fullmatch(r"vllm>=(\d+)\.(\d+),<(\d+)\.(\d+)", spec.replace(" ", ""))
    assert match, spec
    lo, hi = cv.tested_range()
    assert (int(match[1]), int(match[2])) == lo
    assert (int(match[3]), int(match[4])) == (hi[0], hi[1] + 1)


def test_the_harness_runs_every_tested_release_and_one_has_a_real_engine() -> None:
    assert tuple(t.version for t in TESTED) == cv.HARNESS_VERSIONS
    assert sum(t.real_engine for t in TESTED) == 1
    assert [minor(t.version) for t in TESTED] == sorted(minor(t.version) for t in TESTED)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu", "0.33.0", "0.34.0", "0.34.2rc1"])
def test_a_tested_release_is_quiet(version: str) -> None:
    assert untested_warning(version) is None


@pytest.mark.parametrize("version", ["0.31.0", "0.35.0", "0.35.0rc1", "1.0.0", "dev", ""])
def test_an_untested_release_gets_one_line_naming_the_range(version: str) -> None:
    warning = untested_warning(version)
    assert warning is not None and "\n" not in warning
    assert f"vLLM {version} " in warning and f"({cv.range_text()})" in warning
    assert cv.range_text() == "0.32 to 0.34"


def test_minor() -> None:
    assert minor("0.10.1.dev12+gabc") == (0, 10)
    assert minor("v0.34.0") == (0, 34)
    assert minor("main") is None
