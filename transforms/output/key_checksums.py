"""The checksums a streaming output's snapshot pins its micro-batch key files by
(``transforms.output.manifest.Snapshot``): one listing on GCS, the bytes hashed on local disk."""
from __future__ import annotations

import hashlib
import os
from typing import Optional

from apache_beam.io.filesystems import FileSystems

from transforms.gcs import gcs_bucket_and_name
from transforms.output.layout import (
    KEYS_DIR,
    UnsafePath,
    is_compacted,
    join_path,
    open_inside,
    relative_to,
)


def local_checksum(prefix: str, path: str) -> Optional[str]:
    """The sha256 of the key file ``path`` (relative to the local output ``prefix``), as
    ``key_file_checksums`` hashes it, or None where it is not a regular file reached through no
    symlink (a publishing manifest's snapshot names its prefix: a symlinked ``keys/`` there would
    otherwise have every file it leads to hashed, under the lease)."""
    digest = hashlib.sha256()
    try:
        with open_inside(prefix, join_path(prefix, path)) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except (OSError, UnsafePath):
        return None
    return digest.hexdigest()


def key_file_checksums(prefix: str) -> dict[str, str]:
    """{path relative to the output: checksum} of a streaming output's micro-batch key files (not
    the compacted ones): one listing on GCS (its CRC32C, kept by the object), the bytes hashed on
    local disk. A micro-batch redone with the same outcome writes the same bytes (the same keys in
    the same order), so only a change of what it holds changes its checksum."""
    keys = join_path(prefix, KEYS_DIR)
    out = {}
    if keys.startswith("gs://"):
        bucket, name = gcs_bucket_and_name(keys + "/")
        for blob in bucket.list_blobs(prefix=name):
            path = f"gs://{bucket.name}/{blob.name}"
            if path.endswith(".parquet") and not is_compacted(path):
                out[relative_to(prefix, path)] = (blob.crc32c or blob.md5_hash
                                                  or f"{blob.size}:{blob.updated}")
        return out
    if FileSystems.get_scheme(keys) is not None:
        raise ValueError(f"{prefix}: streaming outputs as previous outputs are read on gs:// or "
                         f"local disk")
    if os.path.islink(keys):
        return out  # its files are not this output's: none is held (nor hashed)
    for folder, _, names in os.walk(keys):
        for file_name in names:
            path = os.path.join(folder, file_name)
            if file_name.endswith(".parquet") and not is_compacted(file_name):
                # A regular file only, through no symlink, without waiting on a FIFO: one
                # deleted while listed, a symlink, a FIFO is not held.
                digest = local_checksum(prefix, relative_to(prefix, path))
                if digest is not None:
                    out[relative_to(prefix, path)] = digest
    return out
