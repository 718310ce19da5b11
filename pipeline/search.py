"""Search newsvec's output: ``newsvec search --config C "query text" [--k 10] [--output PREFIX]``.

The query is prepared like an article's text (``normalize_text``, in ``text.unicode_form``),
prefixed with ``model.query_prefix``, tokenized and embedded with the config's model settings:
without starting vLLM where ``transforms.engines.query`` computes the model exactly (a BERT
encoder: a search then takes under 2 s instead of about 13 s, most of it imports), else by the
engine. The nearest articles in the output's Parquet files are found with DuckDB's
``array_cosine_similarity``: by the article's best chunk when the output has ``chunks/``, else by
its row in ``vectors/`` (the ``title`` shown is the column's: the prepared title). Works on a batch
output and on a streaming one (``dt=/hour=`` partitions), local or ``gs://`` (the files are
read through Beam's file systems and handed to DuckDB as Arrow tables, so DuckDB needs no
extension). The vectors are read as float32 whatever they were written as (``sink.vector_dtype``
float16, or files from before their elements were declared not null), so DuckDB computes on one
type and outputs written either way are searched together.

A query is embedded with the prefix the output's articles were embedded for: a batch output
records its run's ``model.document_prefix`` and ``model.query_prefix`` in ``_summary.json``, and a
config whose prefixes differ from those is refused (``PrefixMismatch``) before anything is
embedded. A streaming output records neither (its ledger records count, its key index hashes
the document prefix into each key): it is searched with the config's.
"""
from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from pipeline.config import Config, ConfigError
from transforms.output.layout import CHUNKS_DIR, VECTORS_DIR, join_path, open_output_file
from transforms.output.manifest import COMMITTED, published_summary, read_manifest
from transforms.output.parquet import float32_embeddings


def _read(output: str, subdir: str, columns: list[str]) -> pa.Table | None:
    files = [m.path for m in FileSystems.match([join_path(output, subdir, "**")])[0].metadata_list
             if m.path.endswith(".parquet")]
    tables = []
    for path in sorted(files):  # regular files of the output only (never one outside, no FIFO)
        with open_output_file(output, path) as f:
            tables.append(float32_embeddings(pq.read_table(f, columns=columns)))
    return pa.concat_tables(tables) if tables else None


PREFIXES = ("document_prefix", "query_prefix")


class PrefixMismatch(ConfigError):
    """The config's prefixes are not those the output was written with: its queries would be
    embedded with the wrong prefix, silently worse."""


def recorded_prefixes(output: str) -> dict[str, str]:
    """The prefixes the output's committed batch run recorded in its summary (``model``), those
    it has of ``PREFIXES``; empty for an output that records none (streaming, no committed run,
    a summary that cannot be read)."""
    current = read_manifest(output)
    if current is None or current.state != COMMITTED:
        return {}
    model = published_summary(output).get("model")
    if not isinstance(model, dict):
        return {}
    return {key: model[key] for key in PREFIXES if isinstance(model.get(key), str)}


def check_prefixes(config: Config, output: str) -> None:
    """``PrefixMismatch`` if the output recorded a ``document_prefix`` or ``query_prefix`` other
    than the config's: a query must be embedded as the model was trained to meet the output's
    articles, with the query prefix that goes with their document prefix."""
    recorded = recorded_prefixes(output)
    differ = [key for key, value in recorded.items() if getattr(config.model, key) != value]
    if differ:
        shown = "; ".join(f"model.{key}: the output's {recorded[key]!r}, the config's "
                          f"{getattr(config.model, key)!r}" for key in differ)
        raise PrefixMismatch(f"{output} was written with other prefixes than the config's "
                             f"({shown}): search it with the config it was written with")


def embed_query(config: Config, query: str):
    """The query's vector, as the engine embeds an article of the same text: computed without
    starting vLLM (``transforms.engines.query``) where the model allows it exactly, else by the
    engine (a note on standard error says why)."""
    from transforms.engines.query import QueryEmbedder, Unsupported
    from transforms.text import normalize_text

    text = config.model.query_prefix + normalize_text(query, config.text.unicode_form)
    try:
        embedder = QueryEmbedder(config.model)
    except Unsupported as exc:
        print(f"newsvec search: the query is embedded by the engine (vLLM: slower to start), "
              f"as {config.model.name} is not one it embeds without it: {exc}", file=sys.stderr)
        return embed_query_with_engine(config, text)
    return embedder.embed(embedder.ids(text))


def embed_query_with_engine(config: Config, text: str):
    """The vector of a prepared query text (prefix and all) from the engine itself."""
    from transforms.engines.base import load_engine
    from transforms.text import HeadTokenizer

    ids, _ = HeadTokenizer(config.model)(text)
    (vector,) = load_engine(config.model).embed([ids])
    return vector


def search(config: Config, query: str, k: int = 10, output: str | None = None) -> list[dict]:
    """The ``k`` nearest articles: ``{"id", "title", "score", "chunk_index"}``, best first."""
    try:
        import duckdb
    except ImportError as e:  # not in the worker image: an extra
        raise ImportError("newsvec search needs DuckDB: pip install 'newsvec[search]' "
                          "(make setup installs it)") from e

    output = output or config.output
    check_prefixes(config, output)
    vectors = _read(output, VECTORS_DIR, ["id", "title", "embedding"])
    if vectors is None:
        raise FileNotFoundError(f"no vectors under {output}/{VECTORS_DIR}/: run the pipeline first")
    chunks = _read(output, CHUNKS_DIR, ["id", "chunk_index", "embedding"])
    dim = config.model.output_dim
    for table in (vectors, chunks):
        written = table.schema.field("embedding").type.list_size if table is not None else dim
        if written != dim:
            raise ValueError(f"{output} holds {written}-dimensional vectors, but the config's "
                             f"queries are {dim}-dimensional (model.dimensions): search it with "
                             "the config it was written with")
    con = duckdb.connect()
    con.register("vectors", vectors)
    params = [embed_query(config, query).tolist(), k]
    if chunks is not None:
        con.register("chunks", chunks)
        sql = f"""
            WITH scored AS (
              SELECT id, chunk_index, array_cosine_similarity(
                       embedding::FLOAT[{dim}], $1::FLOAT[{dim}]) AS score FROM chunks),
            best AS (SELECT id, arg_max(chunk_index, score) AS chunk_index, max(score) AS score
                     FROM scored GROUP BY id)
            SELECT b.id, any_value(v.title) AS title, b.score, b.chunk_index
            FROM best b LEFT JOIN vectors v USING (id)
            GROUP BY b.id, b.score, b.chunk_index ORDER BY b.score DESC LIMIT $2"""
    else:
        sql = f"""
            SELECT id, any_value(title) AS title, max(array_cosine_similarity(
                     embedding::FLOAT[{dim}], $1::FLOAT[{dim}])) AS score, NULL AS chunk_index
            FROM vectors GROUP BY id ORDER BY score DESC LIMIT $2"""
    return [{"id": i, "title": t, "score": round(float(s), 4), "chunk_index": c}
            for i, t, s, c in con.execute(sql, params).fetchall()]


def search_store(config: Config, query: str, k: int = 10) -> list[dict]:
    """``search`` over the store (``store:``; ``newsvec search --store``): the HNSW index of
    PostgreSQL + pgvector instead of the Parquet files, the same results' form."""
    from transforms.stores import store_for

    return store_for(config.store).search(embed_query(config, query), k)
