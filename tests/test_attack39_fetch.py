"""Hostile review of issue 39 §3 (``model.path: gs://...``, ``transforms.engines.fetch`` and the
content hash of ``transforms.engines.model``). Each test states the behaviour a fix should have
and FAILS on the code it was written against (attack-39)."""
from __future__ import annotations

import os

import pytest

from tests.test_model_fetch import TINY, cache_fixture, fake_gcs, upload  # noqa: F401


def test_two_different_folders_never_share_a_content_hash(tmp_path):
    """``model_content_hash`` feeds ``name + NUL`` then the file's bytes, with no length: the
    bytes of {a.json: X, b.json: Y} and of {a.json: X + "b.json" NUL + Y} are the same stream,
    so a folder that lost a file (its bytes appended to the file before it) passes the pin
    (``model.sha256``) and the recorded ``content_sha256`` does not tell them apart."""
    from transforms.engines.model import model_content_hash

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "a.json").write_bytes(b'{"x": 1}')
    (one / "b.json").write_bytes(b'{"y": 2}')
    (two / "a.json").write_bytes(b'{"x": 1}' + b"b.json\0" + b'{"y": 2}')
    assert sorted(os.listdir(one)) != sorted(os.listdir(two))
    assert model_content_hash.__wrapped__(str(one)) != model_content_hash.__wrapped__(str(two))


def test_training_checkpoints_beside_the_model_are_not_fetched(fake_gcs, cache):  # noqa: F811
    """A trainer's output folder (transformers' Trainer, sentence-transformers' fit) holds the
    final model and ``checkpoint-N/`` subfolders, each a whole copy of the weights. vLLM reads the
    weights at the folder's top only, but ``list_blobs(prefix=...)`` is recursive: every
    checkpoint is fetched (and hashed) on every worker and at every launch, N times the model's
    size, up to the 64 GiB refusal; and a checkpoint written later changes the pin."""
    from transforms.engines import fetch

    files = dict(TINY)
    files["checkpoint-500/model.safetensors"] = b"\1" * 4096
    files["checkpoint-500/config.json"] = TINY["config.json"]
    files["checkpoint-500/optimizer.pt"] = b"\2" * 4096  # skipped: not a hashed suffix
    path = upload("trainer-output", files)
    folder = fetch.fetch_model(path)
    assert os.path.isfile(os.path.join(folder, "1_Pooling", "config.json")), "modules' folders"
    assert not os.path.exists(os.path.join(folder, "checkpoint-500")), "a checkpoint fetched"


def test_a_cached_folder_that_lost_a_file_is_not_taken_for_the_pinned_one(
        fake_gcs, cache):  # noqa: F811
    """The cache trusts its marker (``.newsvec-sha256``): a process that finds the folder in the
    cache checks the pin against the marker, not the files. A file removed or changed after the
    fetch (a temp-folder cleaner that ages files out one by one, a disk error, a step of the
    same user's) is not noticed: the engine then reads another tokenizer than the pinned one
    (here ``tokenizer_config.json`` gone: the tokenizer's defaults instead), silently."""
    from transforms.engines import fetch
    from transforms.engines.model import model_content_hash

    path = upload("aged", TINY)
    folder = fetch.fetch_model(path)
    pinned = model_content_hash.__wrapped__(folder)
    os.unlink(os.path.join(folder, "tokenizer_config.json"))
    assert model_content_hash.__wrapped__(folder) != pinned
    fetch.fetched.cache_clear()  # another process of the machine
    with pytest.raises(fetch.ModelFetchError):
        again = fetch.fetch_model(path, pinned)
        assert not os.path.isfile(os.path.join(again, "tokenizer_config.json"))
