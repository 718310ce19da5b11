"""One publisher per output prefix at a time, enforced by the storage: a renewed, fenced lease.

A batch run publishes into an output (``transforms.manifest.publish``) only while it holds the lease
on ``<output>/_publish.lock``. The lock object is a small JSON body (who holds it, since when), and
every change to it is conditional on the generation the changer last saw:

- on GCS, through google-cloud-storage's preconditions: ``if_generation_match=0`` creates it only if
  absent, ``if_generation_match=G`` replaces it only if nobody changed it since G. The storage
  refuses the loser of any race (``412 Precondition Failed``). Releasing is a conditional replace
  too (a body that says ``released``), not a delete: fake-gcs-server, the emulator the tests use,
  does not enforce preconditions on deletes;
- on local disk, the same operations under an OS lock (``fcntl.flock``) on the output folder, with
  the generation kept in the file; a released lock is deleted.

The holder renews the lease every ``lease_s / 4`` (a new generation each time). Another run waits
while the generation changes; when it has seen one generation stand for ``lease_s`` by its own
clock, the holder is dead or stalled, and it takes the lease over with a conditional replace of that
generation. No clocks are compared across machines. The holder checks before every file it deletes
or copies (``check``): once a renewal failed (the lease was taken over) or none succeeded for
``lease_s / 2``, it stops (``LeaseLost``), so it stops before the taker, who waited a whole
``lease_s`` after the holder's last renewal, starts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from typing import Any, Iterator, Optional, Protocol

from apache_beam.io.filesystems import FileSystems

from transforms.layout import PUBLISH_LOCK_FILE, join_path

_LOG = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """This holder's lease was taken over, or could not be renewed in time: it must stop writing."""


class LockStore(Protocol):
    """A small object with generations: every change is conditional, and the storage decides."""

    def read(self) -> Optional[tuple[int, dict]]:
        """(generation, body), or None when there is no lock."""

    def create(self, body: dict) -> Optional[int]:
        """The new generation, or None when a lock exists."""

    def replace(self, body: dict, generation: int) -> Optional[int]:
        """The new generation, or None when the lock is not at ``generation`` any more."""

    def release(self, body: dict, generation: int) -> None:
        """Free the lock if it is still at ``generation``; else leave it (somebody else's)."""

    def holder_is_gone(self, body: dict) -> bool:
        """Whether the holder is known dead now (no need to wait out its lease)."""


class GcsLockStore:
    """The lock as a GCS object, every change under an ``if_generation_match`` precondition."""

    def __init__(self, path: str):
        from google.cloud.storage import Client

        bucket, _, name = path[len("gs://"):].partition("/")
        self._blob_name = name
        self._bucket = Client().bucket(bucket)

    def read(self) -> Optional[tuple[int, dict]]:
        from google.api_core import exceptions

        while True:
            blob = self._bucket.get_blob(self._blob_name)  # its metadata: the generation
            if blob is None:
                return None
            generation = int(blob.generation)
            try:  # the body of that generation, not of a newer one
                data = blob.download_as_bytes(if_generation_match=generation)
            except (exceptions.NotFound, exceptions.PreconditionFailed):
                continue  # changed in between: look again
            return generation, json.loads(data)

    def _upload(self, body: dict, generation: int) -> Optional[int]:
        from google.api_core import exceptions

        blob = self._bucket.blob(self._blob_name)
        try:
            blob.upload_from_string(json.dumps(body), content_type="application/json",
                                    if_generation_match=generation)
        except exceptions.PreconditionFailed:
            return None
        return int(blob.generation)

    def create(self, body: dict) -> Optional[int]:
        return self._upload(body, 0)  # 0: only if no live object has this name

    def replace(self, body: dict, generation: int) -> Optional[int]:
        return self._upload(body, generation)

    def release(self, body: dict, generation: int) -> None:
        self._upload({**body, "released": True}, generation)

    def holder_is_gone(self, body: dict) -> bool:
        return False  # another machine's process: only its lease running out tells


class LocalLockStore:
    """The lock as a local file; each read-compare-write holds ``flock`` on its folder (every
    process on this machine sees it; a killed process's flock is released by the OS)."""

    def __init__(self, path: str):
        self._path = path
        self._folder = os.path.dirname(path) or "."
        os.makedirs(self._folder, exist_ok=True)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        guard = os.open(self._folder, os.O_RDONLY)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            yield
        finally:
            os.close(guard)  # and with it the flock

    def _read(self) -> Optional[tuple[int, dict]]:
        try:
            with open(self._path, encoding="utf-8") as f:
                stored = json.load(f)
        except FileNotFoundError:
            return None
        return stored["generation"], stored["body"]

    def _write(self, body: dict, generation: int) -> int:
        temp = f"{self._path}.{uuid.uuid4().hex}.tmp"
        with open(temp, "w", encoding="utf-8") as f:
            json.dump({"generation": generation, "body": body}, f)
        os.replace(temp, self._path)
        return generation

    def read(self) -> Optional[tuple[int, dict]]:
        with self._guarded():
            return self._read()

    def create(self, body: dict) -> Optional[int]:
        with self._guarded():
            current = self._read()
            if current is not None:
                return None
            return self._write(body, time.time_ns())

    def replace(self, body: dict, generation: int) -> Optional[int]:
        with self._guarded():
            current = self._read()
            if current is None or current[0] != generation:
                return None
            return self._write(body, max(time.time_ns(), generation + 1))

    def release(self, body: dict, generation: int) -> None:
        with self._guarded():
            current = self._read()
            if current is not None and current[0] == generation:
                os.remove(self._path)

    def holder_is_gone(self, body: dict) -> bool:
        """A holder on this machine whose process has ended (killed: it never released)."""
        if body.get("host") != socket.gethostname() or not isinstance(body.get("pid"), int):
            return False
        try:
            os.kill(body["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
        return False


def lock_store(output: str) -> LockStore:
    """The lock store of an output prefix: GCS for ``gs://``, the local disk for a path."""
    path = join_path(output, PUBLISH_LOCK_FILE)
    scheme = FileSystems.get_scheme(path)
    if scheme == "gs":
        return GcsLockStore(path)
    if scheme is None:
        return LocalLockStore(os.path.abspath(path))
    raise ValueError(f"no publish lock for {scheme}:// outputs (gs:// or a local path)")


@dataclasses.dataclass
class _Held:
    generation: int
    renewed: float  # time.monotonic() of the last successful renewal's start


class PublishLease:
    """``with PublishLease(output, run_id, lease_s):`` holds the output's publish lease inside the
    block, renewed in a thread of its own; ``check()`` raises ``LeaseLost`` once it is not safe to
    write any more."""

    def __init__(self, output: str, run_id: str, lease_s: float = 600,
                 poll_s: Optional[float] = None, store: Optional[LockStore] = None):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s!r}")
        self._output, self._lease_s = output, lease_s
        self._poll_s = min(lease_s / 4, 5.0) if poll_s is None else poll_s
        self._store = store if store is not None else lock_store(output)
        self._body: dict[str, Any] = {
            "holder": f"{run_id}/{uuid.uuid4().hex[:8]}", "run_id": run_id,
            "host": socket.gethostname(), "pid": os.getpid()}
        self._held: Optional[_Held] = None
        self._lost: Optional[str] = None
        self._stop = threading.Event()
        self._renewer: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    @property
    def holder(self) -> str:
        return self._body["holder"]

    def acquire(self) -> None:
        """Wait until the lease is free, or has stood unrenewed for ``lease_s``, and take it."""
        seen: Optional[int] = None
        seen_since = 0.0
        while True:
            now = time.monotonic()
            current = self._store.read()
            if current is None:
                generation = self._store.create(self._body)
            elif current[1].get("released"):
                generation = self._store.replace(self._body, current[0])
            else:
                if current[0] != seen:  # renewed since we last looked: the holder lives
                    seen, seen_since = current[0], now
                generation = None
                if self._store.holder_is_gone(current[1]):
                    _LOG.warning("the publish lease on %s is held by %s, whose process has ended: "
                                 "%s takes it over", self._output, current[1].get("holder"),
                                 self.holder)
                    generation = self._store.replace(self._body, current[0])
                elif now - seen_since >= self._lease_s:
                    _LOG.warning("the publish lease on %s held by %s was not renewed for %.0f s "
                                 "(killed or stalled): %s takes it over", self._output,
                                 current[1].get("holder"), now - seen_since, self.holder)
                    generation = self._store.replace(self._body, current[0])
                else:
                    _LOG.info("%s is publishing into %s; %s waits", current[1].get("holder"),
                              self._output, self.holder)
            if generation is not None:
                self._held = _Held(generation, now)
                self._renewer = threading.Thread(target=self._renew, daemon=True,
                                                 name="newsvec-publish-lease")
                self._renewer.start()
                return
            time.sleep(self._poll_s * random.uniform(0.75, 1.25))

    def _renew(self) -> None:
        while not self._stop.wait(self._lease_s / 4):
            with self._lock:
                held = self._held
            if held is None:
                return
            started = time.monotonic()
            try:
                generation = self._store.replace(self._body, held.generation)
            except Exception as exc:  # pylint: disable=broad-except  # retried at the next turn
                _LOG.warning("renewing the publish lease on %s failed (%s); retrying",
                             self._output, exc)
                continue
            with self._lock:
                if generation is None:
                    self._lost = "it was taken over"
                    _LOG.error("the publish lease on %s was taken over: %s stops", self._output,
                               self.holder)
                    return
                self._held = _Held(generation, started)

    def check(self) -> None:
        """Raise ``LeaseLost`` unless this holder may still write: call before every change."""
        with self._lock:
            if self._held is None:
                raise LeaseLost(f"{self.holder} does not hold the publish lease on {self._output}")
            if self._lost:
                raise LeaseLost(f"{self.holder} lost the publish lease on {self._output}: "
                                f"{self._lost}")
            stale = time.monotonic() - self._held.renewed
            if stale > self._lease_s / 2:
                raise LeaseLost(f"{self.holder}: the publish lease on {self._output} was not "
                                f"renewed for {stale:.0f} s (lease {self._lease_s:.0f} s)")

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._lock:
            held, self._held = self._held, None
        if held is not None and not self._lost:
            # Only if still ours: a holder whose lease was taken over releases nothing.
            self._store.release(self._body, held.generation)

    def __enter__(self) -> "PublishLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
