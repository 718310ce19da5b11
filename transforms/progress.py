"""Progress of a batch run: articles done (embedded, dead-lettered or unchanged) out of those read.

Counted as Beam metrics (namespace ``newsvec``: ``events_in``, read; ``articles_done``), which
Dataflow shows for a running job (a step's counters in the job page, or Cloud Monitoring's
``dataflow.googleapis.com/job/user_counter``). Where the job runs in the launching process (the
local configs' FnApiRunner), the same counts also go to a counter that the launcher reads to show a
progress bar (``pipeline/progress.py``).
"""
from __future__ import annotations

import threading

import apache_beam as beam
from apache_beam.metrics import Metrics

from transforms.metrics import NAMESPACE

ARTICLES_DONE = Metrics.counter(NAMESPACE, "articles_done")
_lock = threading.Lock()
_done = 0


def local_done() -> int:
    """Articles done in this process since it started (all runs)."""
    return _done


def _mark(_element, weight: int = 1) -> None:
    global _done
    ARTICLES_DONE.inc(weight)
    with _lock:
        _done += weight


class CountDone(beam.PTransform):
    """A side branch that counts each element as an article done; its output is empty."""

    def expand(self, pcoll):
        return pcoll | "Count" >> beam.FlatMap(lambda element: _mark(element) or ())
