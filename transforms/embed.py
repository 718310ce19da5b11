"""Embed: PreparedDoc -> EmbeddedDoc (with its chunk rows in chunks mode) with the engine of
``transforms.engines.base``, or a dead letter.

The ``Embedder``, and the Beam steps that drive it with an engine call in flight. Not Beam's
RunInference: it waits for each call, and the bundle's core idles meanwhile (a duty cycle of 0.51
against 0.99: see docs/design.md and docs/performance.md, Keeping the GPU busy):
- ``Embedder`` embeds documents: it loads the engine (one per worker process, or one per
  machine shared by every process; in setup, never per bundle), sizes batches by a token budget, not
  a count (BatchElements), and embeds a batch;
- batch jobs (``Embed``) drive it with ``_EmbedBatchesFn``, which sends a batch to the
  engine and goes on preparing the next one in the same bundle;
- streaming (``EmbedStreaming``) embeds each ``MicroBatch`` (a window's firing) as a unit with
  ``_EmbedInFlightFn``, which keeps it in state while the engine computes and lets the runner go on
  with other work: preparing the next micro-batch, writing the last one.
In chunks mode a document is embedded as several inputs (its chunks, and its head if that is the
document vector): they go to the engine mixed with other documents' inputs, in calls of at most
``model.token_budget`` tokens, and a document with a failing input is dead-lettered whole.

A failed engine call is an INPUT failure or an ENGINE failure (``transforms.engines.base`` tells
them apart with a canary input; for the shared engine, a call its process ended in is checked on the
next engine the same way: ``transforms.engines.shared``). An input failure is split in halves and
retried (bisection) until the failing inputs stand alone; only those are dead-lettered
(``embedding_failed``). An engine failure (``EngineFailedError``, also raised when the engine cannot
be loaded) blames no input: it fails the bundle, which the runner retries on a fresh engine. Every
vector is checked: one holding a NaN or an infinity is its document's dead letter, never a row. A
model that fails for every input while its canary passes stops the job (``ModelBrokenError``,
counted per process: ``FailureRun``); a shared engine that ends in more calls of one bisection in a
row than one input can make it, and no longer embeds an input it embedded before, fails the bundle
(``_EngineEnds``). """
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime as dt
import hashlib
import logging
import threading
import time
import uuid
from typing import Iterable, Optional, Sequence, cast

import apache_beam as beam
import numpy as np
from apache_beam import pvalue
from apache_beam.ml.inference.base import PredictionResult
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, TimerSpec, on_timer
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from transforms.chunking import (
    ChunkSpan,
    chunk_id,
    late_vector,
    mean_vector,
)
from transforms.engines.base import (
    EngineFactory,
    EngineFailedError,
    EngineHandle,
    ModelHandle,
    finite_rows,
)
from transforms.engines.registry import process_engine
from transforms.engines.shared.client import EngineEndedInCall, deaths_allowed, shared_engine
from transforms.metrics import BATCH_DOCS, BATCH_TOKENS, EMBED_MS, MODEL_LOAD_MS
from transforms.settings import ChunkingSettings, ModelSettings
from transforms.state_coders import MicroBatchCoder, PendingIdCoder
from transforms.types import (
    DEAD_LETTER,
    BatchId,
    ChunkRow,
    DeadLetter,
    EmbeddedDoc,
    MicroBatch,
    PreparedDoc,
    Reason,
    Step,
    story_of,
)
from transforms.vector_math import normalized, pool_tokens

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EmbedFailure:
    error: str


@dataclasses.dataclass
class _EngineEnds:
    """The shared engine's ends in calls of one bisection (``EngineEndedInCall``), in a row with
    no call succeeding between them. One input that ends the engine makes at most ``allowed`` of
    them (``transforms.engines.shared.client.deaths_allowed``: one per halving, and its retry); past
    that, the engine is asked to embed an input it embedded before: if it cannot (or there is
    none yet), the engine is what fails, and the bundle fails (``EngineFailedError``) instead of
    starting an engine per input and dead-lettering every article of the call; if it can, the
    inputs are bisected on (several that end it lie side by side)."""

    allowed: int
    in_a_row: int = 0

    def ended(self, model: ModelHandle, inputs: int) -> None:
        self.in_a_row += 1
        if self.in_a_row <= self.allowed:
            return
        check = getattr(model, "embeds_known_good", None)
        verdict = check() if check is not None else None
        if verdict:
            self.in_a_row = 0
            return
        raise EngineFailedError(
            f"the shared embedding engine ended in {self.in_a_row} calls in a row (the last of "
            f"{inputs} inputs), more than one input that ends it can cause ({self.allowed}), "
            "and it " + ("has embedded nothing in this process yet" if verdict is None
                         else "cannot embed an input it embedded before")
            + ": the engine is failing, not the inputs")


class ModelBrokenError(RuntimeError):
    """The model failed for every input in a long run: a broken model, not poison documents."""


class FailureRun:
    """The documents dead-lettered in a row (``embedding_failed``: a call failed, the engine's
    canary passed, and bisection blamed them) by one embedding step in this process, across its
    bundles, threads and DoFn instances; a document that embeds ends the run.

    Beam makes a new DoFn instance, with a fresh copy of the embedder, for each thread and after
    each failed bundle: a count kept on the embedder would restart there, and a retried micro-batch
    of a broken model would be committed as dead letters. The count is kept per process (one
    ``FailureRun`` per step, found by the embedder's id), so a bundle retried after a
    ``ModelBrokenError`` fails again at its first failing document. Other processes keep their own
    count: each dead-letters at most ``max_consecutive_failures - 1`` documents before it stops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def failed(self) -> int:
        """Count one more failed document; returns the run's length."""
        with self._lock:
            self._count += 1
            return self._count

    def embedded(self) -> None:
        with self._lock:
            self._count = 0


_FAILURE_RUNS: dict[str, FailureRun] = {}
_FAILURE_RUNS_LOCK = threading.Lock()


def failure_run(step_id: str) -> FailureRun:
    """This process's count of consecutive failures for the embedding step ``step_id``."""
    with _FAILURE_RUNS_LOCK:
        return _FAILURE_RUNS.setdefault(step_id, FailureRun())


def _finite_or_failures(vectors: list) -> list:
    """The engine's vectors, each that holds a NaN or an infinity replaced by an EmbedFailure."""
    finite = finite_rows(vectors)
    if finite.all():
        return vectors
    return [v if ok else EmbedFailure(_non_finite(v)) for v, ok in zip(vectors, finite,
                                                                       strict=True)]


def _non_finite(vector) -> str:
    values = np.asarray(vector, dtype=np.float64).ravel()
    return (f"the engine returned a non-finite vector ({int(np.isnan(values).sum())} NaN and "
            f"{int(np.isinf(values).sum())} infinite of {values.size} values)")


def token_budget_slices(items: Sequence, budget: int, size=len) -> Iterable[list]:
    """Consecutive slices of at most ``budget`` tokens (``size(item)`` each; a longer item stands
    alone)."""
    batch: list = []
    tokens = 0
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


@dataclasses.dataclass(frozen=True)
class LateInputs:
    """What the engine computes for a document in late mode (``chunking.mode: late``): one pass
    over its head (``token_ids``, a vector per token), in which each chunk that the head holds
    lies at ``spans[k]`` (None: the chunk is past the head, and embedded alone, as in chunks
    mode)."""

    head: tuple[int, ...]
    spans: tuple[Optional[tuple[int, int]], ...]

    @staticmethod
    def of(doc: PreparedDoc, late_span) -> "LateInputs":
        return LateInputs(doc.token_ids, tuple(late_span(len(doc.token_ids), c)
                                               for c in doc.chunks))

    def alone(self, chunks: Sequence[ChunkSpan]) -> list[tuple[int, ...]]:
        """The chunks embedded alone: those past the head."""
        return [c.token_ids for c, span in zip(chunks, self.spans, strict=True) if span is None]

    def size(self, chunks: Sequence[ChunkSpan]) -> int:
        return len(self.head) + sum(map(len, self.alone(chunks)))


def _late_span_of(settings: ModelSettings, chunking: ChunkingSettings):
    """The chunker's ``late_span`` for these settings (the process's, ``text_tools``)."""
    from transforms.text import text_tools  # it imports the engines; loaded on the worker

    chunker = text_tools(settings, chunking).chunker
    assert chunker is not None  # late mode has one
    return chunker.late_span


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


class Embedder:
    """PreparedDoc -> its vectors (one per ``model_inputs``: the head, or its chunks), or an
    ``EmbedFailure``, through an engine: vLLM, or what ``engine_factory`` makes (tests,
    benchmarks). Engine calls hold at most ``model.token_budget`` tokens of inputs, documents and
    chunks alike. A plain class, driven by ``_EmbedBatchesFn`` and ``_EmbedInFlightFn`` (not
    RunInference, which would wait for each call)."""

    def __init__(self, settings: ModelSettings, engine_factory: Optional[EngineFactory] = None,
                 doc_vector: str = "head", late: Optional[ChunkingSettings] = None):
        """``late``: the chunking settings in late mode (``chunking.mode: late``): the engine is
        loaded for token vectors (``model.pooling_task: token_embed``), and a document's head,
        and each chunk the head holds, are pooled from one pass over its head."""
        self._text_settings = settings  # PrepareText's: the chunker is the one it made
        self._late = late
        if late is not None:
            settings = settings.model_copy(update={"pooling_task": "token_embed"})
        self._settings = settings
        self._engine_factory = engine_factory
        self._doc_vector = doc_vector
        # Pickled with the embedder, so every copy of it (each DoFn instance, each worker process)
        # finds the same count of consecutive failures and the same shared engine, and no other
        # pipeline's.
        self._step_id = uuid.uuid4().hex
        self._shared_tag = f"newsvec-engine-{self._step_id}"

    @property
    def shared_engine_tag(self) -> str:
        """The tag of this step's engine with ``model.share_across_processes``: every process that
        asks for it reaches the same engine."""
        return self._shared_tag

    def batch_elements_kwargs(self):
        # Batches are weighed in tokens: each holds at most token_budget tokens (a document with
        # more, in chunks mode, stands alone and is embedded in several calls).
        doc_vector, late = self._doc_vector, self._late_inputs
        return {"min_batch_size": self._settings.token_budget,
                "max_batch_size": self._settings.token_budget,
                "element_size_fn": lambda doc: (
                    late(doc).size(doc.chunks) if self._late is not None and doc.chunks
                    else sum(map(len, model_inputs(doc, doc_vector))))}

    def _late_inputs(self, doc: PreparedDoc) -> LateInputs:
        if self._late is None:
            raise ValueError("not in late mode")
        return LateInputs.of(doc, _late_span_of(self._text_settings, self._late))

    def load_engine(self) -> ModelHandle:
        if self._settings.share_across_processes:
            return shared_engine(self._settings, self._engine_factory, self._shared_tag)
        return process_engine(self._settings, self._engine_factory)

    def _embed(self, model: ModelHandle, prompts: Sequence[Sequence[int]], retried=False,
               ends: Optional[_EngineEnds] = None, tokens: bool = False) -> list:
        """A vector or an EmbedFailure per prompt: a failing call is retried in halves
        (bisection), and a single failing prompt once more before it is blamed. A vector with a
        NaN or an infinity is its prompt's EmbedFailure (not retried: the engine's canary passed,
        ``transforms.engines.base``), never a row. A bisection in which the shared engine ends more
        often in a row than one input that ends it can make it (``_EngineEnds``) stops with an
        ``EngineFailedError`` unless the engine still embeds an input it embedded before.
        ``tokens``: a vector per token of each prompt (``embed_tokens``, late mode)."""
        if not prompts:
            return []
        if ends is None:
            ends = _EngineEnds(deaths_allowed(len(prompts)))
        try:
            vectors = (cast(EngineHandle, model).embed_tokens(prompts) if tokens
                       else model.embed(prompts))
        except EngineFailedError:
            raise  # no input is to blame: the bundle fails and is retried on a fresh engine
        except Exception as exc:  # pylint: disable=broad-except
            if isinstance(exc, EngineEndedInCall):
                ends.ended(model, len(prompts))
            if len(prompts) == 1:
                if not retried:
                    return self._embed(model, prompts, retried=True, ends=ends, tokens=tokens)
                return [EmbedFailure(f"{type(exc).__name__}: {exc}"[:2000])]
            half = len(prompts) // 2
            _LOG.warning("Embedding a batch of %d failed (%s); retrying in halves", len(prompts),
                         exc)
            return (self._embed(model, prompts[:half], ends=ends, tokens=tokens)
                    + self._embed(model, prompts[half:], ends=ends, tokens=tokens))
        ends.in_a_row = 0
        return _finite_or_failures(vectors)

    def embed_docs(self, model: ModelHandle, docs: Sequence[PreparedDoc],
                   stats: Optional["EngineStats"] = None) -> list:
        """Per document, its vectors (one per ``model_inputs``) or an ``EmbedFailure`` if any of
        its inputs failed (an article is written whole or not at all). Inputs go to the engine in
        calls of at most ``token_budget`` tokens, with the broken-model stop. The batch metrics go
        to ``stats`` when given (a thread that is not the bundle's cannot record metrics), else
        straight to Beam's metrics."""
        own_stats = stats is None
        if stats is None:
            stats = EngineStats()
        stats.load_ms += model.take_load_ms()
        late: dict[int, LateInputs] = ({i: self._late_inputs(doc) for i, doc in enumerate(docs)
                                        if doc.chunks} if self._late is not None else {})
        inputs = [(i, ids) for i, doc in enumerate(docs)
                  for ids in (late[i].alone(doc.chunks) if i in late
                              else model_inputs(doc, self._doc_vector))]
        passes = [(i, late[i].head) for i in late]
        results = self._embed_inputs(model, inputs, stats)
        head_tokens = self._embed_inputs(model, passes, stats, tokens=True)
        if own_stats:
            stats.record()
        per_doc: list = [[] for _ in docs]
        for (i, _), result in zip(inputs, results, strict=True):
            per_doc[i].append(result)
        if late:
            pooling = cast(EngineHandle, model).pooling()
            for (i, _), result in zip(passes, head_tokens, strict=True):
                per_doc[i] = self._late_vectors(late[i], result, per_doc[i], pooling)
        failures = failure_run(self._step_id)
        out = []
        for vectors in per_doc:
            failed = [(k, r) for k, r in enumerate(vectors) if isinstance(r, EmbedFailure)]
            if failed:
                k, failure = failed[0]
                where = f"input {k + 1} of {len(vectors)}: " if len(vectors) > 1 else ""
                out.append(EmbedFailure(f"{where}{failure.error}"))
                in_a_row = failures.failed()
                if in_a_row >= self._settings.max_consecutive_failures:
                    raise ModelBrokenError(
                        f"the model failed for {in_a_row} documents in a row in this process "
                        f"(last: {failure.error}); stopping instead of dead-lettering everything")
            else:
                out.append(vectors)
                failures.embedded()
        return out

    def _embed_inputs(self, model: ModelHandle, inputs: list, stats: "EngineStats",
                      tokens: bool = False) -> list:
        """``_embed`` of ``(document index, token ids)`` inputs, in calls of at most
        ``token_budget`` tokens."""
        results: list = []
        for call in token_budget_slices(inputs, self._settings.token_budget,
                                        size=lambda item: len(item[1])):
            started = time.perf_counter()
            results += self._embed(model, [ids for _, ids in call], tokens=tokens)
            stats.calls.append((int((time.perf_counter() - started) * 1000), len(call),
                                sum(len(ids) for _, ids in call)))
        return results

    def _late_vectors(self, late: LateInputs, tokens, alone: list, pooling: str) -> list:
        """A late-mode document's vectors, as ``model_inputs`` orders them: its head's (pooled
        from the pass as the model pools), then each chunk's (the mean of its span of the pass,
        or its own vector, from ``alone``, for a chunk past the head); a failure if the pass or
        a chunk alone failed."""
        if isinstance(tokens, EmbedFailure):
            return [tokens]
        normalize = self._settings.normalize
        alone_vectors = iter(alone)
        chunks = [late_vector(tokens, *span, normalize) if span is not None
                  else next(alone_vectors) for span in late.spans]
        return [normalized(pool_tokens(tokens, pooling), normalize)] + chunks

    def embed_batch(self, batch: Sequence[PreparedDoc], model: ModelHandle,
                    stats: Optional[EngineStats] = None) -> list[PredictionResult]:
        """``embed_docs``, each document's result with its document and the model's label (as
        Beam's ``PredictionResult``, the type a RunInference step would give)."""
        label = model.label()
        results = self.embed_docs(model, batch, stats)
        return [PredictionResult(example=doc, inference=result, model_id=label)
                for doc, result in zip(batch, results, strict=True)]


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
        for index, (chunk, vector) in enumerate(zip(doc.chunks, chunk_vectors, strict=True)):
            text = doc.text[chunk.char_start:chunk.char_end]
            rows.append(ChunkRow(
                id=doc.id,
                chunk_id=chunk_id(doc.id, doc.text_sha256, model, self.chunk_recipe, index),
                chunk_index=index, chunk_count=len(doc.chunks), token_start=chunk.token_start,
                token_end=chunk.token_end, char_start=chunk.char_start, char_end=chunk.char_end,
                chunk_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                text_sha256=doc.text_sha256, model=model, embedding=vector, embedded_at=now,
                chunk_text=text if self.store_chunk_text else None, **story_of(doc)))
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
        # Beam types PredictionResult's fields with free type variables; the Embedder sets them.
        out = self._rows(cast(PreparedDoc, result.example), result.inference,
                         cast(str, result.model_id))
        yield pvalue.TaggedOutput(DEAD_LETTER, out) if isinstance(out, DeadLetter) else out


def embedder_for(settings: ModelSettings, chunking: ChunkingSettings,
              engine_factory: Optional[EngineFactory]) -> Embedder:
    return Embedder(settings, engine_factory, chunking.doc_vector,
                    late=chunking if chunking.mode == "late" else None)


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

    def __init__(self, embedder: Embedder, in_flight: int = 2):
        self._embedder, self._in_flight = embedder, in_flight
        self._model: Optional[ModelHandle] = None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: collections.deque = collections.deque()

    def setup(self):
        self._model = self._embedder.load_engine()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="newsvec-embed")

    def start_bundle(self):
        self._pending = collections.deque()

    def _submit(self, batch):
        stats = EngineStats()
        assert self._pool is not None and self._model is not None, "setup() makes them"
        future = self._pool.submit(self._embedder.embed_batch, batch, self._model, stats)
        return future, stats

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


class Embed(beam.PTransform):
    """PreparedDoc -> EmbeddedDoc (main output, with its chunk rows in chunks mode) and DeadLetter
    (``dead_letter`` output)."""

    def __init__(self, settings: ModelSettings, *, chunking: ChunkingSettings = ChunkingSettings(),
                 store_chunk_text: bool = False, dead_letter_payload_bytes: int = 4096,
                 engine_factory: Optional[EngineFactory] = None):
        super().__init__()
        self._embedder = embedder_for(settings, chunking, engine_factory)
        self._rows = _row_maker(settings, chunking, store_chunk_text, dead_letter_payload_bytes)

    def expand(self, docs):
        return (docs
                | "Batch" >> beam.BatchElements(**self._embedder.batch_elements_kwargs())
                | "EmbedBatches" >> beam.ParDo(_EmbedBatchesFn(self._embedder))
                | "Route" >> beam.ParDo(_RouteFn(self._rows)).with_outputs(
                    DEAD_LETTER, main="embedded"))


def _fill_micro_batch(result: PredictionResult, rows: RowMaker) -> MicroBatch:
    batch = cast(MicroBatch, result.example)  # see _RouteFn.process
    outs = [rows(doc, r, cast(str, result.model_id))
            for doc, r in zip(batch.docs, cast(list, result.inference), strict=True)]
    return dataclasses.replace(
        batch, docs=(), rows=tuple(o for o in outs if isinstance(o, EmbeddedDoc)),
        dead_letters=batch.dead_letters + tuple(o for o in outs if isinstance(o, DeadLetter)))


_IN_FLIGHT_LOCK = threading.Lock()
_ENGINE_THREADS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}  # one per step
_POLL_S = 0.1  # how often finished calls are looked for
_FORGET_S = 600.0  # a finished call no timer of this process collected (the key moved) is dropped


@dataclasses.dataclass
class _Call:
    """A micro-batch's engine call in this process."""

    batch: MicroBatch
    future: concurrent.futures.Future
    stats: EngineStats
    started: float


_IN_FLIGHT: dict[tuple, _Call] = {}  # (step, micro-batch id) -> this process's call


def _forget_stale(now: float) -> None:
    """Calls that finished long ago and that no timer here collected: their micro-batch was
    emitted by another process (or will be embedded again by its ``DONE`` timer). Bounded memory
    whatever the runner does with keys. Under ``_IN_FLIGHT_LOCK``."""
    for key in [k for k, c in _IN_FLIGHT.items()
                if c.future.done() and now - c.started > _FORGET_S]:
        del _IN_FLIGHT[key]


class _EmbedInFlightFn(beam.DoFn):
    """(shard, MicroBatch) -> the MicroBatch with its rows, with the engine call in flight while the
    runner goes on with other work: preparing the next micro-batch, writing the last one.

    ``process`` hands the micro-batch to this process's engine thread (one per step) and keeps it
    in state. Two timers take the results out, each as a work item of its own (RunInference would
    wait for the call in the bundle that made it, and the runner with it):
    - ``POLL`` (processing time, every ``_POLL_S``) emits the micro-batches whose call in THIS
      process is done. It waits for none and starts none, and reads only the small state of ids
      until something is done;
    - ``DONE`` (event time, at the oldest pending micro-batch's timestamp) emits every micro-batch
      still held, waiting for its call, or making it if this process has none: the end of the
      job's last micro-batch, runners whose clock stands still (TestStream's), and a key whose
      timers run in another process than its call (Dataflow runs a worker's work items in any of
      its SDK processes: a POLL finds its call only in the process that made it, so the rest wait
      for a POLL there or for ``DONE``; a call no timer collects is dropped after ``_FORGET_S``).
    The state makes it safe: a micro-batch leaves it only with its rows emitted (in one commit).
    A call that failed is forgotten, so that the retried work item calls again."""

    PENDING = BagStateSpec("pending", MicroBatchCoder())  # the micro-batches, whole
    PENDING_IDS = BagStateSpec("pending_ids", PendingIdCoder())  # (id, timestamp in micros) of each
    POLL = TimerSpec("poll", TimeDomain.REAL_TIME)
    DONE = TimerSpec("done", TimeDomain.WATERMARK)

    def __init__(self, embedder: Embedder, rows: RowMaker):
        self._embedder, self._rows = embedder, rows
        self._step = uuid.uuid4().hex  # pickled: the same in every copy of this DoFn
        self._model: Optional[ModelHandle] = None

    def setup(self):
        self._model = self._embedder.load_engine()  # once per process (transforms.engines.base)

    def _embed(self, batch: MicroBatch, stats: EngineStats) -> tuple[str, list]:
        assert self._model is not None, "setup() loads the engine"
        return self._model.label(), self._embedder.embed_docs(self._model, batch.docs, stats)

    def _local(self, batch_id: BatchId) -> Optional[_Call]:
        with _IN_FLIGHT_LOCK:
            return _IN_FLIGHT.get((self._step, batch_id))

    def _call(self, batch: MicroBatch) -> _Call:
        """This process's call for the micro-batch, made now if there is none."""
        key = (self._step, batch.batch_id)
        with _IN_FLIGHT_LOCK:
            if key not in _IN_FLIGHT:
                now = time.monotonic()
                _forget_stale(now)
                pool = _ENGINE_THREADS.setdefault(self._step, concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="newsvec-embed"))
                stats = EngineStats()
                _IN_FLIGHT[key] = _Call(batch, pool.submit(self._embed, batch, stats), stats, now)
            return _IN_FLIGHT[key]

    def _result(self, call: _Call):
        try:
            label, vectors = call.future.result()
        finally:
            call.stats.record()  # in the bundle's thread, where metrics count
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.pop((self._step, call.batch.batch_id), None)
        result = PredictionResult(example=call.batch, inference=vectors, model_id=label)
        return TimestampedValue(_fill_micro_batch(result, self._rows), _timestamp(call.batch))

    def process(self, keyed: tuple[int, MicroBatch], pending=beam.DoFn.StateParam(PENDING),
                pending_ids=beam.DoFn.StateParam(PENDING_IDS), poll=beam.DoFn.TimerParam(POLL),
                done=beam.DoFn.TimerParam(DONE)):
        _, batch = keyed
        self._call(batch)
        pending.add(batch)
        pending_ids.add((batch.batch_id, _timestamp(batch).micros))
        poll.set(Timestamp.now() + Duration(seconds=_POLL_S))
        done.set(Timestamp(micros=min(t for _, t in pending_ids.read())))

    @on_timer(POLL)
    def emit_done(self, pending=beam.DoFn.StateParam(PENDING),
                  pending_ids=beam.DoFn.StateParam(PENDING_IDS),
                  poll=beam.DoFn.TimerParam(POLL), done=beam.DoFn.TimerParam(DONE)):
        ids = list(pending_ids.read())
        finished = {batch_id for batch_id, _ in ids
                    if (call := self._local(batch_id)) is not None and call.future.done()}
        if finished:
            held = list(pending.read())
            pending.clear()
            pending_ids.clear()
            for batch in held:
                batch_id = batch.batch_id
                call = self._local(batch_id) if batch_id in finished else None
                if call is not None:
                    yield self._result(call)
                else:
                    finished.discard(batch_id)
                    pending.add(batch)
                    pending_ids.add((batch_id, _timestamp(batch).micros))
            left = [t for batch_id, t in ids if batch_id not in finished]
            if left:
                done.set(Timestamp(micros=min(left)))
        if len(finished) < len(ids):
            poll.set(Timestamp.now() + Duration(seconds=_POLL_S))

    @on_timer(DONE)
    def emit_all(self, pending=beam.DoFn.StateParam(PENDING),
                 pending_ids=beam.DoFn.StateParam(PENDING_IDS), poll=beam.DoFn.TimerParam(POLL)):
        for batch in pending.read():
            yield self._result(self._call(batch))
        pending.clear()
        pending_ids.clear()
        poll.clear()


def _timestamp(batch: MicroBatch) -> Timestamp:
    """A micro-batch's timestamp, as GroupMicroBatches gave it: its window's last instant."""
    return Timestamp(micros=batch.window_end_us) - Duration(micros=1)


class EmbedStreaming(beam.PTransform):
    """Streaming: MicroBatch -> the same MicroBatch with its rows (and any embedding dead letters),
    the engine computing one micro-batch while the runner prepares the next and writes the last
    (``_EmbedInFlightFn``)."""

    def __init__(self, settings: ModelSettings, *, chunking: ChunkingSettings = ChunkingSettings(),
                 store_chunk_text: bool = False, dead_letter_payload_bytes: int = 4096,
                 engine_factory: Optional[EngineFactory] = None):
        super().__init__()
        embedder = embedder_for(settings, chunking, engine_factory)
        self.shared_engine_tag = embedder.shared_engine_tag
        self._fn = _EmbedInFlightFn(embedder, _row_maker(settings, chunking, store_chunk_text,
                                                        dead_letter_payload_bytes))

    def expand(self, batches):
        return (batches
                | "ByShard" >> beam.Map(lambda batch: (batch.shard, batch)).with_output_types(
                    tuple[int, MicroBatch])
                | "EmbedInFlight" >> beam.ParDo(self._fn))
