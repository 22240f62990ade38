"""The import graph points one way: down the layers docs/architecture.md lists, with no
cycles among our packages, nor among modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("specmesh", "shared", "services", "kernels", "drafters")  # installed under `specmesh`


def _module_name(path: Path) -> str:
    """shared/engine/engine.py -> specmesh.shared.engine.engine (setup.py's mapping)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return name if name.split(".")[0] == "specmesh" else f"specmesh.{name}"


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in FOLDERS for p in (ROOT / pkg).rglob("*.py")}


def _imported_names(path: Path) -> set[str]:
    """Every absolute name `path` imports (`from a import b`: a and a.b), at the top or
    inside functions alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that `path` imports."""
    return _imported_names(path) & set(modules)


def _package(module: str) -> str:
    """specmesh.shared.engine.engine -> shared.engine; specmesh.shared.bus -> shared.bus;
    specmesh.__main__ -> specmesh (the command)."""
    parts = module.split(".")[1:]
    return ".".join(parts[:2]) if parts and parts[0] in FOLDERS else "specmesh"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" once explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def _graph(by_package: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        src = _package(name) if by_package else name
        for dst in _imports(path, modules):
            dst = _package(dst) if by_package else dst
            if dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


@pytest.mark.parametrize("by_package", [True, False], ids=["packages", "modules"])
def test_no_import_cycles(by_package: bool) -> None:
    cycle = _cycle(_graph(by_package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}}) is None


def layers() -> list[set[str]]:
    """docs/architecture.md's layers, bottom first: the lines of the text block under
    its "## Layers" heading, each naming the packages of one layer."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("\n## Layers\n", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "docs/architecture.md's Layers section has no ```text block"
    return [set(line.split()) for line in reversed(block.group(1).splitlines())]


def upward_imports(graph: dict[str, set[str]], order: list[set[str]]) -> list[str]:
    """Each import of `graph` that points to a higher layer of `order`, as "a -> b", and
    each package `order` does not place."""
    level = {pkg: i for i, names in enumerate(order) for pkg in names}
    packages = set(graph) | {dst for dsts in graph.values() for dst in dsts}
    found = [f"{pkg} is in no layer" for pkg in sorted(packages - set(level))]
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            if src in level and dst in level and level[dst] > level[src]:
                found.append(f"{src} -> {dst}")
    return found


def test_every_import_of_ours_names_the_specmesh_namespace() -> None:
    """`import shared...` would load a second copy of a module beside specmesh.shared's."""
    old = [
        f"{name}: {imported}"
        for name, path in _modules().items()
        for imported in sorted(_imported_names(path))
        if imported.split(".")[0] in FOLDERS[1:]
    ]
    assert old == []


def test_imports_point_down_the_documented_layers() -> None:
    graph = _graph(by_package=True)
    every = {_package(m) for m in _modules()}
    assert upward_imports({pkg: graph.get(pkg, set()) for pkg in every}, layers()) == []


def test_the_layer_check_finds_upward_imports_and_unplaced_packages() -> None:
    order = [{"low"}, {"mid", "peer"}, {"high"}]
    graph = {"high": {"mid"}, "mid": {"low", "peer"}, "low": {"high"}, "new": {"low"}}
    assert upward_imports(graph, order) == ["new is in no layer", "low -> high"]
