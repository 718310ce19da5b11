"""A model folder's files: which of them make the model (``is_model_file``: what its content hash
covers and what a ``gs://`` folder fetches), its sentence-transformers modules (``modules.json``,
``module_configs``), and the content hash that identifies them (``model_content_hash``).

The floor below ``transforms.engines.model`` (the model's place and checks) and
``transforms.engines.fetch`` (a ``gs://`` folder fetched), which both use these rules.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Optional

_HASHED_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model")
MODULES_FILE = "modules.json"
_MODULE_FOLDER = re.compile(r"[0-9]+_[A-Za-z]\w*")
"""A folder named as sentence-transformers saves a module: ``1_Pooling``, ``2_Dense``."""


def module_folders(modules_json: Optional[bytes]) -> frozenset[str]:
    """The module folders a sentence-transformers ``modules.json`` names (its entries' ``path``;
    the root's ``""`` aside); empty without one or for one that cannot be read."""
    try:
        entries = json.loads(modules_json) if modules_json else []
    except ValueError:
        return frozenset()
    paths = (entry.get("path") for entry in entries if isinstance(entry, dict)) \
        if isinstance(entries, list) else ()
    return frozenset(path.strip("/") for path in paths
                     if isinstance(path, str) and path.strip("/"))


def module_configs(folder: str | Path, kind: str) -> list[Optional[dict]]:
    """The ``config.json`` of each sentence-transformers module of a model folder whose type ends
    with ``kind`` (``Pooling``, ``Dense``), in ``modules.json``'s order: None for one that cannot
    be read; empty without a readable ``modules.json``."""
    folder = Path(folder)
    try:
        modules = json.loads((folder / MODULES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    configs: list[Optional[dict]] = []
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(kind):
            try:
                config = json.loads((folder / str(module.get("path", "")) / "config.json")
                                    .read_text(encoding="utf-8"))
            except (OSError, ValueError):
                config = None
            configs.append(config if isinstance(config, dict) else None)
    return configs


def is_model_file(name: str, modules: frozenset[str]) -> bool:
    """Whether the file ``name`` (relative to the model's folder, ``/``-separated) is one the
    content hash covers, and so one a ``gs://`` folder fetches: a weight, config or tokenizer file
    (``_HASHED_SUFFIXES``) at the folder's top or in a module's folder (named by ``modules.json``,
    or named as sentence-transformers names them: ``1_Pooling``, ``2_Dense``). Anything else in a
    subfolder (a trainer's ``checkpoint-500/``, ``onnx/``, ``openvino/`` exports) is no part of the
    model the engine loads."""
    if PurePosixPath(name).suffix not in _HASHED_SUFFIXES:
        return False
    folder, _, _ = name.rpartition("/")
    return (not folder or _MODULE_FOLDER.fullmatch(folder.split("/")[0]) is not None
            or any(name.startswith(module + "/") for module in modules))


@functools.lru_cache(maxsize=8)
def model_content_hash(path: str) -> str:
    """sha256 over the relative names and bytes of the model's weight, config and tokenizer files
    (``is_model_file``: the folder's top and its modules' folders, the files a ``gs://`` folder
    fetches, so a local folder and its copy in a bucket hash the same).

    A silently changed model gives another hash. Empty string when ``path`` is not a local folder.
    """
    root = Path(path)
    if not root.is_dir():
        return ""
    modules_json = root / MODULES_FILE
    modules = module_folders(modules_json.read_bytes() if modules_json.is_file() else None)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()
                       and is_model_file(p.relative_to(root).as_posix(), modules)):
        digest.update(os.fsencode(file.relative_to(root).as_posix()) + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
