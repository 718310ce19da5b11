"""Model and secret safety.

- ``trust_remote_code`` is off unless the operator's config turns it on: off by default, off in
  every shipped config.
- The run summary's model hash (``model.content_sha256``, tests/end_to_end/test_batch_pipeline.py
  checks it is there) changes when a model file changes, so a silently swapped model is visible.
- No secrets in the repository: no private keys, service-account key files, API keys or tokens in
  any tracked file, and no config or image that names a credentials file. Credentials come from the
  environment (Application Default Credentials), as Google's libraries expect.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline import config as config_lib
from transforms.engines.model_files import model_content_hash
from transforms.settings import ModelSettings

REPO = Path(config_lib.REPO_ROOT)


def test_trust_remote_code_is_off_by_default_and_in_every_shipped_config():
    assert ModelSettings.model_fields["trust_remote_code"].default is False
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        raw = yaml.safe_load(path.read_text())
        if "model" in (raw or {}):
            assert raw["model"].get("trust_remote_code", False) is False, path.name


def test_the_model_hash_sees_a_changed_renamed_or_added_model_file(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 384}')
    (model / "model.safetensors").write_bytes(b"\x00" * 1000)
    (model / "vocab.txt").write_text("[PAD]\n[CLS]\n")
    original = model_content_hash.__wrapped__(str(model))
    assert re.fullmatch(r"[0-9a-f]{64}", original)
    assert model_content_hash.__wrapped__(str(model)) == original, "deterministic"

    (model / "model.safetensors").write_bytes(b"\x00" * 999 + b"\x01")  # one byte
    changed = model_content_hash.__wrapped__(str(model))
    assert changed != original
    (model / "model.safetensors").write_bytes(b"\x00" * 1000)
    assert model_content_hash.__wrapped__(str(model)) == original

    (model / "vocab.txt").rename(model / "vocab2.txt")
    assert model_content_hash.__wrapped__(str(model)) != original
    (model / "vocab2.txt").rename(model / "vocab.txt")
    (model / "extra.bin").write_bytes(b"weights")
    assert model_content_hash.__wrapped__(str(model)) != original


# Patterns of real secrets, each with the public format it matches.
SECRET_PATTERNS = {
    "private key block": re.compile(
        r"-----BEGIN (?:RSA |EC |OPENSSH |DSA |ENCRYPTED )?PRIVATE KEY"),
    "service-account key file": re.compile(r'"private_key(?:_id)?"\s*:\s*"'),
    "Google API key": re.compile(r"AIza[0-9A-Za-z_\-]{35}"),
    "Google OAuth token": re.compile(r"ya29\.[0-9A-Za-z_\-]{20,}"),
    "AWS access key": re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    "GitHub token": re.compile(r"\bgh[pousr]_[0-9A-Za-z]{36}\b"),
}
# Naming a key file in a config or the image means a secret is meant to travel with them.
CREDENTIAL_SETTINGS = re.compile(
    r"GOOGLE_APPLICATION_CREDENTIALS|service_account_key|credentials_file|key_file|\.json\.key|"
    r"-key\.json|api_key|access_token", re.I)


def tracked_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                               check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing to say which files the repository holds")
    return [REPO / n for n in names if n and (REPO / n).is_file()]


def find_secrets(text: str) -> list[str]:
    return [name for name, pattern in SECRET_PATTERNS.items() if pattern.search(text)]


def test_the_secret_patterns_find_secrets():
    """Each pattern matches a sample of its kind (assembled here, so this file holds none)."""
    samples = {
        "private key block": "-----BEGIN " + "PRIVATE KEY-----\nMIIE",
        "service-account key file": '{"type": "service_account", "private_key' + '_id": "abc"}',
        "Google API key": "AIza" + "Sy" + "A" * 33,
        "Google OAuth token": "ya29" + "." + "a0AfH6SMB" * 3,
        "AWS access key": "AKIA" + "IOSFODNN7EXAMPLE",
        "GitHub token": "ghp" + "_" + "x" * 36,
    }
    assert samples.keys() == SECRET_PATTERNS.keys()
    for name, sample in samples.items():
        assert find_secrets(sample) == [name], name
    assert CREDENTIAL_SETTINGS.search("GOOGLE_APPLICATION_" + "CREDENTIALS=/k.json")


def test_no_tracked_file_holds_a_secret():
    files = tracked_files()
    assert len(files) > 20
    found = []
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        found += [f"{path.relative_to(REPO)}: {name}" for name in find_secrets(text)]
    assert not found, found


def test_no_config_or_image_names_a_credentials_file():
    """Credentials come from the environment (ADC: the worker's service account on Dataflow, gcloud
    auth application-default login locally), never from a path in the repository's deployment."""
    deployment = [p for p in tracked_files()
                  if p.parent.name == "configs" or p.name in ("Dockerfile", "Makefile", "setup.py")]
    assert any(p.name == "Dockerfile" for p in deployment)
    named = [f"{p.relative_to(REPO)}: {m.group()}" for p in deployment
             for m in [CREDENTIAL_SETTINGS.search(re.sub(r"#.*", "", p.read_text()))] if m]
    assert not named, named
