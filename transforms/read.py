"""Read: JSON Lines files (a glob, local or gs://, gzip by extension) -> one element per line.

Unlike ``ReadFromText``, which holds each line whole, a line is never buffered past
``max_line_bytes``: a longer one (a 20 MB body) becomes an ``OversizedPayload`` holding its head and
its size, which Parse dead-letters as ``payload_too_large``. Memory per reader stays bounded by
``max_line_bytes`` plus one read chunk.

Reading one file is serial (a gzip file cannot be split); everything after it is not: the lines
are redistributed (``Reshuffle``) as soon as they are read, so parsing, preparing and embedding
spread over every worker and core, even for a day in one large ``.jsonl.gz``.
"""
from __future__ import annotations

import io
from typing import BinaryIO, Iterator, Union

import apache_beam as beam
from apache_beam.io import fileio
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from transforms.schema import OversizedPayload

CHUNK_BYTES = 1 << 16


def iter_lines(f: BinaryIO, max_line_bytes: int,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[Union[bytes, OversizedPayload]]:
    """Each line of ``f`` without its line ending (``\\n`` or ``\\r\\n``), as ``ReadFromText``
    splits them (a final newline does not start an empty line). A line over ``max_line_bytes`` is
    yielded as an ``OversizedPayload`` of its first ``max_line_bytes`` bytes; the rest is skipped
    as it is read, never kept."""
    buffer = bytearray()
    skipped = 0  # bytes of an over-long line dropped so far; 0 while the line fits
    pending = False  # a line has started and not yet been yielded
    while True:
        chunk = f.read(chunk_bytes)
        if not chunk:
            break
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            pending = True
            if skipped:
                skipped += len(piece)
            else:
                room = max_line_bytes + 1 - len(buffer)  # +1: a trailing \r may still be stripped
                buffer += piece[:room]
                if len(piece) > room:
                    skipped = len(buffer) + len(piece) - room
            if end < 0:
                break
            yield _finish(buffer, skipped, max_line_bytes)
            buffer, skipped, pending = bytearray(), 0, False
            start = end + 1
    if pending:
        yield _finish(buffer, skipped, max_line_bytes)


def _finish(buffer: bytearray, skipped: int, max_line_bytes: int) -> Union[bytes, OversizedPayload]:
    if not skipped and buffer.endswith(b"\r"):
        del buffer[-1:]
    size = skipped or len(buffer)
    if size > max_line_bytes:
        return OversizedPayload(head=bytes(buffer[:max_line_bytes]), size=size)
    return bytes(buffer)


class _ReadLinesFn(beam.DoFn):
    def __init__(self, max_line_bytes: int):
        self._max_line_bytes = max_line_bytes

    def process(self, readable: fileio.ReadableFile):
        with readable.open(compression_type=CompressionTypes.AUTO) as f:
            yield from iter_lines(f, self._max_line_bytes)


class ReadJsonLines(beam.PTransform):
    """A glob of JSON Lines files -> bytes per line, or ``OversizedPayload`` past the limit.
    A glob that matches nothing fails the job (``EmptyMatchTreatment.DISALLOW``)."""

    def __init__(self, pattern: str, max_line_bytes: int):
        super().__init__()
        self._pattern, self._max_line_bytes = pattern, max_line_bytes

    def expand(self, pbegin):
        return (pbegin
                | "Match" >> fileio.MatchFiles(self._pattern,
                                               fileio.EmptyMatchTreatment.DISALLOW)
                | "Open" >> fileio.ReadMatches()
                | "SpreadFiles" >> beam.Reshuffle()
                | "ReadLines" >> beam.ParDo(_ReadLinesFn(self._max_line_bytes))
                | "SpreadLines" >> beam.Reshuffle())


def count_nonblank_lines(f: Union[BinaryIO, io.BufferedIOBase],
                         chunk_bytes: int = CHUNK_BYTES) -> int:
    """Lines of ``f`` that hold more than ASCII whitespace (as ``bytes.strip`` sees it), split at
    ``\n``, read ``chunk_bytes`` at a time: one chunk is all it holds, however long a line."""
    total = 0
    pending = False  # the line read so far holds a non-blank byte
    while True:
        chunk = f.read(chunk_bytes)
        if not chunk:
            break
        *complete, last = chunk.split(b"\n")
        for piece in complete:  # each ends a line
            total += pending or bool(piece.strip())
            pending = False
        pending = pending or bool(last.strip())
    return total + pending


def count_lines(pattern: str) -> int:
    """Non-blank lines (articles) in the files a glob matches, local or gs://, .gz or not: the
    total a progress report counts toward. Memory: one read chunk, whatever the lines' length."""
    import gzip

    total = 0
    for match in FileSystems.match([pattern])[0].metadata_list:
        with FileSystems.open(match.path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            f = gzip.GzipFile(fileobj=raw) if match.path.endswith(".gz") else raw
            total += count_nonblank_lines(f)
    return total
