"""A model that needs Python code of its own (PLaMo-Embedding-1B: ``PlamoBiModel``, whose
config.json's ``auto_map`` points at the folder's ``modeling_plamo.py``, an architecture neither
vLLM nor transformers implements) is refused, saying why (newsvec runs no model's own code:
``model.trust_remote_code`` stays off) and what to do (convert it, or pick a supported model):
when the config loads, and by the engine before anything loads. Each folder holds only a
config.json: nothing else is read, no weights are needed, no engine starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline import config as config_lib
from tests.common import REPO, tiny_model_settings
from transforms.engines.model import CustomCodeRefused, check_custom_code
from transforms.engines.vllm import load_vllm

# The keys of PLaMo-Embedding-1B's config.json that matter here (its sizes beside them).
PLAMO = {"architectures": ["PlamoBiModel"],
         "auto_map": {"AutoConfig": "modeling_plamo.PlamoConfig",
                      "AutoModel": "modeling_plamo.PlamoBiModel"},
         "model_type": "plamo", "hidden_size": 2048, "num_hidden_layers": 16,
         "num_attention_heads": 16, "vocab_size": 50112}


def _folder(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _config(tmp_path: Path, folder: Path, **model) -> Path:
    path = tmp_path / f"{folder.name}.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "local.yaml"),
        "model": {"name": "pfnet/plamo-embedding-1b", "path": str(folder), "dim": 2048,
                  "max_tokens": 512, **model}}))
    return path


def _says_why_and_what_to_do(message: str) -> None:
    assert "PlamoBiModel" in message and "modeling_plamo.PlamoBiModel" in message, message
    assert "code of its own" in message and "trust_remote_code" in message, message
    assert "Convert" in message and "pick a supported model" in message, message


def test_a_model_that_needs_its_own_code_is_refused_when_the_config_loads(tmp_path):
    folder = _folder(tmp_path, "plamo-embedding-1b", PLAMO)
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.load(_config(tmp_path, folder))
    _says_why_and_what_to_do(str(info.value))


def test_the_engine_refuses_it_before_loading_anything(tmp_path):
    folder = _folder(tmp_path, "plamo-embedding-1b", PLAMO)
    with pytest.raises(CustomCodeRefused) as info:
        load_vllm(tiny_model_settings(folder, dim=2048))  # no LLM: refused before vLLM starts
    _says_why_and_what_to_do(str(info.value))


def test_code_of_its_own_beside_an_architecture_vllm_runs_is_not_refused(tmp_path):
    """nomic-embed's config.json points at its own code too, for an architecture vLLM
    implements itself; Qwen3-Embedding's ``Qwen3Model`` is vLLM's ``Qwen3ForCausalLM``,
    converted to pooling. And an operator who turns ``trust_remote_code`` on has chosen."""
    nomic = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert",
             "auto_map": {"AutoConfig": "configuration_hf_nomic_bert.NomicBertConfig",
                          "AutoModel": "modeling_hf_nomic_bert.NomicBertModel"}}
    check_custom_code(str(_folder(tmp_path, "nomic", nomic)), trust_remote_code=False)
    qwen3 = {"architectures": ["Qwen3Model"], "model_type": "qwen3",
             "auto_map": {"AutoModel": "modeling_qwen3.Qwen3Model"}}
    check_custom_code(str(_folder(tmp_path, "qwen3", qwen3)), trust_remote_code=False)
    check_custom_code(str(_folder(tmp_path, "plamo", PLAMO)), trust_remote_code=True)
    check_custom_code(str(tmp_path / "no-such-folder"), trust_remote_code=False)  # an HF id
