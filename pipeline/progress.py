"""A local batch run's progress: articles done out of the total, articles/s and an ETA, as a
progress bar on a terminal and as a log line every ``interval_s`` otherwise.

It reads ``transforms.metrics``' in-process counter, so it reports where the job runs in this
process (FnApiRunner in memory or with threads, the local configs); with worker processes the
counts are theirs, and on Dataflow they are the job's ``articles_done`` and ``events_in`` metrics.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

from transforms import metrics

_LOG = logging.getLogger("newsvec.progress")


class ProgressReporter:
    """``with ProgressReporter(total):`` shows the progress of the run inside the block."""

    def __init__(self, total: int, interval_s: float = 10.0, bar: bool | None = None):
        self._total, self._interval_s = total, interval_s
        self._bar = sys.stderr.isatty() if bar is None else bar
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="newsvec-progress", daemon=True)
        self._start_count = metrics.local_done()
        self._started = time.monotonic()
        self.lines: list[str] = []  # the log lines written (for tests and the summary)

    def done(self) -> int:
        return metrics.local_done() - self._start_count

    def line(self) -> str:
        done, elapsed = self.done(), time.monotonic() - self._started
        rate = done / elapsed if elapsed > 0 else 0.0
        left = max(self._total - done, 0)
        eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
        share = 100 * done / self._total if self._total else 100.0
        return (f"progress: {done}/{self._total} articles ({share:.0f}%), {rate:.1f} articles/s, "
                f"ETA {eta}")

    def _run(self) -> None:
        bar = None
        if self._bar:
            from tqdm import tqdm

            bar = tqdm(total=self._total, unit="article", desc="newsvec", file=sys.stderr)
        last_log = time.monotonic()
        while not self._stop.wait(0.5 if bar else 1.0):
            if bar is not None:
                bar.update(self.done() - bar.n)
            elif time.monotonic() - last_log >= self._interval_s:
                last_log = time.monotonic()
                self._log()
        if bar is not None:
            bar.update(self.done() - bar.n)
            bar.close()
        else:
            self._log()

    def _log(self) -> None:
        self.lines.append(self.line())
        _LOG.info(self.lines[-1])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
