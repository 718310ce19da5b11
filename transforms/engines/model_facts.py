"""What a model folder says, and what the engine and the config make of it: its architecture,
pooling and normalization (its sentence-transformers modules, read as the engine reads them:
``transforms.engines.model_files.module_configs``, ``transforms.engines.vllm.
sentence_transformers_pooling``), its declared Matryoshka sizes (``transforms.engines.model.
Matryoshka``), its lengths and local attention window, and the prompts it declares, each with the
role its name gives it and what the config does with it. ``newsvec check-model``
(``pipeline/check_model.py``) reports them beside its cosines.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from transforms.engines.devices import resolved_dtype
from transforms.engines.model import Matryoshka, model_matryoshka
from transforms.engines.model_files import module_configs
from transforms.engines.vllm import sentence_transformers_pooling
from transforms.settings import ModelSettings

DOCUMENT_PROMPTS = ("document", "passage", "doc", "corpus")  # sentence-transformers prompt names
QUERY_PROMPTS = ("query",)
LEFT_OUT = "left out on purpose (model.unused_prompts)"


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the model folder says, and what the engine and the config make of it."""
    path: str
    architecture: str
    model_type: str
    pooling_reference: str  # sentence-transformers' pooling module (1_Pooling/config.json)
    pooling_engine: str  # what vLLM resolved for the loaded model
    normalize_reference: bool  # the modules hold a Normalize
    normalize_config: bool  # model.normalize
    dim: int  # the reference's vectors
    matryoshka_dimensions: Optional[list[int]]  # served sizes; [] declared, any size; None: not
    max_positions: Optional[int]  # config.json's max_position_embeddings
    max_seq_length: Optional[int]  # sentence-transformers' (sentence_bert_config.json)
    max_tokens: int  # the config's
    local_window: Optional[int]  # the config's local attention window; None: none
    local_reach: Optional[int]  # tokens a local layer's token sees on each side
    local_layers: Optional[str]  # "3 of 4"
    document_prefix: str  # the config's, which newsvec puts before every text
    reference_prefix: str  # what the reference puts before every text
    model_prompts: dict[str, str]  # the model's declared prompts (config_sentence_transformers)
    query_prefix: str
    dtype: str  # the engine's, resolved on this machine
    reference_dtype: str
    query_reference_prefix: str = ""  # what the reference puts before every query


@dataclasses.dataclass(frozen=True)
class DeclaredPrompt:
    """A prompt the model declares (``prompts`` in ``config_sentence_transformers.json``)."""
    name: str
    text: str
    role: str  # "query", "document", or "unknown": a name check-model does not know
    use: str  # "model.query_prefix", "model.document_prefix", LEFT_OUT or "unused"


def read_json(path: Path) -> Any:
    """A JSON file of the model folder, or None when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def pooling_and_normalization(folder: Path) -> tuple[str, bool]:
    """(the pooling modes of the sentence-transformers modules, whether they normalize)."""
    modes = sentence_transformers_pooling(folder)
    pooling = ("+".join(modes) or "none" if modes is not None
               else "none (no sentence-transformers modules: the architecture's default)")
    return pooling, bool(module_configs(folder, "Normalize"))


def pooling_config(folder: Path) -> dict:
    """The sentence-transformers pooling module's config (``1_Pooling/config.json``), or {}."""
    configs = module_configs(folder, "Pooling")
    return (configs[0] or {}) if configs else {}


def model_prompts(folder: Path) -> dict:
    """The prompts a model folder declares (``prompts`` in its
    ``config_sentence_transformers.json``), by name; {} for none."""
    return (read_json(folder / "config_sentence_transformers.json") or {}).get("prompts") or {}


def document_prompt(prompts: dict[str, str], left_out: Sequence[str] = ()) -> Optional[str]:
    """The model's declared prompt for documents (sentence-transformers' ``prompts``), if any
    that is not ``left_out``."""
    return _prompt(prompts, DOCUMENT_PROMPTS, left_out)


def query_prompt(prompts: dict[str, str], left_out: Sequence[str] = ()) -> Optional[str]:
    """The model's declared prompt for queries, if any that is not ``left_out``."""
    return _prompt(prompts, QUERY_PROMPTS, left_out)


def _prompt(prompts: dict[str, str], names: Sequence[str], left_out: Sequence[str]
            ) -> Optional[str]:
    for name in names:
        if name in prompts and name not in left_out:
            return str(prompts[name])
    return None


def declared_prompts(prompts: dict[str, str], settings: ModelSettings) -> list[DeclaredPrompt]:
    """Every prompt the model declares, its role by its name, and what the config does with it:
    the prefix of its role whose text is the prompt's (either prefix for a name of no known
    role), else left out on purpose or unused."""
    found = []
    for name, text in prompts.items():
        text = str(text)
        role = ("query" if name in QUERY_PROMPTS else "document" if name in DOCUMENT_PROMPTS
                else "unknown")
        uses = [key for key, prefix in (("document", settings.document_prefix),
                                         ("query", settings.query_prefix))
                if text == prefix and role in (key, "unknown")]
        use = (f"model.{uses[0]}_prefix" if uses else LEFT_OUT
               if name in settings.unused_prompts else "unused")
        found.append(DeclaredPrompt(name, text, role, use))
    return found


def model_facts(settings: ModelSettings, folder: Path, pooling_engine: str, dim: int,
                reference_prefix: str, reference_folder: Optional[Path] = None) -> ModelFacts:
    """What the served model's folder says; its pooling and normalization as the reference's
    modules (``reference_folder``, default the model's) have them."""
    config = read_json(folder / "config.json") or {}
    pooling, normalize = pooling_and_normalization(reference_folder or folder)
    matryoshka = model_matryoshka(settings) or Matryoshka.of_hf_config(config)  # as served
    window, reach, local = local_attention(config)
    st_config = read_json(folder / "sentence_bert_config.json") or {}
    prompts = model_prompts(folder)
    return ModelFacts(
        path=str(folder), architecture=",".join(config.get("architectures") or ["unknown"]),
        model_type=str(config.get("model_type", "unknown")), pooling_reference=pooling,
        pooling_engine=pooling_engine, normalize_reference=normalize,
        normalize_config=settings.normalize, dim=dim,
        matryoshka_dimensions=(list(matryoshka.dimensions or []) if matryoshka.declared
                               else None),
        max_positions=config.get("max_position_embeddings"),
        max_seq_length=st_config.get("max_seq_length"), max_tokens=settings.max_tokens,
        local_window=window, local_reach=reach, local_layers=local,
        document_prefix=settings.document_prefix,
        reference_prefix=reference_prefix, model_prompts=dict(prompts),
        query_prefix=settings.query_prefix, dtype=resolved_dtype(settings),
        reference_dtype="float32")


def local_attention(config: dict) -> tuple[Optional[int], Optional[int], Optional[str]]:
    """(the local attention window as the config gives it, the tokens a token of a local layer
    sees on each side, "N of M" layers local), from a ``config.json``: ModernBERT's
    ``local_attention`` (the whole window: half of it each side), or a ``sliding_window`` (one
    side) where ``layer_types`` or ``use_sliding_window`` says layers use it."""
    layers = config.get("num_hidden_layers")
    types = config.get("layer_types")
    if config.get("model_type") == "modernbert":
        every = config.get("global_attn_every_n_layers", 3)
        if types is None and layers:
            types = ["full_attention" if i % every == 0 else "sliding_attention"
                     for i in range(layers)]
        window = int(config.get("local_attention", 128))
        reach = window // 2
    elif config.get("sliding_window") and (types or config.get("use_sliding_window", True)):
        window = reach = int(config["sliding_window"])
    else:
        return None, None, None
    local = sum(t == "sliding_attention" for t in types) if types else layers
    if not local:
        return None, None, None
    return window, reach, f"{local} of {layers or len(types or [])}"
