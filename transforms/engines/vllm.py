"""vLLM's engine (``Engine``: ``vllm.LLM(runner="pooling")`` behind the calls newsvec makes) and
``load_vllm``, the default ``EngineFactory``: one ``LLM`` per process for given settings, shared by
the engines of other output dimensions on it. The contract it meets, the handle that holds it and
the failure model are in ``transforms.engines.base``."""
from __future__ import annotations

import atexit
import json
import logging
import threading
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import numpy as np

from transforms.engines import base
from transforms.engines.base import _LLM_FIELDS, truncate_vector
from transforms.engines.devices import resolved_dtype
from transforms.engines.model import (
    Matryoshka,
    check_custom_code,
    model_folder,
    model_label,
    pooling_modes,
    truncation,
    vllm_hf_overrides,
)
from transforms.engines.model_files import module_configs
from transforms.settings import ModelSettings
from transforms.vector_math import normalized, pool_tokens

_LOG = logging.getLogger(__name__)
CANARY_TEXT = "newsvec engine check"


class Engine:
    """``vllm.LLM(runner="pooling")`` behind the calls newsvec makes: embed token ids, check health,
    close (an ``EmbeddingEngine``)."""

    def __init__(self, llm, settings: ModelSettings, label: str,
                 truncated_by: Literal["none", "vllm", "newsvec"] = "none"):
        """``truncated_by`` (``transforms.engines.model.truncation``): who cuts the vectors to
        ``settings.dimensions``, vLLM (``PoolingParams(dimensions=...)``) or this class."""
        self._llm, self._normalize, self.label = llm, settings.normalize, label
        self._vllm_dimensions = settings.dimensions if truncated_by == "vllm" else None
        self._own_dimensions = settings.dimensions if truncated_by == "newsvec" else None
        self._canary = [list(llm.get_tokenizer().encode(CANARY_TEXT))]
        self._dimensions = settings.dimensions
        # An LLM loaded for token_embed serves no other task: newsvec pools its token vectors.
        self._token_embed = settings.pooling_task == "token_embed"
        self.pooling = _pooling(llm)

    @property
    def llm(self):
        """The vLLM ``LLM`` itself (the batch benchmark calls it raw, as a baseline)."""
        return self._llm

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        if self._token_embed:
            return [normalized(pool_tokens(t, self.pooling), self._normalize)
                    for t in self.embed_tokens(prompts)]
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        # vLLM aborts a failed call's requests itself (tests/engines/test_embed_failures.py checks
        # it), so none of them can finish in a later call and be returned with its outputs.
        outputs = self._llm.embed(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            pooling_params=PoolingParams(use_activation=self._normalize,
                                         dimensions=self._vllm_dimensions),
            use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"{len(outputs)} outputs for {len(prompts)} inputs")
        for output, prompt in zip(outputs, prompts, strict=True):
            if list(output.prompt_token_ids) != list(prompt):
                raise RuntimeError("an output does not belong to its input")
        vectors = [np.asarray(o.outputs.embedding, dtype=np.float32) for o in outputs]
        base.FREED_MEMORY.after_call()  # looked up at each call: the process's one
        if self._own_dimensions is not None:
            vectors = [truncate_vector(v, self._own_dimensions, self._normalize)
                       for v in vectors]
        return vectors

    def embed_tokens(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per prompt, a vector per token (``len(prompt) x dim``): the model's last hidden
        states (after its sentence-transformers projection, if any), cut to ``model.dimensions``,
        not normalized. Needs an LLM loaded for it (``model.pooling_task: token_embed``)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        outputs = self._llm.encode(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], pooling_task="token_embed",
            pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"{len(outputs)} outputs for {len(prompts)} inputs")
        matrices = []
        for output, prompt in zip(outputs, prompts, strict=True):
            if list(output.prompt_token_ids) != list(prompt):
                raise RuntimeError("an output does not belong to its input")
            tokens = output.outputs.data.float().numpy()
            if tokens.shape[0] != len(prompt):
                raise RuntimeError(f"{tokens.shape[0]} token vectors for {len(prompt)} tokens")
            matrices.append(tokens[:, :self._dimensions] if self._dimensions else tokens)
        base.FREED_MEMORY.after_call()
        return matrices

    def healthy(self) -> bool:
        """Whether the canary still embeds to a finite vector: an engine that fails it is broken,
        whatever the inputs were."""
        try:
            (vector,) = self.embed(self._canary)
            return bool(np.isfinite(vector).all())
        except Exception:  # pylint: disable=broad-except  # any failure of the canary is the answer
            return False

    def close(self) -> None:
        """Stop vLLM's engine core; a process that does not may abort at exit (rc 134). The LLM
        may be shared with engines of other output dimensions (``_shared_llm``): they fail their
        next call, and their handles load a fresh one."""
        with _LLMS_LOCK:
            for key, llm in list(_LLMS.items()):
                if llm is self._llm:
                    del _LLMS[key]
        _shutdown(self._llm)


def _pooling(llm) -> str:
    """How the model pools a sequence, as vLLM resolved it (from its sentence-transformers
    config, else the architecture's default): ``mean``, ``cls`` or ``last``."""
    pooler = getattr(llm.llm_engine.model_config, "pooler_config", None)  # None: a stand-in LLM
    kind = getattr(pooler, "seq_pooling_type", None) or getattr(pooler, "pooling_type", None)
    return str(getattr(kind, "name", kind) or "mean").lower()


_LLMS: dict[str, Any] = {}  # _llm_identity -> vllm.LLM


_LLMS_LOCK = threading.Lock()


def _llm_identity(settings: ModelSettings) -> str:
    """What the vLLM ``LLM`` depends on: engines that differ only in output dimension share it."""
    return json.dumps(settings.model_dump(include=set(_LLM_FIELDS)), sort_keys=True)


def _shared_llm(s: ModelSettings):
    """The process's vLLM ``LLM`` for these settings: loaded once, whatever
    ``model.dimensions`` the engines on it write."""
    identity = _llm_identity(s)
    with _LLMS_LOCK:
        if identity not in _LLMS:
            llm = _LLMS[identity] = _new_llm(s)
            atexit.register(_shutdown, llm)
        return _LLMS[identity]


def _shutdown(llm) -> None:
    """Stop vLLM's engine core; a process that does not may abort at exit (rc 134)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # pylint: disable=broad-except
        pass


def _new_llm(s: ModelSettings):
    s.apply_engine_env()
    from vllm import LLM  # imported on the worker, after the engine environment is set

    path = model_folder(s)
    kwargs: dict[str, Any] = dict(
        model=path, runner="pooling", dtype=resolved_dtype(s), revision=s.revision,
        max_model_len=s.max_tokens, trust_remote_code=s.trust_remote_code,
        enforce_eager=s.enforce_eager, seed=0)
    overrides = vllm_hf_overrides(s)  # over the model's config.json (model.matryoshka_dimensions)
    if overrides:
        kwargs["hf_overrides"] = overrides
    if s.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    if s.max_num_seqs is not None:
        kwargs["max_num_seqs"] = s.max_num_seqs
    if s.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = s.max_num_batched_tokens
    if s.pooling_task != "embed":  # the LLM then serves that task only (chunking.mode: late)
        from vllm.config import PoolerConfig

        kwargs["pooler_config"] = PoolerConfig(task=s.pooling_task)
    _LOG.info("loading %s at %s", s.name, kwargs["dtype"])
    return LLM(**kwargs)


def load_vllm(s: ModelSettings) -> Engine:
    """A real vLLM engine for these settings (the default ``EngineFactory``), on the process's
    ``LLM`` for them (``_shared_llm``). Refused: a model whose declared pooling vLLM does not
    compute (``check_pooling``, before anything loads: a pooling mode, or a prompt its pooling
    leaves out) or that needs code of its own (``check_custom_code``), or whose pooler output is
    not ``model.dim``."""
    folder = model_folder(s)  # once: a gs:// model is listed again at each call
    check_custom_code(folder, s.trust_remote_code)
    check_pooling(folder, s.normalize, prompted_prefixes(s))
    if s.pooling_task == "token_embed":
        check_late_projection(folder)
    llm = _shared_llm(s)
    model_config = llm.llm_engine.model_config
    engine = Engine(llm, s, model_label(s, folder))
    size = model_config.embedding_size  # the pooler's output size
    if size != s.dim:
        engine.close()
        raise ValueError(f"model.dim is {s.dim} in the config but the model {s.path} "
                         f"gives {size}-dimensional embeddings")
    # Refused (a model that does not declare the size): the LLM stays for the process's others.
    truncated_by = truncation(s, Matryoshka.of_hf_config(model_config.hf_config))
    return Engine(llm, s, engine.label, truncated_by)


def resolved_pooling(s: ModelSettings) -> str:
    """How the process's vLLM ``LLM`` for these settings pools (``CLS``, ``MEAN``, ``LAST``...):
    what it read from the model's sentence-transformers modules, or its architecture's default
    where it read none it knows (``newsvec check-model`` shows it beside the reference's)."""
    pooler = _shared_llm(s).llm_engine.model_config.pooler_config
    kind = getattr(pooler, "seq_pooling_type", None) or getattr(pooler, "pooling_type", None)
    return str(kind or "unknown")


# A sentence-transformers pooling mode -> what vLLM computes for it (``get_pooling_config``
# reads the modes it knows: CLS, MEAN, LAST; any other leaves the architecture's default).
_POOLING_VLLM_COMPUTES = {"cls_token": "CLS", "mean_tokens": "MEAN", "lasttoken": "LAST"}


def sentence_transformers_pooling(folder: str | Path) -> Optional[list[str]]:
    """The pooling modes a model folder's sentence-transformers modules declare (``cls_token``,
    ``mean_tokens``...; several: concatenated); None when it has no pooling module."""
    configs = module_configs(folder, "Pooling")
    return pooling_modes(configs[0]) if configs and configs[0] is not None else None


def check_late_projection(folder: str | Path) -> None:
    """Refuse (ValueError) late chunking for a model with a sentence-transformers Dense module
    whose activation is not the identity: vLLM's ``token_embed`` applies it to every token, so
    the mean over a span would be the mean of the activated tokens, not the activated mean the
    model computes (cosine 0.97 against the model's on a Tanh Dense)."""
    for config in module_configs(folder, "Dense"):
        activation = str((config or {}).get("activation_function",
                                            "torch.nn.modules.activation.Tanh"))
        if not activation.endswith("Identity"):
            raise ValueError(
                f"the model {folder} projects its pooled vector through a Dense module with "
                f"{activation.rsplit('.', 1)[-1]}: chunking.mode late would pool tokens "
                "already projected, and its vectors would not be the model's. Use "
                "chunking.mode chunks for this model")


def prompted_prefixes(s: ModelSettings) -> dict[str, str]:
    """The prefixes the config puts before texts the engine embeds (``model.document_prefix``,
    ``model.query_prefix``), by setting name; empty ones left out."""
    return {name: prefix for name, prefix in (("model.document_prefix", s.document_prefix),
                                              ("model.query_prefix", s.query_prefix)) if prefix}


def check_pooling(folder: str | Path, normalize: bool,
                  prefixes: Optional[dict[str, str]] = None) -> None:
    """Refuse (ValueError) a model whose sentence-transformers modules pool in a way vLLM does
    not compute: vLLM 0.32 reads only ``cls_token``, ``mean_tokens`` and ``lasttoken`` and
    falls back to the architecture's default pooling for any other (``max_tokens``,
    ``weightedmean_tokens``, several modes at once), which would give other vectors than the
    model's, silently. ``mean_sqrt_len_tokens`` is the mean's direction: accepted when the
    vectors are normalized. A pooling that leaves the prompt's tokens out (``include_prompt:
    false``) with a prefix in ``prefixes`` (``prompted_prefixes``) is refused for the mean and
    CLS, which vLLM computes over every token (the mean over the prompt too, CLS on its first
    token, where sentence-transformers takes the first after the prompt); last-token pooling
    takes a token after the prompt either way (Qwen3-Embedding, e5-mistral), so it is
    computed as the model does. Checked before the model loads: a vLLM engine shut down in a
    process takes the others of that process with it."""
    modes = sentence_transformers_pooling(folder)
    if not modes:
        return
    computes = dict(_POOLING_VLLM_COMPUTES)
    if normalize:
        computes["mean_sqrt_len_tokens"] = "MEAN"
    if len(modes) != 1 or modes[0] not in computes:
        raise ValueError(
            f"the model {folder} pools by {'+'.join(modes)} (its sentence-transformers "
            "1_Pooling/config.json), which vLLM does not compute: it would pool by the "
            "architecture's default instead, and its vectors would not be the model's. vLLM "
            "computes cls_token, mean_tokens and lasttoken pooling"
            f"{' (mean_sqrt_len_tokens with model.normalize)' if not normalize else ''}; serve "
            "a model that pools by one of them (newsvec check-model compares a model with its "
            "sentence-transformers reference)")
    configs = module_configs(folder, "Pooling")
    if (prefixes and modes[0] != "lasttoken" and configs and configs[0] is not None
            and configs[0].get("include_prompt") is False):
        given = ", ".join(f"{name} {prefix!r}" for name, prefix in prefixes.items())
        raise ValueError(
            f"the model {folder} pools by {modes[0]} leaving the prompt's tokens out "
            "(include_prompt: false in its sentence-transformers 1_Pooling/config.json), and "
            f"the config puts a prompt before its texts ({given}): vLLM pools over every token "
            "of its input, the prompt's too, and its vectors would not be the model's. Serve a "
            "model whose pooling includes the prompt, or one that pools by the last token "
            "(newsvec check-model compares a model with its sentence-transformers reference)")
