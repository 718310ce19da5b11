"""What the streaming steps that keep state per key (``transforms.dedup``, ``transforms.stories``)
share: a timer's time as the portable runners deliver it (``ms_ceiling``), and a micro-batch
regrouped by its id from its header and its verdicts, arriving in any order (``regroup``).
"""
from __future__ import annotations

from typing import Callable, Optional

from apache_beam.utils.timestamp import Timestamp

from transforms.types import MicroBatch


def ms_ceiling(t: Timestamp) -> Timestamp:
    """A timer's time rounded up to the millisecond: portable runners (FnApiRunner; Dataflow's
    runner v2 speaks the same Fn API) deliver a timer's timestamp in milliseconds. A prune that
    compared a microsecond expiry with the truncated firing time found nothing expired and set the
    same timer again, for ever (seen on FnApiRunner)."""
    return Timestamp(micros=-(-t.micros // 1000) * 1000)


def regroup(item, expected: Callable[[MicroBatch], int], header_state, verdicts,
            pending_state) -> Optional[tuple[MicroBatch, list]]:
    """One arrival at a regroup by batch id (``transforms.dedup``'s, ``transforms.stories``'): the
    header (a ``MicroBatch``, which awaits ``expected(header)`` verdicts) or one verdict, in any
    order.
    Returns (the header, every verdict) once all are in, its state cleared; else None, the arrival
    kept. ``pending_state`` counts what is still missing in one small cell (the header adds what
    it awaits, each verdict takes one away; it is 0 only when both are complete), so an arrival
    reads one small cell and appends to a bag; the header and the verdicts are read once, at the
    end."""
    header = item if isinstance(item, MicroBatch) else None
    pending = (pending_state.read() or 0) + (expected(header) if header is not None else -1)
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
