"""Config files: one YAML file per deployment (``configs/``), validated at start.

A wrong key, a wrong value or an unfilled placeholder (``<PROJECT_ID>``) fails before anything runs,
with a message that names it. The ``beam:`` section holds Beam pipeline options (runner, project,
...); flags on the command line override them and the top-level ``input`` and ``output``.

``{date}`` in ``input`` or ``output`` is not a placeholder but a field, filled at launch from
``--input_date`` (see ``fill_date``): a scheduled job embeds each day's news with one config.
A config file may be local or on ``gs://`` (a Flex Template reads its config from the bucket).
"""
from __future__ import annotations

import datetime as dt
import json
import posixpath
import re
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from transforms.engines.fetch import is_gcs
from transforms.engines.model import (
    PYPACKAGE,
    check_custom_code,
    check_dimensions,
    check_without_running_code,
    model_folder,
)
from transforms.engines.model_files import model_content_hash
from transforms.engines.registry import engine_factory
from transforms.settings import (
    ChunkingSettings,
    DedupSettings,
    IncrementalSettings,
    ModelSettings,
    NearDuplicateSettings,
    ParseSettings,
    ServeSettings,
    SinkSettings,
    StreamingSettings,
    TextSettings,
    embedding_signature,
)
from transforms.stores import Settings as StoreSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "local.yaml"
_PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*>")
# {date} or {date:STRFTIME} in input or output; any other {field} is a mistake (Beam globs have no
# brace expansion).
_DATE_FIELD = re.compile(r"\{date(?::([^{}]+))?\}")
_ANY_FIELD = re.compile(r"\{[^{}]*\}")
INPUT_DATE_WORDS = ("today", "yesterday")
DEFAULT_INPUT_DATE = "yesterday"
_ISO_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


class ConfigError(ValueError):
    """A config that cannot run. The message names the file and the key."""


class Config(BaseModel):
    """A whole config: ``input``, ``output``, ``beam:`` and one section each from
    ``transforms/settings.py``; ``store:`` is its backend's own settings (``store.kind``: the
    registry in ``transforms/stores/__init__.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # The day that filled {date} (``fill_date``); not a key of the file: a config read and not
    # filled, or one without the field, has None. Carried by ``model_copy`` and pickling.
    _filled_day: Optional[dt.date] = PrivateAttr(None)

    input: Optional[str] = Field(None, description="JSON Lines glob, local or `gs://`, `.gz` "
                                                   "allowed (`--input`); may hold `{date}`, "
                                                   "`{model}`")
    output: str = Field(description="output prefix, local or `gs://` (`--output`); may hold "
                                    "`{date}`, `{model}`")
    model: ModelSettings
    chunking: ChunkingSettings = ChunkingSettings()
    parse: ParseSettings = ParseSettings()
    text: TextSettings = TextSettings()
    dedup: DedupSettings = DedupSettings()
    sink: SinkSettings = SinkSettings()
    streaming: StreamingSettings = StreamingSettings()
    incremental: IncrementalSettings = IncrementalSettings()
    near_duplicates: NearDuplicateSettings = NearDuplicateSettings()
    store: StoreSettings = StoreSettings()
    serve: ServeSettings = ServeSettings()
    beam: dict[str, Any] = Field(default_factory=dict, description="any Beam pipeline option "
                                 "(`runner`, `project`, `experiments`...); unknown ones fail at "
                                 "start")

    @field_validator("model")
    @classmethod
    def _known_engine(cls, model: ModelSettings) -> ModelSettings:
        engine_factory(model.engine)  # ValueError naming the engines newsvec has
        return model

    @model_validator(mode="after")
    def _chunks_fit_the_model(self):
        if (self.chunking.chunk_tokens or 0) > self.model.max_tokens:
            raise ValueError(f"chunking.chunk_tokens ({self.chunking.chunk_tokens}) must be at "
                             f"most model.max_tokens ({self.model.max_tokens}): the engine would "
                             "truncate chunks")
        if self.chunking.mode == "late" and self.model.share_across_processes:
            raise ValueError("chunking.mode late needs the engine in each process: "
                             "model.share_across_processes must be false")
        if self.serve.max_batch_tokens < self.model.max_tokens:
            raise ValueError(f"serve.max_batch_tokens ({self.serve.max_batch_tokens}) must be at "
                             f"least model.max_tokens ({self.model.max_tokens}), or a long input "
                             "fits in no engine call")
        return self

    @property
    def filled_day(self) -> Optional[dt.date]:
        """The day (``--input_date``) that filled ``{date}`` in ``input`` or ``output``: the day a
        batch run stands for (its rows' ``dt``, ``transforms.stores.batch.run_day``). None: the
        config holds no ``{date}``, or was not filled."""
        return self._filled_day

    def beam_flags(self) -> list[str]:
        """The ``beam:`` section as command-line flags, for PipelineOptions."""
        flags = []
        for key, value in self.beam.items():
            values = value if isinstance(value, list) else [value]
            for item in values:
                if isinstance(item, bool):
                    if item:
                        flags.append(f"--{key}")
                else:
                    flags.append(f"--{key}={item}")
        return flags


def signature_of(config: Config) -> str:
    """The embedding signature of a config's articles (``transforms.settings.embedding_signature``):
    what the key index and a run's summary record, and what ``newsvec search`` checks."""
    return embedding_signature(config.model, config.chunking, config.text.unicode_form)


def _placeholders(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _placeholders(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _placeholders(v, f"{path}[{i}]")]
    if isinstance(node, str) and _PLACEHOLDER.search(node):
        return [f"{path} = {node!r}"]
    return []


def known_beam_options() -> set[str]:
    """Every pipeline option Beam and newsvec define (PipelineOptions subclasses register on
    import)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    import pipeline.options  # noqa: F401  # registers --config, --input, --output

    return set(PipelineOptions([]).get_all_options(drop_default=False).keys())


def validate(raw: Any, source: str = "config") -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a YAML mapping, got {type(raw).__name__}")
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors(include_url=False))
        raise ConfigError(f"{source}: {problems}") from None
    try:  # a pypackage: model is looked for, not imported: the run checks the rest (check_model)
        check_without_running_code(config.model)
    except ValueError as exc:
        raise ConfigError(f"{source}: model.path: {exc}") from None
    unknown = sorted(set(config.beam) - known_beam_options())
    if unknown:
        raise ConfigError(f"{source}: beam.{unknown[0]}: not a Beam pipeline option")
    filled = _placeholders(raw)
    if filled:
        raise ConfigError(f"{source}: fill in the placeholder(s) before running: "
                          f"{', '.join(filled)}")
    return config


def checks_left_to_the_run(config: Config) -> list[str]:
    """A line for each check ``validate`` leaves to the run because it needs the model's files
    (a ``pypackage:`` model's folder is known only by running its code)."""
    return check_without_running_code(config.model)


def check_model(config: Config, source: str = "config") -> Config:
    """What ``validate`` left to the run (``checks_left_to_the_run``): a ``pypackage:`` model
    imported to find its folder (its code runs, as it does for the run itself), a ``gs://`` model
    fetched and hashed, either refused if it needs code of its own (``check_custom_code``), and
    ``model.dimensions`` checked against its ``config.json``. Returns the
    config with a ``gs://`` model's content hash pinned (``model.sha256``, unless the file pins
    one, which the files must then match): the job's workers fetch the folder when they start,
    at different times, and each refuses files that hash otherwise, so no two workers of a job
    embed with two versions of the model. ConfigError for a problem: a module that fails to
    import or has no ``get_model_path()``, or a GCS folder refused, is named here, not in a
    traceback at launch."""
    model = config.model
    if model.path.startswith(PYPACKAGE) or is_gcs(model.path):
        try:
            folder = model_folder(model)
        except Exception as exc:  # pylint: disable=broad-except  # the package's own code raised
            raise ConfigError(f"{source}: model.path {model.path}: its model folder could "
                              f"not be resolved: {type(exc).__name__}: {exc}") from None
        if is_gcs(model.path) and model.sha256 is None:
            config = config.model_copy(update={"model": model.model_copy(
                update={"sha256": model_content_hash(folder)})})
        try:  # a local folder's: validate's (check_without_running_code)
            check_custom_code(folder, model.trust_remote_code)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    try:
        check_dimensions(config.model)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return config


def _read_text(path: str) -> str:
    if path.startswith("gs://"):
        from apache_beam.io.filesystems import FileSystems

        try:
            with FileSystems.open(path) as f:
                return f.read().decode("utf-8")
        except Exception as exc:  # pylint: disable=broad-except  # any GCS error: say which file
            raise ConfigError(f"{path}: cannot read the config: {type(exc).__name__}: {exc}") \
                from None
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror}") from None


MAX_CONFIG_BYTES = 1 << 20
"""A config file is a few KB: a larger one is refused before it is parsed."""
MAX_CONFIG_DEPTH = 32
"""How deep a config's mappings and lists may nest (the schema's deepest key is 3 levels down):
PyYAML composes a node by recursion, so a deeper file would end in a ``RecursionError``."""


class _ConfigLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
    """``yaml.SafeLoader`` with no aliases (``*name``: shared when parsed, but walked expanded
    afterwards, so 2 KB of them can stand for billions of values) and nodes nested at most
    ``MAX_CONFIG_DEPTH`` deep."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "a config cannot use YAML aliases (*name): write the value out "
                "where it is used", mark)
        if self._depth >= MAX_CONFIG_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_CONFIG_DEPTH} levels",
                self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _parse(text: str) -> Any:
    """The YAML of a config, bounded (``MAX_CONFIG_BYTES``, ``_ConfigLoader``)."""
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_CONFIG_BYTES:
        raise ConfigError(f"larger than {MAX_CONFIG_BYTES} bytes: not a config")
    loader = _ConfigLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


EXTENDS = "extends"
"""A config's top-level key naming the config it is written against (``extends: local.yaml``)."""
MAX_EXTENDS = 8
"""How many configs an ``extends:`` chain may hold above the one loaded."""


def _parent_path(path: str, parent: str) -> str:
    """``parent`` (``extends:``) relative to the folder of the config at ``path``; an absolute path
    or a ``gs://`` one as it is."""
    if parent.startswith("gs://") or Path(parent).is_absolute():
        return parent
    if path.startswith("gs://"):
        bucket, _, key = path[len("gs://"):].partition("/")
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(key), parent))
        if joined.startswith(".."):
            raise ConfigError(f"{path}: {EXTENDS}: {parent} is outside the bucket")
        return f"gs://{bucket}/{joined}"
    return str(Path(path).parent / parent)


def _merged(parent: dict, child: dict) -> dict:
    """``child`` over ``parent``: mappings merged key by key, at every depth; anything else
    (lists included) the child's."""
    out = dict(parent)
    for key, value in child.items():
        below = out.get(key)
        out[key] = (_merged(below, value) if isinstance(value, dict) and isinstance(below, dict)
                    else value)
    return out


def _without_parent_dsn_sources(parent: dict, child: dict) -> dict:
    """``parent`` without its ``store:`` DSN sources (``store.dsn_secret``, ``dsn_file``,
    ``dsn_env``) where ``child`` names one: the child's source is then the one read, never a
    parent's that would win over it (a staging config's loads going to the production
    database)."""
    store, below = child.get("store"), parent.get("store")
    if not (isinstance(store, dict) and isinstance(below, dict)):
        return parent
    sources = StoreSettings.DSN_SOURCES
    if not any(key in store for key in sources):
        return parent
    return {**parent, "store": {k: v for k, v in below.items() if k not in sources}}


def _identity(path: str) -> str:
    return path if path.startswith("gs://") else str(Path(path).resolve())


def _read_raw(path: str, chain: tuple[str, ...] = ()) -> Any:
    """The YAML of the config at ``path``, with the configs it ``extends:`` merged under it
    (``_merged``; a child that names a DSN source replaces the parent's,
    ``_without_parent_dsn_sources``); a cycle, a chain longer than ``MAX_EXTENDS`` or a parent
    that cannot be read is a ConfigError naming the chain."""
    text = _read_text(path)  # its errors name the file
    try:
        raw = _parse(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(raw, dict) or EXTENDS not in raw:
        return raw
    parent = raw.pop(EXTENDS)
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{path}: {EXTENDS}: give a file name (the config this one changes), "
                          f"got {parent!r}")
    parent_path = _parent_path(path, parent)
    chain = (*chain, _identity(path))
    if _identity(parent_path) in chain:
        raise ConfigError(f"{path}: {EXTENDS}: a cycle: "
                          f"{' -> '.join((*chain, _identity(parent_path)))}")
    if len(chain) > MAX_EXTENDS:
        raise ConfigError(f"{path}: {EXTENDS}: more than {MAX_EXTENDS} configs extended in a "
                          f"chain: {' -> '.join(chain[:3])} -> ... -> {parent_path}")
    try:
        base = _read_raw(parent_path, chain)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {EXTENDS}: {exc}") from None
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: {EXTENDS}: {parent_path}: the config must be a YAML mapping, "
                          f"got {type(base).__name__}")
    return _merged(_without_parent_dsn_sources(base, raw), raw)


def load(path: str | Path, subscription: Optional[str] = None,
         **overrides: Optional[str]) -> Config:
    """Read and validate a config file (local or gs://) and the files it ``extends:``;
    ``overrides`` (input=..., output=...) and ``subscription`` win when not None. Fills no field:
    a command loads its config with ``load_for_command``."""
    path = str(path)
    raw = _read_raw(path)
    if isinstance(raw, dict):
        raw = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
        if subscription is not None:
            raw["streaming"] = {**(raw.get("streaming") or {}), "subscription": subscription}
    return validate(raw, str(path))


def load_for_command(path: str | Path, *, input: Optional[str] = None,
                     output: Optional[str] = None, subscription: Optional[str] = None,
                     input_date: Optional[str] = None, run_model_code: bool = False,
                     each_day: bool = False, now: Optional[dt.datetime] = None) -> Config:
    """The config of a command, the one way every sub-command and tool loads it, in this order:
    read the file and the files it ``extends:``; apply the command line's overrides (``input``,
    ``output``, ``subscription``); validate; with ``run_model_code`` (the commands that run the
    pipeline), what validation left to the run (``check_model``: a ``pypackage:`` model
    imported); fill ``{model}`` and ``{date}`` (``fill``: from ``input_date``, default yesterday).
    ``each_day``: ``{date}`` is left for the caller, which fills it once per day (backfill)."""
    config = load(path, subscription=subscription, input=input, output=output)
    if run_model_code:
        config = check_model(config, str(path))
    if each_day:
        return fill_model(config)
    return fill(config, input_date, now)


def fill(config: Config, input_date: Optional[str] = None,
         now: Optional[dt.datetime] = None) -> Config:
    """``{model}`` (``fill_model``), then ``{date}`` (``fill_date``) in the config's paths."""
    return fill_date(fill_model(config), input_date, now)


def parse_input_date(value: Optional[str], now: Optional[dt.datetime] = None) -> dt.date:
    """``YYYY-MM-DD``, ``today`` or ``yesterday`` (UTC, at ``now``: the launch); None: yesterday,
    the last complete day, which a run scheduled after midnight UTC embeds."""
    text = DEFAULT_INPUT_DATE if value is None else value
    now = now or dt.datetime.now(dt.timezone.utc)
    today = now.astimezone(dt.timezone.utc).date()
    if text == "today":
        return today
    if text == "yesterday":
        return today - dt.timedelta(days=1)
    if _ISO_DATE.fullmatch(text):
        try:
            return dt.date.fromisoformat(text)
        except ValueError as exc:
            raise ConfigError(f"--input_date: {text!r} is not a real date ({exc})") from None
    raise ConfigError(f"--input_date: {text!r} is not a date: give YYYY-MM-DD, "
                      f"{' or '.join(INPUT_DATE_WORDS)} (UTC)")


_MODEL_FIELD = "{model}"


def fill_model(config: Config) -> Config:
    """Fill ``{model}`` in ``input``, ``output`` and ``incremental.previous_outputs`` (and
    ``incremental.may_be_absent``, which names entries of it as written) with the model's safe
    label (``transforms.engines.model.safe_model_label``): two models' outputs then live side by
    side, and neither replaces the other's."""
    fields = [config.input or "", config.output, *config.incremental.previous_outputs]
    if not any(_MODEL_FIELD in f for f in fields):
        return config
    from transforms.engines.model import safe_model_label

    label = safe_model_label(config.model)
    incremental = config.incremental.model_copy(update={
        key: [p.replace(_MODEL_FIELD, label) for p in getattr(config.incremental, key)]
        for key in ("previous_outputs", "may_be_absent")})
    return config.model_copy(update={
        "input": config.input.replace(_MODEL_FIELD, label) if config.input else config.input,
        "output": config.output.replace(_MODEL_FIELD, label), "incremental": incremental})


def fill_date(config: Config, input_date: Optional[str] = None,
              now: Optional[dt.datetime] = None) -> Config:
    """Fill ``{date}`` / ``{date:STRFTIME}`` in ``input`` and ``output`` with ``input_date``.

    ``gs://B/news/dt={date}/*.jsonl.gz`` with ``--input_date 2026-11-30`` reads
    ``gs://B/news/dt=2026-11-30/*.jsonl.gz``; ``{date:%Y/%m/%d}`` gives ``2026/11/30``. A config
    without the field is returned as is, and then ``--input_date`` is an error (it would be
    ignored).
    Streaming configs may not hold it: streaming output is partitioned by window already.
    """
    fields = {}
    for key in ("input", "output"):
        value = getattr(config, key)
        if not value:
            continue
        unknown = [f for f in _ANY_FIELD.findall(value) if not _DATE_FIELD.fullmatch(f)]
        if unknown:
            raise ConfigError(f"{key}: unknown field {unknown[0]} in {value!r}; the only field is "
                              "{date} (or {date:STRFTIME})")
        if _DATE_FIELD.search(value):
            fields[key] = value
    if not fields:
        if input_date is not None:
            raise ConfigError(f"--input_date {input_date} was given, but neither input nor output "
                              "holds a {date} field to fill")
        return config
    if config.streaming.subscription:
        raise ConfigError(f"{', '.join(fields)}: {{date}} is for batch runs; streaming output is "
                          "partitioned by window (dt=/hour=) already")
    day = parse_input_date(input_date, now)

    def fill(match: re.Match) -> str:
        return day.strftime(match.group(1)) if match.group(1) else day.isoformat()

    filled = config.model_copy(update={k: _DATE_FIELD.sub(fill, v) for k, v in fields.items()})
    filled._filled_day = day
    return filled


def _default_text(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def explain(model: Optional[type[BaseModel]] = None,
            prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, meaning) of every config key, from the schema itself: the one source of
    the config table of docs/configuration.md and of ``newsvec config --explain``."""
    rows = []
    for name, field in (model or Config).model_fields.items():
        key = prefix + name
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            rows += explain(field.annotation, key + ".")
        else:
            rows.append((f"{key}.*" if key == "beam" else key, _default_text(field),
                         field.description or ""))
    return rows


def explain_markdown() -> str:
    """The config table of docs/configuration.md (between its config-table markers), generated."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {meaning} |" for key, default, meaning in explain()]
    return "\n".join(lines)
