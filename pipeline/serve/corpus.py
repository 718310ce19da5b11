"""What ``POST /v1/search`` searches (``serve.search``): the output's Parquet, held warm
(``ParquetCorpus``: ``pipeline.search.ParquetIndex``, read once and again when a newer run
publishes), or the store (``StoreCorpus``: its HNSW index, as ``newsvec search --store``).

The output is checked against the config when the service starts, as ``newsvec search`` checks it
(``pipeline.search.check_output``: the prefixes, the embedding signature and the model's files
its committed run recorded): a config that differs refuses to start, naming the difference. A run
published later is checked again before it is searched; one that differs is not searched (a 503
naming the difference) until the service is restarted with its config."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Protocol

from pipeline.config import Config, ConfigError
from pipeline.search import Filters, ParquetIndex, check_output, committed_summary, parquet_files
from pipeline.serve.limits import ApiError


class Corpus(Protocol):
    kind: str

    def nearest(self, vector, k: int, all_copies: bool, filters: Filters) -> list[dict]:
        """The hits (``pipeline.search.search``'s, with the article's columns)."""

    def ready(self) -> Optional[str]:
        """None when it can be searched; else why not."""


class ParquetCorpus:
    """The output's Parquet (see the module). ``refresh_s``: how often a search first lists the
    output's files, and reads them again when they changed (that search waits for the read; the
    others meanwhile search what was read before)."""

    kind = "parquet"

    def __init__(self, config: Config, refresh_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.output, self._config = config.output, config
        self._refresh_s, self._clock = refresh_s, clock
        self._lock = threading.Lock()
        self._index: Optional[ParquetIndex] = None
        self._problem: Optional[str] = None
        self._checked = clock()
        self._load()

    def _load(self) -> None:
        try:
            self._index = ParquetIndex(self.output, self._config.model.output_dim, details=True)
            self._problem = None
        except FileNotFoundError as exc:  # nothing published yet
            self._index, self._problem = None, str(exc)

    def _refresh(self) -> None:
        """Read the output again if its files changed (a newer run), once it is checked against
        the config; at most every ``refresh_s``."""
        if self._clock() - self._checked < self._refresh_s:
            return
        if not self._lock.acquire(blocking=False):
            return  # another search is looking: this one searches what is read
        try:
            self._checked = self._clock()
            files = parquet_files(self.output)
            if self._index is not None and files == self._index.files:
                return
            try:
                check_output(self._config, self.output)
            except ConfigError as exc:
                self._index, self._problem = None, f"a newer run of the output: {exc}"
                return
            self._load()
        finally:
            self._lock.release()

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
    (``GET /info``): empty for an output with none (streaming, nothing published)."""
    summary = committed_summary(output)
    if summary is None:
        return {}
    model = summary.model if isinstance(summary.model, dict) else {}
    return {"run_id": summary.run_id, "day": summary.day,
            "embedding_signature": (summary.incremental or {}).get("embedding_signature"),
            "model_label": model.get("label"), "content_sha256": model.get("content_sha256"),
            "dimensions": (summary.vectors or {}).get("dim"),
            "dtype": model.get("resolved_dtype")}
