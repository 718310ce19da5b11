"""Vector stores: the contract (``base``) and one module per backend (``pgvector``).

``store.kind`` in the config chooses the backend. A backend registers here, with one entry in
``BACKENDS`` (its kind and its factory: settings -> ``VectorStore``) and its settings model in
``Settings`` (docs/design.md, "Adding a store backend").
"""
from __future__ import annotations

from typing import Any, Callable

from transforms.stores import pgvector
from transforms.stores.base import VectorStore

BACKENDS: dict[str, Callable[[Any], VectorStore]] = {
    "pgvector": pgvector.store_of,
}

# The ``store:`` section of a config. With a second backend: Annotated[Union[pgvector.
# StoreSettings, other.Settings], Field(discriminator="kind")].
Settings = pgvector.StoreSettings


def store_for(settings: Any) -> VectorStore:
    """The store of a config's ``store:`` section (its ``kind``); ``StoreLoadFailed`` when it
    cannot be opened (its connection string is not set)."""
    return BACKENDS[settings.kind](settings)
