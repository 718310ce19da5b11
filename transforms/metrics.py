"""Beam metrics shared by the stages, so each count has one name, and ``CountDone``, which counts
the articles a batch run has finished.

The run summary (``pipeline/summary.py``) reads these back from the job's result. Dataflow shows
them for a running job (a step's counters in the job page, or Cloud Monitoring's
``dataflow.googleapis.com/job/user_counter``): ``events_in`` (read) and ``articles_done``
(embedded, dead-lettered or unchanged) are a batch job's progress. Where the job runs in the
launching process (the local configs' FnApiRunner), ``articles_done`` also goes to an in-process
counter that the launcher reads for its progress bar (``pipeline/progress.py``).
"""
import threading

import apache_beam as beam
from apache_beam.metrics import Metrics

NAMESPACE = "newsvec"
DEAD_LETTER_NAMESPACE = "newsvec.dead_letter"

EVENTS_IN = Metrics.counter(NAMESPACE, "events_in")
ROWS_WRITTEN = Metrics.counter(NAMESPACE, "rows_written")
DUPLICATES = Metrics.counter(NAMESPACE, "duplicates")
NEAR_DUPLICATES = Metrics.counter(NAMESPACE, "near_duplicates")  # copies skipped (action skip)
NEAR_DUPLICATES_MARKED = Metrics.counter(NAMESPACE, "near_duplicates_marked")  # copies found
DEAD_LETTERED = Metrics.counter(NAMESPACE, "dead_lettered")
TRUNCATED = Metrics.counter(NAMESPACE, "truncated")
LATE_REASSIGNED = Metrics.counter(NAMESPACE, "late_reassigned")
ARTICLES_DONE = Metrics.counter(NAMESPACE, "articles_done")
BATCH_DOCS = Metrics.distribution(NAMESPACE, "batch_docs")
BATCH_TOKENS = Metrics.distribution(NAMESPACE, "batch_tokens")
EMBED_MS = Metrics.distribution(NAMESPACE, "embed_batch_ms")
MODEL_LOAD_MS = Metrics.distribution(NAMESPACE, "model_load_ms")
KEY_INDEX_LOAD_MS = Metrics.distribution(NAMESPACE, "key_index_load_ms")  # per process, max
KEY_INDEX_WAIT_MS = Metrics.distribution(NAMESPACE, "key_index_wait_ms")  # the skip, for the load
SKIP_NS = Metrics.counter(NAMESPACE, "skip_ns")  # CPU time of the key and lookup, summed
SKIP_LOOKUPS = Metrics.counter(NAMESPACE, "skip_lookups")
END_TO_END_MS = Metrics.distribution(NAMESPACE, "end_to_end_ms")  # publish -> Parquet (streaming)
MICRO_BATCH_ROWS = Metrics.distribution(NAMESPACE, "micro_batch_rows")  # rows per micro-batch
STORE_LOADS = Metrics.counter(NAMESPACE, "store_loads")  # a micro-batch or a run, loaded
STORE_ROWS_LOADED = Metrics.counter(NAMESPACE, "store_rows_loaded")
STORE_LOAD_FAILURES = Metrics.counter(NAMESPACE, "store_load_failures")  # given up on (retried)


def dead_letter_counter(reason: str):
    return Metrics.counter(DEAD_LETTER_NAMESPACE, reason)


_done_lock = threading.Lock()
_done = 0


def local_done() -> int:
    """Articles done in this process since it started (all runs)."""
    return _done


def _mark_done(_element) -> tuple:
    """Count an article done; nothing to emit."""
    global _done
    ARTICLES_DONE.inc()
    with _done_lock:
        _done += 1
    return ()


class CountDone(beam.PTransform):
    """A side branch that counts each element as an article done; its output is empty."""

    def expand(self, pcoll):
        return pcoll | "Count" >> beam.FlatMap(_mark_done)
