"""A model folder in GCS (``model.path: gs://...``, ``transforms.engines.fetch``) against
fake-gcs-server: fetched once by the processes of a machine, its content hash pinned at launch
and recorded, and refused when incomplete, changed after launch, or named to leave its folder.
The model is a few small files written here (nothing loads it)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import config as config_lib
from tests.common import REPO, make_config
from tests.emulators import fake_gcs_with_client

BUCKET = "newsvec-models"
TINY = {
    "config.json": json.dumps({"architectures": ["BertModel"], "hidden_size": 384}).encode(),
    "model.safetensors": bytes(range(256)) * 64,
    "tokenizer.json": b'{"model": {"type": "WordPiece"}}',
    "tokenizer_config.json": b"{}",
    "vocab.txt": b"[PAD]\n[UNK]\n[CLS]\n[SEP]\nnews\n",
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
    "README.md": b"not fetched: the content hash does not cover it",
}


@pytest.fixture(scope="module")
def fake_gcs(tmp_path_factory):
    with fake_gcs_with_client(BUCKET, tmp_path_factory.mktemp("fake-gcs-log")) as endpoint:
        yield endpoint


@pytest.fixture(name="cache")
def cache_fixture(tmp_path, monkeypatch):
    """A machine's cache of its own (``model_cache``), the process's memory of fetches cleared."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    try:
        from transforms.engines import fetch
    except ImportError:  # newsvec before 0.3 fetched nothing: the tests show what it did instead
        yield folder
        return
    monkeypatch.setattr(fetch, "model_cache", lambda: str(folder))
    fetch.fetched.cache_clear()
    yield folder
    fetch.fetched.cache_clear()


def upload(prefix: str, files: dict[str, bytes]) -> str:
    """The files as objects under ``gs://BUCKET/prefix/``; the folder's gs:// path."""
    from transforms.gcs import gcs_bucket_and_name

    bucket, _ = gcs_bucket_and_name(f"gs://{BUCKET}/")
    for name, data in files.items():
        bucket.blob(f"{prefix}/{name}").upload_from_string(data)
    return f"gs://{BUCKET}/{prefix}/"


def local_copy(tmp_path: Path, files: dict[str, bytes]) -> Path:
    folder = tmp_path / "local-model"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def gcs_config(path: str, **model_changes):
    config = make_config()
    return config.model_copy(update={"model": config.model.model_copy(
        update={"name": "tiny", "path": path, **model_changes})})


def test_the_launch_pins_the_content_hash_and_the_summary_records_it(fake_gcs, cache, tmp_path):
    from pipeline.graph import summary_base
    from transforms.engines.model import model_folder
    from transforms.engines.model_files import model_content_hash
    from transforms.output.layout import new_run_id

    path = upload("pinned", TINY)
    expected = model_content_hash.__wrapped__(str(local_copy(tmp_path, TINY)))
    assert config_lib.checks_left_to_the_run(gcs_config(path)), "config time: left to the run"
    assert not any(cache.iterdir()), "config time fetches nothing"

    config = config_lib.check_model(gcs_config(path), "test.yaml")  # the launcher

    assert config.model.sha256 == expected, "pinned into the config the workers get"
    model = summary_base(config, new_run_id()).model
    assert model["content_sha256"] == expected and model["sha256"] == expected
    assert model["label"] == f"tiny@sha256:{expected[:16]}"
    folder = Path(model_folder(config.model))
    assert folder.parent == cache and (folder / "1_Pooling" / "config.json").is_file()
    assert not (folder / "README.md").exists(), "only the files the hash covers are fetched"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700, "private"


_CHILD = """
import os, sys, time
import google.auth
from google.auth.credentials import AnonymousCredentials
google.auth.default = lambda *a, **k: (AnonymousCredentials(), "test")
from transforms.engines import fetch
real = fetch._download
def counted(spec, listed, into):
    with open(sys.argv[3], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(1)  # the other process arrives while this one fetches
    real(spec, listed, into)
fetch._download = counted
fetch.model_cache = lambda: sys.argv[2]
print("ready", flush=True)
while not os.path.exists(sys.argv[4]):
    time.sleep(0.01)
print(fetch.fetched(sys.argv[1]), flush=True)
"""


def test_two_processes_of_a_machine_fetch_the_folder_once(fake_gcs, cache, tmp_path):
    path = upload("shared", TINY)
    log, go = tmp_path / "downloads.log", tmp_path / "go"
    env = {**os.environ, "STORAGE_EMULATOR_HOST": fake_gcs, "NO_GCE_CHECK": "true",
           "PYTHONPATH": str(REPO)}
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, path, str(cache), str(log),
                                  str(go)], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    for child in children:
        assert child.stdout.readline().strip() == "ready"
    go.touch()
    folders = [child.communicate(timeout=120)[0].strip() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert folders[0] == folders[1] and Path(folders[0]).parent == cache
    assert len(log.read_text().split()) == 1, "one process fetched, the other waited and reused"
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [
        Path(folders[0]).name], "no temp folder left"


@pytest.mark.parametrize("missing, said", [
    ("config.json", "config.json"),
    ("model.safetensors", "weights"),
    ("tokenizer.json", "a tokenizer"),
])
def test_an_incomplete_folder_is_refused(fake_gcs, cache, missing, said):
    files = {k: v for k, v in TINY.items() if k != missing}
    if missing == "tokenizer.json":
        files.pop("vocab.txt")  # tokenizer_config.json alone is not a tokenizer
    path = upload(f"incomplete-{missing}", files)
    with pytest.raises(config_lib.ConfigError,
                       match=f"incomplete model folder, refused: it lacks {said}"):
        config_lib.check_model(gcs_config(path), "test.yaml")
    assert not any(cache.iterdir()), "refused before anything is fetched"


def test_a_sharded_checkpoint_missing_a_shard_is_refused(fake_gcs, cache):
    from transforms.engines.fetch import ModelFetchError, fetch_model

    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    files = {**TINY, "model.safetensors.index.json": json.dumps(index).encode(),
             "model-00001-of-00002.safetensors": b"shard one"}
    path = upload("sharded", {k: v for k, v in files.items() if k != "model.safetensors"})
    with pytest.raises(ModelFetchError, match="names model-00002-of-00002.safetensors"):
        fetch_model(path, cache=str(cache))
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_worker_refuses_a_folder_changed_after_the_launch(fake_gcs, cache, tmp_path):
    from transforms.engines import fetch
    from transforms.engines.model import model_folder

    path = upload("upgraded", TINY)
    config = config_lib.check_model(gcs_config(path), "test.yaml")  # the launcher pins
    first = model_folder(config.model)  # a worker started at the launch
    upload("upgraded", {"model.safetensors": b"the next version of the weights"})
    assert model_folder(config.model) == first, "a process fetches once"

    fetch.fetched.cache_clear()  # a worker process that starts after the change
    with pytest.raises(fetch.ModelFetchError, match="not the pinned"):
        model_folder(config.model)
    other_machine = tmp_path / "other-machine"
    other_machine.mkdir(mode=0o700)
    with pytest.raises(fetch.ModelFetchError, match="not the pinned"):
        fetch.fetch_model(path, config.model.sha256, cache=str(other_machine))
    relaunched = config_lib.check_model(gcs_config(path), "test.yaml")
    assert relaunched.model.sha256 != config.model.sha256, "a new launch pins the new files"


@pytest.mark.parametrize("name", ["../escaped.json", "sub/../../escaped.json", "./config.json",
                                  "sub//vocab.txt"])
def test_object_names_that_leave_the_folder_are_refused(fake_gcs, cache, tmp_path, name):
    prefix = f"traversal-{abs(hash(name))}"
    path = upload(prefix, TINY)
    from transforms.gcs import gcs_bucket_and_name

    bucket, _ = gcs_bucket_and_name(f"gs://{BUCKET}/")
    bucket.blob(f"{prefix}/{name}").upload_from_string(b"{}")
    listed = [b.name for b in bucket.list_blobs(prefix=f"{prefix}/")]
    assert f"{prefix}/{name}" in listed, "the emulator keeps the name as given"
    with pytest.raises(config_lib.ConfigError, match="not a plain relative path"):
        config_lib.check_model(gcs_config(path), "test.yaml")
    assert not list(tmp_path.rglob("escaped.json"))


def test_a_model_fetched_from_gcs_may_not_run_its_own_code(fake_gcs, cache):
    from transforms.engines.fetch import ModelFetchError
    from transforms.engines.model import model_folder

    path = upload("remote-code", TINY)
    with pytest.raises(ModelFetchError, match="trust_remote_code is refused"):
        model_folder(gcs_config(path, trust_remote_code=True).model)


def test_a_pinned_local_folder_with_other_files_is_refused(tmp_path):
    from transforms.engines.model import model_folder

    folder = local_copy(tmp_path, TINY)
    with pytest.raises(ValueError, match="not the pinned model.sha256"):
        model_folder(gcs_config(str(folder), sha256="0" * 64).model)
    assert model_folder(gcs_config(str(folder)).model) == str(folder)


def test_training_checkpoints_beside_the_model_are_not_fetched(fake_gcs, cache):
    """A trainer's output folder (transformers' Trainer, sentence-transformers' fit) holds the
    final model and ``checkpoint-N/`` subfolders, each a whole copy of the weights. vLLM reads the
    weights at the folder's top only: the folder's top and its modules' folders are fetched, never
    a checkpoint (before, ``list_blobs(prefix=...)`` fetched and hashed every one)."""
    from transforms.engines import fetch

    files = dict(TINY)
    files["checkpoint-500/model.safetensors"] = b"\1" * 4096
    files["checkpoint-500/config.json"] = TINY["config.json"]
    files["checkpoint-500/optimizer.pt"] = b"\2" * 4096  # skipped: not a hashed suffix
    path = upload("trainer-output", files)
    folder = fetch.fetch_model(path)
    assert os.path.isfile(os.path.join(folder, "1_Pooling", "config.json")), "modules' folders"
    assert not os.path.exists(os.path.join(folder, "checkpoint-500")), "a checkpoint fetched"


def test_a_local_folder_and_its_bucket_copy_hash_the_same_whatever_lies_beside_the_model(
        fake_gcs, cache, tmp_path):
    """The content hash covers what is fetched: the folder's top and the module folders
    ``modules.json`` names (here one not named as sentence-transformers names them), not a
    checkpoint or an ONNX export; a local folder with those hashes as its bucket copy does, and
    as the model without them. Before, the local hash took in every subfolder."""
    from transforms.engines import fetch
    from transforms.engines.model_files import model_content_hash

    model = {**TINY, "modules.json": json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "pooling", "type": "sentence_transformers.models.Pooling"}]).encode(),
        "pooling/config.json": b'{"pooling_mode_cls_token": true}'}
    extras = {"checkpoint-500/model.safetensors": b"\1" * 4096, "onnx/config.json": b"{}"}
    local = local_copy(tmp_path, {**model, **extras})
    bare = model_content_hash.__wrapped__(str(local_copy(tmp_path / "bare", model)))
    assert model_content_hash.__wrapped__(str(local)) == bare, "the extras are not hashed"
    folder = fetch.fetch_model(upload("with-extras", {**model, **extras}))
    assert model_content_hash.__wrapped__(folder) == bare
    assert os.path.isfile(os.path.join(folder, "pooling", "config.json"))
    (local / "pooling" / "config.json").write_bytes(b"{}")
    assert model_content_hash.__wrapped__(str(local)) != bare, "a module's file is hashed"


def test_a_cached_folder_that_lost_a_file_is_fetched_again(fake_gcs, cache):
    """The cache's private marker records the fetched files' names and sizes, checked (one
    ``stat`` a file) whenever a process first finds the folder in the cache: a file removed or
    changed after the fetch (a temp-folder cleaner that ages files out one by one, a disk error)
    makes it fetch the folder again, at the listed generations, and hash it again. Before, the
    marker alone was trusted and the engine read another tokenizer than the pinned one (here
    ``tokenizer_config.json`` gone: the tokenizer's defaults instead), silently."""
    from transforms.engines import fetch
    from transforms.engines.model_files import model_content_hash

    path = upload("aged", TINY)
    folder = fetch.fetch_model(path)
    pinned = model_content_hash.__wrapped__(folder)
    os.unlink(os.path.join(folder, "tokenizer_config.json"))
    assert model_content_hash.__wrapped__(folder) != pinned
    fetch.fetched.cache_clear()  # another process of the machine
    again = fetch.fetch_model(path, pinned)
    assert os.path.isfile(os.path.join(again, "tokenizer_config.json")), "fetched again"
    assert model_content_hash.__wrapped__(again) == pinned
    with open(os.path.join(again, "vocab.txt"), "ab") as grown:
        grown.write(b"extra\n")  # a file of another size
    assert fetch.fetch_model(path, pinned) == again
    assert model_content_hash.__wrapped__(again) == pinned, "fetched again"
