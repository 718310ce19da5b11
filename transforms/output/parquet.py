"""The Parquet schemas of the output, defined once, and the Arrow helpers that read and write them
(the data types themselves: ``transforms.types``).

- ``vector_schema(dim, vector_dtype)``, ``chunk_schema(dim, vector_dtype)``, ``key_schema()``: the
  Parquet schemas of ``vectors/``, ``chunks/`` and ``keys/``, whose ``embedding`` column's element
  type is ``transforms.settings.VectorDtype`` (``sink.vector_dtype``).
- ``PARQUET_COLUMNS``: every column of every folder with its description (docs/output.md's
  tables are generated from it: ``schema_markdown``).
"""
from __future__ import annotations

import copyreg
import dataclasses
import datetime as dt
from collections.abc import Callable
from typing import Any, Mapping, Optional, get_args

import pyarrow as pa

from transforms.settings import VectorDtype

VECTOR_DTYPES: tuple[str, ...] = get_args(VectorDtype)


_ARROW_FLOATS = {"float32": pa.float32(), "float16": pa.float16()}


def embedding_type(dim: int, vector_dtype: VectorDtype = "float32") -> pa.DataType:
    """``fixed_size_list<item: float not null>[dim]`` (``halffloat`` at float16). The elements are
    declared not null: BigQuery's vector index takes an ARRAY<FLOAT64> only if no element can be
    NULL. Files written before carry nullable elements; readers accept both
    (``unify_embedding``)."""
    return pa.list_(pa.field("item", _ARROW_FLOATS[vector_dtype], nullable=False), dim)


def _fixed_size_list(name: str, value_type: pa.DataType, nullable: bool, size: int,
                     metadata) -> pa.DataType:
    return pa.list_(pa.field(name, value_type, nullable=nullable, metadata=metadata), size)


def _reduce_fixed_size_list(type_: pa.FixedSizeListType):
    field = type_.value_field
    return _fixed_size_list, (field.name, field.type, field.nullable, type_.list_size,
                              field.metadata)


# pyarrow 25's own pickling of a fixed_size_list keeps only its value type and size: the not-null
# flag of its elements is lost, and Beam pickles the schemas it sends to workers, which then wrote
# nullable elements. pickle (and cloudpickle, dill) consult copyreg's table first.
copyreg.pickle(pa.FixedSizeListType, _reduce_fixed_size_list)


def float32_embeddings(table: pa.Table) -> pa.Table:
    """``table`` with its ``embedding`` column as float32 elements declared not null, whatever it
    was written as (float16, or nullable elements before they were declared not null): tables of
    outputs written either way concatenate, and DuckDB (which reads no Arrow float16) computes on
    it."""
    if "embedding" not in table.column_names:
        return table
    index = table.column_names.index("embedding")
    column = table.column(index)
    type_ = embedding_type(column.type.list_size, "float32")
    if not column.type.value_field.nullable and pa.types.is_float32(column.type.value_type):
        return table
    return table.set_column(index, table.schema.field(index).with_type(type_),
                            column.cast(type_))


def vector_matrix(table: pa.Table) -> "Any":
    """The ``embedding`` column as a numpy float32 matrix, one row per row."""
    column = float32_embeddings(table.select(["embedding"])).column(0).combine_chunks()
    return column.flatten().to_numpy().reshape(table.num_rows, column.type.list_size)


def _with_embedding(schema: pa.Schema, vector_dtype: Optional[VectorDtype] = None) -> pa.Schema:
    """``schema`` with its ``embedding`` column declared as now (not-null elements), of its own
    element type or ``vector_dtype``."""
    if "embedding" not in schema.names:
        return schema
    index = schema.get_field_index("embedding")
    field = schema.field(index)
    dtype = vector_dtype or ("float16" if pa.types.is_float16(field.type.value_type)
                             else "float32")
    return schema.set(index, field.with_type(embedding_type(field.type.list_size, dtype)))


def common_schema(schemas: list[pa.Schema], merge_columns: bool = False) -> pa.Schema:
    """The schema files of one kind are compacted into, or read together under: their own, with
    the ``embedding`` column declared as now (files written before carry nullable elements), its
    elements float32 if any file's are (float16 widens exactly; a ``sink.vector_dtype`` changed
    between them), and the nullable columns some files lack (written before the column was
    added, as ``updated_at``) added. Raises ValueError if they differ in anything else (another
    dimension, a column of another type), unless ``merge_columns``: then any column some files
    lack is added (outputs of several newsvec versions, read together). ``conform`` makes a
    file's rows fit it."""
    unified = [_with_embedding(schema) for schema in schemas]
    if any(_embedding_dtype(schema) == "float32" for schema in unified):
        unified = [_with_embedding(schema, "float32") for schema in unified]
    if merge_columns:
        return pa.unify_schemas(unified)
    try:
        union = pa.unify_schemas(unified)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise ValueError("the files' columns have different types: not compacted together") \
            from None
    for i, schema in enumerate(unified):
        lacking = [f for f in union if f.name not in schema.names]
        if any(not f.nullable for f in lacking) or any(
                not union.field(f.name).equals(f) for f in schema):
            raise ValueError(f"file {i} has another schema than the others: not compacted "
                             f"together")
    return union


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` under ``schema`` (``common_schema``'s): a column it lacks as nulls, the
    embedding's elements cast."""
    if batch.schema.equals(schema):
        return batch
    columns = [batch.column(f.name) if f.name in batch.schema.names
               else pa.nulls(batch.num_rows, f.type) for f in schema]
    return pa.RecordBatch.from_arrays(columns, names=schema.names).cast(schema)


def _embedding_dtype(schema: pa.Schema) -> Optional[str]:
    if "embedding" not in schema.names:
        return None
    return "float16" if pa.types.is_float16(schema.field("embedding").type.value_type) \
        else "float32"


@dataclasses.dataclass(frozen=True)
class Column:
    """One Parquet column, defined once: the schema is built from it and the docs' table generated.

    ``type`` is an Arrow type, or, for the vector column, a function of the embedding dimension
    and ``sink.vector_dtype``."""
    name: str
    type: pa.DataType | Callable[[int, VectorDtype], pa.DataType]
    nullable: bool
    description: str

    def field(self, dim: int = 0, vector_dtype: VectorDtype = "float32") -> pa.Field:
        return pa.field(self.name,
                        self.type(dim, vector_dtype) if callable(self.type) else self.type,
                        nullable=self.nullable)


_TIMESTAMP = pa.timestamp("us", tz="UTC")


def _from_event(name: str, type_: pa.DataType) -> Column:
    return Column(name, type_, True, "from the event")


# The columns vectors/ and chunks/ (and keys/) share, with one meaning in each.
_ID = Column("id", pa.string(), False,
             "the event id: the article's (`chunks/` and `keys/` join to `vectors/` on it)")


_TEXT_SHA256 = Column("text_sha256", pa.string(), False,
                      "sha256 of the article's prepared text (normalized title + newline + body)")


_MODEL = Column("model", pa.string(), False,
                "`name@revision`, or `name@sha256:<16 hex>` of the model files")


_DIM = Column("dim", pa.int32(), False,
              "embedding dimension: `model.dimensions`, else the model's (`model.dim`)")


_EMBEDDING = Column("embedding", embedding_type, False,
                    "the vector (L2-normalized if `model.normalize`); its elements are `float16` "
                    "with `sink.vector_dtype: float16`")


_EMBEDDED_AT = Column("embedded_at", _TIMESTAMP, False, "when the vector was computed")


_CHUNK_COUNT = Column("chunk_count", pa.int32(), False,
                      "the article's number of chunks: its rows in `chunks/` (0 in head mode)")


_STORY_ID = Column(
    "story_id", pa.string(), True,
    "the article's story: the id of the first article of its story newsvec saw (its own id if it "
    "copies none; [near duplicates](output.md#the-same-story-once)); null with "
    "`near_duplicates.enabled: false`")


STORY_COLUMNS = (
    _STORY_ID,
    Column("near_duplicate_of", pa.string(), True,
           "the id of the article this one is a copy of (the most similar one held), or null"),
    Column("similarity", pa.float32(), True,
           "the estimated Jaccard similarity of the two texts' character shingles (MinHash), "
           "where `near_duplicate_of` is set"),
)
"""Every row's story (``transforms.stories``): ``vectors/`` and ``chunks/`` end with these."""


VECTOR_COLUMNS = (
    _ID, _from_event("url", pa.string()), _from_event("source", pa.string()),
    Column("title", pa.string(), True,
           "the prepared title: HTML stripped, entities decoded, mojibake repaired, in "
           "`text.unicode_form`, whitespace collapsed, a space after each `<` that would open a "
           "tag (the text's first line); null if none is left"),
    _from_event("published_at", _TIMESTAMP),
    _from_event("language", pa.string()),
    _MODEL, _DIM, _EMBEDDING, _TEXT_SHA256,
    Column("token_count", pa.int32(), False,
           "tokens the vector stands for: the head's, special tokens and the document prefix "
           "included (≤ `model.max_tokens`); for a mean vector, the whole text's (no special "
           "tokens)"),
    Column("truncated", pa.bool_(), False,
           "whether the text was longer than `model.max_tokens` (its head was kept); false for a "
           "mean vector"),
    _EMBEDDED_AT,
    # Lineage of streamed events (null for events read from files).
    Column("pubsub_message_id", pa.string(), True,
           "streaming: the Pub/Sub message id (null in batch)"),
    Column("pubsub_publish_time", _TIMESTAMP, True,
           "streaming: when the message was published"),
    Column("pubsub_attributes", pa.map_(pa.string(), pa.string()), True,
           "streaming: the message attributes"),
    Column("doc_vector", pa.string(), False,
           "what `embedding` is: `head` (head mode, or `chunking.doc_vector: head`) or `mean` (of "
           "the article's chunk vectors)"),
    _CHUNK_COUNT,
    # Last, so that tables built from the columns before it gained this one take it at their end.
    Column("updated_at", _TIMESTAMP, True,
           "from the event: when the article was last changed; the first order of its versions "
           "(the [current vector](incremental.md#the-current-vector-of-every-article))"),
    # Last, for the same reason.
    *STORY_COLUMNS,
)
"""``vectors/``: one row per article."""


VERSION_ORDER = ("updated_at", "published_at", "dt", "pubsub_publish_time", "embedded_at")
"""Which of two rows of one article is its current version: the one later by these columns, in
this order, a null lower than any value (``dt``: the row's day, the ``dt=`` partition). The
article's own order first (``updated_at``, then ``published_at``), then the day it was delivered
(the batch run's day, the streaming window's), then its Pub/Sub publish time; the embedding time
only breaks a tie. The store's upsert (``transforms.stores``), ``transforms.output.current_vectors``
and the SQL in docs/incremental.md, docs/dataflow.md and docs/bigquery.md all order by it."""


NULLABLE_IN_ORDER = frozenset({"updated_at", "published_at", "pubsub_publish_time"})


_LOWEST = -(1 << 80)  # below any microsecond or day count: where a null stands in version_key


def version_key(values: Mapping[str, Any]) -> tuple:
    """``VERSION_ORDER`` as a Python sort key of one row: ``values`` maps each of its columns to
    microseconds since the epoch (``dt``: a ``datetime.date``, or days), or None; the later
    version has the larger key."""
    key = []
    for name in VERSION_ORDER:
        value = values.get(name)
        if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
            value = value.toordinal()
        elif isinstance(value, dt.datetime):
            value = (value - _EPOCH) // dt.timedelta(microseconds=1)
        key.append(_LOWEST if value is None else value)
    return tuple(key)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


CHUNK_COLUMNS = (
    _ID,
    Column("chunk_id", pa.string(), False,
           "deterministic: `sha256(id, text_sha256, model, chunking settings, chunk index)` "
           "(32 hex), the same in every run and retry"),
    Column("chunk_index", pa.int32(), False, "this chunk's place in its article"),
    _CHUNK_COUNT,
    Column("token_start", pa.int32(), False,
           "`[token_start, token_end)`: the chunk's span of the text's own tokens (no special "
           "tokens, no prefix)"),
    Column("token_end", pa.int32(), False, "see `token_start`"),
    Column("char_start", pa.int32(), False,
           "`[char_start, char_end)` of the prepared text's characters: "
           "`text[char_start:char_end]` is the chunk's text"),
    Column("char_end", pa.int32(), False, "see `char_start`"),
    Column("chunk_sha256", pa.string(), False, "sha256 of the chunk's text"),
    _TEXT_SHA256, _MODEL, _DIM, _EMBEDDING, _EMBEDDED_AT,
    Column("chunk_text", pa.string(), True,
           "the chunk's text, with `sink.store_chunk_text: true` (retrieval-augmented "
           "generation); null otherwise"),
    *STORY_COLUMNS,
)
"""``chunks/``: one row per chunk (chunks mode)."""


KEY_COLUMNS = (
    Column("key", pa.string(), False,
           "`sha256(id, text_sha256, model label, embedding signature)` (32 hex): "
           "`transforms.incremental.embedding_key`"),
    _ID, _TEXT_SHA256,
    _STORY_ID,
    Column("minhash", pa.binary(), True,
           "the text's MinHash signature (`near_duplicates.num_perm` uint32, little-endian): a "
           "later run finds this article's copies without its text; null with near duplicates "
           "off"),
    Column("minhash_version", pa.string(), True,
           "what the signature was made with (MinHash algorithm, shingle size, values, seed): "
           "only signatures of one version compare"),
    Column("story_facts", pa.binary(), True,
           "what a copy must keep of this article (`transforms.stories.facts`: its numbers with "
           "action skip, its text when short, the shingles it was signed with); null with near "
           "duplicates off, or where written before 0.5"),
)
"""``keys/``: the key index (``transforms.incremental``), one row per article written."""


PARQUET_COLUMNS = {"vectors": VECTOR_COLUMNS, "chunks": CHUNK_COLUMNS, "keys": KEY_COLUMNS}
"""Every Parquet output folder and its columns: the schemas and the tables of docs/output.md."""


def parquet_schema(columns: tuple[Column, ...], dim: int = 0,
                   vector_dtype: VectorDtype = "float32") -> pa.Schema:
    return pa.schema([column.field(dim, vector_dtype) for column in columns])


def vector_schema(dim: int, vector_dtype: VectorDtype = "float32") -> pa.Schema:
    """The Parquet schema of ``vectors/``: one row per article."""
    return parquet_schema(VECTOR_COLUMNS, dim, vector_dtype)


def chunk_schema(dim: int, vector_dtype: VectorDtype = "float32") -> pa.Schema:
    """The Parquet schema of ``chunks/``: one row per chunk (chunks mode)."""
    return parquet_schema(CHUNK_COLUMNS, dim, vector_dtype)


def key_schema() -> pa.Schema:
    """The Parquet schema of ``keys/``: the key index, one row per article written."""
    return parquet_schema(KEY_COLUMNS)


def _type_text(type_: pa.DataType) -> str:
    """An Arrow type as the docs write it; the embedding's length is the dimension, ``dim``."""
    if pa.types.is_timestamp(type_):
        return f"timestamp[{type_.unit}, {type_.tz}]"
    if pa.types.is_fixed_size_list(type_):
        not_null = "" if type_.value_field.nullable else " not null"
        return f"fixed_size_list<{_type_text(type_.value_type)}{not_null}>[dim]"
    if pa.types.is_map(type_):
        return f"map<{_type_text(type_.key_type)}, {_type_text(type_.item_type)}>"
    if pa.types.is_floating(type_):
        return f"float{type_.bit_width}"
    return str(type_)


def schema_markdown(columns: tuple[Column, ...]) -> str:
    """The Markdown table of a Parquet schema (docs/output.md holds one per folder, generated)."""
    lines = ["| column | Arrow type | meaning |", "|---|---|---|"]
    for column in columns:
        type_text = _type_text(column.field(dim=1).type)
        if not column.nullable:
            type_text += ", not null"
        lines.append(f"| `{column.name}` | {type_text} | {column.description} |")
    return "\n".join(lines)
