"""The package's import graph: no circle (TYPE_CHECKING imports included), and the import
directions that matter (DESIGN.md section 6) hold, transitively:

- the protocol imports no torch and no ``kv`` (a command that only talks to the server never loads
  torch);
- the config imports no storage;
- storage imports no transport;
- the engine imports neither the protocol nor the server (wire structs are built in the server);
- the clients (``lmcache_core.client``) import no vLLM and nothing of the server side, the vLLM
  connector or the CLI (they sit beside the server: the connector and the CLI are built on them),
  and importing them (or LMCache's path of them) loads no torch.

Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too, so those count as imported.
Imports inside functions count as well: a lazy import still ties the layers together."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lmcache_core", "lmcache_cli")


def _modules(root: Path | None = None) -> dict[str, Path]:
    root = root or ROOT
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (``from a import b`` names ``a.b`` when that is a
    module, else ``a``)."""
    return {target for target in _all_imports(name, path, modules)
            if target in modules and target != name}


def _all_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module name ``name``'s source imports, the package's own and third parties'."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + int(is_package)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["lmcache_core.engine.store"], "the import scan found nothing: it is broken"
    assert _cycles(graph) == []


def test_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ---------------------------------------------------------------- import directions


@functools.lru_cache(maxsize=2)
def _runtime_graph(root: Path) -> tuple[dict[str, Path], dict[str, set[str]]]:
    """The modules under ``root``, and what importing each loads directly: its imports (third
    parties by their top-level name), and the ``__init__`` of each package above it and above each
    module it imports."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for target in _all_imports(name, path, modules):
            if target in modules:
                targets.add(target)
            elif not target.startswith(PACKAGES):
                targets.add(target.split(".")[0])
        targets |= {parent for target in [name, *targets] for parent in _parents(target)
                    if parent in modules}
        targets.discard(name)
        graph[name] = targets
    return modules, graph


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """Each import by which importing a module of ``sources`` loads one of ``forbidden``, named by
    the shortest chain from a source module to the module that makes it, e.g.
    ``a.x -> a.y imports b.z`` (one line per importing module and forbidden module)."""
    modules, graph = _runtime_graph(ROOT)
    crossings: dict[tuple[str, str], list[str]] = {}
    starts = sorted(n for n in modules if _within(n, sources))
    came_from: dict[str, str | None] = dict.fromkeys(starts)
    todo = deque(starts)
    while todo:  # breadth first: each module is reached by a shortest chain
        node = todo.popleft()
        for target in sorted(graph.get(node, ())):
            if _within(target, forbidden):
                chain = [node]
                while (back := came_from[chain[-1]]) is not None:
                    chain.append(back)
                crossings.setdefault((node, target), chain[::-1])
            elif target in graph and target not in came_from:
                came_from[target] = node
                todo.append(target)
    # One line per way out: per source module and the first module its chain goes through (or
    # the forbidden module itself, imported directly), the shortest chain.
    shortest: dict[tuple[str, str], str] = {}
    for (_, target), chain in sorted(crossings.items(),
                                     key=lambda kv: (len(kv[1]), kv[0][0], -len(kv[0][1]))):
        crossed = next(f for f in forbidden if _within(target, (f,)))
        way = (chain[0], chain[1] if len(chain) > 1 else crossed)
        shortest.setdefault(way, f"{' -> '.join(chain)} imports {target}")
    return sorted(shortest.values())


def test_the_direction_finder_follows_chains_and_package_inits(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    for rel, text in {"lmcache_core/__init__.py": "", "lmcache_core/low/__init__.py": "",
                      "lmcache_core/low/a.py": "from lmcache_core.mid import b\n",
                      "lmcache_core/mid/__init__.py": "from lmcache_core.mid import c\n",
                      "lmcache_core/mid/b.py": "",
                      "lmcache_core/mid/c.py": "def f():\n    import torch\n",
                      "lmcache_cli/__init__.py": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations(("lmcache_core.low",), ("torch",)) == [
        "lmcache_core.low.a -> lmcache_core.mid -> lmcache_core.mid.c imports torch"]
    assert _violations(("lmcache_core.mid.b",), ("torch",)) == [
        "lmcache_core.mid.b -> lmcache_core.mid -> lmcache_core.mid.c imports torch"]
    assert _violations(("lmcache_core.low",), ("numpy",)) == []


def test_the_protocol_imports_no_torch_and_no_kv():
    assert _violations(("lmcache_core.protocol",), ("torch", "lmcache_core.kv")) == []


def test_the_config_imports_no_storage():
    assert _violations(("lmcache_core.config", "lmcache_core.config_parse"),
                       ("lmcache_core.storage",)) == []


def test_storage_imports_no_transport():
    assert _violations(("lmcache_core.storage",), ("lmcache_core.transport",)) == []


def test_the_engine_imports_no_protocol_and_no_server():
    assert _violations(("lmcache_core.engine",),
                       ("lmcache_core.protocol", "lmcache_core.server")) == []


def test_the_clients_import_no_vllm_nor_the_server_connector_or_cli():
    assert _violations(("lmcache_core.client",),
                       ("vllm", "lmcache_core.integration", "lmcache_core.server",
                        "lmcache_core.engine", "lmcache_core.storage", "lmcache_cli")) == []


def test_importing_the_clients_loads_no_torch():
    """Only registering tensors imports torch (lazily): a process that imports the clients, or
    LMCache's path of them, to look up or to talk to the server never pays for it."""
    code = ("import sys\n"
            "import lmcache_core.client.scheduler, lmcache_core.client.worker\n"
            "import lmcache_core.integration.vllm.vllm_multi_process_adapter\n"
            "print(sorted(m for m in ('torch', 'vllm', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"
