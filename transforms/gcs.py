"""GCS objects with generations, through google-cloud-storage (Beam's client has no
preconditions): one client per process and endpoint, a ``gs://`` path's bucket and object name,
and the conditional operations (read a generation's bytes, write, delete or copy only if the
object is at a given generation). The publish lease (``transforms.output.lease``), the manifest,
the key index of ``transforms.incremental`` and a ``gs://`` model's fetch
(``transforms.engines.fetch``) share them."""
from __future__ import annotations

import functools
import os
from typing import Any, Optional


@functools.lru_cache(maxsize=16)
def _gcs_client(_endpoint: Optional[str], _pid: int):
    from google.cloud.storage import Client

    return Client()


def gcs_bucket_and_name(path: str) -> tuple[Any, str]:
    """The bucket and object name of a gs:// path; one client per process and endpoint."""
    bucket, _, name = path[len("gs://"):].partition("/")
    client = _gcs_client(os.environ.get("STORAGE_EMULATOR_HOST"), os.getpid())
    return client.bucket(bucket), name


def gcs_read(path: str) -> Optional[tuple[int, bytes]]:
    """(generation, bytes) of a GCS object, the bytes of that generation; None if absent."""
    from google.api_core import exceptions

    bucket, name = gcs_bucket_and_name(path)
    while True:
        blob = bucket.get_blob(name)  # its metadata: the generation
        if blob is None:
            return None
        generation = int(blob.generation)
        try:  # the body of that generation, not of a newer one
            return generation, blob.download_as_bytes(if_generation_match=generation)
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            continue  # changed in between: look again


def gcs_write(path: str, data: bytes, if_generation: int,
              content_type: str = "application/json") -> Optional[int]:
    """Upload ``data`` only if the object is at ``if_generation`` (0: absent). The new
    generation, or None when refused. A refusal whose object now holds exactly ``data`` was this
    upload, applied, its response lost and its retry refused: its generation is returned."""
    from google.api_core import exceptions

    bucket, name = gcs_bucket_and_name(path)
    blob = bucket.blob(name)
    try:
        blob.upload_from_string(data, content_type=content_type, if_generation_match=if_generation)
    except exceptions.PreconditionFailed:
        current = gcs_read(path)
        if current is not None and current[1] == data and current[0] != if_generation:
            return current[0]
        return None
    return int(blob.generation)


def gcs_delete(path: str, if_generation: int) -> bool:
    """Delete the object only if it is at ``if_generation``: whether it is gone now."""
    from google.api_core import exceptions

    bucket, name = gcs_bucket_and_name(path)
    try:
        bucket.blob(name).delete(if_generation_match=if_generation)
    except exceptions.NotFound:
        return True
    except exceptions.PreconditionFailed:
        return gcs_read(path) is None
    return True


def gcs_copy(source: str, target: str, if_generation: int = 0) -> int:
    """Copy one GCS object to another name, in one request (retried), only if the target is at
    ``if_generation`` (0: absent; else ``PreconditionFailed``): the generation it created."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    source_bucket, source_name = gcs_bucket_and_name(source)
    target_bucket, target_name = gcs_bucket_and_name(target)
    copied = source_bucket.copy_blob(source_bucket.blob(source_name), target_bucket, target_name,
                                     if_generation_match=if_generation, retry=DEFAULT_RETRY)
    return int(copied.generation)


def gcs_read_generation(path: str) -> int:
    """The generation of a GCS object now; 0 if absent."""
    bucket, name = gcs_bucket_and_name(path)
    blob = bucket.get_blob(name)
    return 0 if blob is None else int(blob.generation)


def gcs_updated(path: str) -> Optional[float]:
    """When GCS last wrote an object (its ``updated``, the storage's clock, Unix seconds)."""
    bucket, name = gcs_bucket_and_name(path)
    blob = bucket.get_blob(name)
    return None if blob is None or blob.updated is None else blob.updated.timestamp()
