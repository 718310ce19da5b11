"""Matryoshka sizes that a model's config.json does not declare, given in the config
(``model.matryoshka_dimensions``; Qwen3-Embedding publishes its sizes only in its model card),
on the tiny BERT (tools/tiny_models.py) through the real vLLM engine in float32: vLLM is told
the sizes (``hf_overrides``), cuts each vector to ``model.dimensions`` and normalizes it, and the
vector is sentence-transformers' own cut (``truncate_dim``); ``newsvec serve``'s cut of a full
vector (``truncate_vector``) is the same vector. A size the model does not declare is a config
error that says what to set."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline import config as config_lib
from tests.common import REPO, tiny_model_settings
from tools.tiny_models import made_up_text
from transforms.engines.base import truncate_vector
from transforms.engines.model import declared_matryoshka, model_matryoshka
from transforms.engines.registry import load_engine
from transforms.text import HeadTokenizer

SIZES = [32, 64]
TEXTS = [made_up_text(random.Random(seed), words) for seed, words in ((5, 3), (6, 25), (7, 90))]
MIN_COSINE = 0.999  # float32 on both sides; measured: 1.0000000 to seven decimals


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def test_vllm_cuts_a_size_the_config_lists_as_sentence_transformers_does(tiny_bert):
    from sentence_transformers import SentenceTransformer

    assert not declared_matryoshka(str(tiny_bert)).declared, "its config.json declares none"
    full_settings = tiny_model_settings(tiny_bert, matryoshka_dimensions=SIZES)
    cut_settings = full_settings.model_copy(update={"dimensions": 64})
    tokenizer = HeadTokenizer(cut_settings)
    prompts = [tokenizer(text)[0] for text in TEXTS]
    # One LLM for both: engines that differ only in model.dimensions share it.
    cut = np.stack(load_engine(cut_settings).embed(prompts))
    full = np.stack(load_engine(full_settings).embed(prompts))
    assert cut.shape == (len(TEXTS), 64) and full.shape == (len(TEXTS), 128)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)  # normalized again

    reference = SentenceTransformer(str(tiny_bert), device="cpu", truncate_dim=64).encode(
        TEXTS, convert_to_numpy=True)
    assert reference.shape == (len(TEXTS), 64)
    cosines = _cosines(cut, reference)
    print(f"Matryoshka 64 of 128, vLLM against sentence-transformers (float32): min cosine "
          f"{cosines.min():.7f}")
    assert cosines.min() >= MIN_COSINE, cosines
    # The full vector cut and normalized by numpy: the same vector (serve's way).
    by_numpy = np.stack([truncate_vector(v, 64, normalize=True) for v in full])
    assert _cosines(cut, by_numpy).min() >= 0.99999
    # And serve accepts the listed sizes as a request's dimensions, as the pipeline does.
    served = model_matryoshka(full_settings, str(tiny_bert))
    assert served is not None and served.allows(32) and not served.allows(48)


def _config(tmp_path: Path, folder: Path, **model) -> Path:
    path = tmp_path / "matryoshka.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "local.yaml"),
        "model": {"name": "tiny/bert", "path": str(folder), "dim": 128, "dtype": "float32",
                  **model}}))
    return path


def test_a_size_the_model_does_not_declare_is_a_config_error(tiny_bert, tmp_path):
    with pytest.raises(config_lib.ConfigError) as info:  # no Matryoshka at all
        config_lib.load(_config(tmp_path, tiny_bert, dimensions=64))
    message = str(info.value)
    assert "model.dimensions is 64" in message and "does not declare" in message
    assert "model.matryoshka_dimensions" in message, "it says what to set"
    with pytest.raises(config_lib.ConfigError) as info:  # a size the list lacks
        config_lib.load(_config(tmp_path, tiny_bert, dimensions=48, matryoshka_dimensions=SIZES))
    assert "dimensions (48) is not one of matryoshka_dimensions [32, 64]" in str(info.value)
    with pytest.raises(config_lib.ConfigError) as info:  # a size larger than the model's
        config_lib.load(_config(tmp_path, tiny_bert, matryoshka_dimensions=[64, 256]))
    assert "256" in str(info.value)
    config = config_lib.load(_config(tmp_path, tiny_bert, dimensions=64,
                                     matryoshka_dimensions=SIZES))
    assert config.model.output_dim == 64
