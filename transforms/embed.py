"""Embed: PreparedDoc -> EmbeddedDoc with a vLLM ``LLM`` held per worker process, or a dead letter.

Beam's RunInference does the batching (BatchElements sized by a token budget, not a count), the model
sharing (one ``LLM`` per worker process, loaded in setup, never per bundle) and the inference metrics.
``VLLMEmbeddingHandler`` is the ModelHandler that RunInference drives.

A failing model call does not take a batch of good articles with it: the batch is split in halves and
retried (bisection) until the failing inputs stand alone; only those are dead-lettered. A model that
fails for every input stops the job instead of dead-lettering the whole stream.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime as dt
import json
import logging
import threading
import time
from typing import Any, Iterable, Optional, Sequence

import apache_beam as beam
import numpy as np
from apache_beam import pvalue
from apache_beam.ml.inference.base import ModelHandler, PredictionResult, RunInference

from transforms.metrics import BATCH_DOCS, BATCH_TOKENS, EMBED_MS, MODEL_LOAD_MS
from transforms.model import ModelSettings, model_content_hash, resolve_model_path
from transforms.schema import DeadLetter, EmbeddedDoc, PreparedDoc, Reason, Step

_LOG = logging.getLogger(__name__)
DEAD_LETTER = "dead_letter"


@dataclasses.dataclass(frozen=True)
class EmbedFailure:
    error: str


@dataclasses.dataclass
class LoadedModel:
    llm: Any
    label: str  # name@revision, or name@sha256:<first 16 hex of the content hash>
    load_s: float = 0.0
    load_reported: bool = False  # metrics cannot be recorded in DoFn.setup, where loading happens
    # One engine serves every DoFn thread of a process; LLM.embed() collects all finished requests,
    # so concurrent calls could take each other's outputs. Calls are serialized.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)


class ModelBrokenError(RuntimeError):
    """The model failed for every input in a long run: a broken model, not poison documents."""


def model_label(settings: ModelSettings, local_path: str) -> str:
    if settings.revision:
        return f"{settings.name}@{settings.revision}"
    digest = model_content_hash(local_path)
    return f"{settings.name}@sha256:{digest[:16]}" if digest else settings.name


class VLLMEmbeddingHandler(ModelHandler[PreparedDoc, PredictionResult, LoadedModel]):
    """RunInference ModelHandler for ``vllm.LLM(runner="pooling").embed()`` on token ids."""

    def __init__(self, settings: ModelSettings):
        super().__init__()
        self._settings = settings
        self._consecutive_failures = 0

    def batch_elements_kwargs(self):
        # Batches are weighed in tokens: each holds at most token_budget tokens.
        return {"min_batch_size": self._settings.token_budget,
                "max_batch_size": self._settings.token_budget,
                "element_size_fn": lambda doc: doc.token_count}

    def load_model(self) -> LoadedModel:
        return load_engine(self._settings)

    def _embed(self, model: LoadedModel, docs: Sequence[PreparedDoc]) -> list:
        """A vector or an EmbedFailure per doc: a failing call is retried in halves (bisection)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        if not docs:
            return []
        try:
            with model.lock:
                outputs = model.llm.embed(
                    [TokensPrompt(prompt_token_ids=list(d.token_ids)) for d in docs],
                    pooling_params=PoolingParams(use_activation=self._settings.normalize),
                    use_tqdm=False)
            if len(outputs) != len(docs):
                raise RuntimeError(f"{len(outputs)} outputs for {len(docs)} inputs")
            return [np.asarray(o.outputs.embedding, dtype=np.float32) for o in outputs]
        except Exception as exc:  # pylint: disable=broad-except
            if _engine_is_dead(exc):
                evict_engine(self._settings)
                raise  # no input is to blame: Beam retries the bundle on a fresh engine
            if len(docs) == 1:
                return [EmbedFailure(f"{type(exc).__name__}: {exc}"[:2000])]
            half = len(docs) // 2
            _LOG.warning("Embedding a batch of %d failed (%s); retrying in halves", len(docs), exc)
            return self._embed(model, docs[:half]) + self._embed(model, docs[half:])

    def run_inference(self, batch: Sequence[PreparedDoc], model: LoadedModel,
                      inference_args: Optional[dict] = None) -> Iterable[PredictionResult]:
        if not model.load_reported:
            MODEL_LOAD_MS.update(int(model.load_s * 1000))
            model.load_reported = True
        started = time.perf_counter()
        results = self._embed(model, batch)
        EMBED_MS.update(int((time.perf_counter() - started) * 1000))
        BATCH_DOCS.update(len(batch))
        BATCH_TOKENS.update(sum(d.token_count for d in batch))
        for doc, result in zip(batch, results):
            if isinstance(result, EmbedFailure):
                self._consecutive_failures += 1
                if self._consecutive_failures >= self._settings.max_consecutive_failures:
                    raise ModelBrokenError(
                        f"the model failed for {self._consecutive_failures} inputs in a row "
                        f"(last: {result.error}); stopping instead of dead-lettering everything")
            else:
                self._consecutive_failures = 0
        return [PredictionResult(example=doc, inference=result, model_id=model.label)
                for doc, result in zip(batch, results)]

    def get_metrics_namespace(self) -> str:
        return "newsvec.RunInference"

    def get_num_bytes(self, batch: Sequence[PreparedDoc]) -> int:
        return sum(len(d.text.encode("utf-8")) for d in batch)


_ENGINES: dict[str, LoadedModel] = {}
_ENGINES_LOCK = threading.Lock()


def _engine_is_dead(exc: BaseException) -> bool:
    """vLLM's engine core died: every later call fails too, whatever the input."""
    return type(exc).__name__ == "EngineDeadError"


def _engine_key(settings: ModelSettings) -> str:
    """What the engine depends on; batching and failure settings may differ and share it."""
    fields = ("name", "path", "revision", "dim", "dtype", "max_tokens", "trust_remote_code",
              "enforce_eager", "gpu_memory_utilization", "max_num_seqs", "engine_env")
    return json.dumps(settings.model_dump(include=set(fields)), sort_keys=True)


def evict_engine(settings: ModelSettings) -> None:
    with _ENGINES_LOCK:
        _ENGINES.pop(_engine_key(settings), None)


def load_engine(settings: ModelSettings) -> LoadedModel:
    """The process's one vLLM engine for these settings, loaded on first use.

    RunInference already keeps one model per DoFn; this cache also spans pipelines run one after
    another in a process (tests, a retried bundle's new DoFn), so a worker never holds two engines.
    """
    key = _engine_key(settings)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = _load(settings)
        return _ENGINES[key]


def _load(s: ModelSettings) -> LoadedModel:
    s.apply_engine_env()
    from vllm import LLM  # imported on the worker, after the engine environment is set

    path = resolve_model_path(s.path)
    started = time.perf_counter()
    kwargs = dict(model=path, runner="pooling", dtype=s.dtype, revision=s.revision,
                  max_model_len=s.max_tokens, trust_remote_code=s.trust_remote_code,
                  enforce_eager=s.enforce_eager, seed=0)
    if s.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    if s.max_num_seqs is not None:
        kwargs["max_num_seqs"] = s.max_num_seqs
    llm = LLM(**kwargs)
    atexit.register(_shutdown, llm)
    size = llm.llm_engine.model_config.embedding_size  # the pooler's output size
    if size != s.dim:
        _shutdown(llm)
        raise ValueError(f"model.dim is {s.dim} in the config but the model {s.path} "
                         f"gives {size}-dimensional embeddings")
    return LoadedModel(llm=llm, label=model_label(s, path), load_s=time.perf_counter() - started)


def _shutdown(llm) -> None:
    """Stop vLLM's engine core at exit; a process that does not may abort (rc 134)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # pylint: disable=broad-except
        pass


class _RouteFn(beam.DoFn):
    def __init__(self, dead_letter_payload_bytes: int):
        self._dl_bytes = dead_letter_payload_bytes

    def process(self, result: PredictionResult):
        doc: PreparedDoc = result.example
        if isinstance(result.inference, EmbedFailure):
            yield pvalue.TaggedOutput(DEAD_LETTER, DeadLetter.for_event(
                doc.event, Step.EMBED, Reason.EMBEDDING_FAILED, result.inference.error,
                self._dl_bytes))
        else:
            yield EmbeddedDoc(doc=doc, embedding=result.inference, model=result.model_id,
                              embedded_at=dt.datetime.now(dt.timezone.utc))


class EmbedWithVLLM(beam.PTransform):
    """PreparedDoc -> EmbeddedDoc (main output) and DeadLetter (``dead_letter`` output)."""

    def __init__(self, settings: ModelSettings, *, dead_letter_payload_bytes: int = 4096,
                 handler: Optional[ModelHandler] = None):
        super().__init__()
        self._handler = handler or VLLMEmbeddingHandler(settings)
        self._dl_bytes = dead_letter_payload_bytes

    def expand(self, docs):
        return (docs
                | "RunInference" >> RunInference(self._handler)
                | "Route" >> beam.ParDo(_RouteFn(self._dl_bytes)).with_outputs(
                    DEAD_LETTER, main="embedded"))
