"""Search newsvec's output: ``newsvec search --config C "query text" [--k 10] [--output PREFIX]
[--all-copies]``.

The query is prepared like an article's text (``normalize_text``, in ``text.unicode_form``),
prefixed with ``model.query_prefix``, tokenized and embedded with the config's model settings:
without starting vLLM where ``transforms.engines.query`` computes the model exactly (a BERT
encoder: a search then takes under 2 s instead of about 13 s, most of it imports), else by the
engine. The nearest articles in the output's Parquet files are found with DuckDB's
``array_cosine_similarity``: by the article's best chunk when the output has ``chunks/``, else by
its row in ``vectors/`` (the ``title`` shown is the column's: the prepared title); then each story
(``coalesce(story_id, id)``: near-duplicate copies of one article share a ``story_id``) by its
nearest article, named with how many other articles of the story the output holds (``copies``),
unless ``all_copies``. ``k`` counts stories. Works on a batch
output and on a streaming one (``dt=/hour=`` partitions), local or ``gs://`` (the files are
read through Beam's file systems and handed to DuckDB as Arrow tables, so DuckDB needs no
extension). The vectors are read as float32 whatever they were written as (``sink.vector_dtype``
float16, or files from before their elements were declared not null), so DuckDB computes on one
type and outputs written either way are searched together.

A query is embedded as the output's articles were (``check_output``, before anything is
embedded): a committed batch output's ``_summary.json`` records its run's settings, and a config
is refused (a ``ConfigError``: the command exits 2) whose ``model.document_prefix`` or
``model.query_prefix`` differ (``PrefixMismatch``), whose embedding signature differs
(``SettingsMismatch``: ``model.max_tokens``, ``model.normalize``, ``model.dimensions``,
``text.unicode_form``; not the chunking's, which decide how articles are cut, not how a query is
embedded), or whose model's files are not those that wrote the output
(``ModelMismatch``: the recorded ``model.content_sha256`` becomes the config's ``model.sha256``,
so a ``gs://`` folder is fetched pinned and a local one is hashed). A committed output whose
summary cannot be read is refused too (``OutputUncheckable``: ``newsvec cleanup`` says what is
missing). A streaming output records none of these (its ledger records count, its key index
hashes the settings into each key), nor does the store: those are searched with the config's
settings, unchecked.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
import threading
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
from apache_beam.io.filesystems import FileSystems

from pipeline.config import Config, ConfigError, signature_of
from transforms.output.layout import CHUNKS_DIR, VECTORS_DIR, join_path, read_parquet
from transforms.output.manifest import (
    SUMMARY_FILE,
    SummaryUnavailable,
    published_summary,
)
from transforms.output.parquet import STORY_COLUMNS, float32_embeddings
from transforms.output.summary import RunSummary


def _read(output: str, subdir: str, columns: list[str], files: tuple[str, ...]
          ) -> pa.Table | None:
    """``columns`` of those of ``files`` under ``subdir``; a column a file lacks (``story_id`` in
    files written before 0.4) reads as nulls of its type."""
    under = join_path(output, subdir, "")
    files = tuple(path for path in files if path.startswith(under))

    def whole(table: pa.Table) -> pa.Table:
        for name in columns:
            if name not in table.column_names:
                table = table.append_column(name, pa.nulls(table.num_rows, _COLUMN_TYPES[name]))
        return float32_embeddings(table.select(columns))

    # regular files of the output only (never one outside, no FIFO)
    return read_parquet(output, sorted(files), columns, each=whole)


_COLUMN_TYPES = {column.name: column.field(0).type for column in STORY_COLUMNS}


PREFIXES = ("document_prefix", "query_prefix")


class PrefixMismatch(ConfigError):
    """The config's prefixes are not those the output was written with: its queries would be
    embedded with the wrong prefix, silently worse."""


class SettingsMismatch(ConfigError):
    """The config's embedding signature (``pipeline.config.signature_of``) is not the one the
    output was written with: its queries would be prepared or embedded otherwise."""


class ModelMismatch(ConfigError):
    """The config's model folder holds other files than the model that wrote the output."""


class OutputUncheckable(ConfigError):
    """A committed output whose summary cannot be read: nothing can be checked against it."""


# The settings each key of an embedding signature comes from, and what its absence means.
_SIGNATURE_SETTINGS = {"max_tokens": "model.max_tokens", "normalize": "model.normalize",
                       "document_prefix": "model.document_prefix",
                       "unicode_form": "text.unicode_form", "dimensions": "model.dimensions"}
# Keys of the signature that decide how articles are cut into chunks, not how a query is embedded:
# a search reads whichever of vectors/ and chunks/ the output holds, so a config of another
# chunking searches it as well (the search of a chunks output with a head config is one).
_CHUNKING_KEYS = frozenset({"mode", "chunking", "doc_vector"})
_SIGNATURE_DEFAULTS = {"unicode_form": "NFC", "dimensions": "the model's dim"}


def committed_summary(output: str) -> RunSummary | None:
    """The summary of the output's committed batch run; None for an output without one
    (streaming, no run committed yet). ``OutputUncheckable`` for a committed run whose summary
    cannot be read (torn, gone, another run's)."""
    try:
        summary = published_summary(output)  # it reads the manifest itself
    except SummaryUnavailable:  # no run committed
        return None
    if summary.summary_unavailable is not None:
        raise OutputUncheckable(
            f"{output}: its committed run's {SUMMARY_FILE} cannot be read "
            f"({summary.summary_unavailable}), so the config's prefixes, embedding settings "
            "and model cannot be checked against the output's: refused rather than searched "
            "unchecked. Run newsvec cleanup on the output (it names what is missing), or run the "
            "pipeline again to write it anew")
    return summary


def recorded_prefixes(output: str) -> dict[str, str]:
    """The prefixes the output's committed batch run recorded in its summary (``model``), those
    it has of ``PREFIXES``; empty for an output that records none (streaming, no committed run).
    ``OutputUncheckable`` for a committed run whose summary cannot be read."""
    return _prefixes(committed_summary(output))


def _prefixes(summary: RunSummary | None) -> dict[str, str]:
    model = summary.model if summary is not None else None
    if not isinstance(model, dict):
        return {}
    return {key: model[key] for key in PREFIXES if isinstance(model.get(key), str)}


def check_output(config: Config, output: str) -> Config:
    """The config to search ``output`` with: the config, its ``model.sha256`` set to the model's
    content hash the output recorded. Refused (a ``ConfigError``) when the output's committed run
    recorded other prefixes (``PrefixMismatch``), another embedding signature
    (``SettingsMismatch``) or another model's files (``ModelMismatch``) than the config's, and for
    a committed run whose summary cannot be read (``OutputUncheckable``). An output without a
    committed batch run (streaming) is not checked."""
    summary = committed_summary(output)
    if summary is None:
        return config
    return check_against(config, output, summary)


def check_against(config: Config, output: str, summary: RunSummary) -> Config:
    """``check_output`` for the committed run ``summary`` is the summary of."""
    check_prefixes(config, output, summary)
    check_signature(config, output, summary)
    return pin_model(config, output, summary)


def check_prefixes(config: Config, output: str, summary: RunSummary | None = None) -> None:
    """``PrefixMismatch`` if the output recorded a ``document_prefix`` or ``query_prefix`` other
    than the config's: a query must be embedded as the model was trained to meet the output's
    articles, with the query prefix that goes with their document prefix."""
    recorded = _prefixes(summary) if summary is not None else recorded_prefixes(output)
    differ = [key for key, value in recorded.items() if getattr(config.model, key) != value]
    if differ:
        shown = "; ".join(f"model.{key}: the output's {recorded[key]!r}, the config's "
                          f"{getattr(config.model, key)!r}" for key in differ)
        raise PrefixMismatch(f"{output} was written with other prefixes than the config's "
                             f"({shown}): search it with the config it was written with")


def check_signature(config: Config, output: str, summary: RunSummary) -> None:
    """``SettingsMismatch`` naming each setting of the embedding signature (``signature_of``)
    whose value the output recorded (``incremental.embedding_signature``) is not the config's:
    those that decide how a query is prepared and embedded (``_SIGNATURE_SETTINGS``), not the
    chunking's (``_CHUNKING_KEYS``)."""
    try:
        recorded = summary.embedding_signature
    except ValueError as e:
        raise OutputUncheckable(f"{output}: {e}, so the config's embedding settings cannot be "
                                "checked against the output's: refused rather than searched "
                                "unchecked") from None
    if recorded is None:
        return  # a summary of a release before the signature was recorded
    ours = json.loads(signature_of(config))
    theirs = json.loads(recorded)
    differ = sorted(key for key in {*ours, *theirs} - _CHUNKING_KEYS
                    if ours.get(key) != theirs.get(key))
    if differ:
        def shown(values: dict, key: str) -> str:
            return repr(values[key]) if key in values else _SIGNATURE_DEFAULTS.get(key, "unset")

        said = "; ".join(f"{_SIGNATURE_SETTINGS.get(key, key)}: the output's "
                         f"{shown(theirs, key)}, the config's {shown(ours, key)}"
                         for key in differ)
        raise SettingsMismatch(f"{output} was embedded with other settings than the config's "
                               f"({said}): its queries would be prepared or embedded otherwise "
                               "than its articles were; search it with the config it was "
                               "written with")


def pin_model(config: Config, output: str, summary: RunSummary) -> Config:
    """The config with ``model.sha256`` the content hash of the model that wrote the output
    (``model.content_sha256`` of its summary), its folder checked against it (``model_folder``:
    a ``gs://`` folder fetched pinned, a local one hashed). ``ModelMismatch`` when the folder's
    files hash otherwise, or the config pins another model. Unchanged for an output that recorded
    no hash (a Hugging Face id, not a local folder, when it was written)."""
    from transforms.engines.fetch import ModelPinMismatch
    from transforms.engines.model import model_folder

    model = summary.model
    if not isinstance(model, dict):
        return config
    recorded = model.get("content_sha256")
    if not isinstance(recorded, str):
        return config
    written_by = f"{model.get('label') or model.get('name')} (its files' sha256 {recorded})"
    if config.model.sha256 not in (None, recorded):
        raise ModelMismatch(f"{output} was written by the model {written_by}, but the config "
                            f"pins model.sha256 {config.model.sha256}: search it with the model "
                            "it was written with")
    pinned = config.model.model_copy(update={"sha256": recorded})
    try:
        model_folder(pinned)
    except ModelPinMismatch as exc:
        raise ModelMismatch(f"{output} was written by the model {written_by}, but the config's "
                            f"model.path {config.model.path} holds other files (sha256 "
                            f"{exc.found}): its query would be embedded by another model than "
                            "the articles were; search it with the model it was written "
                            "with") from None
    return config.model_copy(update={"model": pinned})


def embed_query(config: Config, query: str):
    """The query's vector, as the engine embeds an article of the same text: computed without
    starting vLLM (``transforms.engines.query``) where the model allows it exactly, else by the
    engine (a note on standard error says why)."""
    (vector,), notes = embed_queries(config, [query])
    for note in notes:
        print(f"newsvec search: {note}", file=sys.stderr)
    return vector


def embed_queries(config: Config, queries: Sequence[str]) -> tuple[list, list[str]]:
    """(each query's vector as ``embed_query`` computes it, why any went to the engine): the
    engine embeds every query of a model the query path refuses (``Unsupported``), and a query it
    fails on (a tokenizer's error), so that a search never ends in a traceback the engine would
    not have given."""
    from transforms.engines.query import QueryEmbedder, Unsupported
    from transforms.text import normalize_text

    texts = [config.model.query_prefix + normalize_text(query, config.text.unicode_form)
             for query in queries]
    try:
        embedder = QueryEmbedder(config.model)
    except Unsupported as exc:
        return ([embed_query_with_engine(config, text) for text in texts],
                [f"the query is embedded by the engine (vLLM: slower to start), as "
                 f"{config.model.name} is not one it embeds without it: {exc}"])
    vectors, notes = [], []
    for text in texts:
        try:
            vectors.append(embedder.embed(embedder.ids(text)))
        except Exception as exc:  # pylint: disable=broad-except  # tokenizers raises Exception
            notes.append(f"the query is embedded by the engine (vLLM: slower to start), as the "
                         f"query path failed on it: {type(exc).__name__}: {exc}")
            vectors.append(embed_query_with_engine(config, text))
    return vectors, notes


def embed_query_with_engine(config: Config, text: str):
    """The vector of a prepared query text (prefix and all) from the engine itself."""
    from transforms.engines.registry import load_engine
    from transforms.text import HeadTokenizer

    ids, _ = HeadTokenizer(config.model)(text)
    (vector,) = load_engine(config.model).embed([ids])
    return vector


def search(config: Config, query: str, k: int = 10, output: str | None = None,
           all_copies: bool = False) -> list[dict]:
    """The ``k`` nearest stories, best first: of each story (``coalesce(story_id, id)``: an
    article that copies none, or of an output written before 0.4, is a story of its own) its
    nearest article (by its best chunk in a chunks output), ``{"id", "title", "score",
    "chunk_index", "story_id", "copies"}``, ``copies`` the other articles of the story the output
    holds. ``all_copies``: the ``k`` nearest articles, every copy of a story among them."""
    output = output or config.output
    config = check_output(config, output)
    index = ParquetIndex(output, config.model.output_dim)
    return index.nearest(embed_query(config, query), k, all_copies)


@dataclasses.dataclass(frozen=True)
class Filters:
    """What a search keeps (``newsvec serve``'s ``/v1/search``): articles of one of ``sources``
    and of ``languages`` (empty: any), published at or after ``published_after`` and before
    ``published_before`` (timezone-aware; None: no bound). An article the filter names a column
    of and that has no value there is left out."""

    sources: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()
    published_after: dt.datetime | None = None
    published_before: dt.datetime | None = None

    def sql(self, first: int) -> tuple[str, list]:
        """(a ``WHERE`` clause on the articles ``a``, or ""; its parameters, numbered from
        ``$first``)."""
        terms: list[str] = []
        params: list[Any] = []
        for column, values in (("source", self.sources), ("language", self.languages)):
            if values:
                terms.append(f"list_contains(${first + len(params)}::VARCHAR[], a.{column})")
                params.append(list(values))
        for op, bound in ((">=", self.published_after), ("<", self.published_before)):
            if bound is not None:
                terms.append(f"a.published_at {op} ${first + len(params)}::TIMESTAMPTZ")
                params.append(bound)
        return ("WHERE " + " AND ".join(terms) if terms else ""), params


_DETAILS = ("url", "source", "language", "published_at")
"""The columns of an article a detailed search (``ParquetIndex(details=True)``) adds to each
hit."""


class ParquetIndex:
    """An output's ``vectors/`` (and ``chunks/``) read once and searched many times: ``search``
    reads it for one query, ``newsvec serve`` holds it warm. ``details``: each hit also holds the
    article's ``url``, ``source``, ``language`` and ``published_at`` (ISO 8601, UTC), and
    ``nearest`` takes ``Filters``. ``files`` are the Parquet files it read (a newer run's differ).
    A search may run in any thread: each has its own DuckDB connection on the same Arrow
    tables."""

    def __init__(self, output: str, dim: int, details: bool = False,
                 files: tuple[str, ...] | None = None):
        try:
            import duckdb  # noqa: F401
        except ImportError as e:  # not in the worker image: an extra
            raise ImportError("newsvec search needs DuckDB: pip install 'newsvec[search]' "
                              "(make setup installs it)") from e
        self.output, self.dim, self.details = output, dim, details
        self.files = parquet_files(output) if files is None else files
        self.vectors, self.chunks = _vectors_and_chunks(output, dim, details, self.files)
        self._local = threading.local()

    @property
    def articles(self) -> int:
        return self.vectors.num_rows

    def _connection(self):
        con = getattr(self._local, "con", None)
        if con is None:
            import duckdb

            con = self._local.con = duckdb.connect()
            con.register("vectors", self.vectors)
            if self.chunks is not None:
                con.register("chunks", self.chunks)
        return con

    def nearest(self, vector, k: int, all_copies: bool = False,
                filters: Filters = Filters()) -> list[dict]:
        """The ``k`` nearest stories to ``vector`` (``search``'s hits; with ``details``, each
        with the article's columns), only articles ``filters`` keeps."""
        where, params = filters.sql(3)
        if where and not self.details:
            raise ValueError("filters need an index read with details")
        sql = _nearest_sql(self.dim, self.chunks is not None, all_copies, self.details, where)
        rows = self._connection().execute(
            sql, [np.asarray(vector, dtype=np.float32).tolist(), k, *params]).fetchall()
        hits = []
        for i, t, s, c, story, n, *more in rows:
            hit = {"id": i, "title": t, "score": round(float(s), 4), "chunk_index": c,
                   "story_id": story, "copies": int(n)}
            if self.details:
                hit.update(zip(_DETAILS, [*more[:3], _iso_from_us(more[3])], strict=True))
            hits.append(hit)
        return hits


def _iso_from_us(micros: int | None) -> str | None:
    if micros is None:
        return None
    when = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(microseconds=micros)
    return when.isoformat().replace("+00:00", "Z")


def parquet_files(output: str) -> tuple[str, ...]:
    """The Parquet files of the output's ``vectors/`` and ``chunks/``, sorted: what a search
    reads (another list after a new run published)."""
    return tuple(sorted(m.path for sub in (VECTORS_DIR, CHUNKS_DIR)
                        for m in FileSystems.match([join_path(output, sub, "**")])[0].metadata_list
                        if m.path.endswith(".parquet")))


def _vectors_and_chunks(output: str, dim: int, details: bool, files: tuple[str, ...]
                        ) -> tuple[pa.Table, pa.Table | None]:
    """The output's ``vectors/`` and ``chunks/`` (None: a head output), each of ``dim``-dimensional
    vectors: a ``ValueError`` if not (the config's queries would be of another size)."""
    columns = ["id", "title", "story_id", "embedding", *(_DETAILS if details else ())]
    vectors = _read(output, VECTORS_DIR, columns, files)
    if vectors is None:
        raise FileNotFoundError(f"no vectors under {output}/{VECTORS_DIR}/: run the pipeline first")
    chunks = _read(output, CHUNKS_DIR, ["id", "chunk_index", "embedding"], files)
    for table in (vectors, chunks):
        written = table.schema.field("embedding").type.list_size if table is not None else dim
        if written != dim:
            raise ValueError(f"{output} holds {written}-dimensional vectors, but the config's "
                             f"queries are {dim}-dimensional (model.dimensions): search it with "
                             "the config it was written with")
    return vectors, chunks


def _nearest_sql(dim: int, by_chunk: bool, all_copies: bool, details: bool = False,
                 where: str = "") -> str:
    """DuckDB's query of the nearest stories (``$1`` the query's vector, ``$2`` k) over the
    tables ``vectors`` and, ``by_chunk``, ``chunks``; ``details``: each hit with the article's
    ``_DETAILS`` (``published_at`` in microseconds), ``where``: a ``WHERE`` clause on the articles
    (``a``: ``Filters.sql``)."""
    if by_chunk:  # each article by its best chunk
        best = f"""
            scored AS (
              SELECT id, chunk_index, array_cosine_similarity(
                       embedding::FLOAT[{dim}], $1::FLOAT[{dim}]) AS score FROM chunks),
            best AS (SELECT id, arg_max(chunk_index, score) AS chunk_index, max(score) AS score
                     FROM scored GROUP BY id)"""
    else:  # each article by its row (a streaming output may hold an article's row twice)
        best = f"""
            best AS (SELECT id, NULL::INTEGER AS chunk_index, max(array_cosine_similarity(
                       embedding::FLOAT[{dim}], $1::FLOAT[{dim}])) AS score
                     FROM vectors GROUP BY id)"""
    # Each article's story: its story_id, or its own id where it has none (a null in rows
    # written before 0.4 or with near_duplicates.enabled false).
    one_each = "" if all_copies else \
        "QUALIFY row_number() OVER (PARTITION BY story ORDER BY score DESC, id) = 1"
    more = (", any_value(url) AS url, any_value(source) AS source, any_value(language) AS "
            "language, max(published_at) AS published_at") if details else ""
    shown = ", a.url, a.source, a.language, a.published_at" if details else ""
    picked = ", h.url, h.source, h.language, epoch_us(h.published_at)" if details else ""
    return f"""
        WITH {best},
        articles AS (SELECT id, any_value(title) AS title,
                            coalesce(max(story_id), id) AS story{more} FROM vectors GROUP BY id),
        stories AS (SELECT story, count(*) AS n FROM articles GROUP BY story),
        hits AS (SELECT b.id, a.title, b.score, b.chunk_index, coalesce(a.story, b.id) AS story
                        {shown}
                 FROM best b LEFT JOIN articles a USING (id) {where})
        SELECT h.id, h.title, h.score, h.chunk_index, h.story, greatest(coalesce(s.n, 1) - 1, 0)
               {picked}
        FROM hits h LEFT JOIN stories s USING (story) {one_each}
        ORDER BY h.score DESC, h.id LIMIT $2"""


def search_store(config: Config, query: str, k: int = 10, all_copies: bool = False
                 ) -> list[dict]:
    """``search`` over the store (``store:``; ``newsvec search --store``): the HNSW index of
    PostgreSQL + pgvector instead of the Parquet files, the same results' form, collapsed by
    story in SQL."""
    from transforms.stores import store_for

    return store_for(config.store).search(embed_query(config, query), k, all_copies=all_copies)
