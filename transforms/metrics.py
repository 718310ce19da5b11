"""Beam metrics shared by the stages, so each count has one name.

The run summary (``pipeline/summary.py``) reads these back from the job's result.
"""
from apache_beam.metrics import Metrics

NAMESPACE = "newsvec"
DEAD_LETTER_NAMESPACE = "newsvec.dead_letter"

EVENTS_IN = Metrics.counter(NAMESPACE, "events_in")
ROWS_WRITTEN = Metrics.counter(NAMESPACE, "rows_written")
DUPLICATES = Metrics.counter(NAMESPACE, "duplicates")
DEAD_LETTERED = Metrics.counter(NAMESPACE, "dead_lettered")
TRUNCATED = Metrics.counter(NAMESPACE, "truncated")
LATE_REASSIGNED = Metrics.counter(NAMESPACE, "late_reassigned")
BATCH_DOCS = Metrics.distribution(NAMESPACE, "batch_docs")
BATCH_TOKENS = Metrics.distribution(NAMESPACE, "batch_tokens")
EMBED_MS = Metrics.distribution(NAMESPACE, "embed_batch_ms")
MODEL_LOAD_MS = Metrics.distribution(NAMESPACE, "model_load_ms")
END_TO_END_MS = Metrics.distribution(NAMESPACE, "end_to_end_ms")  # publish -> Parquet (streaming)


def dead_letter_counter(reason: str):
    return Metrics.counter(DEAD_LETTER_NAMESPACE, reason)
