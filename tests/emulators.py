"""Start Google's emulators on loopback for a test, and stop them after.

A test that needs an emulator that is not installed is skipped with the reason locally, and fails
under CI (CI=true), so coverage is never lost silently.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def skip_or_fail(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (required under CI=true)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"emulator exited early with rc {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.2)
    raise TimeoutError(f"emulator not listening on 127.0.0.1:{port} after {timeout} s")


@contextlib.contextmanager
def gcs_emulator(bucket: str, log_dir: Path):
    """gcp-storage-emulator (PyPI) in memory, with ``bucket`` created. Yields its http endpoint."""
    exe = shutil.which("gcp-storage-emulator") or str(Path(sys.executable).with_name(
        "gcp-storage-emulator"))
    if not Path(exe).exists():
        skip_or_fail("gcp-storage-emulator is not installed (pip install gcp-storage-emulator)")
    port = free_port()
    log = open(log_dir / "gcs-emulator.log", "wb")
    process = subprocess.Popen(
        [exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory",
         "--default-bucket", bucket], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, process, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
