"""The docs stay true to the code and findable: docs/configuration.md documents every config key and
is exactly what scripts/gen/gen_config_docs.py writes (the generator runs as a process, as a user
runs it); every relative link in README.md and docs/ names a file (and a heading) that exists; the
README stays a landing page."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_core.config import leaf_keys

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
GENERATOR = Path("scripts") / "gen" / "gen_config_docs.py"  # relative to a checkout's root


def generate(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the generator of the checkout at ``root`` (it writes ``root``'s docs/configuration.md;
    ``--check``: exit 1 when that file is stale or a key has no meaning)."""
    return subprocess.run([sys.executable, str(root / GENERATOR), *args], capture_output=True,
                          text=True, timeout=120, check=False)


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


def test_configuration_md_is_what_the_generator_writes_and_every_key_has_a_meaning() -> None:
    # --check fails on a key without a meaning, a meaning without a key, and a stale page
    check = generate(ROOT, "--check")
    assert check.returncode == 0, f"stale: run python {GENERATOR}\n{check.stderr}"
    text = (ROOT / "docs" / "configuration.md").read_text()
    for key in leaf_keys():
        assert f"| `{key}` |" in text


def test_the_generator_flags_an_undocumented_key(tmp_path: Path) -> None:
    """A copy of the checkout's generator and page, one meaning deleted: --check names the key and
    the stale page; a run writes the key's row as undocumented."""
    source = (ROOT / GENERATOR).read_text()
    assert "\ndef problems()" in source
    (tmp_path / GENERATOR).parent.mkdir(parents=True)
    (tmp_path / GENERATOR).write_text(source.replace(
        "\ndef problems()", '\ndel MEANINGS["server.workers"]\n\n\ndef problems()', 1))
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "configuration.md", tmp_path / "docs" / "configuration.md")
    check = generate(tmp_path, "--check")
    assert check.returncode == 1
    assert check.stderr.splitlines()[0] == (
        "gen_config_docs: server.workers: no entry in MEANINGS (scripts/gen/gen_config_docs.py)")
    assert "is stale" in check.stderr
    assert generate(tmp_path).returncode == 1  # it writes the page, and still names the key
    row = next(line for line in (tmp_path / "docs" / "configuration.md").read_text().splitlines()
               if line.startswith("| `server.workers` |"))
    assert row.endswith("| **undocumented** |"), row


def test_the_generated_table_follows_the_code() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()  # what the generator writes (above)
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
    assert slug("### `scripts/bench/bench_server.py`") == "scriptsbenchbench_serverpy"
    assert slug("## LMCache's client against both servers") == "lmcaches-client-against-both-servers"


def test_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, "README.md: move the detail to docs/ (the map links it)"
    text = "\n".join(lines)
    for command in ("scripts/serve -c configs/llama8b.yaml", "scripts/test", "LMCacheConnector"):
        assert command in text
