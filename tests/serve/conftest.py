"""Fixtures of the ``newsvec serve`` tests: the sample's output written by the local pipeline
(real vLLM, float32: ``make_config``), and the service started in-process on a free loopback
port (uvicorn in a thread) over it, with the session's engine (``load_engine`` keeps one per
process, so the pipeline's run and the service share one load)."""
from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pytest

from pipeline.config import Config
from tests.common import REPO, SAMPLE_EVENTS, make_config
from tests.emulators import skip_or_fail

API_KEY = "test-key-1f0c"


def need(module: str):
    """``module`` imported; the test skipped without it (failed under ``CI=true``)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        skip_or_fail(f"{module} is not installed: pip install -e '.[serve,test]' (make setup)")


def loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """``app`` served by uvicorn in a thread on a free loopback port; yields its base URL."""
    uvicorn = need("uvicorn")
    sock = loopback_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def slow_service(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """``tests.serve.slow_server`` (the real command's ``run``, with a stand-in engine whose
    calls take 2 s, no API key) in a process of its own over no output: (the process, its base
    URL) once ``/healthz`` answers; killed after, if it still runs."""
    httpx = need("httpx")
    need("uvicorn")
    port_file = tmp_path / "port"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.serve.slow_server", str(tmp_path / "no-output"),
         str(port_file)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "NEWSVEC_API_KEY": ""})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the service did not start in 120 s"
            assert process.poll() is None, (process.stdout.read().decode()
                                            if process.stdout else "")
            if port_file.is_file() and port_file.read_text():
                url = f"http://127.0.0.1:{port_file.read_text()}"
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


class Delayed:
    """The session's engine behind a delay per call (``delay_s``), and a gate that holds every
    call while it is closed: a stand-in for a busy engine, with the real vectors."""

    def __init__(self, engine, delay_s: float = 0.0):
        self.engine, self.delay_s = engine, delay_s
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[int] = []

    def label(self) -> str:
        return self.engine.label()

    def embed(self, prompts):
        self.gate.wait(60)
        time.sleep(self.delay_s)
        self.calls.append(len(prompts))
        return self.engine.embed(prompts)


@pytest.fixture(scope="session")
def sample_output(tmp_path_factory) -> Path:
    """The sample's output, written by the local batch pipeline (FnApiRunner, float32)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch

    out = tmp_path_factory.mktemp("serve-output")
    run_batch(make_config(input=str(SAMPLE_EVENTS), output=str(out)),
              PipelineOptions(["--runner=FnApiRunner"]))
    return out


@pytest.fixture(scope="session")
def serve_config(sample_output) -> Config:
    return make_config(input=str(SAMPLE_EVENTS), output=str(sample_output))


@pytest.fixture(scope="session")
def engine(serve_config):
    from transforms.engines.registry import load_engine

    return load_engine(serve_config.model)


@pytest.fixture(scope="module")
def server(serve_config, engine) -> Iterator[str]:
    """The service over the sample's output, its API key ``API_KEY``; its base URL. Stopped at the
    module's end: a process that forks while uvloop runs in a thread has children that crash
    (SIGSEGV), and later tests fork (multiprocessing pools)."""
    need("fastapi")
    from pipeline.serve.app import create_app

    with serving(create_app(serve_config, engine, api_key=API_KEY)) as url:
        yield url


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def headers(key: Optional[str] = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}
