"""What ``POST /v1/search`` searches (``serve.search``): the output's Parquet, held warm
(``ParquetCorpus``: ``pipeline.search.ParquetIndex``, read once and again when a newer run
publishes), or the store (``StoreCorpus``: its HNSW index, as ``newsvec search --store``).

The output is checked against the config when the service starts, as ``newsvec search`` checks it
(``pipeline.search.check_output``: the prefixes, the embedding signature and the model's files
its committed run recorded): a config that differs refuses to start, naming the difference. A run
published later is checked before it is searched, and searched only once committed; one that
differs is not searched (a 503 naming the difference) until the service is restarted with its
config."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Protocol

from pipeline.config import Config, ConfigError
from pipeline.search import (
    Filters,
    ParquetIndex,
    check_against,
    check_output,
    committed_summary,
    parquet_files,
)
from pipeline.serve.limits import ApiError
from transforms.output.layout import join_path
from transforms.output.manifest import COMMITTED, Manifest, read_manifest

_LOG = logging.getLogger(__name__)


class Corpus(Protocol):
    kind: str

    def nearest(self, vector, k: int, all_copies: bool, filters: Filters) -> list[dict]:
        """The hits (``pipeline.search.search``'s, with the article's columns)."""

    def ready(self) -> Optional[str]:
        """None when it can be searched; else why not."""


class ParquetCorpus:
    """The output's Parquet (see the module). ``refresh_s``: how often a search first looks at the
    output's manifest, and reads the output again when another run committed (that search waits
    for the read; the others meanwhile search what was read before).

    A batch output is read as its manifest names it: only a committed run, only the files the
    manifest names, only once its summary is checked against the config, and kept only if the
    manifest still names that run once its files are read. While a newer run publishes (its files
    replacing the old ones in ``vectors/``, its summary not yet written), the run read before is
    searched. An output without a manifest (streaming) is read whole, again when its files
    change. A read that fails (a transient storage error, a file gone meanwhile) keeps what was
    read before and is tried again at the next refresh."""

    kind = "parquet"

    def __init__(self, config: Config, refresh_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.output, self._config = config.output, config
        self._refresh_s, self._clock = refresh_s, clock
        self._lock = threading.Lock()
        self._index: Optional[ParquetIndex] = None
        self._run_id: Optional[str] = None  # the committed run read (or refused)
        self._problem: Optional[str] = None
        self._checked = clock()
        self._read()

    def _refresh(self) -> None:
        """``_read``, at most every ``refresh_s``, by one search at a time."""
        if self._clock() - self._checked < self._refresh_s:
            return
        if not self._lock.acquire(blocking=False):
            return  # another search is looking: this one searches what is read
        try:
            self._checked = self._clock()
            self._read()
        finally:
            self._lock.release()

    def _read(self) -> None:
        try:
            manifest = read_manifest(self.output)
        except (OSError, ValueError) as exc:  # torn, refused: what was read is kept
            _LOG.warning("%s: the manifest cannot be read (%s); searching what was read before",
                         self.output, exc)
            return
        if manifest is None:  # a streaming output
            files = parquet_files(self.output)
            if self._index is None or files != self._index.files:
                self._load(files, None)
            return
        if manifest.state != COMMITTED:
            if self._index is None:
                self._problem = (f"run {manifest.run_id} is publishing into the output: it is "
                                 "searched once it commits and is checked")
            return
        if manifest.run_id == self._run_id:
            return
        try:
            summary = committed_summary(self.output)
            if summary is None or summary.run_id != manifest.run_id:
                return  # another run moved on meanwhile: the next refresh reads it
            check_against(self._config, self.output, summary)
        except ConfigError as exc:  # never searched with this service's queries
            self._index, self._run_id = None, manifest.run_id
            self._problem = f"run {manifest.run_id} of the output: {exc}"
            return
        except (OSError, ValueError) as exc:  # a storage error, a manifest changed meanwhile:
            _LOG.warning("%s: run %s cannot be read yet (%s); searching what was read before",
                         self.output, manifest.run_id, exc)
            return  # read again at the next refresh
        self._load(tuple(join_path(self.output, path)
                         for path in (*manifest.vectors, *manifest.chunks)), manifest)

    def _load(self, files: tuple[str, ...], manifest: Optional[Manifest]) -> None:
        """Read ``files``; kept only if ``manifest`` (None: none) is still the output's."""
        try:
            index: Optional[ParquetIndex] = ParquetIndex(
                self.output, self._config.model.output_dim, details=True, files=files)
            problem = None
        except (OSError, ValueError) as exc:  # nothing published yet; a file gone meanwhile
            index, problem = None, str(exc)
        if manifest is not None:
            try:
                if read_manifest(self.output) != manifest:
                    return  # another run began publishing while they were read: read again
            except (OSError, ValueError):
                return
        if index is None:  # nothing published yet; a read that failed (a transient error, a
            # file gone while listed): what was read is kept, and read again at the next refresh
            # (the run is not recorded as read: it would never be read again)
            if self._index is None:
                self._problem, self._run_id = problem, None
            else:
                _LOG.warning("%s: %s; searching what was read before until it can be read",
                             self.output, problem)
            return
        self._index, self._problem = index, problem
        self._run_id = manifest.run_id if manifest is not None else None

    def ready(self) -> Optional[str]:
        return self._problem

    def nearest(self, vector, k: int, all_copies: bool, filters: Filters) -> list[dict]:
        self._refresh()
        index = self._index
        if index is None:
            raise ApiError(503, f"nothing to search: {self._problem}", "corpus_unavailable",
                           type_="service_unavailable")
        return index.nearest(vector, k, all_copies, filters)

    @property
    def articles(self) -> int:
        return self._index.articles if self._index is not None else 0


class StoreCorpus:
    """The store of the config's ``store:`` section, through its HNSW index. Its hits hold no
    ``url``, ``source``, ``language`` or ``published_at``, and a filter is refused (400): the
    store's search does not take them."""

    kind = "store"

    def __init__(self, config: Config):
        from transforms.stores import store_for

        self._store = store_for(config.store)

    def ready(self) -> Optional[str]:
        from transforms.stores.base import StoreError

        try:
            with self._store.reader():  # a connection, the catalog checked
                return None
        except StoreError as exc:  # scrubbed of the connection string
            return f"the store cannot be reached: {exc}"

    def nearest(self, vector, k: int, all_copies: bool, filters: Filters) -> list[dict]:
        if filters != Filters():
            raise ApiError(400, "filters (source, language, published_after, published_before) "
                                "are not taken by the store's search: search the Parquet "
                                "output (serve.search: parquet)", "unsupported_filter")
        from transforms.stores.base import StoreError

        try:
            return self._store.search(vector, k, all_copies=all_copies)
        except StoreError as exc:
            raise ApiError(503, f"the store's search failed: {exc}", "store_unavailable",
                           type_="service_unavailable") from None


def corpus_for(config: Config) -> tuple[Config, Optional[Corpus]]:
    """(the config with the output's model pinned (``check_output``), what ``/v1/search``
    searches or None); a ``ConfigError`` naming the difference when the output was written
    otherwise than the config says."""
    config = check_output(config, config.output)
    kind = config.serve.search
    if kind == "auto":
        kind = "store" if config.store.enabled else "parquet"
    if kind == "off":
        return config, None
    if kind == "store":
        return config, StoreCorpus(config)
    return config, ParquetCorpus(config, config.serve.search_refresh_s)


def output_record(output: str) -> dict[str, Any]:
    """What the output's committed run recorded that a client checks itself against
    (``GET /info``): empty for an output with none (streaming, nothing published); ``problem``
    alone where it cannot be read now (a storage error, a summary not the committed run's)."""
    try:
        summary = committed_summary(output)
    except (ConfigError, OSError, ValueError) as exc:
        return {"problem": f"the output's committed run cannot be read: {exc}"[:1000]}
    if summary is None:
        return {}
    model = summary.model if isinstance(summary.model, dict) else {}
    return {"run_id": summary.run_id, "day": summary.day,
            "embedding_signature": (summary.incremental or {}).get("embedding_signature"),
            "model_label": model.get("label"), "content_sha256": model.get("content_sha256"),
            "dimensions": (summary.vectors or {}).get("dim"),
            "dtype": model.get("resolved_dtype")}
