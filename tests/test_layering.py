"""The rooms of the repository import one way: benchmarks/ and tests/ -> tools/ -> pipeline/ ->
transforms/. tests/ and benchmarks/ share code only through tools/ (neither imports the other), and
transforms/ never imports pipeline/. Read from the source (every import statement, at any depth),
not from what a run happens to import."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

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
