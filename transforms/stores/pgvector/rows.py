"""A load's rows on their way to PostgreSQL: what the store cannot take, found before anything is
sent (``check``: a NUL character, a non-finite vector, a timestamp out of range, a missing
value), the rejection a row refused gets (``rejection``, ``refusal``: stable reasons,
``Refusal``), and the rows as the tuples a binary COPY sends (``copy_rows``, pgvector's binary
format: ``vector_dumper``)."""
from __future__ import annotations

import datetime as dt
import struct
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from transforms.stores.base import LoadRows
from transforms.stores.base import printable as _printable
from transforms.stores.pgvector.schema import store_tables
from transforms.stores.pgvector.settings import StoreSettings

_HALF_MAX = 65504.0  # the largest finite float16: a larger float32 is infinite as halfvec


class Refusal:
    """Why a row cannot be stored (``reason`` of a rejected row): stable codes."""

    NUL = "nul_character"  # PostgreSQL text and jsonb cannot hold U+0000
    NON_FINITE = "non_finite_vector"  # pgvector refuses NaN and infinity (float16: over 65504)
    TIMESTAMP = "timestamp_out_of_range"  # outside years 1-9999 UTC
    MISSING = "missing_value"  # null where the table needs a value
    REFUSED = "refused_by_store"  # the server refused it: detail holds its SQLSTATE and message


def rejection(doc_id: Any, text_sha256: Any, reason: str, detail: str) -> dict:
    return {"id": _printable(doc_id), "text_sha256": _printable(text_sha256), "reason": reason,
            "detail": _printable(detail)[:300]}


_PY_MIN_US = -62135596800 * 10**6  # 0001-01-01T00:00:00Z, the first instant Python can hold
_PY_MAX_US = 253402300799 * 10**6 + 999999  # 9999-12-31T23:59:59.999999Z


def _where(mask) -> np.ndarray:
    return np.flatnonzero(np.asarray(mask, dtype=bool))


def _nul_in_map(column) -> np.ndarray:
    """The rows of a map column with a NUL character in a key or value."""
    # As a list of (key, value) structs: Arrow's list kernels do not take a map.
    pairs = pa.ListArray.from_arrays(column.offsets, column.values)
    flat = pc.list_flatten(pairs)
    if not len(flat):
        return np.array([], dtype=np.int64)
    entries = pc.or_(pc.fill_null(pc.match_substring(flat.field(0), "\x00"), False),
                     pc.fill_null(pc.match_substring(flat.field(1), "\x00"), False))
    parents = pc.list_parent_indices(pairs).to_numpy(zero_copy_only=False)
    return parents[_where(entries.to_numpy(zero_copy_only=False))]


def _non_finite(column, halfvec: bool) -> np.ndarray:
    """The rows of an embedding column with NaN or infinity (into a ``halfvec`` table, also an
    element beyond float16's range)."""
    valid = _where(column.is_valid().to_numpy(zero_copy_only=False))
    if not len(valid):
        return valid
    present = column.take(pa.array(valid))
    values = np.asarray(present.flatten().to_numpy(zero_copy_only=False),
                        dtype=np.float32).reshape(len(valid), column.type.list_size)
    bad = ~np.isfinite(values).all(axis=1)
    if halfvec:
        bad |= (np.abs(np.nan_to_num(values)) > _HALF_MAX).any(axis=1)
    return valid[bad]


def _column_problems(name: str, column, halfvec: bool) -> Optional[tuple[Any, str, str]]:
    """(rows, reason, detail) of what the store cannot take in one column, by its type; None
    for a type with nothing to check."""
    type_ = column.type
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        nul = pc.fill_null(pc.match_substring(column, "\x00"), False)
        return (_where(nul.to_numpy(zero_copy_only=False)), Refusal.NUL,
                f"{name} holds a NUL character")
    if pa.types.is_timestamp(type_):
        if type_.unit != "us":
            column = column.cast(pa.timestamp("us", type_.tz), safe=False)
        micros = pc.fill_null(column.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return (_where((micros < _PY_MIN_US) | (micros > _PY_MAX_US)), Refusal.TIMESTAMP,
                f"{name} is outside years 1-9999 UTC")
    if pa.types.is_map(type_):
        return (_nul_in_map(column), Refusal.NUL,
                f"{name} holds a NUL character in a key or value")
    if pa.types.is_fixed_size_list(type_) and name == "embedding":
        return (_non_finite(column, halfvec), Refusal.NON_FINITE,
                "embedding holds NaN or infinity" + (" (as float16)" if halfvec else ""))
    return None


def _problems(table: pa.Table, not_null: set[str], halfvec: bool) -> list[Optional[tuple]]:
    """For each row of ``table``: None, or (reason, detail) of the first thing about it the store
    cannot take: a null where the table needs a value, a NUL character in a text or in an
    attribute's key or value, a timestamp outside years 1-9999 UTC (what psycopg, Python and
    every reader can represent), a non-finite vector (or, into a ``halfvec`` table, one with an
    element beyond float16's range)."""
    found: list[Optional[tuple]] = [None] * table.num_rows

    def mark(rows: Iterable[int], reason: str, detail: str) -> None:
        for i in rows:
            if found[i] is None:
                found[i] = (reason, detail)

    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if name in not_null and column.null_count:
            mark(_where(column.is_null().to_numpy(zero_copy_only=False)), Refusal.MISSING,
                 f"{name} is null")
        problems = _column_problems(name, column, halfvec)
        if problems is not None:
            mark(*problems)
    return found


def vector_dumper(oid: int, pgvector_type: str = "vector"):
    """psycopg's binary dumper for pgvector's ``vector`` (or ``halfvec``): int16 dimension, int16
    0, then float4 (float2) big-endian (pgvector's ``vector_recv``, ``halfvec_recv``)."""
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    element = ">f2" if pgvector_type == "halfvec" else ">f4"

    class VectorBinaryDumper(Dumper):
        format = Format.BINARY

        def dump(self, obj):
            values = np.asarray(obj, dtype=element)
            return struct.pack(">HH", values.shape[0], 0) + values.tobytes()

    VectorBinaryDumper.oid = oid
    return VectorBinaryDumper


def copy_rows(table: pa.Table, names: Sequence[str], day: dt.date, load_key: str
              ) -> Iterator[tuple]:
    """The rows of ``table`` as tuples of the columns ``names``, as a binary COPY sends them:
    ``dt`` the day, ``load_key`` the load's, a column the table lacks null, maps as jsonb."""
    from psycopg.types.json import Jsonb

    columns: list[Iterable] = []
    for name in names:
        if name == "dt":
            columns.append(_repeat(day, table.num_rows))
        elif name == "load_key":
            columns.append(_repeat(load_key, table.num_rows))
        elif name not in table.column_names:
            columns.append(_repeat(None, table.num_rows))
        elif name == "embedding":
            values = table.column(name).combine_chunks()
            dim = values.type.list_size
            columns.append(np.asarray(values.flatten().to_numpy(zero_copy_only=False),
                                      dtype=np.float32).reshape(-1, dim))
        elif pa.types.is_map(table.schema.field(name).type):
            columns.append([None if v is None else Jsonb(dict(v))
                            for v in table.column(name).to_pylist()])
        else:
            columns.append(table.column(name).to_pylist())
    return zip(*columns, strict=True)


def _repeat(value, n: int) -> list:
    return [value] * n


def chunk_groups(rows: LoadRows) -> dict[tuple, list[int]]:
    """{(id, text_sha256): the indices of its chunk rows}: the chunks of each article version."""
    groups: dict[tuple, list[int]] = {}
    if rows.chunks is None:
        return groups
    keys = zip(rows.chunks.column("id").to_pylist(),
               rows.chunks.column("text_sha256").to_pylist(), strict=True)
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


def check(rows: LoadRows, settings: StoreSettings, halfvec: bool
          ) -> tuple[list[int], list[dict]]:
    """The rows that can be sent (indices of ``rows.vectors``), and a rejection for each one
    that cannot (``_problems``), its chunks' problems counted as its own."""
    vectors_table, chunks_table = store_tables(settings)
    found = _problems(rows.vectors, vectors_table.not_null, halfvec)
    ids = rows.vectors.column("id").to_pylist()
    shas = rows.vectors.column("text_sha256").to_pylist()
    if rows.chunks is not None and rows.chunks.num_rows:
        chunk_found = _problems(rows.chunks, chunks_table.not_null, halfvec)
        bad: dict[tuple, tuple[str, str]] = {}
        chunk_keys = zip(rows.chunks.column("id").to_pylist(),
                         rows.chunks.column("text_sha256").to_pylist(),
                         rows.chunks.column("chunk_index").to_pylist(), strict=True)
        for problem, (doc_id, sha, index) in zip(chunk_found, chunk_keys, strict=True):
            if problem is not None:
                bad.setdefault((doc_id, sha), (problem[0], f"chunk {index}: {problem[1]}"))
        for i, key in enumerate(zip(ids, shas, strict=True)):
            if found[i] is None and key in bad:
                found[i] = bad[key]
    keep = [i for i, problem in enumerate(found) if problem is None]
    rejected = [rejection(ids[i], shas[i], *problem) for i, problem in enumerate(found)
                if problem is not None]
    return keep, rejected


def refusal(rows: LoadRows, i: int, failure: BaseException, scrub: Callable[[str], str]
            ) -> dict:
    """The rejection of row ``i`` of ``rows.vectors``, which the store refused with
    ``failure``: its SQLSTATE and the server's primary message, never its DETAIL (which
    quotes the row: the article's text in every log and in ``<table>_loads``)."""
    diag = getattr(failure, "diag", None)
    sqlstate = getattr(diag, "sqlstate", None)
    message = getattr(diag, "message_primary", None) or str(failure).split("\n", 1)[0]
    return rejection(rows.vectors.column("id")[i].as_py(),
                     rows.vectors.column("text_sha256")[i].as_py(), Refusal.REFUSED,
                     scrub(f"{sqlstate or ''} {type(failure).__name__}: "
                           f"{message}".strip()))
