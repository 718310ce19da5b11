"""Dynamic batching: the inputs of concurrent requests embedded together, in engine calls of up to
``serve.max_batch_tokens`` tokens, as the pipeline's ``Embedder`` batches documents by a token
budget.

Each input waits in one asyncio queue with a future of its own. One task on the event loop takes
them in order: as soon as the engine is free and either the inputs waiting fill the token budget
or the oldest has waited ``serve.max_wait_ms``, it takes up to the budget and hands them to the
engine in its one worker thread (the engine takes one call at a time:
``transforms.engines.base.EngineHandle``), so the event loop goes on reading, tokenizing and
answering requests while the engine computes, and the inputs that arrive meanwhile make the next
call. Under a burst every call is full; when traffic is light an input waits at most
``max_wait_ms`` (0 by default: an idle engine takes the first input at once, as a wait only adds
latency unless a call costs much more than its inputs).

The queue is bounded (``serve.max_queue`` inputs): a request that would pass it is refused at once
(``QueueFull``: 429 with a ``Retry-After`` from the rate the engine has been embedding), so that
an overload is answered instead of piling up; and so is one whose inputs would wait longer than
``serve.request_timeout_s`` at the pace full engine calls have embedded, in tokens a second (a
call costs its tokens: a pace in inputs taken from long documents would refuse short queries),
as it would time out: a 503 after 30 s, where a 429 now lets its client retry elsewhere or
later; one that alone would take longer is told to send fewer inputs a request. An input whose
request gave up (timed out, or its client went away) is dropped if no call has taken it yet.

On SIGTERM (``drain_by``) no call is begun that would end after the service goes; the inputs
still waiting then are refused (``Draining``: a 503 their clients retry elsewhere).

A call that fails with the engine broken (``EngineFailedError``) fails its inputs' requests (503);
one that fails otherwise (the inputs to blame) is split in halves and tried again until the
failing input stands alone (``InputFailed``, a 400 for its request), as the pipeline's
``Embedder`` isolates a failing article. A vector with a NaN or an infinity is such a failure.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

import numpy as np

from pipeline.serve.metrics import ServeMetrics
from transforms.engines.base import EngineFailedError

Embed = Callable[[list[Sequence[int]]], list[np.ndarray]]


class QueueFull(Exception):
    """The queue holds ``serve.max_queue`` inputs: the request is refused, to be retried after
    ``retry_after_s``."""

    def __init__(self, waiting: int, retry_after_s: int, message: Optional[str] = None):
        super().__init__(message or f"the service is at capacity: {waiting} inputs are waiting "
                                    "for the engine")
        self.waiting, self.retry_after_s = waiting, retry_after_s


class Draining(Exception):
    """The service is going away (SIGTERM) and no engine call that would end before it goes can
    take the input: its request is refused, to be sent again (to another instance)."""


class InputFailed(Exception):
    """The engine failed on this input alone (its canary passing), or gave it a vector that is
    not finite."""


@dataclasses.dataclass
class _Waiting:
    ids: Sequence[int]
    future: asyncio.Future
    since: float


class Batcher:
    """The queue and the task that empties it into engine calls (see the module). ``start`` and
    ``close`` on the event loop that ``embed`` is awaited on."""

    def __init__(self, embed: Embed, *, max_batch_tokens: int, max_wait_ms: float,
                 max_queue: int, metrics: ServeMetrics, timeout_s: Optional[float] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self._embed, self._metrics, self._clock = embed, metrics, clock
        self.max_batch_tokens, self.max_queue = max_batch_tokens, max_queue
        self.max_wait_s = max_wait_ms / 1000
        self.timeout_s = timeout_s
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._tokens = 0  # of the inputs in the queue
        self._arrived: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None
        self._thread: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # tokens/s of the engine in full calls, smoothed (0: none yet): a call costs its tokens,
        # so a pace in inputs taken from calls of long documents refuses short queries
        self._rate = 0.0
        self._call_s = 0.0  # seconds an engine call takes, smoothed: for drain_by
        self._deadline: Optional[float] = None  # drain_by's

    @property
    def waiting(self) -> int:
        """Inputs in the queue, not yet in an engine call."""
        return len(self._queue)

    def start(self) -> None:
        self._arrived = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="newsvec-engine")
        self._task = self._loop.create_task(self._run(), name="newsvec-batcher")

    async def close(self) -> None:
        """Stop taking inputs from the queue; the call in flight ends first. Inputs still waiting
        fail (``Draining``): the service is going away."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._shed()
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def drain_by(self, deadline: float) -> None:
        """From now on, begin no engine call that would not end by ``deadline`` (in the clock's
        seconds), at the pace calls have taken; the inputs waiting then fail (``Draining``), so
        that each request has its answer before the service goes. Safe from any thread and from
        a signal handler."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain_by, deadline)

    def _drain_by(self, deadline: float) -> None:
        self._deadline = deadline
        if self._arrived is not None:
            self._arrived.set()

    def _shed(self) -> None:
        while self._queue:
            waiting = self._queue.popleft()
            if not waiting.future.done():
                waiting.future.set_exception(Draining(
                    "the service is shutting down and cannot embed it in time"))
        self._tokens = 0
        self._metrics.queue_depth.set(0)

    def retry_after_s(self) -> int:
        """Seconds until the queue has room again, at the rate the engine has been embedding."""
        if self._rate <= 0:
            return 1
        return max(1, math.ceil(self._tokens / self._rate))

    async def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt (token ids), once engine calls have embedded them all. Raises
        ``QueueFull`` at once when they do not fit in the queue, ``InputFailed`` for a prompt the
        engine failed on, ``EngineFailedError`` when the engine broke."""
        if self._arrived is None:
            raise RuntimeError("Batcher.start() was not called")
        waiting = len(self._queue) + len(prompts)
        if waiting > self.max_queue:
            raise QueueFull(len(self._queue), self.retry_after_s())
        if self.timeout_s is not None and self._rate > 0:
            tokens = sum(len(ids) for ids in prompts)
            if tokens / self._rate > self.timeout_s:  # never in time, whatever the load
                raise QueueFull(len(self._queue), self.retry_after_s(), (
                    f"this request alone ({len(prompts)} inputs, {tokens} tokens) would take "
                    f"the engine about {tokens / self._rate:.0f} s at the pace it has embedded "
                    f"({self._rate:.0f} tokens a second), over serve.request_timeout_s "
                    f"({self.timeout_s:g} s): send fewer inputs a request"))
            if (self._tokens + tokens) / self._rate > self.timeout_s:
                raise QueueFull(len(self._queue), self.retry_after_s())
        loop = asyncio.get_running_loop()
        now = self._clock()
        futures = []
        for ids in prompts:
            future = loop.create_future()
            self._queue.append(_Waiting(ids, future, now))
            self._tokens += len(ids)
            futures.append(future)
        self._metrics.queue_depth.set(len(self._queue))
        self._arrived.set()
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:
            for future in futures:  # a request that gave up: its inputs not yet taken are dropped
                future.cancel()
            raise

    async def _run(self) -> None:
        assert self._arrived is not None and self._thread is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if self._deadline is not None and self._clock() + self._call_s > self._deadline:
                self._shed()  # draining: a call begun now would end after the service
                continue
            wait = self._queue[0].since + self.max_wait_s - self._clock()
            if self._tokens < self.max_batch_tokens and wait > 0:
                await asyncio.sleep(wait)  # others may join the call meanwhile
            batch = self._take()
            if batch:
                try:
                    await self._call(loop, batch)
                except Exception as exc:  # pylint: disable=broad-except  # never the task's end
                    self._metrics.failed_batches.inc()
                    for waiting in batch:
                        if not waiting.future.done():
                            waiting.future.set_exception(EngineFailedError(
                                f"the engine call failed: {type(exc).__name__}: {exc}"[:500]))

    def _take(self) -> list[_Waiting]:
        """The inputs of the next call, in order: up to ``max_batch_tokens`` tokens (one input at
        least), those whose request gave up left out."""
        batch: list[_Waiting] = []
        tokens = 0
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # cancelled: its request gave up
                self._queue.popleft()
                self._tokens -= len(head.ids)
                continue
            if batch and tokens + len(head.ids) > self.max_batch_tokens:
                break
            self._queue.popleft()
            self._tokens -= len(head.ids)
            tokens += len(head.ids)
            batch.append(head)
        self._metrics.queue_depth.set(len(self._queue))
        return batch

    async def _call(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiting]) -> None:
        """Embed ``batch`` in the engine's thread and settle each input's future."""
        tokens = sum(len(w.ids) for w in batch)
        started = self._clock()
        outcomes = await loop.run_in_executor(self._thread, self._embed_isolating,
                                              [w.ids for w in batch])
        if len(outcomes) != len(batch):  # never a vector handed to another input
            raise ValueError(f"{len(outcomes)} vectors for {len(batch)} prompts")
        seconds = self._clock() - started
        self._metrics.engine_call(len(batch), tokens, seconds)
        self._call_s = seconds if self._call_s <= 0 else max(seconds, 0.8 * self._call_s
                                                                 + 0.2 * seconds)
        if seconds > 0 and 2 * tokens >= self.max_batch_tokens:  # a full call: the pace of a
            rate = tokens / seconds  # queue (one of a few inputs says little of it)
            self._rate = rate if self._rate <= 0 else 0.8 * self._rate + 0.2 * rate
        for waiting, outcome in zip(batch, outcomes, strict=True):
            if waiting.future.done():
                continue
            if isinstance(outcome, BaseException):
                waiting.future.set_exception(outcome)
            else:
                waiting.future.set_result(outcome)

    def _embed_isolating(self, prompts: list[Sequence[int]]) -> list:
        """Per prompt, its vector or the exception that stands for it (in the engine's thread):
        a call that fails with the engine working is split in halves until the failing prompts
        stand alone; an engine failure fails every prompt of the call."""
        try:
            vectors = self._embed(prompts)
        except EngineFailedError as exc:
            self._metrics.failed_batches.inc()
            return [exc] * len(prompts)
        except Exception as exc:  # pylint: disable=broad-except  # the inputs are to blame
            self._metrics.failed_batches.inc()
            if len(prompts) == 1:
                return [InputFailed(f"the engine could not embed it: {type(exc).__name__}: "
                                    f"{exc}"[:500])]
            half = len(prompts) // 2
            return (self._embed_isolating(prompts[:half])
                    + self._embed_isolating(prompts[half:]))
        return [v if np.isfinite(v).all() else InputFailed(
            "the engine gave it a vector that is not finite (NaN or infinite values)")
            for v in vectors]
