"""The previous outputs' keys in a worker process (transforms/output/key_index.py, and its use by
SkipUnchanged in transforms/incremental.py): exact lookups with no false positive on near keys,
each key mapped to the output that holds it, a key file gone -> SnapshotChanged, and one load per
process whatever the number of DoFn instances, bundles and threads. No engine: keys only."""
from __future__ import annotations

import copy
import os
import pickle
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from transforms import incremental
from transforms.incremental import (
    SKIPPED_FROM,
    UNCHANGED,
    KeyFiles,
    embedding_key,
    key_index,
)
from transforms.output.key_index import KeyIndex, ProcessCache, hex_key_to_words, hex_keys_to_words
from transforms.output.manifest import Snapshot, SnapshotChanged
from transforms.output.parquet import key_schema
from transforms.types import NewsEvent, PreparedDoc

LABEL, SIGNATURE = "model@test", "{}"


def key_of(doc_id: str, text: str = "t") -> str:
    return embedding_key(doc_id, text, LABEL, SIGNATURE)


def write_keys(path, keys: list[str]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    none = [None] * len(keys)  # written with near duplicates off
    table = pa.table({"key": keys, "id": [f"i{n}" for n in range(len(keys))],
                      "text_sha256": ["0" * 64] * len(keys), "story_id": none,
                      "minhash": none, "minhash_version": none, "story_facts": none},
                     schema=key_schema())
    pq.write_table(table, path)
    return str(path)


def flip(key: str, position: int) -> str:
    """``key`` with one hex digit changed: a near key."""
    digit = "0" if key[position] != "0" else "1"
    return key[:position] + digit + key[position + 1:]


def test_hex_decoding_matches_python_on_sliced_and_chunked_arrays():
    keys = [key_of(f"d{i}") for i in range(50)] + ["0" * 32, "f" * 32, "ABCDEF" + "0" * 26]
    array = pa.chunked_array([pa.array(keys[:20]), pa.array(keys[20:])]).combine_chunks()[7:]
    hi, lo = hex_keys_to_words(array)
    assert [(int(h), int(l_)) for h, l_ in zip(hi, lo, strict=True)] == [
        hex_key_to_words(k) for k in keys[7:]]
    assert int(hi[-1]) == int("ABCDEF0000000000", 16)
    with pytest.raises(ValueError):
        hex_keys_to_words(pa.array(["g" * 32]))
    with pytest.raises(ValueError):
        hex_keys_to_words(pa.array(["ab" * 15]))


def test_lookups_are_exact_no_false_positive_on_near_keys(tmp_path):
    keys = [key_of(f"d{i}") for i in range(1000)]
    index = KeyIndex.build([[write_keys(tmp_path / "a.parquet", keys)]])
    assert len(index) == 1000 and index.nbytes == 1000 * 17
    assert all(index.lookup(k) == 0 for k in keys)
    for key in keys[:50]:
        # the same first 16 hex (hi) or the same last 16 (lo): only the whole key matches
        assert index.lookup(flip(key, 31)) is None and index.lookup(flip(key, 0)) is None
    assert index.lookup(key_of("absent")) is None
    assert KeyIndex.build([]).lookup(keys[0]) is None


def test_keys_of_several_outputs_map_to_the_output_that_holds_them(tmp_path):
    shared = key_of("in-both")
    groups = [[write_keys(tmp_path / "a1.parquet", [key_of("a1"), shared]),
               write_keys(tmp_path / "a2.parquet", [key_of("a2")])],
              [],  # an output with no key yet
              [write_keys(tmp_path / "c.parquet", [key_of("c"), shared, key_of("c2")])]]
    # the same 16 first hex digits in two outputs, the rest different
    twin = shared[:16] + ("0" * 16 if shared[16:] != "0" * 16 else "1" * 16)
    groups[1].append(write_keys(tmp_path / "b.parquet", [twin]))
    index = KeyIndex.build(groups)
    assert [index.lookup(key_of(i)) for i in ("a1", "a2", "c", "c2")] == [0, 0, 2, 2]
    assert index.lookup(twin) == 1 and index.lookup(shared) in (0, 2)


def test_a_key_file_gone_since_the_keys_were_resolved_is_a_changed_snapshot(tmp_path):
    # Each output's key files under it, as ReadKeys lists them: each is read below its output.
    present = write_keys(tmp_path / "out-a" / "keys" / "a.parquet", [key_of("a")])
    gone = tmp_path / "out-b" / "keys" / "gone.parquet"
    files = KeyFiles((Snapshot(str(tmp_path / "out-a"), "run-1"),
                      Snapshot(str(tmp_path / "out-b"), "run-7")),
                     ((present,), (str(gone),)))
    with pytest.raises(SnapshotChanged, match="out-b \\(run run-7\\) was republished"):
        key_index(files)
    streaming = KeyFiles((Snapshot(str(tmp_path / "stream"), None),),
                         ((str(tmp_path / "stream" / "keys" / "compacted-away.parquet"),),))
    with pytest.raises(SnapshotChanged, match="stream was compacted"):
        key_index(streaming)
    # A failed load is not kept: the bundle's retry loads again (here the file is back).
    write_keys(gone, [key_of("b")])
    assert key_index(files).lookup(key_of("b")) == 1


def test_one_load_per_process_across_dofn_instances_bundles_and_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(incremental, "_INDEXES", ProcessCache())
    path = write_keys(tmp_path / "keys" / "k.parquet", [key_of("old")])
    files = KeyFiles((Snapshot(str(tmp_path), "run-1"),), ((path,),))
    loads = []
    build = KeyIndex.build
    monkeypatch.setattr(KeyIndex, "build", classmethod(
        lambda cls, groups, outputs=None: loads.append(groups) or build(groups, outputs)))
    doc_old, doc_new = (PreparedDoc(event=NewsEvent(id=i, body="x"), text="x", text_sha256="t",
                                    token_ids=(1,), truncated=False) for i in ("old", "new"))
    fns = [pickle.loads(pickle.dumps(incremental._SkipFn(LABEL, SIGNATURE))) for _ in range(3)]
    outputs: list = []

    def bundles(fn):
        for _ in range(3):
            fn.start_bundle()
            # Beam decodes the side input again for each bundle: an equal object, not the same
            fresh = copy.deepcopy(files)
            outputs.extend(fn.process(doc_old, fresh))
            outputs.extend(fn.process(doc_new, fresh))
            fn.finish_bundle()

    threads = [threading.Thread(target=bundles, args=(fn,)) for fn in fns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(loads) == 1 and incremental._INDEXES.builds == 1
    unchanged = [o.value for o in outputs if getattr(o, "tag", None) == UNCHANGED]
    embedded = [o for o in outputs if isinstance(o, PreparedDoc)]
    snapshots = [o.value for o in outputs if getattr(o, "tag", None) == SKIPPED_FROM]
    assert unchanged == ["old"] * 9 and [d.id for d in embedded] == ["new"] * 9
    assert snapshots == [0] * 9, "named (by its position in the side input) once per bundle"


def test_the_index_of_ten_thousand_random_keys_against_a_python_set(tmp_path):
    rng = np.random.default_rng(3)
    keys = [bytes(row).hex() for row in rng.integers(0, 256, (10_000, 16), dtype=np.uint8)]
    index = KeyIndex.build([[write_keys(tmp_path / "a.parquet", keys[:5000])],
                            [write_keys(tmp_path / "b.parquet", keys[5000:8000])]])
    truth = {k: 0 for k in keys[:5000]} | {k: 1 for k in keys[5000:8000]}
    assert all(index.lookup(k) == truth.get(k) for k in keys)
