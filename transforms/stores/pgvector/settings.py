"""The pgvector backend's settings: the ``store:`` section of a config (``StoreSettings``), and
where its connection string is read at run time (``resolve_dsn``; never the config file)."""
from __future__ import annotations

import re
from typing import ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from transforms.stores.secret import read_dsn

# A PostgreSQL identifier that needs no quoting (quoted all the same, with sql.Identifier), short
# enough that the names derived from the table (``_chunks_embedding_hnsw``...) fit in 63 bytes.
IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,39}")


def _identifier(value: str) -> str:
    if not IDENTIFIER.fullmatch(value):
        raise ValueError(f"{value!r} is not a plain SQL identifier ({IDENTIFIER.pattern})")
    return value


class StoreSettings(BaseModel):
    """The ``store:`` section of a config: where vectors are also loaded, and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    DSN_SOURCES: ClassVar[tuple[str, ...]] = ("dsn_secret", "dsn_file", "dsn_env")
    """The keys that name where the connection string is read: a config that ``extends:``
    another and names one of them replaces all of the parent's (``pipeline.config``)."""

    kind: Literal["pgvector"] = Field(
        "pgvector", description="the store's backend (`transforms/stores/`): `pgvector`, "
                                "PostgreSQL with pgvector")
    enabled: bool = Field(False, description="load every committed batch run and every streaming "
                                             "micro-batch into PostgreSQL + pgvector "
                                             "(docs/store.md)")
    dsn_env: str = Field("NEWSVEC_STORE_DSN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                         description="the environment variable that holds the connection string "
                                     "(never the config file)")
    dsn_file: Optional[str] = Field(
        None, description="a file that holds the connection string instead (a mounted secret); "
                          "wins over `dsn_env`")
    dsn_secret: Optional[str] = Field(
        None, pattern=r"^projects/[^/\s]+/secrets/[A-Za-z0-9_-]{1,255}/versions/(latest|[0-9]+)$",
        description="a Secret Manager secret version that holds the connection string instead "
                    "(`projects/P/secrets/S/versions/latest`), read at run time with the "
                    "machine's credentials (on Dataflow: the worker service account, which needs "
                    "`roles/secretmanager.secretAccessor` on it); wins over `dsn_file` and "
                    "`dsn_env`")
    schema_name: str = Field("public", description="the schema of the tables (an SQL identifier: "
                                                   "`[a-z_][a-z0-9_]*`)")
    table: str = Field("news_vectors", description="the articles' table; `<table>_chunks` and "
                                                   "`<table>_loads` beside it (an SQL identifier, "
                                                   "at most 40 characters)")
    table_owner: Optional[str] = Field(
        None, min_length=1, max_length=63, pattern=r"^[^\x00-\x1f\x7f]+$",
        description="the role that owns the store's tables, where the connection's role (the "
                    "DSN's user) neither is it nor is a member of it: a loader that owns nothing "
                    "(docs/store.md, \"Roles and privileges\"). A table or index of the store, "
                    "or a trigger's function on one, owned by any role but this one, the "
                    "connection's role, a role it is a member of or a superuser is refused (a "
                    "role that may create in the schema could have made them first)")
    hnsw_m: int = Field(16, ge=2, le=100, description="HNSW index: links per node (`m`)")
    hnsw_ef_construction: int = Field(64, ge=4, le=1000,
                                      description="HNSW index: `ef_construction`")
    index_build_memory_mb: Optional[int] = Field(
        None, ge=64, le=65536,
        description="`maintenance_work_mem` of the load that builds the HNSW index after a first "
                    "large load (an index whose graph does not fit in it builds several times "
                    "slower); null: the server's setting")
    ef_search: int = Field(100, ge=1, le=1000, description="`hnsw.ef_search` of "
                                                           "`newsvec search --store`")
    retry_s: float = Field(300, ge=0, description="how long a load retries, with backoff, on "
                                                  "transient errors (the database down or failing "
                                                  "over, a lock or statement timeout)")
    lock_timeout_s: float = Field(
        60, ge=1, le=86400,
        description="how long (1 s at least) one try of a load waits for the table's lock "
                    "(another load holds it) or any other lock; then the try fails and is retried "
                    "within `retry_s`. "
                    "Also how long a load's session may sit idle inside its transaction before the "
                    "server ends it (a loader that stalled or vanished releases the table)")
    statement_timeout_s: float = Field(
        1800, ge=1, le=86400,
        description="the longest (1 s at least) one statement of a load may run (the COPY, the "
                    "upsert); then the try fails and is retried within `retry_s`. Raise it for "
                    "batch loads of "
                    "millions of rows into an indexed table. Also how long a load may spend "
                    "finding the rows the server refuses. The HNSW index build after a first "
                    "large load is not bounded by it")
    superseded_keep_days: float = Field(
        7, gt=0, le=3650,
        description="how long the store keeps an article's version that a load replaced (or "
                    "that lost to a load's row), so that a redo of a streaming micro-batch with "
                    "another outcome, or a rerun of a batch output that no longer holds the "
                    "article, can bring it back; later than this, the article is left without a "
                    "row (docs/store.md says what reports it)")

    @field_validator("schema_name", "table")
    @classmethod
    def _plain_identifier(cls, value: str) -> str:
        return _identifier(value)

    @model_validator(mode="after")
    def _ef_construction_holds_m(self):
        if self.hnsw_ef_construction < 2 * self.hnsw_m:
            raise ValueError(f"hnsw_ef_construction ({self.hnsw_ef_construction}) must be at "
                             f"least 2 x hnsw_m ({self.hnsw_m}), as pgvector requires")
        return self


def resolve_dsn(settings: StoreSettings) -> str:
    """The connection string, from the Secret Manager secret ``dsn_secret``, the file
    ``dsn_file`` or the environment variable ``dsn_env`` (the first one set)."""
    return read_dsn(settings.dsn_secret, settings.dsn_file, settings.dsn_env)
