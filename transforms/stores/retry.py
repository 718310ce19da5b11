"""What a load does with an error, whatever the backend. Transient ones (the database down,
failing over or read-only for a moment, a lock or statement timeout) are retried with backoff for
``store.retry_s`` (``retrying``). Data errors never succeed on retry: the rows the server refuses
are found by halving the load, each part in a savepoint, and set aside with their reason, the
rest of the load commits (``Isolation``); but more than ``max(REFUSED_AT_LEAST, REFUSED_SHARE x
its rows)`` refusals, or a search for them longer than its budget, fail the load. The backend
says which error is which (``transforms.stores.pgvector.sql``: ``is_transient``,
``is_data_error``)."""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Sequence

from transforms.stores.base import StoreLoadFailed

if TYPE_CHECKING:
    import tenacity

REFUSED_SHARE, REFUSED_AT_LEAST = 0.10, 3
"""A load the server refuses more than ``max(REFUSED_AT_LEAST, REFUSED_SHARE x its rows)`` rows of
fails (``StoreLoadFailed``): so many refusals are the table's or the database's problem (a
constraint or trigger every row fails), not the rows'."""

_clock = time.monotonic  # the isolation's deadline (tests replace it)

ErrorTest = Callable[[BaseException], bool]


def retrying(retry_s: float, is_transient: ErrorTest,
             on_retry: Callable[[int, Optional[BaseException]], None]) -> "tenacity.Retrying":
    """Calls retried with exponential backoff (0.5 s doubling, at most 10 s apart) while they
    raise an error ``is_transient`` holds, for up to ``retry_s``; then the error is raised.
    ``on_retry(attempt, error)`` before each wait."""
    import tenacity

    def before_sleep(state: tenacity.RetryCallState) -> None:
        on_retry(state.attempt_number, state.outcome.exception() if state.outcome else None)

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        stop=tenacity.stop_after_delay(retry_s),
        wait=tenacity.wait_exponential(multiplier=0.5, max=10),
        before_sleep=before_sleep, reraise=True)


class Isolation:
    """The rows the server refuses of one load, found by halving (``halve``), and the bounds on
    finding them: more than ``cap`` refusals, or longer than ``budget_s`` from the first, fail
    the load (``StoreLoadFailed``, not transient). ``is_data_error`` and ``is_transient``: the
    backend's reading of an error."""

    def __init__(self, rows: int, budget_s: float, is_data_error: ErrorTest,
                 is_transient: ErrorTest):
        self.rows = rows
        self.cap = max(REFUSED_AT_LEAST, math.ceil(REFUSED_SHARE * rows))
        self.budget_s = budget_s
        self.deadline: Optional[float] = None
        self.refused: list[dict] = []
        self._is_data_error, self._is_transient = is_data_error, is_transient

    def started(self) -> None:
        if self.deadline is None:
            self.deadline = _clock() + self.budget_s

    def check_time(self) -> None:
        if self.deadline is not None and _clock() > self.deadline:
            raise StoreLoadFailed(
                f"finding the rows the store refuses of a load of {self.rows} rows took over "
                f"{self.budget_s:g} s (store.statement_timeout_s; {len(self.refused)} refused "
                f"so far{self._first()}): nothing of this load was stored; a table or database "
                "that refuses this many rows needs fixing")

    def refuse(self, items: Sequence[dict]) -> None:
        """Rejections for what the server refused: none (counted already: another chunk of the
        same article), one row, or every version of one article."""
        if not items:
            return
        self.refused.extend(items)
        if len(self.refused) > self.cap:
            raise StoreLoadFailed(
                f"the store refused more than {self.cap} of the load's {self.rows} rows "
                f"(max({REFUSED_AT_LEAST}, {REFUSED_SHARE:.0%}){self._first()}): that many "
                "refusals are a problem of the table or the database (a constraint or trigger "
                "every row fails), not of the rows; nothing of this load was stored")

    def _first(self) -> str:
        if not self.refused:
            return ""
        first = self.refused[0]
        return f"; the first: article {first['id']}: {first['detail']}"

    def halve(self, savepoint: Callable[[], ContextManager], n: int,
              attempt: Callable[[int, int], Any],
              refusal: Callable[[int, BaseException], list[dict]],
              again: Optional[Callable[[int], bool]] = None) -> list:
        """``attempt(0, n)`` in a ``savepoint()``; when the server refuses it for its data
        (``is_data_error``), it is rolled back and halved, each half in a savepoint of its own,
        down to the single positions it refuses (``refusal``: their rejections, into this
        isolation, which bounds how many there may be and for how long they are sought); a
        position refused is tried again while ``again`` says something of it is left (an
        article's earlier version, once its latest is set aside). Returns what the attempts that
        passed returned."""
        done = []
        pending = [(0, n)] if n else []
        while pending:
            lo, hi = pending.pop()
            self.check_time()
            failure = None
            try:
                with savepoint():
                    done.append(attempt(lo, hi))
                continue
            except Exception as exc:  # pylint: disable=broad-except  # sorted just below
                if not self._is_data_error(exc) or self._is_transient(exc):
                    raise
                failure = exc
            self.started()
            if hi - lo == 1:
                self.refuse(refusal(lo, failure))
                if again is not None and again(lo):
                    pending.append((lo, hi))
                continue
            middle = (lo + hi) // 2
            pending += [(middle, hi), (lo, middle)]  # the first half first
        return done
