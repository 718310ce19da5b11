"""What check-model and the engine's model checks must not let through, on the tiny models of
tools/tiny_models.py through the real vLLM engine (float32): a pooling config in the form the
pinned sentence-transformers writes (read, not refused) or with several modes (refused); a
Matryoshka config (checked at the dimensions written); late chunking on a model whose Dense
projection has an activation (refused: vLLM's token_embed projects every token); check-model on a
late config (the pipeline's embedder, so such a model is not passed)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline import cli
from tests.common import REPO
from tests.engines.test_check_model import _TEXTS, events  # noqa: F401  (the fixture)
from tools.tiny_models import write_pooling


def _config(tmp_path: Path, folder: Path, chunking=None, **model) -> Path:
    path = tmp_path / f"{folder.name}.yaml"
    raw = {"extends": str(REPO / "configs" / "local.yaml"),
           "model": {"name": f"tiny/{folder.name}", "path": str(folder), "dim": 128,
                     "dtype": "float32", **model}}
    if chunking:
        raw["chunking"] = chunking
    path.write_text(yaml.safe_dump(raw))
    return path


def _check(capsys, config: Path, events: Path, *args: str):  # noqa: F811
    code = cli.main(["check-model", "--config", str(config), "--input", str(events), "--json",
                     *args])
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else None)


def test_check_model_reports_on_a_matryoshka_config(
        tiny_bert, tmp_path, events, capsys):  # noqa: F811
    """A model that declares Matryoshka sizes, served at model.dimensions 64: the pipeline writes
    64-dim vectors; check-model must compare them with the reference cut the same way (as
    sentence-transformers' truncate_dim), not crash."""
    folder = tmp_path / "matryoshka"
    shutil.copytree(tiny_bert, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "matryoshka_dimensions": [64, 128]}))
    code, report = _check(capsys, _config(tmp_path, folder, dimensions=64), events)
    assert report is not None, "no report on stdout"
    assert code == 0 and report["passed"], report["problems"]
    assert report["summaries"][0]["min"] >= 0.999


def _with_tanh_dense(tiny_bert: Path, out: Path) -> Path:
    """tiny_bert with a sentence-transformers Dense (128 -> 128, Tanh: the Dense module's default
    activation) between its pooling and its Normalize."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    st = SentenceTransformer(str(tiny_bert), device="cpu")
    transformer, pooling, normalize = list(st)
    torch.manual_seed(3)
    dense = models.Dense(128, 128, activation_function=torch.nn.Tanh())
    with torch.no_grad():
        dense.linear.weight.mul_(20.0)
    SentenceTransformer(modules=[transformer, pooling, dense, normalize], device="cpu").save(
        str(out))
    write_pooling(out, "mean", 128)  # the legacy keys: newsvec refuses the string form (below)
    return out


def test_late_mode_head_vector_is_the_models_vector_with_a_tanh_dense(tiny_bert, tmp_path):
    """chunking.mode late pools the document vector (doc_vector head) from token_embed's per-token
    outputs. vLLM applies the model's Dense projector (and its Tanh) to each token there, so the
    mean of tanh(W h_i + b) is not the model's tanh(W mean(h) + b): the late document vector must
    still be the model's (or the config refused)."""
    from sentence_transformers import SentenceTransformer

    from pipeline import config as config_lib
    from pipeline.graph import prepare_text
    from tools.tiny_models import made_up_text
    from transforms.embed import Embedder, EmbedFailure
    from transforms.engines.base import EngineFailedError
    from transforms.settings import ChunkingSettings
    from transforms.types import NewsEvent

    folder = _with_tanh_dense(tiny_bert, tmp_path / "dense-tanh")
    late = ChunkingSettings(mode="late", chunk_tokens=64, overlap_tokens=8)
    config = config_lib.load(_config(tmp_path, folder))
    config = config.model_copy(update={"chunking": late})
    rng = random.Random(5)
    events_ = [NewsEvent(id=f"e{i}", title=made_up_text(rng, 3), body=made_up_text(rng, 120))
               for i in range(3)]
    docs = [d for d in prepare_text(config).prepare(events_) if hasattr(d, "token_ids")]
    assert docs and all(d.chunks for d in docs)
    embedder = Embedder(config.model, doc_vector="head", late=late)
    try:
        handle = embedder.load_engine()
    except EngineFailedError as refused:  # the config refused: what it must do
        assert "Dense" in str(refused) and "chunking.mode chunks" in str(refused), refused
        return
    results = embedder.embed_docs(handle, docs)
    assert not any(isinstance(r, EmbedFailure) for r in results)
    st = SentenceTransformer(str(folder), device="cpu")
    ref = st.encode([d.text for d in docs], normalize_embeddings=True)
    cosines = [float(np.dot(r[0], v) / np.linalg.norm(r[0]))
               for r, v in zip(results, ref, strict=True)]
    assert min(cosines) >= 0.99, cosines


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_the_pooling_check_reads_what_sentence_transformers_writes(tiny_bert, tmp_path, mode):
    """sentence-transformers (the pinned 6.2, and 5.x) saves its Pooling module as
    ``{"pooling_mode": "mean"}``, which vLLM 0.32 reads (MEAN, CLS, LAST): a model fine-tuned and
    saved with it must not be refused."""
    from sentence_transformers import SentenceTransformer, models

    from transforms.engines.vllm import check_pooling

    st = SentenceTransformer(str(tiny_bert), device="cpu")
    transformer = list(st)[0]
    out = tmp_path / mode
    SentenceTransformer(modules=[transformer, models.Pooling(128, pooling_mode=mode),
                                 models.Normalize()], device="cpu").save(str(out))
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode"] == mode
    check_pooling(out, normalize=True)  # raises ValueError today


def test_the_pooling_check_refuses_several_modes_in_the_new_form(tiny_bert, tmp_path):
    """``pooling_mode: ["cls", "mean"]`` (concatenated): vLLM reads no pooling from a list and
    falls back to the architecture's default: it must be refused, as the legacy form is."""
    from sentence_transformers import SentenceTransformer, models

    from transforms.engines.vllm import check_pooling

    st = SentenceTransformer(str(tiny_bert), device="cpu")
    out = tmp_path / "two"
    SentenceTransformer(modules=[list(st)[0], models.Pooling(128, pooling_mode=("cls", "mean")),
                                 models.Normalize()], device="cpu").save(str(out))
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode"] == [
        "cls", "mean"]
    with pytest.raises(ValueError, match="vLLM does not compute"):
        check_pooling(out, normalize=True)


def test_check_model_does_not_pass_a_late_config_whose_vectors_are_not_the_models(
        tiny_bert, tmp_path, events, capsys):  # noqa: F811
    """check-model with ``chunking.mode: late`` on the Dense/Tanh model above: the pipeline's
    document vectors are 0.97 from the model's (previous test), so the gate must not pass. It
    builds its Embedder without ``late`` and checks chunks mode's vectors instead."""
    folder = _with_tanh_dense(tiny_bert, tmp_path / "dense-tanh")
    config = _config(tmp_path, folder, chunking={"mode": "late", "chunk_tokens": 64,
                                                 "overlap_tokens": 8})
    code, report = _check(capsys, config, events, "--min-cosine", "0.999")
    assert report is not None
    assert code == 1 and not report["passed"], report["summaries"]
