"""ReadJsonLines / iter_lines: lines as ReadFromText splits them, and no line buffered past the
limit."""
from __future__ import annotations

import gzip
import io
import tracemalloc

import apache_beam as beam
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import given, settings
from hypothesis import strategies as st

from transforms import read
from transforms.read import ReadJsonLines, count_lines, iter_lines
from transforms.types import OversizedPayload


def _reference(data: bytes) -> list[bytes]:
    """ReadFromText's split: on \\n, a trailing \\r stripped, no empty line after a final \\n."""
    if not data:
        return []
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400).map(lambda b: b.replace(b"\x00", b"\n")),
       chunk=st.integers(1, 17))
def test_lines_match_readfromtext_whatever_the_chunking(data, chunk):
    assert list(iter_lines(io.BytesIO(data), max_line_bytes=10_000, chunk_bytes=chunk)) == \
        _reference(data)


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b),
                      min_size=1, max_size=8),
       limit=st.integers(1, 20), chunk=st.integers(1, 9))
def test_a_line_over_the_limit_is_its_head_and_size(lines, limit, chunk):
    got = list(iter_lines(io.BytesIO(b"\n".join(lines) + b"\n"), limit, chunk_bytes=chunk))
    assert len(got) == len(lines)
    for line, item in zip(lines, got, strict=True):
        if len(line) > limit:
            assert item == OversizedPayload(head=line[:limit], size=len(line))
        else:
            assert item == line


def test_a_20_mb_line_is_never_held_whole(tmp_path):
    path = tmp_path / "big.jsonl"
    body = b"x" * (20 << 20)
    path.write_bytes(b'{"id": "a", "body": "ok"}\n{"id": "big", "body": "' + body + b'"}\n'
                     b'{"id": "b", "body": "ok"}\n')
    tracemalloc.start()
    try:
        with open(path, "rb") as f:
            got = list(iter_lines(f, max_line_bytes=1 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [type(g) for g in got] == [bytes, OversizedPayload, bytes]
    assert got[1].size == len(body) + len(b'{"id": "big", "body": ""}')
    assert got[1].head.startswith(b'{"id": "big"') and len(got[1].head) == 1 << 20
    assert peak < 4 << 20, f"peak {peak} bytes: the line was buffered"


def test_read_json_lines_reads_plain_and_gzip_files_of_a_glob(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"one\r\ntwo\n\nthree")
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(b"four\n" + b"y" * 50 + b"\n")
    with beam.Pipeline("FnApiRunner") as p:
        lines = p | ReadJsonLines(str(tmp_path / "*.jsonl*"), max_line_bytes=20)
        assert_that(lines, equal_to([b"one", b"two", b"", b"three", b"four",
                                     OversizedPayload(head=b"y" * 20, size=50)]))


def test_an_oversized_line_reaches_the_dead_letters_with_its_real_size(tmp_path):
    from transforms.parse import ParseEvents

    big = b'{"id": "big", "body": "' + b"z" * 5000 + b'"}'
    (tmp_path / "in.jsonl").write_bytes(b'{"id": "a", "body": "fine"}\n' + big + b"\n")
    with beam.Pipeline("FnApiRunner") as p:
        parsed = (p | ReadJsonLines(str(tmp_path / "in.jsonl"), max_line_bytes=1000)
                  | ParseEvents(max_payload_bytes=1000, dead_letter_payload_bytes=64))
        assert_that(parsed.events | beam.Map(lambda e: e.id), equal_to(["a"]), label="events")
        assert_that(parsed.dead_letter | beam.Map(lambda d: (d.reason, d.payload_bytes,
                                                             d.payload)),
                    equal_to([("payload_too_large", len(big), big[:64].decode())]),
                    label="dead letters")


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300).map(
    lambda b: b.replace(b"\x00", b"\n").replace(b"\x01", b" ")), chunk=st.integers(1, 17))
def test_count_nonblank_lines_counts_as_reading_whole_lines_did(data, chunk):
    """The launcher's count (progress bar, ``newsvec backfill``) is what ``for line in f: if
    line.strip()`` gave, whatever the chunking."""
    want = sum(1 for line in io.BytesIO(data) if line.strip())
    assert read.count_nonblank_lines(io.BytesIO(data), chunk_bytes=chunk) == want


def test_count_lines_holds_one_chunk_however_long_the_line(tmp_path):
    """A small .gz of one huge line (64 MiB of text in 64 KB) costs the launcher one read chunk, not
    the line: the count never holds a whole line."""
    line = b"x" * (64 << 20)
    with gzip.open(tmp_path / "huge.jsonl.gz", "wb", compresslevel=1) as f:
        f.write(b'{"id": "a"}\n \t\n' + line + b"\n" + b'{"id": "b"}')
    (tmp_path / "plain.jsonl").write_bytes(b'{"id": "c"}\n\n')
    assert (tmp_path / "huge.jsonl.gz").stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        total = count_lines(str(tmp_path / "*.jsonl*"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == 4, "a, the huge line, b and c; blank lines are not articles"
    assert peak < 4 << 20, f"peak {peak} bytes: a line was held whole"


def _compressed(fmt: str, chunks, *, streams: int = 1) -> bytes:
    """``chunks`` (bytes, in pieces) compressed as ``fmt`` (a file extension), in ``streams``
    streams one after another (gzip members, zstd frames...)."""
    import bz2
    import lzma
    import zlib

    import zstandard

    makers = {
        "gz": lambda: zlib.compressobj(6, zlib.DEFLATED, zlib.MAX_WBITS | 16),
        "deflate": lambda: zlib.compressobj(6, zlib.DEFLATED, zlib.MAX_WBITS),
        "bz2": lambda: bz2.BZ2Compressor(9),
        "xz": lambda: lzma.LZMACompressor(preset=0),
        "lzma": lambda: lzma.LZMACompressor(format=lzma.FORMAT_ALONE, preset=0),
        "zst": lambda: zstandard.ZstdCompressor().compressobj(),
    }
    pieces = list(chunks)
    out = []
    for i in range(streams):
        compressor = makers[fmt]()
        out += [compressor.compress(p) for p in pieces[i::streams]] + [compressor.flush()]
    return b"".join(out)


FORMATS = ["gz", "deflate", "bz2", "xz", "lzma", "zst"]


def test_compressed_files_read_as_beams_own_reader_reads_them(tmp_path):
    """Every extension Beam's CompressionTypes.AUTO knows, one stream or several one after
    another: the same lines as through Beam's reader, and count_lines counts them; a truncated
    file is an error, not a silent end."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    data = [b'{"id": "a"}\n', b"\n", b'{"id": "b", "body": "' + b"y" * 3000 + b'"}\r\n',
            b"tail without a newline"]
    paths = {}
    for fmt in FORMATS:
        for streams in (1, 2):
            path = paths[fmt, streams] = str(tmp_path / f"in-{streams}.jsonl.{fmt}")
            with open(path, "wb") as f:
                f.write(_compressed(fmt, data, streams=streams))
    counts = {key: count_lines(path) for key, path in paths.items()}
    assert all(count == 3 for count in counts.values()), counts
    for (fmt, streams), path in paths.items():
        with FileSystems.open(path, compression_type=CompressionTypes.AUTO) as f:
            want = list(iter_lines(f, 1000))
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as raw:
            got = list(iter_lines(read.open_decompressed(raw, path), 1000))
        assert got == want and len(got) == 4, (fmt, streams, got)
    whole = _compressed("gz", data)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    try:
        count_lines(str(tmp_path / "cut.jsonl.gz"))
    except EOFError as exc:
        assert "cut.jsonl.gz ends inside a compressed stream" in str(exc)
    else:
        raise AssertionError("a truncated .gz was read as if whole")


_BOMB_READER = """
import json, resource, sys
from apache_beam.io import fileio
from apache_beam.io.filesystems import FileSystems
from transforms.read import _ReadLinesFn, count_lines

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

for path in sys.argv[1:]:
    before = peak_mib()
    (metadata,) = FileSystems.match([path])[0].metadata_list
    lines = [getattr(x, "size", x) for x in _ReadLinesFn(1 << 20).process(
        fileio.ReadableFile(metadata))]
    lines = [x if isinstance(x, int) else x.decode() for x in lines]
    print(json.dumps({"format": path.rsplit(".", 1)[-1], "lines": lines,
                      "count": count_lines(path), "growth_mib": round(peak_mib() - before)}),
          flush=True)
"""


def test_a_decompression_bomb_costs_the_reader_one_chunk(tmp_path):
    """A small file of one 128 MiB line, in every format: the batch reader and the launcher's
    count hold a chunk of it at a time (peak memory of a separate process, formats one after
    another), not the decompressed line (Beam's own reader decompresses a 16 MiB read whole)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    block = b"a" * (1 << 20)
    paths = []
    for fmt in ["gz", "bz2", "xz", "zst", "deflate"]:
        path = tmp_path / f"bomb.jsonl.{fmt}"
        path.write_bytes(_compressed(fmt, [block] * 128 + [b'\n{"id": "b"}\n']))
        assert path.stat().st_size < 1 << 20
        paths.append(str(path))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _BOMB_READER, *paths], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["format"]: r for r in map(json.loads, done.stdout.split("\n")[:-1])}
    assert set(results) == {"gz", "bz2", "xz", "zst", "deflate"}, done.stdout
    growth = {fmt: result["growth_mib"] for fmt, result in results.items()}
    assert all(mib < 48 for mib in growth.values()), f"peak memory grew (MiB): {growth}"
    for result in results.values():
        assert result["lines"] == [128 << 20, '{"id": "b"}'] and result["count"] == 2, result
