"""A model folder in GCS (``model.path: gs://BUCKET/PREFIX/``), fetched into a private cache on
the machine once, verified, and then read like a local folder.

- What is fetched: the files the content hash covers (``model_files.is_model_file``: weights, JSON
  configs, tokenizer files, at the folder's top and in its modules' folders, those
  ``modules.json`` names and ``1_Pooling``-like ones), so every byte the engine reads is covered by
  the hash and a local folder hashes as its copy in the bucket does; anything else (a README, ONNX
  exports, a model's own ``.py`` code, a trainer's ``checkpoint-N/`` folders) is left in the
  bucket and logged.
- Refused before a byte is fetched (``ModelFetchError``): an object name that would leave the
  folder (``..``, ``.``, an empty part, a backslash, a NUL), a folder without ``config.json``,
  weights or a tokenizer, more than ``MAX_FILES`` files or ``MAX_BYTES`` bytes, or more than the
  cache's disk has free.
- Once per machine: the cache is ``{temp}/newsvec-engine-<uid>/models`` (the shared engine's
  private folder, ``transforms.private_files``: 0700, this user's), one folder per listing (the
  objects' names, generations and sizes). The first process takes the listing's lock file
  (``flock``), fetches into a temp folder, hashes it, and renames it into place; every other
  process of the machine (the shared engine, the SDK processes) waits on the lock and finds it
  there. A process killed mid-fetch leaves only a temp folder, removed by the next holder.
- A cached folder is checked on every first use by a process (one ``stat`` per file): its files'
  names and sizes against those its private marker recorded when it was fetched. A folder that
  lost, gained or resized a file (a temp-folder cleaner, a disk error) is fetched again (the
  listing's generations: the same bytes) and hashed again, never used as it is. A file changed in
  place to the same size is not seen by this check (only hashing every byte would).
- Each object is fetched at the generation listed (``if_generation_match``): an object replaced
  while the folder is fetched fails the fetch, never mixes two versions. google-cloud-storage
  checks each download's checksum.
- Pinned (``model.sha256``, set by the launcher of a run when the config has none): a fetched
  folder whose content hash is another is refused, so a worker that starts after the folder was
  changed in the bucket stops rather than embed with another model than the rest of the job.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterator, NamedTuple, Optional

from transforms.engines.model_files import (
    MODULES_FILE,
    is_model_file,
    model_content_hash,
    module_folders,
)
from transforms.gcs import gcs_bucket_and_name
from transforms.private_files import (
    check_private_folder,
    open_private_file,
    private_folder,
    read_private,
    write_private,
)

_LOG = logging.getLogger(__name__)

GS = "gs://"
MAX_FILES = 1_000
MAX_LISTED = 100_000
"""The most objects listed under a model's folder (a trainer's output with its checkpoints)."""
MAX_MODULES_BYTES = 1 << 20
MAX_BYTES = 64 << 30
"""The largest folder fetched: a 7B-parameter model in bfloat16 is about 15 GB."""
DISK_MARGIN_BYTES = 1 << 30
"""Left free on the cache's disk after a fetch."""
_MARKER = ".newsvec-sha256"  # in a fetched folder: its content hash and files (not a hashed name)
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_TOKENIZER_VOCABS = ("vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                     "tokenizer.model")


class ModelFetchError(RuntimeError):
    """A GCS model folder that is refused: incomplete, unsafe, too big, changed while fetched, or
    not the pinned one."""


class ModelPinMismatch(ModelFetchError, ValueError):
    """A model folder whose files hash otherwise than the ``model.sha256`` that pins it."""

    def __init__(self, message: str, found: str, pinned: str):
        super().__init__(message)
        self.found, self.pinned = found, pinned


class Listed(NamedTuple):
    """One object of the folder: its name relative to the folder, its generation and size."""

    name: str
    generation: int
    size: int


def is_gcs(spec: str) -> bool:
    return spec.startswith(GS)


def split_gcs_folder(spec: str) -> tuple[str, str]:
    """(bucket, prefix ending in ``/``) of ``gs://BUCKET/PREFIX/``."""
    bucket, _, prefix = spec[len(GS):].partition("/")
    if not bucket or not prefix.strip("/"):
        raise ModelFetchError(f"model.path {spec}: give a folder, gs://BUCKET/PATH/")
    return bucket, prefix.rstrip("/") + "/"


def safe_relative(spec: str, name: str) -> str:
    """``name`` (relative to the folder) if it stays inside it as a plain path, else
    ModelFetchError."""
    parts = name.split("/")
    if ("\\" in name or "\0" in name or name.startswith("/")
            or any(part in ("", ".", "..") for part in parts)):
        raise ModelFetchError(f"model.path {spec}: refused the object {name!r}: its name is not a "
                              "plain relative path (an empty part, '.', '..', a backslash or a "
                              "NUL) and could write outside the model's folder")
    return PurePosixPath(*parts).as_posix()


def list_folder(spec: str) -> list[Listed]:
    """The objects to fetch, checked (``safe_relative``, ``check_complete``, the limits)."""
    bucket_name, prefix = split_gcs_folder(spec)
    bucket, _ = gcs_bucket_and_name(f"{GS}{bucket_name}/")
    every = []
    for blob in bucket.list_blobs(prefix=prefix):  # names only: nothing is fetched yet
        relative = blob.name[len(prefix):]
        if not relative or relative.endswith("/") and not blob.size:
            continue  # the folder's own placeholder object (made by the console)
        every.append(Listed(safe_relative(spec, relative), int(blob.generation),
                            int(blob.size or 0)))
        if len(every) > MAX_LISTED:
            raise ModelFetchError(f"model.path {spec}: more than {MAX_LISTED} objects")
    modules = None
    for item in every:
        if item.name == MODULES_FILE and item.size <= MAX_MODULES_BYTES:
            modules = bucket.blob(prefix + MODULES_FILE).download_as_bytes(
                if_generation_match=item.generation)  # the one fetched: changed, it fails there
    folders = module_folders(modules)
    listed = [item for item in every if is_model_file(item.name, folders)]
    skipped = [item.name for item in every if not is_model_file(item.name, folders)]
    if len(listed) > MAX_FILES:
        raise ModelFetchError(f"model.path {spec}: more than {MAX_FILES} files")
    if skipped:
        _LOG.info("model %s: not fetched (not covered by the content hash): %s", spec,
                  ", ".join(sorted(skipped)[:20]))
    check_complete(spec, {item.name for item in listed})
    total = sum(item.size for item in listed)
    if total > MAX_BYTES:
        raise ModelFetchError(f"model.path {spec}: {total} bytes, more than the {MAX_BYTES} "
                              "newsvec fetches")
    return sorted(listed)


def check_complete(spec: str, names: set[str]) -> None:
    """ModelFetchError naming what a model folder lacks: ``config.json``, weights
    (``*.safetensors`` or ``*.bin``), a tokenizer (``tokenizer.json``, or
    ``tokenizer_config.json`` with its vocabulary)."""
    top = {name for name in names if "/" not in name}
    missing = []
    if "config.json" not in top:
        missing.append("config.json")
    if not any(name.endswith(_WEIGHT_SUFFIXES) for name in top):
        missing.append("weights (*.safetensors or pytorch_model.bin)")
    if "tokenizer.json" not in top and not (
            "tokenizer_config.json" in top and top.intersection(_TOKENIZER_VOCABS)):
        missing.append("a tokenizer (tokenizer.json, or tokenizer_config.json with "
                       f"{' or '.join(_TOKENIZER_VOCABS)})")
    if missing:
        raise ModelFetchError(f"model.path {spec}: an incomplete model folder, refused: it "
                              f"lacks {'; '.join(missing)}")


def check_shards(spec: str, folder: Path) -> None:
    """A sharded checkpoint's index (``*.index.json``) names only files that were fetched."""
    for index in folder.glob("*.index.json"):
        shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        absent = sorted(s for s in shards if not (folder / safe_relative(spec, s)).is_file())
        if absent:
            raise ModelFetchError(f"model.path {spec}: an incomplete model folder, refused: "
                                  f"{index.name} names {', '.join(absent)}, not in the folder")


def model_cache() -> str:
    """``{temp}/newsvec-engine-<uid>/models``: private (0700, this user's), machine-wide."""
    folder = os.path.join(private_folder(), "models")
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    check_private_folder(folder)
    return folder


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    fd = open_private_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the other processes of the machine wait here
        yield
    finally:
        os.close(fd)  # releases the lock


def _key(spec: str, listed: list[Listed]) -> str:
    return hashlib.sha256(json.dumps([spec, listed]).encode()).hexdigest()[:32]


def _download(spec: str, listed: list[Listed], into: Path) -> None:
    from google.api_core import exceptions

    bucket_name, prefix = split_gcs_folder(spec)
    bucket, _ = gcs_bucket_and_name(f"{GS}{bucket_name}/")
    for item in listed:
        target = into / item.name
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            bucket.blob(prefix + item.name).download_to_filename(
                str(target), if_generation_match=item.generation)
        except (exceptions.NotFound, exceptions.PreconditionFailed) as exc:
            raise ModelFetchError(f"model.path {spec}: {item.name} changed or vanished while the "
                                  f"folder was fetched ({type(exc).__name__}): refused; fetch "
                                  "again once the upload is complete") from None
        if target.stat().st_size != item.size:
            raise ModelFetchError(f"model.path {spec}: {item.name}: {target.stat().st_size} "
                                  f"bytes fetched, {item.size} listed")


def fetch_model(spec: str, sha256: Optional[str] = None, cache: Optional[str] = None) -> str:
    """The local folder of the GCS model folder ``spec``, fetched into the machine's cache if it
    is not there yet (see the module), its content hash ``sha256`` if that is given, else
    ModelFetchError."""
    listed = list_folder(spec)
    cache = cache or model_cache()
    key = _key(spec, listed)
    final = os.path.join(cache, key)
    with _locked(os.path.join(cache, f"{key}.lock")):
        digest = _cached_digest(spec, final, listed)
        if digest is None:
            for stale in Path(cache).glob(f".{key}.*"):  # a fetch killed midway
                shutil.rmtree(stale, ignore_errors=True)
            need = sum(item.size for item in listed) + DISK_MARGIN_BYTES
            free = shutil.disk_usage(cache).free
            if need > free:
                raise ModelFetchError(f"model.path {spec}: {need} bytes needed (with a margin) "
                                      f"in {cache}, {free} free")
            tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{key}."))
            try:
                _download(spec, listed, tmp)
                check_shards(spec, tmp)
                digest = model_content_hash.__wrapped__(str(tmp))
                write_private(str(tmp / _MARKER), json.dumps(
                    {"sha256": digest, "files": _files_of(tmp)}).encode())
                shutil.rmtree(final, ignore_errors=True)  # a folder left without its marker
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _LOG.info("model %s: fetched %d files into %s (sha256 %s)", spec, len(listed), final,
                      digest)
    if sha256 is not None and digest != sha256:
        raise ModelPinMismatch(
            f"model.path {spec}: its files hash to sha256 {digest}, not the pinned {sha256} "
            "(model.sha256, set when the run was launched): the folder changed in the bucket "
            "since, and this worker refuses to embed with another model than the rest of the "
            "job. Publish a new model version under a new path and launch again", digest, sha256)
    return final


def _files_of(folder: Path) -> list[list]:  # [str, int] each: as JSON reads them back
    """``[name, size]`` of each file of a fetched folder (its marker aside), sorted: one ``stat``
    per file."""
    files = []
    for parent, _, names in os.walk(folder):
        for name in names:
            path = Path(parent, name)
            if path != folder / _MARKER:
                files.append([path.relative_to(folder).as_posix(), path.stat().st_size])
    return sorted(files)


def _cached_digest(spec: str, final: str, listed: list[Listed]) -> Optional[str]:
    """The content hash of the cached folder ``final`` as its marker records it, if the folder
    holds the files the marker lists, at their sizes, and those are the listing's; None for a
    folder to fetch (absent, without a marker, with a marker of a release before 0.3's
    listing, or changed since it was fetched: that one is logged)."""
    if not os.path.isdir(final):
        return None
    raw = read_private(os.path.join(final, _MARKER))
    try:
        marker = json.loads(raw) if raw is not None else None
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or not isinstance(marker.get("sha256"), str):
        return None
    expected = sorted([item.name, item.size] for item in listed)
    if marker.get("files") != expected:
        return None  # not this listing's (a marker written before the files were recorded)
    found = _files_of(Path(final))
    if found != expected:
        lost = sorted({str(name) for name, _ in expected} - {str(name) for name, _ in found})
        other = sorted({str(name) for name, size in found} - {str(name) for name, size in expected
                                                                 if [name, size] in found})
        _LOG.warning("model %s: the cached folder %s changed since it was fetched (lost: %s; "
                     "other or added: %s): fetched again", spec, final,
                     ", ".join(lost) or "none", ", ".join(other) or "none")
        return None
    return marker["sha256"]


@functools.lru_cache(maxsize=8)
def fetched(spec: str, sha256: Optional[str] = None) -> str:
    """``fetch_model`` once per process for a spec and pin (a refusal is not remembered)."""
    return fetch_model(spec, sha256)
