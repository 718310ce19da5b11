"""What the streaming steps that keep state per key (``transforms.dedup``, ``transforms.stories``)
share: a timer's time as the portable runners deliver it (``ms_ceiling``), and a micro-batch
regrouped by its id from its header and its verdicts, arriving in any order (``RegroupFn``,
``regroup``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import apache_beam as beam
from apache_beam.coders import VarIntCoder
from apache_beam.transforms.userstate import BagStateSpec, ReadModifyWriteStateSpec
from apache_beam.utils.timestamp import Timestamp

from transforms.state_coders import MicroBatchCoder
from transforms.types import BatchId, MicroBatch


def ms_ceiling(t: Timestamp) -> Timestamp:
    """A timer's time rounded up to the millisecond: portable runners (FnApiRunner; Dataflow's
    runner v2 speaks the same Fn API) deliver a timer's timestamp in milliseconds. A prune that
    compared a microsecond expiry with the truncated firing time found nothing expired and set the
    same timer again, for ever (seen on FnApiRunner)."""
    return Timestamp(micros=-(-t.micros // 1000) * 1000)


def regroup(item, awaits: int, header_state, verdicts,
            pending_state) -> Optional[tuple[MicroBatch, list]]:
    """One arrival at a regroup by batch id (``RegroupFn``): the header (a ``MicroBatch``, which
    awaits ``awaits`` verdicts) or one verdict, in any order.
    Returns (the header, every verdict) once all are in, its state cleared; else None, the arrival
    kept. ``pending_state`` counts what is still missing in one small cell (the header adds what
    it awaits, each verdict takes one away; it is 0 only when both are complete), so an arrival
    reads one small cell and appends to a bag; the header and the verdicts are read once, at the
    end."""
    header = item if isinstance(item, MicroBatch) else None
    pending = (pending_state.read() or 0) + (awaits if header is not None else -1)
    if pending:
        pending_state.write(pending)
        if header is not None:
            header_state.write(header)
        else:
            verdicts.add(tuple(item))
        return None
    every = list(verdicts.read()) + ([] if header is not None else [tuple(item)])
    header = header or header_state.read()
    header_state.clear()
    verdicts.clear()
    pending_state.clear()
    return header, every


def by_batch(label: str, headers, arrivals):
    """What a ``RegroupFn`` step regroups: the headers and the arrivals, one PCollection keyed by
    batch id."""
    return (headers, arrivals) | label >> beam.Flatten().with_output_types(tuple[BatchId, Any])


class RegroupFn(beam.DoFn):
    """The base of a step that regroups a micro-batch by its batch id (``transforms.dedup``'s and
    ``transforms.stories``' streaming steps): per batch id, the header and the verdicts, in any
    order, in three state cells (``header``; the verdicts, a bag of the subclass's; ``pending``),
    read by ``regroup``. A subclass names its bag and makes its ``process`` with it::

        VERDICTS = BagStateSpec("verdicts", coder)
        process = RegroupFn.processing(VERDICTS)

    and says how many verdicts a header awaits (``awaits``) and what a complete micro-batch gives
    (``complete``); one whose arrivals are not plain headers and verdicts unpacks them
    (``arrival``)."""

    HEADER = ReadModifyWriteStateSpec("header", MicroBatchCoder())
    PENDING = ReadModifyWriteStateSpec("pending", VarIntCoder())

    def awaits(self, header: MicroBatch) -> int:
        raise NotImplementedError

    def arrival(self, item, verdicts) -> tuple[Any, int]:  # pylint: disable=unused-argument
        """(the header, what it awaits) or (one verdict, 0)."""
        return (item, self.awaits(item)) if isinstance(item, MicroBatch) else (item, 0)

    def complete(self, header: MicroBatch, verdicts: list) -> Iterable:
        raise NotImplementedError

    @staticmethod
    def processing(verdicts_spec: BagStateSpec) -> Callable:
        """A subclass's ``process``, its verdicts in ``verdicts_spec`` (Beam reads a step's state
        cells from its ``process``' defaults)."""
        def process(self, element, header_state=beam.DoFn.StateParam(RegroupFn.HEADER),
                    verdicts=beam.DoFn.StateParam(verdicts_spec),
                    pending_state=beam.DoFn.StateParam(RegroupFn.PENDING)):
            item, awaits = self.arrival(element[1], verdicts)
            done = regroup(item, awaits, header_state, verdicts, pending_state)
            if done is not None:
                yield from self.complete(*done)
        return process
