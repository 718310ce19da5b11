"""Attack 50: ``model.matryoshka_dimensions`` is for "the Matryoshka sizes the model was trained to
give ... where its config.json does not declare them" (docs/configuration.md, the setting's
description). A model whose config.json declares its own sizes (``matryoshka_dimensions``, as
vLLM reads it) keeps them: a config that lists a size the model does not declare must not
silently override the model (vLLM is told the config's list through ``hf_overrides``, replacing
the model's, and cuts the vectors to a size the model was never trained for). Before 0.6 the same
``model.dimensions`` was refused ("declares only the Matryoshka dimensions ..."). Only
config.json is read: no weights, no engine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline import config as config_lib
from tests.common import REPO


def _folder(tmp_path: Path, declared: list[int]) -> Path:
    folder = tmp_path / "declares-its-sizes"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 128,
        "matryoshka_dimensions": declared}))
    return folder


def _config(tmp_path: Path, folder: Path, **model) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "local.yaml"),
        "model": {"name": "x/declares", "path": str(folder), "dim": 128, "dtype": "float32",
                  **model}}))
    return path


def test_without_the_setting_an_undeclared_size_is_refused(tmp_path):
    folder = _folder(tmp_path, [128, 64, 32])
    with pytest.raises(config_lib.ConfigError, match="declares only the Matryoshka dimensions"):
        config_lib.load(_config(tmp_path, folder, dimensions=48))


def test_the_setting_does_not_override_the_sizes_the_model_declares(tmp_path):
    folder = _folder(tmp_path, [128, 64, 32])
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.load(_config(tmp_path, folder, dimensions=48,
                                matryoshka_dimensions=[48, 128]))
    assert "48" in str(info.value) and "[128, 64, 32]" in str(info.value), str(info.value)
    # Without model.dimensions too: serve would accept 48 as a request's dimensions.
    with pytest.raises(config_lib.ConfigError):
        config_lib.load(_config(tmp_path, folder, matryoshka_dimensions=[48, 128]))


def test_sizes_the_model_declares_may_be_listed_again(tmp_path):
    folder = _folder(tmp_path, [128, 64, 32])
    config = config_lib.load(_config(tmp_path, folder, dimensions=64,
                                     matryoshka_dimensions=[64, 32]))
    assert config.model.output_dim == 64
