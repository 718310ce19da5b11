"""The rooms of the repository import one way: benchmarks/ and tests/ -> tools/ -> pipeline/ ->
transforms/. tests/ and benchmarks/ share code only through tools/ (neither imports the other), and
transforms/ never imports pipeline/. Inside pipeline/ and transforms/, module by module, the imports
draw no circle. Read from the source (every import statement, at any depth), not from what a run
happens to import."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# room -> the rooms it may not import
FORBIDDEN = {
    "transforms": {"pipeline", "tools", "tests", "benchmarks"},
    "pipeline": {"tools", "tests", "benchmarks"},
    "tools": {"tests", "benchmarks"},
    "benchmarks": {"tests"},
    "tests": {"benchmarks"},
}


def imported_rooms(path: Path) -> set[tuple[int, str]]:
    """(line, top-level package) of every absolute import in a file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, alias.name.split(".")[0]) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add((node.lineno, node.module.split(".")[0]))
    return found


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_imports_no_room_above_it(room):
    files = sorted((REPO / room).rglob("*.py"))
    assert files, f"no Python files in {room}/"
    wrong = [f"{path.relative_to(REPO)}:{line} imports {target}"
             for path in files for line, target in sorted(imported_rooms(path))
             if target in FORBIDDEN[room]]
    assert not wrong, "\n".join(wrong)


# The import graph of pipeline/ and transforms/, module by module (sub-packages included), from
# every import statement of each file, those inside functions too: an import put in a function to
# dodge a circle still draws it. On 2cf06e9 (the base) this found the four cycles of the
# 2026-12-07 review, and no other:
#   transforms.engines.base <-> transforms.engines.vllm
#   transforms.engines.devices <-> transforms.settings
#   transforms.engines.fetch <-> transforms.engines.model
#   transforms.incremental -> transforms.output.compaction -> transforms.output.manifest
#     -> transforms.incremental (Snapshot, SnapshotChanged)
GRAPHED = ("pipeline", "transforms")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the graphed rooms (``pkg/__init__.py``
    is the module ``pkg``)."""
    found = {}
    for room in GRAPHED:
        for path in sorted((REPO / room).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _nearest(name: str, known: set[str]) -> str | None:
    """``name`` where it is a module of ours, else the nearest package above it that is."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) or None


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``module`` imports anywhere in its file: ``import a.b`` is a.b,
    ``from a.b import c`` is a.b.c where that is a module, else a.b; relative imports alike."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                     for alias in node.names]
        else:
            continue
        found |= {target for name in names if (target := _nearest(name, known))}
    return found - {module}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {module: imported_modules(module, path, set(files)) for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_import_graph_is_read_whole():
    graph = import_graph()
    assert "transforms.output.manifest" in graph and "pipeline.search" in graph
    assert "transforms.stores.base" in graph["transforms.stores.batch"]


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)

    def edges(component: list[str]) -> str:
        return "; ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a])
                         if b in component)

    assert not found, "import cycles (imports inside functions included):\n" + "\n".join(
        f"  {' <-> '.join(component)}: {edges(component)}" for component in found)
