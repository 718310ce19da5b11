"""Attack 50 on the refusal of models that need code of their own (``check_custom_code``), with
config.json files that users' folders do hold:

- a config.json vLLM itself reads (``architectures`` as one string: vLLM's registry takes a str
  or a list, ``inspect_model_cls``) must not be refused as though each letter were an
  architecture;
- a config.json the check cannot read is "not this check's to judge: vLLM names a config it
  cannot read" (``check_custom_code``'s own comment): a deeply nested one makes ``json.loads``
  raise RecursionError, not ValueError, and the config load must still answer with a config
  error or pass, never a traceback (docs/configuration.md: validate fails with a message)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from pipeline import config as config_lib
from tests.common import REPO
from transforms.engines.model import check_custom_code


def _folder(tmp_path: Path, name: str, text: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return folder


def test_architectures_as_one_string_is_read_as_vllm_reads_it(tmp_path):
    nomic = {"architectures": "NomicBertModel", "model_type": "nomic_bert",
             "auto_map": {"AutoModel": "modeling_hf_nomic_bert.NomicBertModel"}}
    check_custom_code(str(_folder(tmp_path, "nomic", json.dumps(nomic))),
                      trust_remote_code=False)


def test_a_deeply_nested_config_json_is_no_traceback_at_config_load(tmp_path):
    folder = _folder(tmp_path, "nested", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "local.yaml"),
        "model": {"name": "x/nested", "path": str(folder), "dim": 128}}))
    try:
        config_lib.load(path)
    except config_lib.ConfigError:
        pass  # named, as any config problem is


def test_a_deeply_nested_config_json_with_dimensions_is_a_config_error(tmp_path):
    """With ``model.dimensions`` the config.json is read for its Matryoshka sizes too
    (``declared_matryoshka``): a config error naming it, as for any JSON it cannot read."""
    import pytest

    folder = _folder(tmp_path, "nested", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "local.yaml"),
        "model": {"name": "x/nested", "path": str(folder), "dim": 128, "dimensions": 64,
                  "matryoshka_dimensions": [64]}}))
    with pytest.raises(config_lib.ConfigError, match="nested too deeply"):
        config_lib.load(path)
