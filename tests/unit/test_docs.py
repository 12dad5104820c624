"""The docs stay true to the code and findable: docs/configuration.md documents every config key and
is exactly what scripts/gen_config_docs.py writes; every relative link in README.md and docs/ names
a file (and a heading) that exists; the README stays a landing page."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lmcache_core.config import leaf_keys

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _generator() -> ModuleType:
    path = ROOT / "scripts" / "gen_config_docs.py"
    spec = importlib.util.spec_from_file_location("gen_config_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, markup and punctuation dropped, spaces
    to dashes (underscores and dashes kept)."""
    text = re.sub(r"[`*]", "", heading.strip().lstrip("#").strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            base = slug(line)
            name, n = base, 1
            while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_every_config_key_has_a_meaning_and_every_meaning_a_key() -> None:
    assert gen.problems() == []
    assert set(gen.MEANINGS) == set(leaf_keys())


def test_configuration_md_is_what_the_generator_writes() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert gen.rewritten(text) == text, "stale: run python scripts/gen_config_docs.py"
    for key in leaf_keys():
        assert f"| `{key}` |" in text


def test_the_generator_flags_an_undocumented_key(monkeypatch: pytest.MonkeyPatch) -> None:
    meanings = dict(gen.MEANINGS)
    del meanings["server.workers"]
    monkeypatch.setattr(gen, "MEANINGS", meanings)
    assert gen.problems() == ["server.workers: no entry in MEANINGS (scripts/gen_config_docs.py)"]
    assert "| `server.workers` |" in gen.render() and "**undocumented**" in gen.render()


def test_the_generated_table_follows_the_code() -> None:
    text = gen.render()
    assert ("| `server.pool_size` | size (bytes, or `4GiB`) | `4GiB` | "
            "`LMCACHE_SERVER_POOL_SIZE`<br>`--pool-size` |") in text
    assert "| `server.url` | str | `tcp://127.0.0.1:5555` | `LMCACHE_SERVER_URL`<br>`--url` |" in text
    assert "`--prefault`, `--no-prefault`" in text
    assert "| `timeouts.load_ms` | int ≥ 0, ≤ 86400000 | `2000` |" in text


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading in {dest.name}")
    return broken


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_name_files_and_headings_that_exist(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## `lmcache ping`\n\n## Ping\n\n## Ping\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#lmcache-ping) [ok](other.md#ping-1) [ok](#page) "
                    "[web](https://example.com/x.md) ![img](missing.png)\n"
                    "[a](gone.md) [b](other.md#nowhere) [c](#nothing)\n"
                    "```\n[in code](ignored.md)\n```\n")
    assert broken_links(page) == ["gone.md: no such file", "other.md#nowhere: no such heading in other.md",
                                  "#nothing: no such heading in page.md"]


def test_slugs_follow_githubs_rules() -> None:
    assert slug("## `lmcache serve`") == "lmcache-serve"
    assert (slug("## One server per node: any model, any TP size")
            == "one-server-per-node-any-model-any-tp-size")
    assert slug("### `scripts/bench_server.py`") == "scriptsbench_serverpy"
    assert slug("## LMCache's client against both servers") == "lmcaches-client-against-both-servers"


def test_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, "README.md: move the detail to docs/ (the map links it)"
    text = "\n".join(lines)
    for command in ("scripts/serve -c configs/llama8b.yaml", "scripts/test", "LMCacheConnector"):
        assert command in text
