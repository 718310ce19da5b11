"""The rooms stay small: no module of pipeline/ or transforms/ over 800 lines, and no function
over 50 (its AST span, docstring included) except the few named in ``LONG_FUNCTIONS``, each a
table or a sequence that reads better whole, with the reason. Read from the source, as
``tests/repo/test_layering.py`` reads imports."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOMS = ("pipeline", "transforms")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 50

# Qualified name (``Class.method``, ``outer.inner``) -> why it reads better whole. Keyed by name,
# not path, so that a module moved whole keeps its entry. At most 5.
LONG_FUNCTIONS: dict[str, str] = {}  # none today; at most 5, each with its reason


def _modules() -> list[Path]:
    return sorted(path for room in ROOMS for path in (REPO / room).rglob("*.py"))


def _function_spans(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function in the file, nested ones too."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(encoding="utf-8"), str(path)), "")
    return found


def test_no_module_over_800_lines():
    over = [f"{path.relative_to(REPO)}: {lines} lines" for path in _modules()
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not over, "\n".join(over)


def test_at_most_five_long_functions_each_with_a_reason():
    assert len(LONG_FUNCTIONS) <= 5
    long = {}
    for path in _modules():
        for name, line, lines in _function_spans(path):
            if lines > MAX_FUNCTION_LINES:
                long.setdefault(name, []).append(f"{path.relative_to(REPO)}:{line} {name} {lines}")
    unlisted = [where for name, wheres in sorted(long.items()) if name not in LONG_FUNCTIONS
                for where in wheres]
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not unlisted, "functions over 50 lines, not in LONG_FUNCTIONS:\n" + "\n".join(unlisted)
    assert not stale, f"LONG_FUNCTIONS names functions no longer over 50 lines: {stale}"
