"""A batch run's summary (``_summary.json``), typed: ``RunSummary``.

The graph builds it from the config (``pipeline.graph.summary_base``: the settings, the run's day,
its store load key), ``CommitRun`` (``transforms.commit``) adds what the run did and writes it
(``to_json``), and every reader takes it through ``from_dict``/``from_json``: ``newsvec search``
(the settings a query must be embedded with), the launcher (``pipeline.run``), ``newsvec
backfill`` (whether a day is done) and the store load (``transforms.stores.batch``: the run's day,
whether it published). A field that is None is absent from the JSON: a summary holds what its run
recorded (one written before a field existed lacks it), and the JSON's keys keep this order.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any, Optional

from transforms.types import Counts


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """``_summary.json``, its fields in the order the file holds them. The settings sections are
    the config's sections as the run saw them (``model_dump()``, and what the run resolved)."""

    near_duplicates: Optional[dict] = None  # near_duplicates: with its signature_version
    input: Optional[str] = None
    output: Optional[str] = None
    vectors: Optional[dict] = None  # dim, vector_dtype
    chunking: Optional[dict] = None
    text: Optional[dict] = None
    incremental: Optional[dict] = None  # with embedding_signature; outputs_read, absent, ...
    model: Optional[dict] = None  # with resolved_path, label, resolved_dtype, content_sha256
    day: Optional[str] = None  # the day the run stands for (ISO), its rows' dt in the store
    store: Optional[dict] = None  # kind and load_key; the launcher adds the store's record
    run_id: Optional[str] = None
    published: Optional[bool] = None  # False: a newer run holds the output (superseded_by)
    superseded_by: Optional[str] = None
    counts: Optional[dict] = None  # Counts.to_summary()
    invariant_holds: Optional[bool] = None
    near_duplicates_by_similarity: Optional[dict] = None  # action skip: by similarity band
    summary_unavailable: Optional[str] = None  # why the committed run's file could not be read
    extra: dict = dataclasses.field(default_factory=dict)  # keys of no field, kept as read

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSummary":
        names = {field.name for field in dataclasses.fields(cls)} - {"extra"}
        return cls(**{key: value for key, value in data.items() if key in names},
                   extra={key: value for key, value in data.items() if key not in names})

    @classmethod
    def from_json(cls, data: bytes) -> "RunSummary":
        """``ValueError`` for bytes that are not a JSON object."""
        read = json.loads(data.decode("utf-8"))
        if not isinstance(read, dict):
            raise ValueError(f"a summary is a JSON object, not {type(read).__name__}")
        return cls.from_dict(read)

    def to_dict(self) -> dict[str, Any]:
        out = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
               if field.name != "extra" and getattr(self, field.name) is not None}
        return {**out, **self.extra}

    def to_json(self) -> bytes:
        """The bytes of ``_summary.json``."""
        return json.dumps(self.to_dict(), indent=2, default=str).encode("utf-8")

    def replace(self, **changes: Any) -> "RunSummary":
        return dataclasses.replace(self, **changes)

    @property
    def is_published(self) -> bool:
        """False only for a run that a newer run superseded before it published."""
        return self.published is not False

    @property
    def recorded_day(self) -> Optional[dt.date]:
        """``day`` as a date; None where the run recorded none (before 0.3). ``ValueError`` for
        one that is not a date."""
        return None if self.day is None else dt.date.fromisoformat(self.day)

    @property
    def model_label(self) -> Optional[str]:
        return self.model.get("label") if isinstance(self.model, dict) else None

    @property
    def embedding_signature(self) -> Optional[str]:
        """The signature the run's articles were embedded under (``incremental``); None in a
        summary of a release before it was recorded. ``ValueError`` for a recorded value that
        is not one (a JSON object's text): a summary this release did not write is never read as
        one that recorded nothing, which would go unchecked."""
        recorded = (self.incremental.get("embedding_signature")
                    if isinstance(self.incremental, dict) else None)
        if recorded is None:
            return None
        try:
            if isinstance(recorded, str) and isinstance(json.loads(recorded), dict):
                return recorded
        except (ValueError, RecursionError):
            pass
        raise ValueError("its _summary.json records an embedding signature that is not one "
                         f"({str(recorded)[:200]!r})")

    def counted(self) -> Counts:
        """``counts`` as ``Counts``; ``KeyError`` for a summary without them (a superseded run)."""
        if self.counts is None:
            raise KeyError("counts")
        return Counts.from_summary(self.counts)
