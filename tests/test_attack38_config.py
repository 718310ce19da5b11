"""Review repros (attack-38) against the one config loader (``pipeline.config.load_for_command``,
``extends:``). No emulator, no engine: each test writes small config files into ``tmp_path``."""
from __future__ import annotations

from pathlib import Path

import yaml

from pipeline import config as config_lib
from pipeline import ledger
from transforms.model import safe_model_label
from transforms.stores.pgvector import resolve_dsn

CONFIGS = Path(config_lib.REPO_ROOT) / "configs"


def _local_raw() -> dict:
    return yaml.safe_load((CONFIGS / "local.yaml").read_text())


def test_a_child_that_names_its_own_dsn_source_does_not_load_into_the_parents_database(
        tmp_path, monkeypatch):
    """A parent (the production config) reads its DSN from ``dsn_file``; a child written against
    it (``extends:``, a staging copy) names its own source, ``dsn_env``. The merge keeps the
    parent's ``dsn_file``, which wins over ``dsn_env``: the child's loads, searches and ledger
    checks go to the parent's database with nothing said. The child's source must be the one
    used, or the config refused as naming two."""
    prod = tmp_path / "prod-dsn"
    prod.write_text("host=prod.example dbname=news user=newsvec")
    prod.chmod(0o600)
    parent = {**_local_raw(), "store": {"enabled": True, "dsn_file": str(prod)}}
    (tmp_path / "prod.yaml").write_text(yaml.safe_dump(parent))
    (tmp_path / "staging.yaml").write_text(yaml.safe_dump({
        "extends": "prod.yaml", "output": str(tmp_path / "staging"),
        "store": {"dsn_env": "STAGING_DSN"}}))
    monkeypatch.setenv("STAGING_DSN", "host=staging.example dbname=news user=newsvec")
    try:
        config = config_lib.load_for_command(str(tmp_path / "staging.yaml"))
    except config_lib.ConfigError:
        return  # refused as ambiguous: fine
    assert resolve_dsn(config.store) == "host=staging.example dbname=news user=newsvec"


def test_a_very_long_extends_chain_is_a_config_error_not_a_recursion_error(tmp_path):
    """``extends:`` has no bound on the chain: about 1,000 tiny files (or a generator of them on a
    bucket) end in Python's ``RecursionError`` (a traceback, exit status 1, not the loader's
    ``ConfigError`` and status 2), after one read per file."""
    (tmp_path / "c0.yaml").write_text((CONFIGS / "local.yaml").read_text())
    n = 1200
    for i in range(1, n):
        (tmp_path / f"c{i}.yaml").write_text(f"extends: c{i - 1}.yaml\n")
    try:
        config_lib.load_for_command(str(tmp_path / f"c{n - 1}.yaml"))
    except config_lib.ConfigError:
        pass


def test_ledger_output_flag_is_filled_as_the_run_fills_it(tmp_path, monkeypatch):
    """``newsvec run --output gs://B/x/{model}/stream`` writes under the model's label (the loader
    fills ``{model}`` in the override); ``newsvec ledger --config C --output`` the same string
    must check that folder, as ``newsvec compact --output`` does, not a literal ``{model}``."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**_local_raw(), "input": None,
                                      "output": str(tmp_path / "other")}))
    flag = str(tmp_path / "{model}" / "stream")
    label = safe_model_label(config_lib.load(str(config)).model)
    seen: list = []

    class _Report:
        ok, problems, totals = True, [], {}

    monkeypatch.setattr(ledger, "check", lambda output, *a, **k: seen.append(output) or _Report())
    assert ledger.main(["--config", str(config), "--output", flag]) == 0
    assert seen == [str(tmp_path / label / "stream")]
