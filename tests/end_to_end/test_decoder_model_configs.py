"""The configs of two decoder embedders, validated as every command reads them
(``config_lib.load``), without the models' files: configs/sarashina-v2.yaml
(sbintuitions/sarashina-embedding-v2-1b) and configs/qwen3-embedding.yaml
(Qwen/Qwen3-Embedding-0.6B). Each refuses to run with its placeholder, extends local.yaml, and
once filled holds the model's dimension, a length within its context, its prefixes to the
character (the model cards'), its licence in a comment, and (Qwen3) the Matryoshka sizes its
config.json does not declare."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline import config as config_lib
from tests.common import REPO

CONFIGS = REPO / "configs"


def _filled(tmp_path: Path, name: str, placeholder: str) -> config_lib.Config:
    """The shipped config refused as it is, then loaded with an empty folder for its model."""
    text = (CONFIGS / name).read_text(encoding="utf-8")
    assert yaml.safe_load(text)["extends"] == "local.yaml", "the model block is written once"
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.load(CONFIGS / name)
    assert "model.path" in str(info.value) and placeholder in str(info.value)
    (path_line,) = [line for line in text.splitlines() if line.strip().startswith("path:")]
    assert placeholder in path_line and "local folder" in path_line
    folder = tmp_path / "model"
    folder.mkdir()
    filled = tmp_path / name
    filled.write_text(text.replace(placeholder, str(folder)), encoding="utf-8")
    (tmp_path / "local.yaml").write_text((CONFIGS / "local.yaml").read_text())  # extended
    return config_lib.load(filled)


def _common(config: config_lib.Config, text: str) -> None:
    model = config.model
    assert model.token_budget >= model.max_tokens
    assert (model.max_num_batched_tokens or 4096) >= model.max_tokens  # vLLM's CPU default
    assert model.engine_env["HF_HUB_OFFLINE"] == model.engine_env["TRANSFORMERS_OFFLINE"] == "1"
    assert not model.trust_remote_code
    assert config.text.unicode_form == "NFC"
    local = config_lib.load(CONFIGS / "local.yaml")
    assert config.input == local.input and config.beam == local.beam, "a local batch run"
    assert config.output not in (local.output, "out/ruri-v3", "out/multilingual-e5")


def test_the_sarashina_v2_config_is_ready_without_its_weights(tmp_path):
    config = _filled(tmp_path, "sarashina-v2.yaml", "<SARASHINA_V2_DIR>")
    text = (CONFIGS / "sarashina-v2.yaml").read_text(encoding="utf-8")
    model = config.model
    assert (model.name, model.dim) == ("sbintuitions/sarashina-embedding-v2-1b", 1792)
    assert model.max_tokens == 2048 and model.max_tokens <= 8192, "within its context"
    assert model.document_prefix == "text: "
    assert model.query_prefix == (
        "task: \u30af\u30a8\u30ea\u3092\u4e0e\u3048\u308b\u306e\u3067\u3001\u4e0e\u3048\u3089"
        "\u308c\u305fWeb\u691c\u7d22\u30af\u30a8\u30ea\u306b\u7b54\u3048\u308b\u95a2\u9023\u6587"
        "\u7ae0\u3092\u691c\u7d22\u3057\u3066\u304f\u3060\u3055\u3044\u3002\nquery: ")
    assert model.matryoshka_dimensions is None and model.dimensions is None
    assert "Sarashina Model NonCommercial License" in text
    assert "huggingface-cli download sbintuitions/sarashina-embedding-v2-1b" in text
    _common(config, text)


def test_the_qwen3_embedding_config_is_ready_without_its_weights(tmp_path):
    config = _filled(tmp_path, "qwen3-embedding.yaml", "<QWEN3_EMBEDDING_DIR>")
    text = (CONFIGS / "qwen3-embedding.yaml").read_text(encoding="utf-8")
    model = config.model
    assert (model.name, model.dim) == ("Qwen/Qwen3-Embedding-0.6B", 1024)
    assert model.max_tokens <= 32768, "within its context"
    assert model.document_prefix == ""
    assert model.query_prefix == ("Instruct: Given a web search query, retrieve relevant "
                                  "passages that answer the query\nQuery:")
    assert model.matryoshka_dimensions is not None
    assert min(model.matryoshka_dimensions) == 32 and max(model.matryoshka_dimensions) == 1024
    assert model.output_dim == 1024, "full vectors unless model.dimensions is set"
    assert "Apache-2.0" in text
    assert "huggingface-cli download Qwen/Qwen3-Embedding-0.6B" in text
    _common(config, text)
    # A shorter size among those listed loads; one outside them is refused, naming the list.
    filled = (tmp_path / "qwen3-embedding.yaml").read_text(encoding="utf-8")
    assert filled.count("  dimensions: null") == 1
    for dimensions in (256, 100):
        path = tmp_path / f"qwen3-{dimensions}.yaml"
        path.write_text(filled.replace("  dimensions: null", f"  dimensions: {dimensions}"),
                        encoding="utf-8")
        if dimensions == 256:
            assert config_lib.load(path).model.output_dim == 256
        else:
            with pytest.raises(config_lib.ConfigError, match="not one of matryoshka_dimensions"):
                config_lib.load(path)
