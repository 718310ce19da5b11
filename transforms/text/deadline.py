"""A document's budget of CPU time while its text is prepared (``text.prepare_budget_s``):
checked between the steps (normalization, tokenization, chunking, the unknown-token count) and
every so often in the loops that can be long; past it, ``PrepareTimeout`` (the document is
dead-lettered ``prepare_failed``)."""
from __future__ import annotations

import time
from typing import Optional


class PrepareTimeout(Exception):
    """A document used more than its budget of CPU time (``Deadline``)."""


# The clock of the budget: CPU time of the calling thread, so that other threads of the worker (and
# waiting for the GIL) do not count against a document. A module global, for the tests.
_clock = time.thread_time


class Deadline:
    """A document's budget of CPU time, checked between the steps of its preparation and every so
    often in the loops that can be long. Python cannot interrupt a thread from outside (signals
    reach only the main thread, and Beam runs DoFns in worker threads), so this is a backstop: the
    steps themselves are linear in the text (see the package docstring, ``transforms.text``)."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self._start = _clock()

    def elapsed(self) -> float:
        return _clock() - self._start

    def check(self, step: str) -> None:
        elapsed = self.elapsed()
        if elapsed > self.budget_s:
            raise PrepareTimeout(f"{elapsed:.1f} s of CPU by {step}")


def _check(deadline: Optional[Deadline], step: str) -> None:
    if deadline is not None:
        deadline.check(step)
