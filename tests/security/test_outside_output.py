"""Nothing outside the output prefix is ever touched (issue 37 §2; the security review of
2026-12-06, sections 3, 4, 5 and 13): a crafted ``_manifest.json`` or compaction manifest is
refused, naming it, never followed; a symlinked ``_temp/``, ``_staging/``, published or partition
folder is refused before anything is deleted, copied or renamed through it. Each case runs in a
sandbox whose output is ``<sandbox>/a/out``: everything else in the sandbox (a victim folder, an
``authorized_keys``, a secret) must hash the same before and after.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from apache_beam.io.filesystems import FileSystems

from pipeline import cleanup
from tools import streaming_output as so
from transforms.output import compaction, manifest
from transforms.output.layout import PartFileName, UnsafePath
from transforms.output.lease import PublishLease
from transforms.output.summary import RunSummary

RUN = "20261201T093000Z-1a2b3c4d"
SECRET = "AWS_SECRET_ACCESS_KEY=abc123"
KEY = "ssh-ed25519 AAAA... alice@laptop"
H09 = "dt=2026-12-01/hour=09"


def _manifest(**changes) -> dict:
    base = {"run_id": RUN, "state": "publishing", "started_at": 0.0, "vectors": [],
            "dead_letter": [], "summary": f"_staging/{RUN}/_summary.json", "counts": {}}
    return {**base, **changes}


# The review's manifests (§3, §13), and others a reader must refuse.
CRAFTED = {
    "delete_outside": _manifest(run_id="../../../victim", summary="_summary.json"),
    "overwrite_and_read_outside": _manifest(
        run_id="A/../../alice/.ssh", vectors=["_staging/A/../../alice/.ssh/authorized_keys"],
        summary="../../secret.txt"),
    "run_id_dotdot": _manifest(run_id="..", summary="_summary.json"),
    "run_id_unicode_digits": _manifest(run_id="٢٠٢٦١٢٠١T093000Z-1a2b3c4d"),
    "run_id_not_a_time": _manifest(run_id="99991399T999999Z-00000000", state="committed",
                                   summary="_summary.json"),
    "absolute_path": _manifest(vectors=["/etc/passwd"]),
    "dotdot_in_staged_path": _manifest(vectors=[f"_staging/{RUN}/vectors/../../../../x"]),
    "backslash": _manifest(vectors=[f"_staging/{RUN}/vectors\\..\\..\\x"]),
    "empty_segment": _manifest(vectors=[f"_staging/{RUN}//vectors/x.parquet"]),
    "another_runs_staging": _manifest(vectors=["_staging/20261130T000000Z-00000000/vectors/x"]),
    "wrong_folder": _manifest(vectors=[f"_staging/{RUN}/dead_letter/x.jsonl"]),
    "committed_outside": _manifest(state="committed", vectors=["../victim/important.txt"],
                                   summary="_summary.json"),
    "summary_elsewhere": _manifest(state="committed", summary="vectors/_summary.json"),
    "unknown_state": _manifest(state="published"),
    "previous_crafted": _manifest(skipped_from=[{"prefix": "x"}],
                                  previous=_manifest(run_id="../../../victim")),
}


def sandbox(tmp_path: Path) -> tuple[Path, Path]:
    """``<tmp>/a/out`` (an output with a published run) beside what an attacker wants."""
    out = tmp_path / "a" / "out"
    for name, text in {"victim/important.txt": "important", "victim/sub/data.bin": "data",
                       "alice/.ssh/authorized_keys": KEY, "secret.txt": SECRET,
                       "a/out/vectors/part-x.parquet": "rows",
                       # what the crafted manifest B names as its staged file
                       "a/out/alice/.ssh/authorized_keys": "ssh-ed25519 AAAA... ATTACKER",
                       "a/out/_staging/A/keep": "x"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path, out


def outside_hash(root: Path, out: Path) -> str:
    """A hash of every file, folder and link under ``root`` but not under ``out``."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == out or out in here.parents:
            continue
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = here / name
            h.update(str(path.relative_to(root)).encode())
            if path.is_symlink():
                h.update(os.readlink(path).encode())
            elif path.is_file():
                h.update(path.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_manifest_is_refused_naming_it(tmp_path, case):
    _, out = sandbox(tmp_path)
    (out / "_manifest.json").write_text(json.dumps(CRAFTED[case]))
    with pytest.raises(ValueError, match="_manifest.json"):
        manifest.read_manifest(str(out))


@pytest.mark.parametrize("case", ["delete_outside", "overwrite_and_read_outside",
                                  "run_id_dotdot", "committed_outside"])
def test_cleanup_refuses_a_crafted_manifest_and_touches_nothing(tmp_path, case, capsys):
    root, out = sandbox(tmp_path)
    text = json.dumps(CRAFTED[case])
    (out / "_manifest.json").write_text(text)
    before = outside_hash(root, out)
    assert cleanup.main(["--output", str(out), "--older-than-s", "0"]) == 1
    assert outside_hash(root, out) == before
    assert (out / "_manifest.json").read_text() == text  # not followed, not rewritten
    assert (out / "vectors" / "part-x.parquet").read_text() == "rows"
    assert not (out / "_summary.json").exists()
    report = json.loads(capsys.readouterr().out)
    assert "_manifest.json" in report["refused"]


def _gcs_write(path: str, data: bytes) -> None:
    with FileSystems.create(path) as f:
        f.write(data)


def _gcs_tree(prefix: str) -> dict:
    found = {}
    for m in FileSystems.match([prefix + "**"])[0].metadata_list:
        with FileSystems.open(m.path) as f:
            found[m.path] = hashlib.sha256(f.read()).hexdigest()
    return found


@pytest.mark.parametrize("case", ["delete_outside", "overwrite_and_read_outside",
                                  "run_id_dotdot", "committed_outside"])
def test_on_gcs_cleanup_refuses_a_crafted_manifest(gcs, tmp_path, case, capsys):
    from tests.common import GCS_BUCKET

    root = f"gs://{GCS_BUCKET}/{tmp_path.name}/"
    out = root + "a/out"
    for name, text in {"victim/important.txt": "important", "alice/.ssh/authorized_keys": KEY,
                       "secret.txt": SECRET, "a/out/vectors/part-x.parquet": "rows",
                       }.items():
        _gcs_write(root + name, text.encode())
    text = json.dumps(CRAFTED[case]).encode()
    _gcs_write(out + "/_manifest.json", text)
    outside = {p: h for p, h in _gcs_tree(root).items() if not p.startswith(out + "/")}
    assert cleanup.main(["--output", out, "--older-than-s", "0"]) == 1
    after = _gcs_tree(root)
    assert {p: h for p, h in after.items() if not p.startswith(out + "/")} == outside
    with FileSystems.open(out + "/_manifest.json") as f:
        assert f.read() == text
    assert out + "/_summary.json" not in after
    assert "_manifest.json" in json.loads(capsys.readouterr().out)["refused"]


def _old(path: Path, text: str = "x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    past = time.time() - 3 * 86400
    os.utime(path, (past, past))


@pytest.mark.parametrize("folder", ["_temp", "_staging", "vectors"])
def test_cleanup_refuses_a_symlinked_folder(tmp_path, folder, capsys):
    """§4: ``out/_temp -> victim/`` (or ``_staging``, or a published folder with a committed
    manifest): the clean-up listed through the link and deleted the victim's old files."""
    root, out = sandbox(tmp_path)
    _old(root / "victim" / "thesis.tex")
    _old(root / "victim" / "photos" / "2019.jpg")
    if folder == "vectors":
        (out / "vectors" / "part-x.parquet").unlink()
        (out / "vectors").rmdir()
        (out / "_manifest.json").write_text(json.dumps(
            _manifest(state="committed", summary="_summary.json")))
    else:
        (out / "_staging" / "A" / "keep").unlink()
        (out / "_staging" / "A").rmdir()
        if folder == "_staging":
            (out / "_staging").rmdir()
    (out / folder).symlink_to(root / "victim", target_is_directory=True)
    before = outside_hash(root, out)
    assert cleanup.main(["--output", str(out), "--older-than-s", "0"]) == 1
    assert outside_hash(root, out) == before
    report = json.loads(capsys.readouterr().out)
    assert "symlink" in report["refused"] and folder in report["refused"]


def test_compaction_refuses_a_symlinked_partition_folder(tmp_path):
    """A partition folder linked elsewhere: compaction took the ``compacted-*`` files it found
    there for a killed run's leftovers and deleted them."""
    root, out = sandbox(tmp_path)
    _old(root / "victim" / "compacted-20261201T000000Z-00000000.parquet")
    (out / "vectors" / "dt=2026-12-01").mkdir(parents=True)
    (out / "vectors" / "dt=2026-12-01" / "hour=09").symlink_to(root / "victim")
    before = outside_hash(root, out)
    with PublishLease(str(out), "compact", lease_s=30) as lease:
        with pytest.raises(ValueError, match="symlink"):
            compaction.compact_partition(str(out), H09, lease, 16)
    assert outside_hash(root, out) == before


def test_compaction_refuses_a_crafted_compaction_manifest(tmp_path):
    """§5: a manifest whose current ledger file is ``../../secret.env``: compaction copied the
    secret into the output's compacted ledger file."""
    root, out = sandbox(tmp_path)
    (root / "secret.env").write_text(SECRET + "\n")
    so.write(str(out), so.micro_batches(4, windows=1, shards=1), row_group_rows=16)
    crafted = {"partition": H09, "compaction_id": RUN, "compacted_at": "2026-12-01T10:00:00",
               "files": {"ledger": {"path": "../../secret.env", "rows": 1}}, "batches": []}
    path = out / "_compaction" / H09 / "manifest.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(crafted))
    before = outside_hash(root, out)
    with PublishLease(str(out), "compact", lease_s=30) as lease:
        with pytest.raises(ValueError, match="manifest.json"):
            compaction.compact_partition(str(out), H09, lease, 16)
    assert outside_hash(root, out) == before
    assert not any(SECRET in p.read_text(errors="replace")
                   for p in out.rglob("*") if p.is_file() and p.suffix == ".jsonl")


@pytest.mark.parametrize("bad", [
    {"files": {"ledger": {"path": f"ledger/{H09}/../../../../x.jsonl", "rows": 1}}},
    {"files": {"vectors": {"path": f"ledger/{H09}/compacted-{RUN}.jsonl", "rows": 1}}},
    {"files": {"vectors": {"path": f"vectors/dt=2026-12-01/hour=10/compacted-{RUN}.parquet",
                           "rows": 1}}},
    {"partition": "dt=2026-12-01/hour=10"},
    {"batches": [{"record": "/etc/passwd", "files": {}}]},
    {"batches": [{"record": f"ledger/{H09}/x.json", "files": {"vectors": "../x.parquet"}}]},
], ids=["dotdot", "wrong_kind", "wrong_partition", "partition", "absolute_record",
        "dotdot_batch"])
def test_a_crafted_compaction_manifest_is_refused_on_read(tmp_path, bad):
    good = {"partition": H09, "compaction_id": RUN, "compacted_at": "2026-12-01T10:00:00",
            "files": {"ledger": {"path": f"ledger/{H09}/compacted-{RUN}.jsonl", "rows": 1}},
            "batches": []}
    path = tmp_path / "_compaction" / H09 / "manifest.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(good))
    assert compaction.read_compaction(str(tmp_path), H09) is not None
    path.write_text(json.dumps({**good, **bad}))
    with pytest.raises(ValueError, match="manifest.json"):
        compaction.read_compaction(str(tmp_path), H09)


@pytest.mark.parametrize("name", [
    "part-٢٠٢٦١٢٠١T095900Z-001-00000-of-00004-0123456789abcdef.parquet",
    "part-20261301T995900Z-001-00000-of-00004-0123456789abcdef.parquet",
    "part-..-20261201T095900Z-001-00000-of-00004.parquet",
])
def test_a_name_that_is_not_ours_parses_to_none(name):
    """§13: a stray file crashed ``newsvec ledger`` (``parse`` raised ValueError)."""
    assert PartFileName.parse(name) is None


def test_cleanup_names_every_file_and_folder_a_repair_removed(tmp_path, capsys):
    """A repaired publish deletes its staging folder: the report names it and its files (before,
    ``deleted: 0`` said nothing of them)."""
    out = tmp_path / "out"
    staged = out / "_staging" / RUN
    (staged / "vectors").mkdir(parents=True)
    (staged / "vectors" / f"part-{RUN}-00000-of-00001.parquet").write_text("rows")
    (staged / "_summary.json").write_text(json.dumps({"run_id": RUN}))
    (out / "_manifest.json").write_text(json.dumps(_manifest(
        vectors=[f"_staging/{RUN}/vectors/part-{RUN}-00000-of-00001.parquet"])))
    assert cleanup.main(["--output", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["repaired_run"] == RUN
    removed = sorted(os.path.relpath(p, out) for p in report["repair_removed"])
    assert removed == [f"_staging/{RUN}", f"_staging/{RUN}/_summary.json",
                       f"_staging/{RUN}/vectors",
                       f"_staging/{RUN}/vectors/part-{RUN}-00000-of-00001.parquet"]
    assert not staged.exists()


@pytest.fixture(scope="module")
def stream(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stream") / "out"
    so.write(str(out), so.micro_batches(6, windows=1, shards=1), row_group_rows=16)
    return out


def test_a_stray_file_does_not_crash_the_ledger(stream, tmp_path):
    """§13: ``newsvec ledger`` died on a file named like a micro-batch's with no such date."""
    from pipeline import ledger

    out = tmp_path / "out"
    shutil.copytree(stream, out)
    assert ledger.check(str(out)).ok
    (out / "vectors" / H09 / "part-20261301T995900Z-001-00000-of-00004-0123456789abcdef.parquet"
     ).write_bytes(b"stray")
    ledger.check(str(out))  # a stray name is not one of ours: no ValueError


@pytest.mark.parametrize("stray", ["not json", "a fifo", "not utf-8"])
def test_a_stray_file_among_the_ledger_records_is_named_not_a_crash_or_a_wait(
        stream, tmp_path, stray):
    # Anyone who can write the output leaves a file among the ledger records: newsvec ledger names
    # it as a problem (the ledger does not balance) instead of ending in a traceback, or waiting
    # for ever on a FIFO that nobody writes.
    import threading

    from pipeline import ledger

    out = tmp_path / "out"
    shutil.copytree(stream, out)
    junk = out / "ledger" / H09 / "junk.json"
    if stray == "a fifo":
        os.mkfifo(junk)
    else:
        junk.write_bytes(b"\xff\xfe{" if stray == "not utf-8" else b"{ this is not a record")
    result: dict = {}

    def check() -> None:
        try:
            result["report"] = ledger.check(str(out))
        except Exception as exc:  # pylint: disable=broad-except  # the test reads it
            result["error"] = exc

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert "error" not in result, f"newsvec ledger ended in {result['error']!r}"
    assert "report" in result, "newsvec ledger waited on the stray file"
    report = result["report"]
    assert not report.ok
    assert any(f"ledger/{H09}/junk.json is not a ledger record" in p for p in report.problems), \
        report.problems


def test_a_ledger_record_naming_a_file_outside_is_refused(stream, tmp_path):
    from pipeline import ledger

    root = tmp_path
    out = root / "a" / "out"
    shutil.copytree(stream, out)
    (root / "secret.parquet").write_text(SECRET)
    (record_path,) = (out / "ledger" / H09).glob("*.json")
    record = json.loads(record_path.read_text())
    record["vectors_file"] = "../../secret.parquet"
    record_path.write_text(json.dumps(record))
    before = outside_hash(root, out)
    report = ledger.check(str(out))  # named, never followed; the other records still checked
    assert not report.ok and any(record_path.name in p and "refused, not followed" in p
                                 for p in report.problems), report.problems
    with PublishLease(str(out), "compact", lease_s=30) as lease:
        with pytest.raises(ValueError, match=record_path.name):
            compaction.compact_partition(str(out), H09, lease, 16)
    assert outside_hash(root, out) == before


def test_the_batch_commit_refuses_a_crafted_manifest(tmp_path):
    """§3: a ``publishing`` manifest whose run id sorts after the new run's is finished by the
    next batch commit (``CommitRun``) before it publishes: it deleted ``victim/``."""
    from transforms import commit

    root, out = sandbox(tmp_path)
    (out / "_staging" / "zz").mkdir()  # for the kernel to resolve its ..
    (out / "_manifest.json").write_text(json.dumps(
        _manifest(run_id="zz/../../../../victim", summary="_summary.json")))
    before = outside_hash(root, out)
    with pytest.raises(ValueError, match="_manifest.json"):
        list(commit._CommitFn(str(out), RUN, RunSummary(), lease_s=30).process(None, [], {}))
    assert outside_hash(root, out) == before


@pytest.mark.parametrize("name", ["*", "part-[a-z]*", "?art-a.parquet"])
def test_a_stray_named_like_a_pattern_deletes_only_itself(tmp_path, name):
    # Beam's local delete takes each path for a glob pattern: a stray file named "*" in vectors/
    # would take the committed run's files with it. A stray is deleted by its name alone.
    out = tmp_path / "out"
    (out / "vectors").mkdir(parents=True)
    (out / "vectors" / "part-a.parquet").write_text("the committed run's rows")
    (out / "_summary.json").write_text("{}")
    committed = _manifest(state="committed", vectors=["vectors/part-a.parquet"],
                          summary="_summary.json")
    (out / "_manifest.json").write_text(json.dumps(committed))
    (out / "vectors" / name).write_text("stray")
    with PublishLease(str(out), "cleanup", 360) as lease:
        strays = manifest.remove_strays(str(out), lease)
    assert [os.path.basename(s) for s in strays] == [name]
    assert sorted(os.listdir(out / "vectors")) == ["part-a.parquet"]
    assert manifest.missing_files(str(out)) == []


@pytest.mark.parametrize("entry", ["a folder of symlinks", "a symlink"])
def test_a_publish_copies_only_regular_files_never_through_a_symlink(tmp_path, capsys, entry):
    # A well-formed publishing manifest names a staged entry that is a folder holding symlinks to
    # files outside (Beam's local copy copies a folder whole, following every link in it), or a
    # symlink itself: finishing that publish must not copy anything from outside into vectors/.
    root, out = sandbox(tmp_path)
    staged = out / "_staging" / RUN / "vectors"
    staged.mkdir(parents=True)
    if entry == "a symlink":
        (staged / "d").symlink_to(root / "secret.txt")
    else:
        (staged / "d").mkdir()
        (staged / "d" / "secret").symlink_to(root / "secret.txt")
        (staged / "d" / "ssh").symlink_to(root / "alice" / ".ssh")
    (out / "_staging" / RUN / "_summary.json").write_text(json.dumps({"run_id": RUN}))
    (out / "_manifest.json").write_text(json.dumps(_manifest(
        vectors=[f"_staging/{RUN}/vectors/d"])))
    cleanup.main(["--output", str(out)])
    copied = [p for p in (out / "vectors").rglob("*") if p.is_file() and not p.is_symlink()]
    leaked = [p for p in copied if p.read_text() in (SECRET, KEY)]
    assert not leaked, f"copied from outside the output: {leaked}"
    assert json.loads((out / "_manifest.json").read_text())["state"] != "committed"


# A local attacker who can write into the output swaps what newsvec reads, deletes, copies or
# renames there for a symlink (or a FIFO): compaction, publishing, the lease and the readers of the
# manifest and the summary follow no symlink below the output when they act, not only when they
# check, and never wait on a FIFO.

@pytest.fixture(scope="module")
def lettered(tmp_path_factory) -> Path:
    """A streaming output of one micro-batch with a dead letter (one message in 20)."""
    out = tmp_path_factory.mktemp("lettered") / "out"
    so.write(str(out), so.micro_batches(20, windows=1, shards=1), row_group_rows=16)
    return out


def _compactable(stream: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    out = root / "a" / "out"
    shutil.copytree(stream, out)
    (root / "secret.txt").write_text(SECRET + "\n")
    return root, out


def _secret_parquet_like(part: Path, target: Path) -> None:
    """A Parquet file of the part's schema whose ids are the secret."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(part)
    ids = pa.array([SECRET] * table.num_rows, type=table.schema.field("id").type)
    pq.write_table(table.set_column(table.schema.get_field_index("id"), "id", ids), target)


def _leaked(out: Path) -> list[Path]:
    found = []
    for path in out.rglob("*"):
        if path.is_file() and not path.is_symlink() and SECRET.encode() in path.read_bytes():
            found.append(path)
        elif path.is_file() and not path.is_symlink() and path.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                if SECRET in pq.read_table(path).column("id").to_pylist():
                    found.append(path)
            except Exception:  # pylint: disable=broad-except  # not a Parquet file: no rows
                pass
    return found


@pytest.mark.parametrize("kind", ["vectors", "dead_letter"])
def test_compaction_never_reads_a_source_swapped_for_a_symlink(lettered, tmp_path, kind):
    # A micro-batch file replaced by a symlink to a file outside the output: compaction copied
    # the file's bytes (rows) into its compacted file, which any reader of the output reads.
    root, out = _compactable(lettered, tmp_path)
    suffix = ".parquet" if kind == "vectors" else ".jsonl"
    part = sorted((out / kind / H09).glob(f"part-*{suffix}"))[0]
    if kind == "vectors":
        _secret_parquet_like(part, root / "secret.parquet")
        target = root / "secret.parquet"
    else:
        target = root / "secret.txt"
    part.unlink()
    part.symlink_to(target)
    before = outside_hash(root, out)
    with PublishLease(str(out), "compact", lease_s=30) as lease:
        with pytest.raises(ValueError, match=f"{part.name} is a symlink"):
            compaction.compact_partition(str(out), H09, lease, 16)
    assert outside_hash(root, out) == before
    assert not _leaked(out), "the file outside was copied into the output"
    assert not list(out.rglob("compacted-*")), "nothing is written before the refusal"


def _within(seconds: float, action) -> dict:
    """``action()`` in a thread: {"result": ...} or {"error": ...}, {} if it did not end."""
    import threading

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = action()
        except Exception as exc:  # pylint: disable=broad-except  # the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    return outcome


def _unblock(fifo: Path) -> None:
    """Let a reader stuck opening the FIFO go (its open returns, then end of file)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody is reading it


@pytest.mark.parametrize("kind", ["vectors", "dead_letter", "ledger"])
def test_compaction_never_waits_on_a_fifo_among_its_sources(lettered, tmp_path, kind):
    # A FIFO in place of a micro-batch file (or its ledger record): compaction opened it and
    # waited for a writer for ever, holding the output's lease, so that no publish, compaction or
    # clean-up of the output could run again.
    _, out = _compactable(lettered, tmp_path)
    suffix = {"vectors": ".parquet", "dead_letter": ".jsonl", "ledger": ".json"}[kind]
    part = sorted((out / kind / H09).glob(f"part-*{suffix}"))[0]
    part.unlink()
    os.mkfifo(part)

    def compact():
        with PublishLease(str(out), "compact", lease_s=30) as lease:
            return compaction.compact_partition(str(out), H09, lease, 16)

    try:
        outcome = _within(30, compact)
    finally:
        _unblock(part)
    assert outcome, "compaction waited on the FIFO"
    assert isinstance(outcome.get("error"), ValueError), outcome
    assert part.name in str(outcome["error"])
    assert not list(out.rglob("compacted-*"))


def _swap_for_symlink(folder: Path, to: Path) -> None:
    folder.rename(folder.with_name(folder.name + ".moved"))
    folder.symlink_to(to, target_is_directory=True)


def _race(monkeypatch, module, swap, at: int = 1) -> None:
    """``module.require_inside`` checks, then, after its ``at``-th check, ``swap()`` runs once:
    the folder changes between that check and the operation, as a racing attacker would make
    it."""
    real = module.require_inside
    calls: list = []

    def check_then_swap(output, *paths):
        real(output, *paths)
        calls.append(paths)
        if len(calls) == at:
            swap()

    monkeypatch.setattr(module, "require_inside", check_then_swap)


def test_a_delete_never_follows_a_folder_swapped_after_its_check(tmp_path, monkeypatch):
    # remove_strays checked vectors/ (a plain folder), then vectors/ became a symlink to a folder
    # outside holding a file of the stray's name: the delete by path followed it.
    root, out = sandbox(tmp_path)
    (out / "vectors" / "stray.parquet").write_text("stray")
    (root / "victim" / "stray.parquet").write_text("the victim's file")
    (out / "_summary.json").write_text("{}")
    (out / "_manifest.json").write_text(json.dumps(_manifest(
        state="committed", vectors=["vectors/part-x.parquet"], summary="_summary.json")))
    before = outside_hash(root, out)
    _race(monkeypatch, manifest, lambda: _swap_for_symlink(out / "vectors", root / "victim"))
    with PublishLease(str(out), "cleanup", 360) as lease:
        with pytest.raises(ValueError, match="symlink"):
            manifest.remove_strays(str(out), lease)
    assert outside_hash(root, out) == before


def test_a_publish_never_copies_through_a_folder_swapped_after_its_check(tmp_path, monkeypatch):
    # The publish checked _staging/<run>/vectors (a plain folder), then it became a symlink to a
    # folder outside holding a file of the staged file's name: the copy followed it (O_NOFOLLOW
    # only guards the last segment) and published the file from outside.
    root, out = sandbox(tmp_path)
    name = f"part-{RUN}-00000-of-00001.parquet"
    staged = out / "_staging" / RUN / "vectors"
    staged.mkdir(parents=True)
    (staged / name).write_text("rows")
    (root / "victim" / name).write_text(SECRET)
    (out / "_staging" / RUN / "_summary.json").write_text(json.dumps({"run_id": RUN}))
    (out / "vectors" / "part-x.parquet").unlink()
    publishing = manifest.Manifest.from_dict(_manifest(vectors=[f"_staging/{RUN}/vectors/{name}"]))
    (out / "_manifest.json").write_text(publishing.to_json())
    before = outside_hash(root, out)
    _race(monkeypatch, manifest, lambda: _swap_for_symlink(staged, root / "victim"))
    with PublishLease(str(out), "publish", 360) as lease:
        with pytest.raises(ValueError, match="symlink"):
            manifest.publish(str(out), publishing, lease)
    assert outside_hash(root, out) == before
    assert not _leaked(out / "vectors"), "a file from outside was published"


def test_compaction_never_follows_a_partition_swapped_after_its_check(stream, tmp_path,
                                                                       monkeypatch):
    # Compaction checked the compacted file's target (vectors/<partition>/compacted-<id>, in a
    # plain folder), then the partition became a symlink to a folder outside: the rename put the
    # compacted file there.
    root, out = _compactable(stream, tmp_path)
    partition = out / "vectors" / H09
    victim = root / "victim"
    victim.mkdir()
    for part in partition.glob("part-*.parquet"):
        _secret_parquet_like(part, victim / part.name)
    before = outside_hash(root, out)
    _race(monkeypatch, compaction.layout, lambda: _swap_for_symlink(partition, victim), at=2)
    with PublishLease(str(out), "compact", lease_s=30) as lease:
        with pytest.raises(ValueError, match="symlink"):
            compaction.compact_partition(str(out), H09, lease, 16)
    assert outside_hash(root, out) == before
    assert not _leaked(out), "rows from outside were compacted into the output"


def test_a_publish_lease_is_not_blocked_by_someone_else_flocking_the_folder(tmp_path):
    # Anyone who could read the output folder could open it and take the flock the local lease
    # took on it: every publish, compaction and clean-up of the output then waited for ever.
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    other = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)

        def take():
            with PublishLease(str(out), "publish", lease_s=30):
                return True

        outcome = _within(20, take)
    finally:
        os.close(other)
    assert outcome == {"result": True}, outcome or "the publish waited on the folder's flock"


@pytest.mark.parametrize("name", ["_publish.lock.flock", "_publish.lock"])
def test_a_symlinked_publish_lock_is_refused(tmp_path, name):
    root, out = sandbox(tmp_path)
    (out / name).symlink_to(root / "secret.txt")
    before = outside_hash(root, out)
    outcome = _within(20, lambda: PublishLease(str(out), "publish", lease_s=30).acquire())
    assert outcome, "the lease waited"
    assert isinstance(outcome.get("error"), (OSError, ValueError)), outcome
    assert name in str(outcome["error"]) and "refused" in str(outcome["error"])
    assert not isinstance(outcome["error"], json.JSONDecodeError), "it read the file outside"
    assert outside_hash(root, out) == before
    assert (root / "secret.txt").read_text() == SECRET


@pytest.mark.parametrize("entry", ["a symlink", "a fifo"])
def test_a_manifest_that_is_not_a_regular_file_of_the_output_is_refused(tmp_path, entry):
    # A _manifest.json symlinked to a manifest outside was followed (read as the output's own),
    # and a FIFO there made every reader wait for ever.
    root, out = sandbox(tmp_path)
    elsewhere = root / "victim" / "_manifest.json"
    elsewhere.write_text(json.dumps(_manifest(state="committed", summary="_summary.json")))
    if entry == "a symlink":
        (out / "_manifest.json").symlink_to(elsewhere)
    else:
        os.mkfifo(out / "_manifest.json")
    try:
        outcome = _within(20, lambda: manifest.read_manifest(str(out)))
    finally:
        if entry == "a fifo":
            _unblock(out / "_manifest.json")
    assert outcome, "the reader waited on the FIFO"
    assert isinstance(outcome.get("error"), ValueError), outcome
    assert "_manifest.json" in str(outcome["error"])


def test_a_summary_symlinked_outside_is_never_echoed(tmp_path):
    # _summary.json symlinked to a JSON file outside that names the committed run: newsvec took
    # it for the run's summary and printed it (``newsvec run``, ``backfill``).
    root, out = sandbox(tmp_path)
    (root / "secret.json").write_text(json.dumps({"run_id": RUN, "secret": SECRET}))
    (out / "_summary.json").symlink_to(root / "secret.json")
    (out / "_manifest.json").write_text(json.dumps(_manifest(
        state="committed", vectors=["vectors/part-x.parquet"], summary="_summary.json")))
    summary = manifest.published_summary(str(out))
    assert SECRET not in json.dumps(summary.to_dict())
    assert summary.summary_unavailable


@pytest.mark.parametrize("skipped", [
    [{"prefix": "../../victim", "run_id": None}],
    [{"prefix": "victim", "run_id": RUN}],
    [{"prefix": "/tmp/a/../../etc", "run_id": RUN}],
    [{"prefix": "/tmp/prev", "run_id": None, "pins": [["../../secret.txt", "0"]]}],
    [{"prefix": "/tmp/prev", "run_id": "../x"}],
    ["/tmp/prev"],
], ids=["relative_dotdot", "relative", "dotdot", "pin_outside", "run_id", "not_a_snapshot"])
def test_a_crafted_skipped_from_is_refused_on_read(tmp_path, skipped):
    # The snapshots a publishing manifest records are checked (read, hashed) before its publish:
    # any prefix or pin was taken, so a crafted manifest made the publish read (and wait on) any
    # file it named.
    _, out = sandbox(tmp_path)
    (out / "_manifest.json").write_text(json.dumps(_manifest(skipped_from=skipped)))
    with pytest.raises(ValueError, match="_manifest.json"):
        manifest.read_manifest(str(out))


def test_a_skipped_from_naming_the_output_itself_is_refused(tmp_path):
    _, out = sandbox(tmp_path)
    crafted = manifest.Manifest.from_dict(_manifest(
        skipped_from=[{"prefix": str(out / "vectors"), "run_id": None}]))
    (out / "_manifest.json").write_text(crafted.to_json())
    with PublishLease(str(out), "publish", 360) as lease:
        with pytest.raises(ValueError, match="_manifest.json"):
            manifest.check_snapshots(str(out), crafted, lease)


def test_a_fifo_among_a_previous_outputs_key_files_is_not_waited_on(stream, tmp_path):
    from transforms.output.key_checksums import key_file_checksums

    out = tmp_path / "prev"
    shutil.copytree(stream, out)
    fifo = out / "keys" / H09 / "part-20261201T095900Z-001-00000-of-00004-0123456789abcdef.parquet"
    os.mkfifo(fifo)
    try:
        outcome = _within(20, lambda: key_file_checksums(str(out)))
    finally:
        _unblock(fifo)
    assert "result" in outcome, outcome or "it waited on the FIFO"
    assert os.path.relpath(fifo, out) not in outcome["result"]


# Readers of an output's files (the batch commit's counts, newsvec load, search, the key index,
# the ledger, the current-vector reader) open each through ``layout.open_output_file``: a file a
# writer of the output swapped for a symlink to a file outside is never read as the output's, and
# a FIFO in its place is refused at once (UnsafePath naming it), never waited on.

STAGED_RUN = "20261201T000000Z-0000000c"
NEWER_RUN = "20261202T000000Z-0000000d"


def _swap(path: Path, entry: str, outside: Path) -> None:
    """Put a symlink to ``outside``, or a FIFO, in place of ``path``."""
    path.unlink()
    if entry == "a symlink":
        path.symlink_to(outside)
    else:
        os.mkfifo(path)


def _outside_rows(root: Path, ids: list[str]) -> Path:
    """Another output of the same user (its one vectors and keys file of ``ids``), beside ours."""
    from tests.output.test_concurrent_commits import hand_staged_run

    hand_staged_run(str(root / "private"), "20261130T000000Z-0000000a", ids)
    return root / "private"


def _staged_for_commit(root: Path, kind: str) -> tuple[Path, list, dict, Path]:
    """A run stopped before its commit (vectors, keys, and one dead letter), and the staged file
    of ``kind``."""
    from tests.output.test_concurrent_commits import hand_staged_run

    out = root / "a" / "out"
    staged, tallies = hand_staged_run(str(out), STAGED_RUN, ["a", "b"])
    letter = (out / "_staging" / STAGED_RUN / "dead_letter"
              / f"part-{STAGED_RUN}-00000-of-00001.jsonl")
    letter.parent.mkdir(parents=True)
    letter.write_text(json.dumps({"event_id": "c", "reason": "invalid_json"}) + "\n")
    staged.append(("dead_letter", str(letter)))
    tallies = {**tallies, "in": tallies["in"] + 1}
    suffix = ".jsonl" if kind == "dead_letter" else ".parquet"
    (path,) = [Path(p) for d, p in staged if d == kind and p.endswith(suffix)]
    return out, staged, tallies, path


@pytest.mark.parametrize("kind", ["vectors", "keys", "dead_letter"])
@pytest.mark.parametrize("entry", ["a symlink", "a fifo"])
def test_the_batch_commit_never_reads_or_waits_on_a_staged_file_swapped(tmp_path, kind, entry,
                                                                        monkeypatch):
    # A staged file swapped, after the run wrote it, for a symlink to a file outside (another
    # output's 7 rows, a dead-letter file elsewhere) or a FIFO: the commit's counts
    # (layout.parquet_rows, manifest.dead_letter_reasons) read the file outside (its row count in
    # the AccountingError), or blocked in open() for ever while holding the publish lease, which
    # its renewer kept fresh: no newer run or clean-up of the output could go on. Now it is
    # refused before the lease is even taken.
    from transforms import commit
    from transforms.commit import _CommitFn

    leases: list = []

    class CountedLease(PublishLease):
        def acquire(self):
            leases.append(self)
            return super().acquire()

    monkeypatch.setattr(commit, "PublishLease", CountedLease)

    root = tmp_path
    out, staged, tallies, path = _staged_for_commit(root, kind)
    private = _outside_rows(root, [f"secret-{n}" for n in range(7)])
    outside = next((private / "_staging").rglob(f"{kind}/*.parquet"), None) \
        or root / "letters.jsonl"
    if kind == "dead_letter":
        outside.write_text("".join(json.dumps({"reason": f"secret-{n}"}) + "\n" for n in range(7)))
    _swap(path, entry, outside)
    before = outside_hash(root, out)
    try:
        outcome = _within(30, lambda: list(_CommitFn(str(out), STAGED_RUN, RunSummary(),
                                                     lease_s=360).process(None, staged, tallies)))
    finally:
        if entry == "a fifo":
            _unblock(path)
    assert outcome, "the commit waited on the FIFO"
    assert isinstance(outcome.get("error"), UnsafePath), outcome
    assert f"{path.name} is " in str(outcome["error"]), outcome["error"]
    assert not (out / "_manifest.json").exists(), "nothing is published"
    assert leases == [], "refused before the publish lease is taken"
    assert outside_hash(root, out) == before
    _the_lease_is_free(out)


def _the_lease_is_free(out: Path) -> None:
    """A newer run takes the output's publish lease at once: nobody holds it."""
    newer = PublishLease(str(out), NEWER_RUN, lease_s=360)
    taken = _within(10, newer.acquire)
    assert taken, "a newer run still waits for the lease"
    newer.release()
    assert "error" not in taken, taken


SECRET_IDS = [f"secret-{n}" for n in range(3)]


@pytest.fixture
def committed_pair(tmp_path) -> tuple[Path, Path, Path]:
    """``<tmp>/a/out`` holding run ``STAGED_RUN`` committed (ids a, b), and beside it another
    output of the same user (``<tmp>/private``) holding ``SECRET_IDS`` committed."""
    from tests.output.test_concurrent_commits import hand_staged_run
    from transforms.commit import _CommitFn

    out, private = tmp_path / "a" / "out", tmp_path / "private"
    for where, run, ids in ((out, STAGED_RUN, ["a", "b"]),
                            (private, "20261130T000000Z-0000000a", SECRET_IDS)):
        list(_CommitFn(str(where), run, RunSummary(), lease_s=360).process(
            None, *hand_staged_run(str(where), run, ids)))
    return tmp_path, out, private


def _published(output: Path, kind: str) -> Path:
    (path,) = (output / kind).glob("*.parquet")
    return path


def _refused_at_once(action, swapped: Path, entry: str, error=ValueError) -> Exception:
    """``action()`` ends within 20 s in ``error`` naming ``swapped`` (a FIFO freed after)."""
    try:
        outcome = _within(20, action)
    finally:
        if entry == "a fifo":
            _unblock(swapped)
    assert outcome, f"it waited on the FIFO {swapped.name}"
    assert "error" in outcome, f"it read {swapped.name} and returned {outcome['result']!r}"
    assert isinstance(outcome["error"], error), outcome
    assert f"{swapped.name} is " in str(outcome["error"]), outcome["error"]
    return outcome["error"]


@pytest.mark.parametrize("entry", ["a symlink", "a fifo"])
def test_newsvec_load_never_stores_a_file_swapped_in_the_output(committed_pair, entry):
    # A published vectors file swapped for a symlink to another output's: newsvec load stored
    # that output's rows (secret-0..2) as this run's; a FIFO there made it wait for ever.
    from pipeline.load import run_rows
    from transforms.stores.base import StoreLoadFailed

    _, out, private = committed_pair
    part = _published(out, "vectors")
    _swap(part, entry, _published(private, "vectors"))
    error = _refused_at_once(lambda: run_rows(str(out), STAGED_RUN), part, entry,
                             StoreLoadFailed)
    assert "UnsafePath" in str(error)


def _as_chunks(vectors: Path, target: Path) -> Path:
    """A chunks file of one chunk per row of a vectors file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(vectors, columns=["id", "embedding"])
    pq.write_table(table.append_column("chunk_index", pa.array([0] * table.num_rows, pa.int32())),
                   target)
    return target


@pytest.mark.parametrize("kind", ["vectors", "chunks"])
@pytest.mark.parametrize("entry", ["a symlink", "a fifo"])
def test_newsvec_search_never_reads_a_file_swapped_in_the_output(committed_pair, monkeypatch,
                                                                 entry, kind):
    # newsvec search listed vectors/ (and chunks/) and read each file through Beam: a symlink to
    # another output's vectors returned its articles (secret-0..2) as hits; a FIFO hung it.
    from pipeline import search
    from tests.common import make_config
    from tests.fakes import FakeEngine

    root, out, private = committed_pair
    outside = _published(private, "vectors")
    if kind == "chunks":  # outputs with chunks (one per article): ours swapped, vectors stay
        _as_chunks(_published(out, "vectors"), out / "chunks" / "part-chunks.parquet")
        outside = _as_chunks(outside, root / "secret-chunks.parquet")
    part = _published(out, kind)
    _swap(part, entry, outside)
    config = make_config(output=str(out))
    monkeypatch.setattr(search, "embed_query",
                        lambda cfg, query: FakeEngine(cfg.model).embed([[1]])[0])
    _refused_at_once(lambda: search.search(config, "anything", k=10), part, entry, UnsafePath)


@pytest.mark.parametrize("entry", ["a symlink", "a fifo"])
def test_the_incremental_key_index_never_reads_a_key_file_swapped(committed_pair, monkeypatch,
                                                                  entry):
    # A previous output's key file swapped for a symlink to another output's keys: the skip
    # counted those articles (secret-0..2) as already embedded there, and left them out of the
    # run; a FIFO hung every worker's index load (and the run) for ever.
    from transforms import incremental
    from transforms.incremental import KeyFiles
    from transforms.output.key_index import ProcessCache
    from transforms.output.manifest import Snapshot

    monkeypatch.setattr(incremental, "_INDEXES", ProcessCache())
    _, out, private = committed_pair
    part = _published(out, "keys")
    _swap(part, entry, _published(private, "keys"))
    files = KeyFiles((Snapshot(str(out), STAGED_RUN),), ((str(part),),))
    _refused_at_once(lambda: incremental.key_index(files), part, entry, UnsafePath)


@pytest.mark.parametrize("kind", ["vectors", "dead_letter"])
@pytest.mark.parametrize("entry", ["a symlink", "a fifo"])
def test_newsvec_ledger_names_a_file_swapped_never_reads_or_waits(lettered, tmp_path, kind,
                                                                  entry):
    # A micro-batch's vectors file swapped for a symlink to a file outside with as many rows (or
    # its dead-letter file for one with as many lines): newsvec ledger read it and said the
    # output balances; a FIFO there made it wait for ever.
    from pipeline import ledger

    root, out = _compactable(lettered, tmp_path)
    suffix = ".parquet" if kind == "vectors" else ".jsonl"
    part = sorted((out / kind / H09).glob(f"part-*{suffix}"))[0]
    outside = root / f"outside{suffix}"
    if kind == "vectors":
        _secret_parquet_like(part, outside)
    else:
        shutil.copy(part, outside)
    _swap(part, entry, outside)
    try:
        outcome = _within(30, lambda: ledger.check(str(out)))
    finally:
        if entry == "a fifo":
            _unblock(part)
    assert outcome, "newsvec ledger waited on the FIFO"
    assert "result" in outcome, outcome
    report = outcome["result"]
    assert not report.ok, "a file outside was read as the output's"
    assert any(f"{part.name} is " in p and "refused" in p for p in report.problems), \
        report.problems


@pytest.mark.parametrize("entry", ["a symlink", "a fifo"])
def test_the_current_vector_reader_never_reads_a_file_swapped(committed_pair, entry):
    # transforms.output.current_vectors read every dt=*/vectors/*.parquet with pyarrow's dataset: a
    # symlink to another output's vectors made its articles (secret-0..2) current; a FIFO hung it.
    from transforms.output.current_vectors import current_vectors

    root, out, private = committed_pair
    days = root / "days"
    for day in ("2026-12-01", "2026-12-02"):
        shutil.copytree(out, days / f"dt={day}")
    part = _published(days / "dt=2026-12-02", "vectors")
    _swap(part, entry, _published(private, "vectors"))
    _refused_at_once(lambda: current_vectors(str(days)), part, entry, UnsafePath)
