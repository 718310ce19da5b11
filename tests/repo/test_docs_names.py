"""Every code name the docs write in backticks exists in the code, so a move or a rename that
leaves a page behind fails here (docs/testing.md, "Docs").

README.md and docs/*.md are read: each ``code span`` outside fenced blocks, and in fenced blocks
the ``from <project module> import ...`` lines and the ``newsvec`` and ``python -m`` commands. Each
is checked by its shape, against the repository read statically (an AST of every .py file in
pipeline/, transforms/, tools/ and benchmarks/; tests/ for test names, fixtures and the variables
the tests read), the config schema (``pipeline.config.explain``), the argparse definitions of the
``newsvec`` sub-commands and the Makefile:

- a path under a repository folder (``transforms/parse.py``, ``configs/``, ``tests/x.py::test_y``)
  exists, the test too; a bare file name (``index.py``, ``local.yaml``) exists somewhere;
- a dotted project name (``transforms.output.parquet.schema_markdown``, ``pipeline.search``)
  resolves: the longest module prefix, then classes and their members;
- ``section.key`` of a config section (``store.ef_search``, ``chunking.mode: chunks``) is a key
  of the schema; a ``module.name`` whose module's file name is unique (``layout.open_inside``)
  resolves in it;
- ``newsvec SUB [--flag]``, ``python -m MODULE [--flag]`` and ``make TARGET`` name a sub-command,
  a module and a target that exist, and flags the command's parser defines;
- a bare ``--flag`` is defined by some parser in the repository;
- a CamelCase name (``Embedder``, ``Store.search``, a step label such as ``EmbedStreaming``) is a
  class, function or step label of the project (or a name it imports from a library);
- ``name()`` is a function or method of the project; a snake_case or UPPER_CASE name with an
  underscore (a column, a reason code, a constant) occurs in the project's code;
- a name a page places in a file ("`X` in `f.py`", "(`f.py`, `X`)", or a table row whose cell
  holds only project .py files, as README's boxes: the names another cell starts with) is
  defined there.

What names a user's file, another project's API, SQL or a shell command is either of a shape
that is not checked or in ``ALLOWED`` below. A failure lists ``file:line: `span` -- why``, with
where the name is now when the code defines it elsewhere.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE_ROOTS = ("pipeline", "transforms", "tools", "benchmarks")
# first path components that are the repository's own (anything else: a user's or output path)
REPO_DIRS = {*CODE_ROOTS, "tests", "configs", "docs", "docker", ".ci"}
REPO_FILES = {"Dockerfile", "Makefile", "constraints.txt", "setup.py", "setup.cfg", "ruff.toml",
              "README.md", "CHANGELOG.md", ".dockerignore"}

# Names of other projects and of the user's world, written in the shapes checked below (only those
# the docs use: a name the project's code also mentions passes without being listed).
ALLOWED = {
    # vLLM, Beam, Python
    "LLM", 'vllm.LLM(runner="pooling")', "get_model_path()", "share_model_across_processes()",
    "BatchElements", "RunInference", "MultiProcessShared", "Reshuffle", "SdkProcess",
    "WatermarkManager", "FileSystems.delete", "InterfaceError", "Infinity", "NaN", "sha256",
    "PoolingParams", "Streaming",  # the suffix of a streaming step's name
    # SQL (PostgreSQL, DuckDB, BigQuery), and jina's task name
    "coalesce", "COALESCE", "count", "OPERATOR", "halfvec", "pg_has_role(..., 'MEMBER')",
    "pg_advisory_xact_lock", "pg_rewrite", "suppress_redundant_updates_trigger", "VECTOR_SEARCH",
    "top_k", "retrieval.passage",
    # Cloud Monitoring, Pub/Sub, the worker image's build argument, a tokenizer's normalizer
    "metric_name", "oldest_unacked_message_age", "NVIDIA_L4_GPUS", "nmt_nfkc",
    # what the docs show as wrong: a key that does not exist, and the error it gives
    "store.dsn", "model.dtyp: Extra inputs are not permitted",
}
# flags of other programs (Beam's and Dataflow's pipeline options, pip, Cloud Run)
ALLOWED_FLAGS = {
    "--update", "--transform_name_mapping", "--create_from_snapshot", "--dry_run",
    "--semi_persist_dir", "--parquet_enable_list_inference", "--require-hashes",
    "--extra-index-url", "--upgrade", "--help", "--max-retries",
}

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_TEMPLATED = re.compile(r"[<>{}*…|\[\]]|\.\.\.")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(rf"^{_IDENT}(\.{_IDENT})+(\(.*\))?$")
_CAMEL = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
_CALL = re.compile(rf"^({_IDENT})\(.*\)$")
_SNAKE = re.compile(r"^_?[A-Za-z][A-Za-z0-9]*(_[A-Za-z0-9]+)+$")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
_WORDS = re.compile(_IDENT)


def code_spans(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every code span outside fenced blocks."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            for match in _CODE_SPAN.finditer(line):
                yield number, match.group(2).strip().replace("\\|", "|")


_IMPORT = re.compile(r"^\s*from\s+((?:pipeline|transforms|tools|benchmarks)[\w.]*)\s+import\s+"
                     r"\(?([\w\s,]+)\)?\s*$")
_RUN = re.compile(r"^\s*(?:\$\s+)?(?:\S*/)?((?:newsvec|python[0-9.]*\s+-m)\s.*)$")


def fenced_commands(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of what fenced blocks import from the project and the ``newsvec`` and
    ``python -m`` commands they run (a command's continued lines joined): checked as spans."""
    fenced, pending, start = False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        if pending:
            pending += " " + line.strip().rstrip("\\")
            if not line.rstrip().endswith("\\"):
                yield start, pending
                pending = ""
            continue
        if match := _IMPORT.match(line):
            for name in match.group(2).replace(",", " ").split():
                if name != "as":
                    yield number, f"{match.group(1)}.{name}"
        elif match := _RUN.match(line.split("#")[0]):
            if line.rstrip().endswith("\\"):
                pending, start = match.group(1).rstrip().rstrip("\\"), number
            else:
                yield number, match.group(1).strip()


class Code:
    """What the repository defines, read once."""

    def __init__(self) -> None:
        self.trees: dict[str, ast.Module] = {}  # module -> its AST
        for root in (*CODE_ROOTS, "tests"):
            for path in sorted((REPO / root).rglob("*.py")):
                parts = path.relative_to(REPO).with_suffix("").parts
                module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                self.trees[module] = ast.parse(path.read_text(), str(path))
        self.top = {module: _top_level(tree) for module, tree in self.trees.items()}
        self.code_modules = [m for m in self.trees if m.split(".")[0] in CODE_ROOTS]
        self.defined: set[str] = set()  # classes, functions, methods, module-level names
        self.functions: set[str] = set()  # functions at a module's top level
        self.classes: dict[str, set[str]] = {}  # class name -> its members (every such class)
        self.words: set[str] = set()  # every identifier and every word of a string constant
        self.strings: set[str] = set()  # every string constant
        self.imported: set[str] = set()  # names the project imports from libraries
        self.flags: dict[str, set[str]] = {}  # module -> the flags its parsers define
        for module in self.code_modules:
            self._read(module, self.trees[module])
        tests = [tree for module, tree in self.trees.items() if module.startswith("tests")]
        self.tests = {n.name for tree in tests for n in ast.walk(tree)
                      if isinstance(n, ast.FunctionDef)}
        # fixtures and the environment variables the tests read (docs/testing.md names them)
        self.test_words = self.tests | {n.value for tree in tests for n in ast.walk(tree)
                                        if isinstance(n, ast.Constant)
                                        and isinstance(n.value, str)}
        for extra in ("Makefile", "Dockerfile", *(REPO / "configs").iterdir()):
            if (REPO / extra).is_file():
                self.words |= set(_WORDS.findall((REPO / extra).read_text(errors="replace")))
        self.all_flags = set().union(*self.flags.values())
        self.files = [p.relative_to(REPO) for d in REPO_DIRS for p in (REPO / d).rglob("*")
                      if "__pycache__" not in p.parts]
        self.make_targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(),
                                           re.MULTILINE))

    def _read(self, module: str, tree: ast.Module) -> None:
        flags = self.flags.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(node.name)
                self.words.add(node.name)
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, set()).update(_members(node))
            elif isinstance(node, (ast.Name, ast.Attribute, ast.arg, ast.keyword)):
                self.words.add(getattr(node, "id", None) or getattr(node, "attr", None)
                               or getattr(node, "arg", None) or "")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                self.strings.add(node.value)
                self.words |= set(_WORDS.findall(node.value))
            elif isinstance(node, ast.ImportFrom) and not _is_project(node.module or ""):
                self.imported |= {alias.asname or alias.name for alias in node.names}
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant)
                          and isinstance(a.value, str) and a.value.startswith("--")}
        self.defined |= set(self.top[module])
        self.functions |= {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}

    def flags_of(self, module: str) -> set[str]:
        """The flags ``module``'s parsers define, with those of the project modules it imports
        (a helper that adds a common flag, such as a benchmark's ``--results``)."""
        found = set(self.flags.get(module, set()))
        for node in self.trees[module].body:
            if isinstance(node, ast.ImportFrom) and _is_project(node.module or ""):
                for alias in node.names:
                    found |= self.flags.get(f"{node.module}.{alias.name}", set())
                found |= self.flags.get(node.module or "", set())
        return found

    def resolve(self, dotted: str) -> Optional[str]:
        """Why a dotted project name does not resolve, or None."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in self.trees:
                return self._attribute(module, parts[cut:])
        return f"no module {'.'.join(parts[:2])}" + self.hint(parts[-1])

    def _attribute(self, module: str, rest: list[str]) -> Optional[str]:
        if not rest:
            return None
        if rest[0] not in self.top[module]:
            return f"{module} defines no {rest[0]}" + self.hint(rest[0])
        node = self.top[module][rest[0]]
        for attribute in rest[1:]:
            if not isinstance(node, ast.ClassDef) or attribute not in _members(node):
                return f"{module}.{rest[0]} has no {attribute}"
            node = _members(node)[attribute]
        return None

    def homes(self, name: str) -> list[str]:
        """The modules (tests too) that define ``name`` at their top level (not by importing it)."""
        return [module for module in self.trees if name in self.top[module]
                and not isinstance(self.top[module][name], (ast.Import, ast.ImportFrom))]

    def hint(self, name: str) -> str:
        homes = self.homes(name) or [str(f) for f in self.files if f.name == name]
        return f" (it is in {', '.join(homes)})" if homes else ""

    def unique_module(self, basename: str) -> Optional[str]:
        """The project module whose last name is ``basename``, when only one is."""
        found = [m for m in self.code_modules if m.rsplit(".", 1)[-1] == basename]
        return found[0] if len(found) == 1 else None


def _is_project(module: str) -> bool:
    return module.split(".")[0] in (*CODE_ROOTS, "tests")


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """The names a module defines or imports at its top level (inside if/try blocks too)."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        for inner in [node, *getattr(node, "body", []), *getattr(node, "orelse", []),
                      *[h for handler in getattr(node, "handlers", []) for h in handler.body]]:
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if inner is node or not isinstance(node, (ast.ClassDef, ast.FunctionDef,
                                                          ast.AsyncFunctionDef)):
                    names[inner.name] = inner
            elif inner is node or not isinstance(node, (ast.ClassDef, ast.FunctionDef,
                                                        ast.AsyncFunctionDef)):
                names.update(_assigned(inner))
    return names


def _members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    members: dict[str, ast.AST] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members[node.name] = node
        members.update(_assigned(node))
    return members


def _assigned(node: ast.AST) -> dict[str, ast.AST]:
    if isinstance(node, ast.Assign):
        return {t.id: node for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id: node}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0]: node for a in node.names}
    return {}


@functools.lru_cache(maxsize=None)
def code() -> Code:
    return Code()


@functools.lru_cache(maxsize=None)
def config_keys() -> frozenset[str]:
    from pipeline.config import explain

    return frozenset(key for key, _, _ in explain())


@functools.lru_cache(maxsize=None)
def sub_commands() -> dict[str, list[str]]:
    """Each ``newsvec`` sub-command -> the modules whose parsers define its flags."""
    from pipeline.cli import _DELEGATED

    commands = {name: [module] for name, module in _DELEGATED.items()}
    commands["run"].append("pipeline.options")
    commands.update(config=["pipeline.cli"], search=["pipeline.cli"])
    return commands


# -- the checks, by shape ---------------------------------------------------------------------
def problem(span: str) -> Optional[str]:
    """Why ``span`` names nothing that exists, or None (it does, or it is not checked)."""
    if span in ALLOWED:
        return None
    first = span.split()[0]
    for check in (_command, _path, _test_name, _basename, _flag, _dotted, _camel, _call,
                  _snake):
        verdict = check(span, first)
        if verdict is not False:
            return verdict  # type: ignore[return-value]
    return None


def _command(span: str, first: str):
    words = span.split()
    if first == "newsvec" and len(words) > 1 and not words[1].startswith("-"):
        commands = sub_commands()
        if words[1] not in commands:
            return f"no sub-command `newsvec {words[1]}` (pipeline/cli.py)"
        known = set().union(*(code().flags_of(m) for m in commands[words[1]]))
        known |= {"--verbose", "--help"}
        if words[1] == "run":
            return None  # Beam's pipeline options too
        missing = [f for f in _FLAG.findall(span) if f not in known]
        return f"`newsvec {words[1]}` has no {', '.join(missing)}" if missing else None
    if re.match(r"^python[0-9.]* -m \S", span):
        module = words[2]
        if module not in code().trees:
            return f"no module {module}"
        if module in ("pipeline", "tests.streaming.test_state_coders"):
            return None
        missing = [f for f in _FLAG.findall(span) if f not in code().flags_of(module)]
        return f"{module} defines no {', '.join(missing)}" if missing else None
    if first == "make":
        target = words[1] if len(words) > 1 else None
        if target and target not in code().make_targets:
            return f"no Makefile target {target}"
        return None
    return False


def _path(span: str, first: str):
    head = first.split("/")[0]
    if "/" not in first or (head not in REPO_DIRS and first not in REPO_FILES):
        return False
    if _TEMPLATED.search(first) or "=" in first:
        return None
    file_part, _, test = first.partition("::")
    if not (REPO / file_part).exists():
        package = REPO / file_part.removesuffix(".py")
        if file_part.endswith(".py") and package.is_dir():
            return f"no file {file_part}: it is a package now, {package.relative_to(REPO)}/"
        return f"no file or folder {file_part}" + code().hint(Path(file_part).name)
    if test and test not in code().tests:
        return f"no test {test} in {file_part}"
    return None


def _test_name(span: str, first: str):
    if not first.startswith("::") and not re.match(r"^test_\w+$", first):
        return False
    name = first.removeprefix("::")
    return None if name in code().tests else f"no test {name} in tests/"


def _basename(span: str, first: str):
    if span in REPO_FILES:
        return None if (REPO / span).exists() else f"no file {span}"
    if not re.match(r"^[\w.-]+\.(py|yaml|yml|md|sh)$", span):
        return False
    if any(f.name == span for f in code().files):
        return None
    return f"no file named {span} in {', '.join(sorted(REPO_DIRS))}"


def _flag(span: str, first: str):
    if not first.startswith("--"):
        return False
    flag = _FLAG.match(first)
    if not flag or flag.group(1) in ALLOWED_FLAGS or flag.group(1) in code().all_flags:
        return None
    return f"no parser in {', '.join(CODE_ROOTS)} defines {flag.group(1)}"


def _dotted(span: str, first: str):
    text = re.sub(r":\s.*$|:$", "", span)  # `chunking.mode: chunks`: the key
    if not _DOTTED.match(text) and not re.match(rf"^{_IDENT}(\.{_IDENT})*\.\*$", text):
        return False
    name = re.sub(r"\(.*\)$", "", text)
    section = name.split(".")[0]
    if section in CODE_ROOTS or section == "tests":
        return code().resolve(name)
    sections = {key.split(".")[0] for key in config_keys()}
    if section in sections:
        if name in config_keys() or section == "beam" or (name.endswith(".*")
                                                         and name[:-2] in sections):
            return None
        module = code().unique_module(section)
        if module and code().resolve(f"{module}.{name.split('.', 1)[1]}") is None:
            return None
        if name.rsplit(".", 1)[-1] in code().strings:
            return None  # a key of the run summary the code writes (`store.rejected`)
        return f"no config key {name} (pipeline.config.explain), nor a summary key" + \
            code().hint(name.rsplit(".", 1)[-1])
    module = code().unique_module(section)
    if module:
        return code().resolve(f"{module}.{name.split('.', 1)[1]}")
    if _CAMEL.match(section):
        return _qualified(name)
    return None


def _qualified(name: str) -> Optional[str]:
    cls, _, member = name.partition(".")
    if cls not in code().classes:
        return f"no class {cls} in {', '.join(CODE_ROOTS)}"
    if member.split(".")[0] not in code().classes[cls]:
        return f"class {cls} has no {member}"
    return None


def _camel(span: str, first: str):
    parts = span.split("/")
    if not all(_CAMEL.match(part) for part in parts):
        return False
    missing = [p for p in parts if p not in code().defined and p not in code().strings
               and p not in code().imported and p not in ALLOWED]
    return f"no class, function or step label {', '.join(missing)} in " \
        f"{', '.join(CODE_ROOTS)}" if missing else None


def _call(span: str, first: str):
    match = _CALL.match(span)
    if not match:
        return False
    name = match.group(1)
    if name in code().defined or name in ALLOWED:
        return None
    return f"no function {name} in {', '.join(CODE_ROOTS)}"


def _snake(span: str, first: str):
    if not _SNAKE.match(span):
        return False
    if span in code().words or span in code().test_words:
        return None
    return f"{span} occurs nowhere in {', '.join(CODE_ROOTS)}"


# -- names placed in a file -------------------------------------------------------------------
_IN_FILE = re.compile(r"`([^`]+)`\)?,?\s+\(?in\s+`([\w/]+\.py)`")
_FILE_THEN = re.compile(r"\(`([\w/]+\.py)`,\s+`([^`]+)`\)")
_CELL = re.compile(r"(?<!\\)\|")


def placed_names(page: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, name, files) where a page places a code name in files: "`X` in `f.py`",
    "(`f.py`, `X`)", and a table row with a cell of only project .py files (README's boxes),
    whose other cells' class and function names are theirs."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for name, file in _IN_FILE.findall(line):
            yield number, name, [file]
        for file, name in _FILE_THEN.findall(line):
            yield number, name, [file]
        if line.lstrip().startswith("|"):
            yield from _row_names(number, _CELL.split(line.strip().strip("|")))


def _row_names(number: int, cells: list[str]) -> Iterator[tuple[int, str, list[str]]]:
    for index, cell in enumerate(cells):
        files = _CODE_SPAN.findall(cell)
        if not files or re.sub(r"`[^`]*`|[,\s]|and", "", cell) or not all(
                re.match(r"^[\w/]+\.py$", f) and f.split("/")[0] in CODE_ROOTS
                for _, f in files):
            continue
        for other in cells[:index] + cells[index + 1:]:
            for name in _leading_names(other):
                if _CAMEL.match(name) or _CALL.match(name) or (
                        "_" in name and name in code().functions):
                    yield number, name, [f for _, f in files]


def _leading_names(cell: str) -> list[str]:
    """The code spans a cell starts with ("`A` (...), `B`: ..." gives A and B)."""
    names = []
    rest = re.sub(r"^\s*(the\s+)?", "", cell)
    while match := re.match(r"`([^`]+)`\s*(\([^)]*\))?\s*(,\s*|$)", rest):
        names.append(match.group(1))
        rest = rest[match.end():]
        if not match.group(3):
            break
    return names


def misplaced(name: str, files: list[str]) -> Optional[str]:
    """Why ``name`` is defined in none of ``files`` (a path not there is _path's to report)."""
    ident = re.match(_IDENT, name)
    if not ident or "/" in name or name.endswith(".py") or \
            not all((REPO / file).is_file() for file in files):
        return None
    modules = []
    for file in files:
        parts = Path(file).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    homes = code().homes(ident.group(0))
    if set(modules) & set(homes):
        return None
    return f"not defined in {', '.join(files)}" + (f" (it is in {', '.join(homes)})"
                                                   if homes else "")


def findings(pages: list[Path] = PAGES) -> list[str]:
    """``file:line: `span` -- why`` for every span that names nothing, or a wrong home."""
    found = []
    for page in pages:
        for number, span in [*code_spans(page), *fenced_commands(page)]:
            why = problem(span)
            if why:
                found.append(f"{page.relative_to(REPO)}:{number}: `{span}` -- {why}")
        for number, name, files in placed_names(page):
            why = misplaced(name, files)
            if why:
                found.append(f"{page.relative_to(REPO)}:{number}: `{name}` -- {why}")
    return found


def test_every_code_name_in_the_docs_exists():
    found = findings()
    assert not found, f"{len(found)} names in the docs that the code does not define (fix the " \
        "page, or add a name of another project to ALLOWED in tests/repo/test_docs_names.py):\n" + \
        "\n".join(found)


def test_the_checks_catch_what_moves_leave_behind():
    assert problem("VLLMEmbeddingHandler")
    assert problem("VLLMEmbeddingHandler.batch_elements_kwargs()")
    assert problem("transforms.types.common_schema")
    assert misplaced("vector_schema(dim, vector_dtype)", ["transforms/types.py"])
    assert problem("tests/reference_prepare.py")
    assert problem("benchmarks/japanese.py")
    assert problem("transforms.output.parquet.no_such_name")
    assert problem("store.no_such_key")
    assert problem("newsvec search --no-such-flag")
    assert problem("newsvec nothing")
    assert problem("make no-such-target")
    assert problem("python -m benchmarks.no_such_benchmark")
    assert problem("tests/repo/test_docs.py::test_no_such_test")
    assert "a package now" in problem("transforms/engines.py")


def test_the_checks_pass_what_exists():
    for span in ("transforms.output.parquet.schema_markdown", "transforms/parse.py", "configs/",
                 "Embedder", "Embedder.batch_elements_kwargs", "store.ef_search",
                 "chunking.mode: chunks", "newsvec search --all-copies", "newsvec load --reload",
                 "newsvec ledger --no-verify", "make test", "python -m benchmarks.batch --runs 3",
                 "tests/repo/test_docs.py::test_pages_are_found", "gs://BUCKET/PATH/", "out/local",
                 "LLM.embed()", "text_sha256", "near_duplicates"):
        assert problem(span) is None, (span, problem(span))


def _parser_flags(module: str, function: Optional[str] = None) -> set[str]:
    """The flags one module's parsers define (or one top-level function's, in pipeline/cli.py)."""
    tree = code().trees[module]
    if function:
        tree = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return {a.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "add_argument"
            for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            and a.value.startswith("--")} - {"--verbose", "--help"}


def test_the_sub_command_table_shows_every_flag():
    """docs/configuration.md's sub-command table: each command's usage cells name every flag its
    parser defines (`run` takes the pipeline's options, listed under "Flags")."""
    shown: dict[str, set[str]] = {}
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        if match := re.match(r"^\| `newsvec ([\w-]+)([^`]*)` \|", line):
            shown.setdefault(match.group(1), set()).update(
                _FLAG.findall(match.group(2)))
    from pipeline.cli import _DELEGATED

    parsers = {name: _parser_flags(module) for name, module in _DELEGATED.items()
               if name != "run"}
    parsers["config"] = _parser_flags("pipeline.cli", "_config_command")
    parsers["search"] = _parser_flags("pipeline.cli", "_search_command")
    missing = {name: sorted(flags - shown.get(name, set()))
               for name, flags in parsers.items() if flags - shown.get(name, set())}
    assert not missing, f"docs/configuration.md's sub-command table lacks: {missing}"
