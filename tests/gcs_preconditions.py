"""GCS's preconditions, played on gcp-storage-emulator for the tests that need both Beam's GCS
filesystem and ``if_generation_match``.

gcp-storage-emulator ignores ``if_generation_match``; fake-gcs-server enforces it on uploads, but
Beam's batch requests (every delete and rename through ``FileSystems``) fail there. So a test of a
whole compaction or publish on GCS runs on gcp-storage-emulator with ``enforced()``: an upload, a
copy or a delete through google-cloud-storage that names ``if_generation_match`` is refused with
``PreconditionFailed`` (HTTP 412), as GCS refuses it, when the object is not at that generation
(0: absent). The check and the request are two steps, not one: the tests that use it order their
writers themselves."""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest


def _generation(blob) -> int:
    current = blob.bucket.get_blob(blob.name)
    return 0 if current is None else int(current.generation)


@contextlib.contextmanager
def enforced() -> Iterator[list]:
    """Inside the block, conditional uploads and deletes are refused as GCS refuses them; yields
    the list of (operation, object name) refused."""
    from google.api_core import exceptions
    from google.cloud.storage import Blob, Bucket

    refused: list = []
    real_upload, real_delete, real_copy = Blob.upload_from_string, Blob.delete, Bucket.copy_blob

    def check(blob, operation: str, kwargs: dict) -> None:
        wanted = kwargs.get("if_generation_match")
        if wanted is not None and _generation(blob) != int(wanted):
            refused.append((operation, blob.name))
            raise exceptions.PreconditionFailed(f"{operation} {blob.name}: not at {wanted}")

    def upload(self, *args, **kwargs):
        check(self, "upload", kwargs)
        return real_upload(self, *args, **kwargs)

    def delete(self, *args, **kwargs):
        check(self, "delete", kwargs)
        return real_delete(self, *args, **kwargs)

    def copy_blob(self, blob, destination_bucket, new_name=None, *args, **kwargs):
        check(destination_bucket.blob(new_name or blob.name), "copy", kwargs)
        return real_copy(self, blob, destination_bucket, new_name, *args, **kwargs)

    patch = pytest.MonkeyPatch()
    patch.setattr(Blob, "upload_from_string", upload)
    patch.setattr(Blob, "delete", delete)
    patch.setattr(Bucket, "copy_blob", copy_blob)
    try:
        yield refused
    finally:
        patch.undo()
