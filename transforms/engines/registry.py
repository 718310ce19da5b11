"""The engine backends, by the name ``model.engine`` gives (as ``transforms.stores.BACKENDS`` is
for ``store.kind``), and the handle a process gets on its engine for given settings.

A backend registers here, with one entry in ``ENGINES``: its name and its ``EngineFactory``
(settings -> ``EmbeddingEngine``, the contract of ``transforms.engines.base``). ``load_engine``
keeps one handle per process for given engine settings, on the backend ``model.engine`` names;
``process_engine`` gives a handle in this process on a test's or a benchmark's factory instead
(``transforms.engines.shared`` serves one engine per machine, in a process of its own).
"""
from __future__ import annotations

import json
import threading
from typing import Optional

from transforms.engines import vllm
from transforms.engines.base import _LLM_FIELDS, EngineFactory, EngineHandle
from transforms.settings import ModelSettings

ENGINES: dict[str, EngineFactory] = {
    "vllm": vllm.load_vllm,
}


def engine_factory(name: str) -> EngineFactory:
    """The factory of the backend ``name`` (``model.engine``); ValueError naming the known ones
    for any other."""
    if name not in ENGINES:
        raise ValueError(f"model.engine {name!r} is not an engine newsvec has; the known ones: "
                         f"{', '.join(sorted(ENGINES))}")
    return ENGINES[name]


_HANDLES: dict[str, EngineHandle] = {}


_HANDLES_LOCK = threading.Lock()


def _engine_identity(settings: ModelSettings) -> str:
    """What the engine depends on; batching and failure settings may differ and share it. Engines
    of other output dimensions are other engines, on one ``LLM`` (``_shared_llm``)."""
    return json.dumps(settings.model_dump(include={
        "engine", *_LLM_FIELDS, "normalize", "dimensions", "truncate_dimensions_knowingly"}),
        sort_keys=True)


def load_engine(settings: ModelSettings) -> EngineHandle:
    """The process's one engine handle for these settings (on the backend ``model.engine``
    names), loaded on first use.

    The embedding steps keep one handle per DoFn; this cache also spans pipelines run one after
    another in a process (tests, a retried bundle's new DoFn), so a worker never holds two engines.
    """
    identity = _engine_identity(settings)
    with _HANDLES_LOCK:
        if identity not in _HANDLES:
            _HANDLES[identity] = EngineHandle(settings, engine_factory(settings.engine))
        return _HANDLES[identity]


_FACTORY_HANDLES: dict[tuple[type, str], EngineHandle] = {}


_FACTORY_HANDLES_LOCK = threading.RLock()  # a test's factory may itself call load_engine


def process_engine(settings: ModelSettings, factory: Optional[EngineFactory]) -> EngineHandle:
    """A handle in this process: without ``factory``, on the process's engine (``load_engine``);
    with one (tests, benchmarks), on an engine from it. A factory that is a class is kept like
    the real engine, one handle per process for given settings, so that a stand-in engine goes
    through the handle's life as the real one does (a retried bundle's new DoFn finds the handle
    whose engine failed); any other factory gets a new handle each time."""
    if factory is None:
        return load_engine(settings)
    if not isinstance(factory, type):
        return EngineHandle(settings, factory)
    key = (factory, _engine_identity(settings))
    with _FACTORY_HANDLES_LOCK:
        if key not in _FACTORY_HANDLES:
            _FACTORY_HANDLES[key] = EngineHandle(settings, factory)
        return _FACTORY_HANDLES[key]
