"""The previous outputs' keys in a worker process: 17 bytes a key, loaded once per process.

``SkipUnchanged`` asks, for each article, whether its key (32 hex, ``embedding_key``) is in the
key index of any previous output, and which. Held as a Python dict of str, a key costs about 123
bytes, and as a Beam side input that dict was decoded again for every bundle on every harness
thread. Here a key is its 16 raw bytes as two ``uint64`` (``hi`` sorted, ``lo`` beside it) plus the
position of the output that holds it (``source``, a small int): 17 bytes, about 170 MB for 10
million keys, once per process. A lookup is a binary search of ``hi`` and an exact compare of
``lo``: no false positive, about a microsecond.

The key files are read with pyarrow a record batch at a time and decoded without a Python loop:
the Arrow string column's data buffer, 32 bytes a key, viewed as an ``(n, 32)`` array of ASCII and
turned into nibbles by arithmetic on whole arrays. A ``ProcessCache`` (``transforms.incremental``
holds one) keeps one index per set of files in the process, built once, in a thread of its own,
whichever DoFn instance, bundle or harness thread asks first; the others wait for the same build.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Callable, Hashable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from transforms.output.layout import open_output_file, output_of

KEY_HEX_CHARS = 32
_BATCH_ROWS = 1 << 20  # rows decoded at a time: about 100 MB of temporaries, whatever the file

class MissingKeyFile(FileNotFoundError):
    """A key file named when the index was asked for is no longer there."""

    def __init__(self, path: str, group: int):
        super().__init__(path)
        self.path, self.group = path, group


def hex_keys_to_words(keys: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """An Arrow array of 32-hex keys -> (hi, lo): the 16 bytes of each as two big-endian uint64."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if pa.types.is_large_string(keys.type) or pa.types.is_string_view(keys.type):
        keys = keys.cast(pa.string())
    n = len(keys)
    if n == 0:
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    if keys.null_count or not pc.all(pc.equal(pc.binary_length(keys), KEY_HEX_CHARS)).as_py():
        raise ValueError("a key index holds a key that is not 32 hex characters")
    offsets = np.frombuffer(keys.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * keys.offset)
    start = int(offsets[0])  # every key 32 bytes: the keys lie one after the other from here
    ascii_ = np.frombuffer(keys.buffers()[2], dtype=np.uint8, count=n * KEY_HEX_CHARS,
                           offset=start).reshape(n, KEY_HEX_CHARS)
    lower = ascii_ | 0x20  # digits have the bit already
    if not (((ascii_ >= 48) & (ascii_ <= 57)) | ((lower >= 97) & (lower <= 102))).all():
        raise ValueError("a key index holds a key that is not 32 hex characters")
    nibbles = (ascii_ & 0x0F) + 9 * (ascii_ >> 6)  # '0'-'9' -> 0-9, 'a'-'f' and 'A'-'F' -> 10-15
    raw = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]  # (n, 16) bytes
    words = raw.view(">u8")  # (n, 2) big-endian: the order of the hex strings
    return words[:, 0].astype(np.uint64), words[:, 1].astype(np.uint64)


def hex_key_to_words(key: str) -> tuple[int, int]:
    """One 32-hex key -> (hi, lo), as ``hex_keys_to_words`` gives them."""
    if len(key) != KEY_HEX_CHARS:
        raise ValueError(f"not a 32-hex key: {key!r}")
    return int(key[:16], 16), int(key[16:], 16)


def _key_batches(output: str, path: str) -> Iterator[pa.Array]:
    with open_output_file(output, path) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=_BATCH_ROWS, columns=["key"]):
            yield batch.column(0)


class KeyIndex:
    """Keys, each with the position (``source``) of the group of files it was read from."""

    def __init__(self, hi: np.ndarray, lo: np.ndarray, source: np.ndarray):
        self.hi, self.lo, self.source = hi, lo, source
        self.load_s = 0.0  # how long ``build`` took

    @classmethod
    def build(cls, groups: Sequence[Sequence[str]],
              outputs: Optional[Sequence[str]] = None) -> "KeyIndex":
        """The keys of each group of Parquet files (``key`` column); group i gives source i, the
        files of output ``outputs[i]`` (without, each file's own: ``layout.output_of``). Each
        file is opened by ``layout.open_output_file``: a symlink or a FIFO in place of one is an
        ``UnsafePath`` naming it, never read or waited on. A file that is not there raises
        ``MissingKeyFile``."""
        his: list[np.ndarray] = []
        los: list[np.ndarray] = []
        sources: list[np.ndarray] = []
        source_type = np.min_scalar_type(max(len(groups) - 1, 0))
        for group, paths in enumerate(groups):
            for path in paths:
                try:
                    output = outputs[group] if outputs is not None else output_of(path)
                    for keys in _key_batches(output, path):
                        hi, lo = hex_keys_to_words(keys)
                        his.append(hi)
                        los.append(lo)
                        sources.append(np.full(len(hi), group, dtype=source_type))
                except FileNotFoundError as exc:
                    raise MissingKeyFile(path, group) from exc
                except OSError as exc:  # GCS and some local errors do not say FileNotFound
                    if FileSystems.exists(path):
                        raise
                    raise MissingKeyFile(path, group) from exc
        if not his:
            empty = np.empty(0, np.uint64)
            return cls(empty, empty, np.empty(0, source_type))
        hi = np.concatenate(his)
        his.clear()
        order = np.argsort(hi)  # keys equal in hi need no order: ``lookup`` compares each
        hi = hi[order]
        lo = np.concatenate(los)[order]
        los.clear()
        source = np.concatenate(sources)[order]
        return cls(hi, lo, source)

    def __len__(self) -> int:
        return len(self.hi)

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes + self.source.nbytes

    def lookup(self, key: str) -> Optional[int]:
        """The source of ``key`` (32 hex), or None: exact, the whole 16 bytes compared."""
        hi, lo = hex_key_to_words(key)
        i = int(np.searchsorted(self.hi, np.uint64(hi)))
        while i < len(self.hi) and int(self.hi[i]) == hi:  # equal hi: the same key in two outputs
            if int(self.lo[i]) == lo:
                return int(self.source[i])
            i += 1
        return None


class ProcessCache:
    """Values built once per process per key, in a thread of their own, shared by every thread
    that asks (the first starts the build, the others wait for it). A failed build is raised to
    those waiting for it and forgotten: the retry of a bundle builds again (a read that failed
    for a moment may work). Only the latest ``size`` keys are kept: a worker serves one job."""

    def __init__(self, size: int = 2):
        self._size = size
        self._lock = threading.Lock()
        self._futures: collections.OrderedDict[Hashable, concurrent.futures.Future] = (
            collections.OrderedDict())
        self.builds = 0  # how many builds this process started: tests read it

    def start(self, key: Hashable, build: Callable[[], object]) -> concurrent.futures.Future:
        """The build of ``key``'s value, started now unless it already was."""
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            future = concurrent.futures.Future()
            self._futures[key] = future
            while len(self._futures) > self._size:
                self._futures.popitem(last=False)
            self.builds += 1

        def run():
            try:
                future.set_result(build())
            except BaseException as exc:  # pylint: disable=broad-except  # raised to each caller
                with self._lock:
                    if self._futures.get(key) is future:
                        del self._futures[key]
                future.set_exception(exc)

        threading.Thread(target=run, name="newsvec-key-index", daemon=True).start()
        return future

    def get(self, key: Hashable, build: Callable[[], object]):
        return self.start(key, build).result()

    def clear(self) -> None:
        with self._lock:
            self._futures.clear()
