"""The vLLM CPU engine against sentence-transformers on tiny random models (tools/tiny_models.py):
a ModernBERT as ruri-v3 is built (local attention in a 16-token window, a global layer every 3,
CLS pooling, a Unigram tokenizer) and a BERT (WordPiece, mean pooling), on texts shorter and
longer than the window, through newsvec's own tokenization and engine handle
(``transforms.engines.registry.load_engine``).

The reference runs in the engine's dtype: random weights of this scale lose up to about 0.005 of
cosine to bfloat16 itself (``transformers`` in bfloat16 against float32, measured), which is not the
engine's doing; trained models lose about 0.0001 (MiniLM, docs/languages.md)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.common import tiny_model_settings
from tools.tiny_models import made_up_text
from transforms.engines.devices import resolved_dtype
from transforms.engines.registry import load_engine
from transforms.text import HeadTokenizer

WINDOW = 16  # build_modernbert's local_attention: 8 tokens each side
WITHIN = WINDOW // 2 + 1  # a text this short: every token sees every other in a local layer
TEXTS = [made_up_text(random.Random(seed), words) for seed, words in
         ((1, 1), (2, 2), (3, 30), (4, 70))]
_REFERENCES: dict = {}


def _reference(folder, dtype: str, **config):
    """sentence-transformers on the model folder, in ``dtype`` (``config``: changes to the
    model's config, e.g. the window)."""
    import torch
    from sentence_transformers import SentenceTransformer

    key = (str(folder), dtype, tuple(sorted(config.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = SentenceTransformer(
            str(folder), device="cpu", config_kwargs=config,
            model_kwargs={"dtype": getattr(torch, dtype)})
    return _REFERENCES[key]


def _reference_vectors(folder, dtype: str, **config) -> np.ndarray:
    vectors = _reference(folder, dtype, **config).encode(
        TEXTS, normalize_embeddings=True, convert_to_tensor=True).float().numpy()
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _engine_vectors(folder, dtype: str) -> tuple[np.ndarray, list[int]]:
    """newsvec's head tokenization and engine (vLLM, one per model and dtype per process)."""
    settings = tiny_model_settings(folder, dtype)
    tokenizer = HeadTokenizer(settings)
    prompts = [tokenizer(text)[0] for text in TEXTS]
    vectors = np.stack(load_engine(settings).embed(prompts))
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True), [len(p) for p in prompts]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.round((a * b).sum(axis=1), 5)


def _dtypes():
    """float32, and the dtype newsvec runs at on this CPU (``model.dtype: native``)."""
    native = resolved_dtype(tiny_model_settings(Path("unused"), "native"))
    return sorted({"float32", native})


@pytest.mark.parametrize("dtype", _dtypes())
def test_modernbert_on_the_engine_is_sentence_transformers(tiny_modernbert, dtype):
    """Texts of fewer tokens than the window and of several windows: cosine >= 0.999."""
    vectors, lengths = _engine_vectors(tiny_modernbert, dtype)
    assert min(lengths) <= WITHIN < 4 * WINDOW < max(lengths), lengths
    cosines = _cosines(vectors, _reference_vectors(tiny_modernbert, dtype))
    assert cosines.min() >= 0.999, dict(zip(lengths, cosines, strict=True))


@pytest.mark.parametrize("dtype", _dtypes())
def test_the_engine_honours_the_window(tiny_modernbert, dtype):
    """The same vectors against a reference without the window (every layer global): the texts
    within the window agree, the longer ones do not. An engine that ignored the window would
    match this reference instead."""
    vectors, lengths = _engine_vectors(tiny_modernbert, dtype)
    cosines = _cosines(vectors, _reference_vectors(tiny_modernbert, dtype,
                                                   local_attention=100_000))
    long = [c for n, c in zip(lengths, cosines, strict=True) if n > WINDOW]
    assert long and max(long) < 0.99, dict(zip(lengths, cosines, strict=True))


def test_the_window_changes_the_reference_on_these_texts(tiny_modernbert):
    """The test texts are ones where the window matters (with mean pooling over small random
    weights it would not: attention is near uniform), and only beyond it."""
    with_window = _reference_vectors(tiny_modernbert, "float32")
    without = _reference_vectors(tiny_modernbert, "float32", local_attention=100_000)
    lengths = [len(_reference(tiny_modernbert, "float32").tokenizer(t)["input_ids"])
               for t in TEXTS]
    cosines = dict(zip(lengths, _cosines(with_window, without), strict=True))
    within = [c for n, c in cosines.items() if n <= WITHIN]
    beyond = [c for n, c in cosines.items() if n > WINDOW]
    assert within and min(within) >= 0.99999, cosines
    assert beyond and max(beyond) < 0.99, cosines


@pytest.mark.parametrize("dtype", _dtypes())
def test_bert_on_the_engine_is_sentence_transformers(tiny_bert, dtype):
    vectors, lengths = _engine_vectors(tiny_bert, dtype)
    cosines = _cosines(vectors, _reference_vectors(tiny_bert, dtype))
    assert cosines.min() >= 0.999, dict(zip(lengths, cosines, strict=True))


@pytest.mark.parametrize("model", ["tiny_bert", "tiny_modernbert"])
def test_newsvec_tokenizes_as_the_models_own_tokenizer(model, request):
    folder = request.getfixturevalue(model)
    tokenizer = HeadTokenizer(tiny_model_settings(folder))
    own = _reference(folder, "float32").tokenizer
    assert [list(tokenizer(t)[0]) for t in TEXTS] == [own(t)["input_ids"] for t in TEXTS]


def test_the_engine_refuses_a_pooling_it_does_not_compute(tmp_path):
    """vLLM 0.32 reads cls, mean and lasttoken pooling from the modules; for a weighted mean it
    would pool by the architecture's CLS, silently. newsvec refuses the model instead, before it
    loads (shutting a loaded engine down would end the process's other engines)."""
    from tools.tiny_models import build_modernbert
    from transforms.engines.base import EngineFailedError

    folder = build_modernbert(tmp_path / "weightedmean", seed=1, pooling="weightedmean")
    with pytest.raises(EngineFailedError, match="pools by weightedmean_tokens .* would pool "
                                                "by the architecture's default"):
        load_engine(tiny_model_settings(folder)).embed([[1, 2, 3]])


@pytest.mark.parametrize("modes, normalize, refused", [
    ({"pooling_mode_cls_token": True}, True, False),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, True, False),  # the mean's direction
    ({"pooling_mode_mean_sqrt_len_tokens": True}, False, True),  # not its length
    ({"pooling_mode_max_tokens": True}, True, True),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, True, True),
])
def test_which_poolings_the_engine_computes(tmp_path, modes, normalize, refused):
    from transforms.engines.vllm import check_pooling

    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": 1, "name": "1", "path": "1_Pooling",
          "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    if refused:
        with pytest.raises(ValueError, match="would pool by"):
            check_pooling(tmp_path, normalize)
    else:
        check_pooling(tmp_path, normalize)
