"""What a vector store is, whatever its backend (``transforms.stores.pgvector`` is one): the
contract every stage and command uses, and the values that cross it.

A store takes a load of rows (``LoadRows``: a batch run's committed files, a streaming
micro-batch's rows) under a load key (``batch_load_key``, ``streaming_load_key``), and a load is
idempotent by its key: a load retried or repeated with the same key and the same rows changes
nothing (``StoreLoad.already_loaded``), so a bundle that Beam retries, a lost commit response or a
rerun of ``newsvec load`` never stores a row twice. Each load is all or nothing: its rows and its
record under the key are stored together or not at all. A batch run's load (``BatchOutput``)
replaces the previous run's load of the same output, and an older run's load never replaces a
newer one's (it fails, ``StoreLoadFailed``). The store keeps each article's current version
(``schema.VERSION_ORDER``).

Reading: ``search`` (``newsvec search --store``), and ``reader`` for ``newsvec ledger --store``:
the record of given loads and the stored version of given articles, against which the ledger's
records and files are checked (``pipeline.ledger``).

A backend is one package or module with its settings model (a ``kind`` field) and a factory,
registered by one line in ``transforms/stores/__init__.py`` (docs/design.md, "Adding a store
backend"); what backends share beside this contract is in ``secret`` (reading the connection
string), ``scrub`` (keeping it out of messages) and ``retry`` (transient and data errors)."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import re
from typing import Any, Optional, Protocol, Sequence

import pyarrow as pa

from transforms.output.parquet import VERSION_ORDER
from transforms.settings import VectorDtype


class StoreError(RuntimeError):
    """A store failure, its message scrubbed of the connection string."""


class StoreLoadFailed(StoreError):
    """A load into the store failed; the Parquet it was loading from stays as committed."""


@dataclasses.dataclass
class LoadRows:
    """What one load writes: Arrow tables of ``vectors/`` and ``chunks/`` rows (any subset of
    their columns that holds the keys, ``embedded_at`` and ``embedding``), and their day."""

    vectors: pa.Table
    chunks: Optional[pa.Table]
    dt: dt.date

    @property
    def dim(self) -> int:
        return self.vectors.schema.field("embedding").type.list_size

    @property
    def vector_dtype(self) -> VectorDtype:
        value_type = self.vectors.schema.field("embedding").type.value_type
        return "float16" if pa.types.is_float16(value_type) else "float32"

    def outcome(self) -> str:
        """A digest of the article versions of the load (id, ``text_sha256``, ``embedded_at``):
        the same for every try of one load; another for a micro-batch redone with another
        result."""
        table = self.vectors
        lines = sorted(f"{i}\0{t}\0{e}" for i, t, e in zip(
            table.column("id").to_pylist(), table.column("text_sha256").to_pylist(),
            table.column("embedded_at").cast(pa.int64()).to_pylist(), strict=True))
        return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def batch_load_key(run_id: str) -> str:
    """A batch run's load key, ``run:<run_id>``: the same for the graph's step
    (``LoadCommittedRun``) and ``newsvec load``."""
    return f"run:{run_id}"


def streaming_load_key(window_start: dt.datetime, pane: int, shard: int, digest: str) -> str:
    """The load key of a streaming micro-batch, ``mb:<window start>:<pane>:<shard>:<digest>``:
    the same for every attempt at it (as its file names, ``transforms.sinks``); ``newsvec
    ledger`` makes it from a record."""
    return f"mb:{window_start:%Y%m%dT%H%M%SZ}:{pane}:{shard}:{digest}"


REJECTED_FIELDS = ("id", "text_sha256", "reason", "detail")
"""A row the store refused: ``StoreLoad.rejected``, ``LedgerRecord.store_rejected``, the
``rejected`` column of ``<table>_loads``, each one a dict of these."""


def printable(text: Any) -> Any:
    """``text`` with control characters written as ``\\xNN``: ids in a rejection are shown and
    stored (jsonb cannot hold U+0000) in this form."""
    if not isinstance(text, str):
        return text
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", text)


@dataclasses.dataclass(frozen=True)
class StoreLoad:
    """What a load did: ``already_loaded`` when its key was in ``<table>_loads`` with the same
    outcome (nothing changed); ``rows``: the articles' rows it stored (the rows given, less
    ``rejected``); ``articles_current``: the articles whose stored row it wrote (the others
    already had a later version); ``rejected``: the rows the store cannot take, each a dict of
    ``REJECTED_FIELDS``; ``withdrawn``: the articles whose rows an earlier try of the same load
    (a micro-batch redone with another outcome) or the load this one replaces (``replaces``: the
    previous run of the same batch output) stored and this one does not hold, whose rows were
    withdrawn (and the version each had replaced brought back where one was kept);
    ``not_restored``: those of ``withdrawn`` with no row now (no earlier version was kept)."""

    load_key: str
    rows: int
    chunk_rows: int
    articles_current: int
    already_loaded: bool
    seconds: float
    rejected: tuple = ()
    withdrawn: tuple = ()
    not_restored: tuple = ()
    replaces: Optional[str] = None

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        for name in ("rejected", "withdrawn", "not_restored"):
            out[name] = list(getattr(self, name))
        return out


@dataclasses.dataclass(frozen=True)
class BatchOutput:
    """The output a batch run's load is of: ``prefix``, the output prefix (``{date}`` filled: each
    day's prefix is an output of its own), and the run's ``run_id``. Run ids begin with the launch
    time, and an output only ever goes from a run to a newer one (a run that finds the output
    held by a newer run publishes nothing: ``transforms.commit``), so of two runs of one output
    the greater id is the one the output holds, or held last. A run's load replaces the previous
    run's load of the same output (``pgvector.withdraw.previous_load``), as its files replaced
    that run's files."""

    prefix: str
    run_id: str


ROW_FIELDS = ("id", "text_sha256", *VERSION_ORDER, "load_key")
"""What ``StoreReader.rows`` gives of an article's stored row: its version (the text's digest, the
``VERSION_ORDER`` columns) and the load key that wrote it; None where the store has no value."""


class StoreReader(Protocol):
    """One consistent read of the store (``VectorStore.reader``), for checking it against ledger
    records: the record of given loads, the stored rows of given articles."""

    def loads(self, keys: Sequence[str]) -> dict[str, StoreLoad]:
        """The record of each of ``keys`` the store holds (``already_loaded`` true, ``seconds``
        0): its rows, chunk rows and rejected rows. A key never loaded is absent."""

    def rows(self, ids: Sequence[Any]) -> dict[str, dict]:
        """The stored row of each of ``ids`` the store holds, as a dict of ``ROW_FIELDS``."""


class VectorStore(Protocol):
    """A vector store (the module docstring). ``settings`` is its config section
    (``store:``, with ``kind`` naming the backend and ``enabled``)."""

    settings: Any

    def load(self, rows: LoadRows, load_key: str, ids: Optional[Sequence[str]] = None, *,
             output: Optional[BatchOutput] = None, reload: bool = False) -> StoreLoad:
        """Store ``rows`` under ``load_key``, all or nothing; a key loaded with the same rows
        changes nothing (unless ``reload``). ``ids``: every article the key may have stored
        before (a streaming micro-batch redone with another outcome withdraws its rows among
        them). ``output``: a batch run's output, whose previous run's load this one replaces.
        Raises ``StoreLoadFailed`` (its message free of secrets) when it gives up."""

    def search(self, vector, k: int, all_copies: bool = False) -> list[dict]:
        """The ``k`` nearest stories to ``vector``, best first: of each story (``COALESCE(
        story_id, id)``) its nearest article (by its best chunk where the store holds chunks),
        ``{"id", "title", "score", "chunk_index", "story_id", "copies"}``, ``copies`` the other
        articles of the story the store holds. ``all_copies``: the ``k`` nearest articles,
        every copy of a story among them."""

    def reader(self) -> contextlib.AbstractContextManager[StoreReader]:
        """A read of the store for checking it (``StoreReader``); ``StoreError`` when it cannot
        be read."""


def loaded(store: VectorStore, load_key: str) -> Optional[StoreLoad]:
    """The store's record of the load ``load_key``; None when it holds none."""
    with store.reader() as read:
        return read.loads([load_key]).get(load_key)
