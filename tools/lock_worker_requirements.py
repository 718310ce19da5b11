"""Write configs/worker-requirements.txt, the worker image's lock, from worker-requirements.in:
every package pip's resolver picks for the image (CPython 3.11, Linux x86_64, PyPI only), pinned,
with the sha256 of the file pip picks for it, which the Dockerfile installs with --require-hashes.

    python3.11 -m tools.lock_worker_requirements [--upgrade]

The versions already locked are kept (they constrain the resolution, as pip-compile keeps them);
``--upgrade`` resolves the .in afresh, to the newest versions it allows.

Run it with CPython 3.11 on Linux x86_64 with glibc 2.36, as in the image (Debian bookworm): pip
prefers the wheel with the most specific platform tag the interpreter supports, so the file,
and so the hash, is the one the image's pip picks. pip reads each wheel's metadata from PyPI (PEP
658) and takes each file's sha256 from PyPI's index: nothing large is downloaded. If a project later
uploads another file to a locked release that pip then prefers, the image build stops on its hash;
run this again.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOP_LEVEL = REPO / "configs" / "worker-requirements.in"
LOCK = REPO / "configs" / "worker-requirements.txt"
# As the Dockerfile installs: wheels only, but google-apitools (it has no wheel).
PIP_FLAGS = ["--only-binary=:all:", "--no-binary=google-apitools"]

HEADER = """\
# The GPU worker image's complete Python environment: every package pinned, as pip's resolver chose
# them from configs/worker-requirements.in for CPython 3.11 on Linux x86_64 (glibc >= 2.28), PyPI
# only, each with the sha256 of the file pip picks for it there. The Dockerfile installs exactly
# this file with --require-hashes: a file whose hash is not here is refused.
# tests/end_to_end/test_deploy_image.py resolves it against PyPI and checks those hashes.
# torch 2.13.0 from PyPI is the CUDA 13.0 build: workers need an NVIDIA driver >= 580.
# google-apitools 0.5.31 (the only version apache-beam[gcp] 2.77.0 accepts) has no wheel: it builds
# from its sdist (hash-checked; its build backend, fetched by pip for the build, is not);
# everything else installs from wheels.
#
# Regenerate with CPython 3.11 on Linux x86_64 (glibc 2.36, as in the image), PyPI only:
#   python3.11 -m tools.lock_worker_requirements
# --- pins
"""


def locked_pins() -> list[str]:
    """The lock's ``name==version`` lines, without their hashes (none if there is no lock)."""
    if not LOCK.exists():
        return []
    text = re.sub(r"\\\n", " ", LOCK.read_text())
    return [line.split()[0] for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def resolve(keep: list[str]) -> list[dict]:
    """pip's install report for the .in, held to the ``keep`` pins: what it would install, with
    the hashes of each file."""
    # PyPI alone, as in the image: no pip config files, wheel folders or constraints of this host.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "locked.txt"
        constraints.write_text("".join(f"{pin}\n" for pin in keep))
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--report", "-", *PIP_FLAGS, "-r", str(TOP_LEVEL), "-c", str(constraints)],
            capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pip could not resolve {TOP_LEVEL.name}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)["install"]


def lock_text(installs: list[dict]) -> str:
    lines = []
    for item in sorted(installs, key=lambda p: p["metadata"]["name"].lower()):
        name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{digest}\n")
    return HEADER + "".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--upgrade"]):
        raise SystemExit(__doc__)
    if sys.version_info[:2] != (3, 11) or (sys.platform, platform.machine()) != ("linux",
                                                                                  "x86_64"):
        raise SystemExit("run this with CPython 3.11 on Linux x86_64, as in the image")
    LOCK.write_text(lock_text(resolve([] if args else locked_pins())))
    print(f"wrote {LOCK.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
