"""Read: JSON Lines files (a glob, local or gs://, compressed by extension) -> one element per line.

Unlike ``ReadFromText``, which holds each line whole, a line is never buffered past
``max_line_bytes``: a longer one (a 20 MB body) becomes an ``OversizedPayload`` holding its head and
its size, which Parse dead-letters as ``payload_too_large``. Memory per reader stays bounded by
``max_line_bytes`` plus one read chunk, compressed files included: they are decompressed as they
are read, one chunk of output at a time (``open_decompressed``; Beam's own reader decompresses a
16 MiB read of compressed input whole, so a small file of a highly compressible line, a
"decompression bomb", held gigabytes).

Reading one file is serial (a gzip file cannot be split); everything after it is not: the lines
are redistributed (``Reshuffle``) as soon as they are read, so parsing, preparing and embedding
spread over every worker and core, even for a day in one large ``.jsonl.gz``.
"""
from __future__ import annotations

import bz2
import lzma
import zlib
from typing import IO, Callable, Iterator, Protocol, Union, cast

import apache_beam as beam
from apache_beam.io import fileio
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from transforms.types import OversizedPayload

CHUNK_BYTES = 1 << 16
# Compressed input read at a time, and the most memory a decompressor may hold of its own: an xz
# or lzma file declares the dictionary it needs (up to 4 GiB), a zstd frame its window (zstd's own
# default limit, 128 MiB: a file made with --long=28 or more is refused).
_COMPRESSED_READ_BYTES = 1 << 16
_MAX_DECOMPRESSOR_MEMORY = 1 << 27


class Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


class _ZlibDecompressor:
    """zlib's decompressor (gzip or zlib streams) with the interface of bz2's and lzma's:
    ``decompress(data, max_length)``, ``needs_input``, ``eof``, ``unused_data``."""

    def __init__(self, wbits: int):
        self._d = zlib.decompressobj(wbits)
        self.needs_input = True

    @property
    def eof(self) -> bool:
        return self._d.eof

    @property
    def unused_data(self) -> bytes:
        return self._d.unused_data

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._d.decompress(self._d.unconsumed_tail + data, max_length)
        self.needs_input = not self._d.unconsumed_tail and len(out) < max_length
        return out


class _Decompressing:
    """The decompressed bytes of ``raw``, at most ``size`` bytes of output at a time, whatever the
    compressed input holds; streams one after another are read as one (as Beam reads them: a
    .gz of several members, a concatenated .bz2). Compressed data that ends inside a stream (a
    truncated file) is an ``EOFError``."""

    def __init__(self, raw: Readable, new_decompressor: Callable, name: str):
        self._raw, self._new, self._name = raw, new_decompressor, name
        self._d = new_decompressor()
        self._fed = False  # the current stream has been given input

    def read(self, size: int = CHUNK_BYTES) -> bytes:
        size = size if size and size > 0 else CHUNK_BYTES
        while True:
            if self._d.eof:  # a stream ended: another may follow
                data = self._d.unused_data or self._raw.read(_COMPRESSED_READ_BYTES)
                if not data:
                    return b""
                self._d, self._fed = self._new(), False
            elif self._d.needs_input:
                data = self._raw.read(_COMPRESSED_READ_BYTES)
                if not data:
                    if self._fed:
                        raise EOFError(f"{self._name} ends inside a compressed stream: the file "
                                       f"is truncated")
                    return b""
            else:
                data = b""
            self._fed = True
            out = self._d.decompress(data, size)
            if out:
                return out


def open_decompressed(raw: Readable, path: str) -> Readable:
    """``raw`` (a file opened ``UNCOMPRESSED``) decompressed as Beam's ``CompressionTypes.AUTO``
    would for ``path`` (by its extension: .gz, .bz2, .deflate, .zst/.zstd, .xz/.lzma; any other
    is read as it is), one bounded read of output at a time."""
    kind = CompressionTypes.detect_compression_type(path)
    if kind == CompressionTypes.GZIP:
        return _Decompressing(raw, lambda: _ZlibDecompressor(zlib.MAX_WBITS | 16), path)
    if kind == CompressionTypes.DEFLATE:
        return _Decompressing(raw, lambda: _ZlibDecompressor(zlib.MAX_WBITS), path)
    if kind == CompressionTypes.BZIP2:
        return _Decompressing(raw, bz2.BZ2Decompressor, path)
    if kind == CompressionTypes.LZMA:
        return _Decompressing(
            raw, lambda: lzma.LZMADecompressor(memlimit=_MAX_DECOMPRESSOR_MEMORY), path)
    if kind == CompressionTypes.ZSTD:
        import zstandard  # Beam's own zstd dependency

        return zstandard.ZstdDecompressor(max_window_size=_MAX_DECOMPRESSOR_MEMORY).stream_reader(
            cast(IO[bytes], raw), read_size=_COMPRESSED_READ_BYTES, read_across_frames=True,
            closefd=False)
    return raw


def iter_lines(f: Readable, max_line_bytes: int,
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
        with readable.open(compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            yield from iter_lines(open_decompressed(raw, readable.metadata.path),
                                  self._max_line_bytes)


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


def count_nonblank_lines(f: Readable, chunk_bytes: int = CHUNK_BYTES) -> int:
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
    """Non-blank lines (articles) in the files a glob matches, local or gs://, compressed or not
    (as ``ReadJsonLines`` reads them): the total a progress report counts toward. Memory: one read
    chunk, whatever the lines' length."""
    total = 0
    for match in FileSystems.match([pattern])[0].metadata_list:
        with FileSystems.open(match.path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            total += count_nonblank_lines(open_decompressed(raw, match.path))
    return total
