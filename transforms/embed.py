"""Embed: PreparedDoc -> EmbeddedDoc with a vLLM ``LLM`` held per worker process, or a dead letter.

``VLLMEmbeddingHandler`` is a Beam ModelHandler: it loads the engine (one per worker process, or one
per machine shared by every process; in setup, never per bundle), sizes batches by a token budget,
not a count (BatchElements), and embeds a batch. Batch jobs drive it with ``_EmbedBatchesFn``, which
keeps one engine call in flight while the bundle prepares the next batch (RunInference waits for each
call, and the bundle's core idles meanwhile: see README, Keeping the GPU busy); streaming drives
``MicroBatchEmbeddingHandler``, which embeds one ``MicroBatch`` (a window's firing) as a unit, with
RunInference. In chunks mode a document is embedded as several inputs (its chunks, and its head if that is the
document vector): they go to the engine mixed with other documents' inputs, in calls of at most
``model.token_budget`` tokens, and a document with a failing input is dead-lettered whole.

Two kinds of failure, told apart by a health check of the engine (a fixed canary input):
- an INPUT failure (the canary still embeds): the batch is split in halves and retried (bisection)
  until the failing inputs stand alone; only those are dead-lettered (``embedding_failed``);
- an ENGINE failure (the canary fails too, or vLLM says its engine died; a CUDA error looks like
  this): no input is blamed. The engine is closed, ``EngineFailedError`` fails the bundle, and the
  runner retries it; the handle loads a fresh engine on its next use, so whatever still holds the
  handle (the embedding step, RunInference's shared model, the retried bundle) gets a working one.
A model that fails for every input while its canary passes stops the job (``ModelBrokenError``).
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Optional, Sequence

import apache_beam as beam
import numpy as np
from apache_beam import pvalue
from apache_beam.ml.inference.base import ModelHandler, PredictionResult, RunInference
from apache_beam.utils.windowed_value import WindowedValue

from transforms.chunking import ChunkingSettings, chunk_id, mean_vector
from transforms.metrics import BATCH_DOCS, BATCH_TOKENS, EMBED_MS, MODEL_LOAD_MS
from transforms.model import ModelSettings, model_label, resolve_model_path
from transforms.schema import (DEAD_LETTER, ChunkRow, DeadLetter, EmbeddedDoc, MicroBatch,
                               PreparedDoc, Reason, Step)

_LOG = logging.getLogger(__name__)
CANARY_TEXT = "newsvec engine check"


@dataclasses.dataclass(frozen=True)
class EmbedFailure:
    error: str


class ModelBrokenError(RuntimeError):
    """The model failed for every input in a long run: a broken model, not poison documents."""


class EngineFailedError(RuntimeError):
    """The engine failed, not an input: the bundle fails (and is retried on a fresh engine)."""


class Engine:
    """``vllm.LLM(runner="pooling")`` behind the calls newsvec makes: embed token ids, check health,
    close. A stand-in (a FAKE in a test, the MODELED engine of a benchmark) has the same four
    members: ``label``, ``embed``, ``healthy``, ``close``."""

    def __init__(self, llm, settings: ModelSettings, label: str):
        self._llm, self._normalize, self.label = llm, settings.normalize, label
        self._canary = [list(llm.get_tokenizer().encode(CANARY_TEXT))]

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        # vLLM aborts a failed call's requests itself (tests/test_embed_failures.py checks it), so
        # none of them can finish in a later call and be returned with its outputs.
        outputs = self._llm.embed(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            pooling_params=PoolingParams(use_activation=self._normalize), use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"{len(outputs)} outputs for {len(prompts)} inputs")
        for output, prompt in zip(outputs, prompts):
            if list(output.prompt_token_ids) != list(prompt):
                raise RuntimeError("an output does not belong to its input")
        return [np.asarray(o.outputs.embedding, dtype=np.float32) for o in outputs]

    def healthy(self) -> bool:
        """Whether the canary still embeds to a finite vector: an engine that fails it is broken,
        whatever the inputs were."""
        try:
            (vector,) = self.embed(self._canary)
            return bool(np.isfinite(vector).all())
        except Exception:  # pylint: disable=broad-except  # any failure of the canary is the answer
            return False

    def close(self) -> None:
        """Stop vLLM's engine core; a process that does not may abort at exit (rc 134)."""
        try:
            self._llm.llm_engine.engine_core.shutdown()
        except Exception:  # pylint: disable=broad-except
            pass


EngineFactory = Callable[[ModelSettings], Any]  # settings -> Engine (or a stand-in)


class EngineHandle:
    """What RunInference holds as its model: the engine for some settings, loaded at once, and
    loaded again after an engine failure.

    One handle serves every DoFn thread of a process; ``LLM.embed()`` collects every finished
    request, so concurrent calls could take each other's outputs: calls are serialized.
    """

    def __init__(self, settings: ModelSettings, factory: EngineFactory):
        self._settings, self._factory = settings, factory
        self._lock = threading.Lock()
        self._engine = None
        self._unreported_load_ms: list[int] = []
        self._label = ""
        with self._lock:
            self._load()

    def _load(self) -> None:
        started = time.perf_counter()
        self._engine = self._factory(self._settings)
        self._label = self._engine.label
        self._unreported_load_ms.append(int((time.perf_counter() - started) * 1000))

    def label(self) -> str:
        return self._label

    @property
    def llm(self):
        """The vLLM ``LLM`` behind the handle (the batch benchmark calls it raw, as a baseline)."""
        with self._lock:
            if self._engine is None:
                self._load()
            return self._engine._llm

    def take_load_ms(self) -> list[int]:
        """Load times not reported yet (metrics cannot be recorded in DoFn.setup, where loading
        happens)."""
        with self._lock:
            taken, self._unreported_load_ms = self._unreported_load_ms, []
            return taken

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt. Raises ``EngineFailedError`` when the engine broke (it is closed,
        and the next call loads a fresh one), or the engine's own error when the inputs failed."""
        with self._lock:
            if self._engine is None:
                self._load()
            engine = self._engine
            try:
                return engine.embed(prompts)
            except Exception as exc:  # pylint: disable=broad-except
                if not _engine_is_dead(exc) and engine.healthy():
                    raise  # the engine works: the inputs are to blame
                _LOG.error("the embedding engine failed (%s: %s); closing it, the next call loads "
                           "a fresh one", type(exc).__name__, exc)
                self._engine = None
                engine.close()
                raise EngineFailedError(f"the embedding engine failed, not the inputs: "
                                        f"{type(exc).__name__}: {exc}"[:2000]) from exc


def _engine_is_dead(exc: BaseException) -> bool:
    """vLLM's engine core died (its multiprocess client says so): every later call fails too."""
    return type(exc).__name__ == "EngineDeadError"


def load_vllm(s: ModelSettings) -> Engine:
    """A real vLLM engine for these settings (the default ``EngineFactory``)."""
    s.apply_engine_env()
    from vllm import LLM  # imported on the worker, after the engine environment is set

    path = resolve_model_path(s.path)
    kwargs = dict(model=path, runner="pooling", dtype=s.resolved_dtype(), revision=s.revision,
                  max_model_len=s.max_tokens, trust_remote_code=s.trust_remote_code,
                  enforce_eager=s.enforce_eager, seed=0)
    if s.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    if s.max_num_seqs is not None:
        kwargs["max_num_seqs"] = s.max_num_seqs
    if s.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = s.max_num_batched_tokens
    _LOG.info("loading %s at %s", s.name, kwargs["dtype"])
    engine = Engine(LLM(**kwargs), s, model_label(s, path))
    atexit.register(engine.close)
    size = engine._llm.llm_engine.model_config.embedding_size  # the pooler's output size
    if size != s.dim:
        engine.close()
        raise ValueError(f"model.dim is {s.dim} in the config but the model {s.path} "
                         f"gives {size}-dimensional embeddings")
    return engine


_HANDLES: dict[str, EngineHandle] = {}
_HANDLES_LOCK = threading.Lock()


def _engine_key(settings: ModelSettings) -> str:
    """What the engine depends on; batching and failure settings may differ and share it."""
    fields = ("name", "path", "revision", "dim", "dtype", "max_tokens", "trust_remote_code",
              "enforce_eager", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
              "engine_env")
    return json.dumps(settings.model_dump(include=set(fields)), sort_keys=True)


def load_engine(settings: ModelSettings) -> EngineHandle:
    """The process's one vLLM engine handle for these settings, loaded on first use.

    RunInference already keeps one model per DoFn; this cache also spans pipelines run one after
    another in a process (tests, a retried bundle's new DoFn), so a worker never holds two engines.
    """
    key = _engine_key(settings)
    with _HANDLES_LOCK:
        if key not in _HANDLES:
            _HANDLES[key] = EngineHandle(settings, load_vllm)
        return _HANDLES[key]


class _SharedEngine:
    """Makes the shared engine's handle in the process multi_process_shared spawns for it."""

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory]):
        self._settings, self._factory = settings, factory

    def __call__(self) -> EngineHandle:
        if self._factory is not None:
            return EngineHandle(self._settings, self._factory)
        return load_engine(self._settings)


def token_budget_slices(items: Sequence, budget: int, size=len) -> Iterable[list]:
    """Consecutive slices of at most ``budget`` tokens (``size(item)`` each; a longer item stands
    alone)."""
    batch, tokens = [], 0
    for item in items:
        if batch and tokens + size(item) > budget:
            yield batch
            batch, tokens = [], 0
        batch.append(item)
        tokens += size(item)
    if batch:
        yield batch


def model_inputs(doc: PreparedDoc, doc_vector: str = "head") -> list[tuple[int, ...]]:
    """What the engine embeds for a document: its head (head mode); or its chunks, after its head
    when that is the document vector and is not the first chunk already."""
    if not doc.chunks:
        return [doc.token_ids]
    chunks = [c.token_ids for c in doc.chunks]
    if doc_vector == "head" and chunks[0] != doc.token_ids:
        return [doc.token_ids] + chunks
    return chunks


@dataclasses.dataclass
class EngineStats:
    """Model loads and engine calls, kept until a bundle's thread records them as Beam metrics."""

    load_ms: list = dataclasses.field(default_factory=list)
    calls: list = dataclasses.field(default_factory=list)  # (ms, inputs, tokens) per engine call

    def record(self) -> None:
        for load_ms in self.load_ms:
            MODEL_LOAD_MS.update(load_ms)
        for ms, inputs, tokens in self.calls:
            EMBED_MS.update(ms)
            BATCH_DOCS.update(inputs)
            BATCH_TOKENS.update(tokens)


class VLLMEmbeddingHandler(ModelHandler[PreparedDoc, PredictionResult, EngineHandle]):
    """RunInference ModelHandler: PreparedDoc -> its vectors (one per ``model_inputs``: the head, or
    its chunks), or an ``EmbedFailure``. Engine calls hold at most ``model.token_budget`` tokens of
    inputs, documents and chunks alike. ``engine_factory`` replaces vLLM (tests, benchmarks)."""

    def __init__(self, settings: ModelSettings, engine_factory: Optional[EngineFactory] = None,
                 doc_vector: str = "head"):
        super().__init__()
        self._settings = settings
        self._engine_factory = engine_factory
        self._doc_vector = doc_vector
        self._consecutive_failures = 0
        # Pickled with the handler, so every worker process of this pipeline finds the same
        # shared engine, and no other pipeline's.
        self._shared_tag = f"newsvec-engine-{uuid.uuid4().hex}"

    def batch_elements_kwargs(self):
        # Batches are weighed in tokens: each holds at most token_budget tokens (a document with
        # more, in chunks mode, stands alone and is embedded in several calls).
        doc_vector = self._doc_vector
        return {"min_batch_size": self._settings.token_budget,
                "max_batch_size": self._settings.token_budget,
                "element_size_fn": lambda doc: sum(map(len, model_inputs(doc, doc_vector)))}

    def load_model(self) -> EngineHandle:
        if self._settings.share_across_processes:
            # One engine per machine, in a process of its own that Beam's multi_process_shared
            # spawns: every SDK process reaches it through a proxy, and none of them prepares text
            # in the engine's process, where it would hold the GIL the engine needs. (RunInference's
            # own share_model_across_processes puts the model in one of the SDK processes.)
            from apache_beam.utils import multi_process_shared

            return multi_process_shared.MultiProcessShared(
                _SharedEngine(self._settings, self._engine_factory), tag=self._shared_tag,
                always_proxy=True, spawn_process=True).acquire()
        if self._engine_factory is not None:
            return EngineHandle(self._settings, self._engine_factory)
        return load_engine(self._settings)

    def _embed(self, model: EngineHandle, prompts: Sequence[Sequence[int]], retried=False) -> list:
        """A vector or an EmbedFailure per prompt: a failing call is retried in halves
        (bisection), and a single failing prompt once more before it is blamed."""
        if not prompts:
            return []
        try:
            return model.embed(prompts)
        except EngineFailedError:
            raise  # no input is to blame: the bundle fails and is retried on a fresh engine
        except Exception as exc:  # pylint: disable=broad-except
            if len(prompts) == 1:
                if not retried:
                    return self._embed(model, prompts, retried=True)
                return [EmbedFailure(f"{type(exc).__name__}: {exc}"[:2000])]
            half = len(prompts) // 2
            _LOG.warning("Embedding a batch of %d failed (%s); retrying in halves", len(prompts),
                         exc)
            return self._embed(model, prompts[:half]) + self._embed(model, prompts[half:])

    def embed_docs(self, model: EngineHandle, docs: Sequence[PreparedDoc],
                   stats: Optional["EngineStats"] = None) -> list:
        """Per document, its vectors (one per ``model_inputs``) or an ``EmbedFailure`` if any of
        its inputs failed (an article is written whole or not at all). Inputs go to the engine in
        calls of at most ``token_budget`` tokens, with the broken-model stop. The batch metrics go
        to ``stats`` when given (a thread that is not the bundle's cannot record metrics), else
        straight to Beam's metrics."""
        own_stats = stats is None
        stats = EngineStats() if own_stats else stats
        stats.load_ms += model.take_load_ms()
        inputs = [(i, ids) for i, doc in enumerate(docs)
                  for ids in model_inputs(doc, self._doc_vector)]
        results = []
        for call in token_budget_slices(inputs, self._settings.token_budget,
                                        size=lambda item: len(item[1])):
            started = time.perf_counter()
            results += self._embed(model, [ids for _, ids in call])
            stats.calls.append((int((time.perf_counter() - started) * 1000), len(call),
                                sum(len(ids) for _, ids in call)))
        if own_stats:
            stats.record()
        per_doc: list = [[] for _ in docs]
        for (i, _), result in zip(inputs, results):
            per_doc[i].append(result)
        out = []
        for vectors in per_doc:
            failed = [(k, r) for k, r in enumerate(vectors) if isinstance(r, EmbedFailure)]
            if failed:
                k, failure = failed[0]
                where = f"input {k + 1} of {len(vectors)}: " if len(vectors) > 1 else ""
                out.append(EmbedFailure(f"{where}{failure.error}"))
                self._consecutive_failures += 1
                if self._consecutive_failures >= self._settings.max_consecutive_failures:
                    raise ModelBrokenError(
                        f"the model failed for {self._consecutive_failures} inputs in a row "
                        f"(last: {failure.error}); stopping instead of dead-lettering everything")
            else:
                out.append(vectors)
                self._consecutive_failures = 0
        return out

    def run_inference(self, batch: Sequence[PreparedDoc], model: EngineHandle,
                      inference_args: Optional[dict] = None,
                      stats: Optional[EngineStats] = None) -> list[PredictionResult]:
        label = model.label()
        return [PredictionResult(example=doc, inference=result, model_id=label)
                for doc, result in zip(batch, self.embed_docs(model, batch, stats))]

    def get_metrics_namespace(self) -> str:
        return "newsvec.RunInference"

    def get_num_bytes(self, batch: Sequence[PreparedDoc]) -> int:
        return sum(len(d.text.encode("utf-8")) for d in batch)


class MicroBatchEmbeddingHandler(VLLMEmbeddingHandler):
    """Streaming: the examples are ``MicroBatch``es, each embedded whole, in calls of at most
    ``model.token_budget`` tokens, so that its rows are written together. Use it through
    ``with_no_batching()`` on pre-batched input (a micro-batch in a 1-tuple): RunInference's
    BatchElements would stamp its batches with the end of the global window."""

    def run_inference(self, batch: Sequence[MicroBatch], model: EngineHandle,
                      inference_args: Optional[dict] = None) -> Iterable[PredictionResult]:
        label = model.label()
        return [PredictionResult(example=micro_batch, model_id=label,
                                 inference=self.embed_docs(model, micro_batch.docs))
                for micro_batch in batch]

    def get_num_bytes(self, batch: Sequence[MicroBatch]) -> int:
        return sum(super(MicroBatchEmbeddingHandler, self).get_num_bytes(b.docs) for b in batch)


@dataclasses.dataclass(frozen=True)
class RowMaker:
    """Makes an embedded document's rows (``EmbeddedDoc`` and its ``ChunkRow``s) from its vectors,
    or its dead letter."""

    chunking: ChunkingSettings
    chunk_recipe: str  # ChunkingSettings.chunk_recipe: part of every chunk id
    store_chunk_text: bool
    payload_limit: int

    def __call__(self, doc: PreparedDoc, result, model: str):
        if isinstance(result, EmbedFailure):
            return DeadLetter.for_event(doc.event, Step.EMBED, Reason.EMBEDDING_FAILED,
                                        result.error, self.payload_limit)
        now = dt.datetime.now(dt.timezone.utc)
        if not doc.chunks:
            return EmbeddedDoc.of(doc, result[0], model, now)
        chunk_vectors = result[-len(doc.chunks):]
        rows = []
        for index, (chunk, vector) in enumerate(zip(doc.chunks, chunk_vectors)):
            text = doc.text[chunk.char_start:chunk.char_end]
            rows.append(ChunkRow(
                id=doc.id, chunk_id=chunk_id(doc.id, doc.text_sha256, model, self.chunk_recipe, index),
                chunk_index=index, chunk_count=len(doc.chunks), token_start=chunk.token_start,
                token_end=chunk.token_end, char_start=chunk.char_start, char_end=chunk.char_end,
                chunk_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                text_sha256=doc.text_sha256, model=model, embedding=vector, embedded_at=now,
                chunk_text=text if self.store_chunk_text else None))
        if self.chunking.doc_vector == "mean":
            vector = mean_vector(chunk_vectors, [c.token_end - c.token_start for c in doc.chunks])
        else:
            vector = result[0]  # the head's, or the first chunk's where that is the head
        return EmbeddedDoc.of(doc, vector, model, now, doc_vector=self.chunking.doc_vector,
                              chunks=tuple(rows))


class _RouteFn(beam.DoFn):
    def __init__(self, rows: RowMaker):
        self._rows = rows

    def process(self, result: PredictionResult):
        out = self._rows(result.example, result.inference, result.model_id)
        yield pvalue.TaggedOutput(DEAD_LETTER, out) if isinstance(out, DeadLetter) else out


def _row_maker(settings: ModelSettings, chunking: ChunkingSettings, store_chunk_text: bool,
               payload_limit: int) -> RowMaker:
    return RowMaker(chunking, chunking.chunk_recipe(settings.max_tokens, settings.document_prefix),
                    store_chunk_text, payload_limit)


class _EmbedBatchesFn(beam.DoFn):
    """Batches of PreparedDoc -> a PredictionResult per document, with an engine call in flight
    while the bundle goes on. RunInference calls its model synchronously: the bundle's core idles
    while the engine embeds. Here each batch goes to the engine from a thread of this DoFn's own,
    and its results are emitted when the next batch has been prepared (or at the end of the
    bundle), so the bundle prepares batch k+1 while the engine embeds batch k, and the engine finds
    the next call waiting. Failures surface in the bundle's thread (the bundle fails and is
    retried), metrics are recorded there."""

    def __init__(self, handler: VLLMEmbeddingHandler, in_flight: int = 2):
        self._handler, self._in_flight = handler, in_flight
        self._model = self._pool = None
        self._pending: collections.deque = collections.deque()

    def setup(self):
        self._model = self._handler.load_model()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="newsvec-embed")

    def start_bundle(self):
        self._pending = collections.deque()

    def _submit(self, batch):
        stats = EngineStats()
        return self._pool.submit(self._handler.run_inference, batch, self._model, None, stats), stats

    def process(self, batch, window=beam.DoFn.WindowParam, timestamp=beam.DoFn.TimestampParam):
        self._pending.append((*self._submit(batch), window, timestamp))
        while len(self._pending) >= self._in_flight:
            yield from self._results(*self._pending.popleft())

    def finish_bundle(self):
        while self._pending:
            yield from self._results(*self._pending.popleft())

    @staticmethod
    def _results(future, stats: EngineStats, window, timestamp):
        try:
            results = future.result()
        finally:
            stats.record()
        for result in results:
            yield WindowedValue(result, timestamp, (window,))

    def teardown(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class EmbedWithVLLM(beam.PTransform):
    """PreparedDoc -> EmbeddedDoc (main output, with its chunk rows in chunks mode) and DeadLetter
    (``dead_letter`` output)."""

    def __init__(self, settings: ModelSettings, *, chunking: ChunkingSettings = ChunkingSettings(),
                 store_chunk_text: bool = False, dead_letter_payload_bytes: int = 4096,
                 engine_factory: Optional[EngineFactory] = None):
        super().__init__()
        self._handler = VLLMEmbeddingHandler(settings, engine_factory, chunking.doc_vector)
        self._rows = _row_maker(settings, chunking, store_chunk_text, dead_letter_payload_bytes)

    def expand(self, docs):
        return (docs
                | "Batch" >> beam.BatchElements(**self._handler.batch_elements_kwargs())
                | "Embed" >> beam.ParDo(_EmbedBatchesFn(self._handler))
                | "Route" >> beam.ParDo(_RouteFn(self._rows)).with_outputs(
                    DEAD_LETTER, main="embedded"))


def _fill_micro_batch(result: PredictionResult, rows: RowMaker) -> MicroBatch:
    batch: MicroBatch = result.example
    outs = [rows(doc, r, result.model_id) for doc, r in zip(batch.docs, result.inference)]
    return dataclasses.replace(
        batch, docs=(), rows=tuple(o for o in outs if isinstance(o, EmbeddedDoc)),
        dead_letters=batch.dead_letters + tuple(o for o in outs if isinstance(o, DeadLetter)))


class EmbedMicroBatches(beam.PTransform):
    """Streaming: MicroBatch -> the same MicroBatch with its rows (and any embedding dead letters),
    one RunInference call per micro-batch."""

    def __init__(self, settings: ModelSettings, *, chunking: ChunkingSettings = ChunkingSettings(),
                 store_chunk_text: bool = False, dead_letter_payload_bytes: int = 4096,
                 engine_factory: Optional[EngineFactory] = None):
        super().__init__()
        self._handler = MicroBatchEmbeddingHandler(
            settings, engine_factory, chunking.doc_vector).with_no_batching()
        self._rows = _row_maker(settings, chunking, store_chunk_text, dead_letter_payload_bytes)

    def expand(self, batches):
        return (batches
                | "PreBatched" >> beam.Map(lambda batch: (batch,))
                | "RunInference" >> RunInference(self._handler)
                | "AttachRows" >> beam.Map(_fill_micro_batch, self._rows))
