"""The pre-commit configuration runs what ``make lint`` runs (and CI runs first): the same
commands, each over the whole project, so a commit that passes its hooks passes CI's linters."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def lint_commands() -> list[str]:
    """The commands of the Makefile's ``lint`` target, with ``$(PY)`` spelled out."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    python = re.search(r"^PY := (.+)$", makefile, re.M).group(1).replace("$(VENV)", ".venv")
    body = re.search(r"^lint:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    return [line.strip().replace("$(PY)", python) for line in body.splitlines()]


def test_the_hooks_run_what_make_lint_runs():
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert [hook["entry"] for hook in hooks] == lint_commands()
    # Each over the whole project as configured (ruff.toml, setup.cfg), not over the staged files.
    assert all(hook["pass_filenames"] is False and hook["language"] == "system" for hook in hooks)
