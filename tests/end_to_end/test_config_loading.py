"""One way to load a config for a command (``config.load_for_command``): every sub-command and tool
reads the file (and the files it ``extends:``), applies its overrides, fills ``{model}`` and
``{date}`` and validates, in that order, so one config names one output whichever command reads
it. And ``extends:``: a config written as the changes to another."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import yaml

from pipeline import backfill, cli, compact, ledger
from pipeline import config as config_lib
from pipeline import load as load_cmd
from pipeline.run import resolve
from tests.common import GCS_BUCKET
from transforms.engines.model import safe_model_label
from transforms.types import Counts

CONFIGS = Path(config_lib.REPO_ROOT) / "configs"


def local_raw() -> dict:
    return yaml.safe_load((CONFIGS / "local.yaml").read_text())


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def yesterday() -> str:
    return (dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=1)).isoformat()


@pytest.fixture(scope="module")
def label() -> str:
    return safe_model_label(config_lib.load(CONFIGS / "local.yaml").model)


# --- the two commands that had their own recipe and got it wrong ------------------------------

def test_compact_with_model_in_the_output_compacts_the_filled_folder(tmp_path, label):
    """``{model}`` in a streaming config's output: ``newsvec compact --config`` works on the folder
    the job wrote (the model's label), as ``newsvec ledger`` does, never on a literal
    ``{model}`` folder."""
    config = write(tmp_path / "c.yaml", {**local_raw(), "input": None,
                                         "output": str(tmp_path / "{model}" / "stream")})
    assert compact.main(["--config", str(config), "--hour", "2026-12-01T09",
                         "--closed-after-s", "0"]) == 0
    assert not (tmp_path / "{model}").exists()
    assert (tmp_path / label / "stream").is_dir()  # its publish lease was taken there


def test_search_with_date_in_the_output_searches_the_filled_folder(tmp_path, monkeypatch, label):
    """``{date}`` in a batch config's output: ``newsvec search`` looks in the day's folder
    (``--input_date``, default yesterday), not under a literal ``dt={date}``."""
    import pipeline.search

    seen = []
    monkeypatch.setattr(pipeline.search, "search",
                        lambda config, query, k, output=None: seen.append(config.output) or [])
    config = write(tmp_path / "c.yaml", {**local_raw(), "output": str(tmp_path / "dt={date}")})
    assert cli.main(["search", "--config", str(config), "a query"]) == 0
    assert cli.main(["search", "--config", str(config), "--input_date", "2026-11-30",
                     "a query"]) == 0
    assert seen == [str(tmp_path / f"dt={yesterday()}"), str(tmp_path / "dt=2026-11-30")]


# --- every command through the one loader -----------------------------------------------------

class _Loaded:
    """What a stubbed command step returns: enough for the command to print and exit."""
    ok, problems, totals = True, [], {}

    def to_json(self) -> dict:
        return {}


def _run(config: Path, monkeypatch, seen: list) -> None:
    seen.append(resolve(["--config", str(config)])[0].output)


def _load(config: Path, monkeypatch, seen: list) -> None:
    monkeypatch.setattr(load_cmd, "load_run",
                        lambda cfg, run_id, reload=False: seen.append(cfg.output) or _Loaded())
    assert load_cmd.main(["--config", str(config), "--run-id", "r"]) == 0


def _search(config: Path, monkeypatch, seen: list) -> None:
    import pipeline.search

    monkeypatch.setattr(pipeline.search, "search",
                        lambda cfg, query, k, output=None: seen.append(cfg.output) or [])
    assert cli.main(["search", "--config", str(config), "q"]) == 0


def _ledger(config: Path, monkeypatch, seen: list) -> None:
    monkeypatch.setattr(ledger, "check", lambda output, *a, **k: seen.append(output) or _Loaded())
    assert ledger.main(["--config", str(config)]) == 0


def _compact(config: Path, monkeypatch, seen: list) -> None:
    monkeypatch.setattr(compact, "compact_range", lambda output, *a, **k: seen.append(output) or [])
    assert compact.main(["--config", str(config)]) == 0


def _backfill(config: Path, monkeypatch, seen: list) -> None:
    import pipeline.run

    def run_batch(cfg, options, engine_factory=None):
        seen.append(cfg.output)
        return {"run_id": "r", "counts": Counts().to_summary()}

    monkeypatch.setattr(pipeline.run, "run_batch", run_batch)
    assert backfill.main(["--config", str(config), "--from", yesterday(),
                          "--until", yesterday()]) == 0


def _streaming_demo(config: Path, monkeypatch, seen: list) -> None:
    from tools import streaming_demo

    class Stop(Exception):
        pass

    def job(cfg, work):
        seen.append(cfg.output)
        raise Stop

    monkeypatch.setattr(streaming_demo, "emulated_streaming_job", job)
    with pytest.raises(Stop):
        streaming_demo.run_demo(str(config), Path("unused"), None, rate=1, timeout_s=1)


@pytest.mark.parametrize("command", [_run, _load, _search, _ledger, _compact, _backfill,
                                     _streaming_demo], ids=lambda f: f.__name__.strip("_"))
def test_every_command_resolves_one_config_to_the_same_output(command, tmp_path, monkeypatch,
                                                               capsys, label):
    """A config whose output holds ``{model}`` and ``{date}``: every sub-command and tool, given
    no --input_date, works on the same folder (the model's label, yesterday)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / f"{yesterday()}.jsonl").write_text("")
    config = write(tmp_path / "c.yaml", {**local_raw(),
                                         "input": str(tmp_path / "in" / "{date}.jsonl"),
                                         "output": str(tmp_path / "{model}" / "dt={date}")})
    seen: list = []
    command(config, monkeypatch, seen)
    assert seen == [str(tmp_path / label / f"dt={yesterday()}")]


def test_ledger_output_flag_is_filled_as_the_run_fills_it(tmp_path, monkeypatch, label):
    """``newsvec run --output gs://B/x/{model}/stream`` writes under the model's label (the loader
    fills ``{model}`` in the override); ``newsvec ledger --config C --output`` the same string
    checks that folder, as ``newsvec compact --output`` does, not a literal ``{model}``."""
    config = write(tmp_path / "c.yaml", {**local_raw(), "input": None,
                                         "output": str(tmp_path / "other")})
    flag = str(tmp_path / "{model}" / "stream")
    seen: list = []

    class _Report:
        ok, problems, totals = True, [], {}

    monkeypatch.setattr(ledger, "check", lambda output, *a, **k: seen.append(output) or _Report())
    assert ledger.main(["--config", str(config), "--output", flag]) == 0
    assert seen == [str(tmp_path / label / "stream")]


# --- extends: ---------------------------------------------------------------------------------

def test_a_config_extends_another_its_mappings_merged_and_its_lists_replaced(tmp_path):
    base = local_raw()
    base["beam"] = {"runner": "FnApiRunner", "experiments": ["a", "b"]}
    write(tmp_path / "base.yaml", base)
    (tmp_path / "sub").mkdir()
    child = write(tmp_path / "sub" / "child.yaml", {
        "extends": "../base.yaml", "output": "out/child",
        "model": {"token_budget": 4096}, "beam": {"experiments": ["c"]}})
    grandchild = write(tmp_path / "sub" / "grandchild.yaml", {
        "extends": "child.yaml", "streaming": {"window_s": 30}})
    config = config_lib.load(grandchild)
    assert config.output == "out/child" and config.input == base["input"]
    assert config.model.token_budget == 4096 and config.model.dim == base["model"]["dim"]
    assert config.model.engine_env == base["model"]["engine_env"]
    assert config.beam == {"runner": "FnApiRunner", "experiments": ["c"]}
    assert config.streaming.window_s == 30
    assert config_lib.load(child).streaming.window_s == 60


def test_extends_refuses_a_cycle_a_missing_parent_and_a_non_name(tmp_path):
    write(tmp_path / "a.yaml", {"extends": "b.yaml", "output": "x"})
    write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(config_lib.ConfigError, match=r"extends: a cycle: .*a\.yaml -> .*b\.yaml "
                                                     r"-> .*a\.yaml"):
        config_lib.load(tmp_path / "a.yaml")
    write(tmp_path / "c.yaml", {"extends": "nope.yaml", "output": "x"})
    with pytest.raises(config_lib.ConfigError, match=r"c\.yaml: extends: .*nope\.yaml: cannot "
                                                     "read the config"):
        config_lib.load(tmp_path / "c.yaml")
    write(tmp_path / "d.yaml", {"extends": ["local.yaml"], "output": "x"})
    with pytest.raises(config_lib.ConfigError, match="extends: .*a file name"):
        config_lib.load(tmp_path / "d.yaml")


def test_a_very_long_extends_chain_is_a_config_error_not_a_recursion_error(tmp_path):
    """``extends:`` had no bound on the chain: about 1,000 tiny files (or a generator of them on
    a bucket) ended in Python's ``RecursionError`` (a traceback, exit status 1, not the loader's
    ``ConfigError`` and status 2), after one read per file. A chain of ``MAX_EXTENDS`` parents
    loads; one more is refused, naming the bound."""
    (tmp_path / "c0.yaml").write_text((CONFIGS / "local.yaml").read_text())
    n = 1200
    for i in range(1, n):
        (tmp_path / f"c{i}.yaml").write_text(f"extends: c{i - 1}.yaml\n")
    with pytest.raises(config_lib.ConfigError, match="more than"):
        config_lib.load_for_command(str(tmp_path / f"c{n - 1}.yaml"))
    assert config_lib.load(tmp_path / f"c{config_lib.MAX_EXTENDS}.yaml").output
    with pytest.raises(config_lib.ConfigError, match=f"more than {config_lib.MAX_EXTENDS} "
                                                     "configs extended"):
        config_lib.load(tmp_path / f"c{config_lib.MAX_EXTENDS + 1}.yaml")


def test_a_child_that_names_its_own_dsn_source_does_not_load_into_the_parents_database(
        tmp_path, monkeypatch):
    """A parent (the production config) reads its DSN from ``dsn_file``; a child written against
    it (``extends:``, a staging copy) names its own source, ``dsn_env``. Before, the merge kept
    the parent's ``dsn_file``, which wins over ``dsn_env``: the child's loads, searches and ledger
    checks went to the parent's database with nothing said. A child that names a DSN source
    replaces all of the parent's; one that names none keeps them."""
    from transforms.stores.pgvector import resolve_dsn

    prod = tmp_path / "prod-dsn"
    prod.write_text("host=prod.example dbname=news user=newsvec")
    prod.chmod(0o600)
    secret = "projects/p/secrets/prod-dsn/versions/latest"
    write(tmp_path / "prod.yaml", {**local_raw(), "store": {
        "enabled": True, "dsn_file": str(prod), "dsn_secret": secret, "table": "prod_vectors"}})
    write(tmp_path / "staging.yaml", {"extends": "prod.yaml", "output": str(tmp_path / "staging"),
                                      "store": {"dsn_env": "STAGING_DSN"}})
    monkeypatch.setenv("STAGING_DSN", "host=staging.example dbname=news user=newsvec")
    config = config_lib.load_for_command(str(tmp_path / "staging.yaml"))
    assert config.store.dsn_file is None and config.store.dsn_secret is None
    assert config.store.table == "prod_vectors" and config.store.enabled  # the rest is merged
    assert resolve_dsn(config.store) == "host=staging.example dbname=news user=newsvec"
    write(tmp_path / "same-db.yaml", {"extends": "prod.yaml", "store": {"table": "other"}})
    kept = config_lib.load(tmp_path / "same-db.yaml").store
    assert (kept.dsn_file, kept.dsn_secret) == (str(prod), secret)


def test_extends_on_gcs_reads_the_parent_beside_the_child(gcs):
    """A Flex Template reads its config from the bucket: the parent is read from the child's
    folder there."""
    from google.cloud import storage

    bucket = storage.Client.create_anonymous_client().bucket(GCS_BUCKET)
    bucket.blob("cfg/base.yaml").upload_from_string(yaml.safe_dump(local_raw()))
    bucket.blob("cfg/sub/child.yaml").upload_from_string(json.dumps(
        {"extends": "../base.yaml", "output": "out/x", "model": {"token_budget": 4096}}))
    config = config_lib.load(f"gs://{GCS_BUCKET}/cfg/sub/child.yaml")
    assert config.output == "out/x" and config.model.token_budget == 4096
    assert config.model.name == local_raw()["model"]["name"]


def test_shipped_configs_that_extend_keep_the_model_block_of_their_parent():
    """dataflow-streaming.yaml and dataflow-batch-2xl4.yaml extend dataflow-batch.yaml;
    local-streaming.yaml and multilingual-e5.yaml extend local.yaml: the model is written once."""
    for child, parent in [("dataflow-streaming.yaml", "dataflow-batch.yaml"),
                          ("dataflow-batch-2xl4.yaml", "dataflow-batch.yaml"),
                          ("local-streaming.yaml", "local.yaml"),
                          ("multilingual-e5.yaml", "local.yaml")]:
        assert yaml.safe_load((CONFIGS / child).read_text())["extends"] == parent
    raw = config_lib._read_raw(str(CONFIGS / "dataflow-streaming.yaml"))
    assert raw["model"] == config_lib._read_raw(str(CONFIGS / "dataflow-batch.yaml"))["model"]
