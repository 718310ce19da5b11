"""Attack 38b: the query path without vLLM (transforms/engines/query.py) against the token ids the
engine is given (transforms.text.HeadTokenizer, i.e. transformers 5's BertTokenizer) and against
a model whose weights numpy cannot read. Each test: the fast path either gives the engine's ids
(and so its vector) or steps aside (``Unsupported`` -> the engine), never another vector, never a
crash of ``newsvec search``."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from pipeline import search as search_lib
from tests.conftest import make_config
from transforms.engines.model import resolve_model_path
from transforms.engines.query import QueryEmbedder, Unsupported

TEXTS = ["Élection Présidentielle: Café à PARIS", "東京で新しい図書館", "tab\there\x00nul",
         "[SEP] x [MASK]"]


def _copy(tmp_path: Path, tokenizer_config=None, tokenizer_json=None) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path(make_config().model.path), folder)
    for name, change in (("tokenizer_config.json", tokenizer_config),
                         ("tokenizer.json", tokenizer_json)):
        if change:
            data = json.loads((folder / name).read_text())
            change(data)
            (folder / name).write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("what", [
    # A cased BERT whose tokenizer_config.json does not name do_lower_case: transformers' default
    # (True) rebuilds the normalizer lowercasing; the query path reads tokenizer.json's (cased).
    "cased_without_do_lower_case",
    # strip_accents false in tokenizer.json, absent from tokenizer_config.json: transformers None.
    "strip_accents_without_key",
    # transformers 5's BertTokenizer always builds BertNormalizer(clean_text=True, ...).
    "clean_text_false",
    # ... and always BertPreTokenizer and a [CLS] $A [SEP] post-processor.
    "whitespace_pre_tokenizer",
    "post_processor_without_sep",
])
def test_query_ids_are_the_engines_or_unsupported(tmp_path, what):
    from transforms.text import HeadTokenizer

    changes = {
        "cased_without_do_lower_case": (lambda c: c.pop("do_lower_case"),
                                        lambda j: j["normalizer"].update(lowercase=False)),
        "strip_accents_without_key": (lambda c: c.pop("strip_accents"),
                                      lambda j: j["normalizer"].update(strip_accents=False)),
        "clean_text_false": (None, lambda j: j["normalizer"].update(clean_text=False)),
        "whitespace_pre_tokenizer": (None, lambda j: j.update(
            pre_tokenizer={"type": "WhitespaceSplit"})),
        "post_processor_without_sep": (None, lambda j: j["post_processor"].update(single=[
            {"SpecialToken": {"id": "[CLS]", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}}])),
    }[what]
    folder = _copy(tmp_path, *changes)
    settings = make_config().model.model_copy(update={"path": str(folder)})
    try:
        fast = QueryEmbedder(settings)
    except Unsupported:
        return  # the engine embeds the query: what it should do
    engine_ids = HeadTokenizer(settings)
    differ = [t for t in TEXTS if tuple(fast.ids(t)) != engine_ids(t)[0]]
    assert not differ, f"the query path tokenizes {differ} otherwise than the engine's tokenizer"


def test_a_bert_with_bfloat16_weights_goes_to_the_engine(tmp_path, monkeypatch):
    """A BertModel saved in bfloat16 (numpy has no bfloat16: safetensors.numpy raises TypeError):
    the query is embedded by the engine, not ``newsvec search`` failing."""
    from safetensors.numpy import load_file

    folder = _copy(tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    header, blobs, offset = {}, [], 0
    for name, value in weights.items():
        if value.dtype == np.float32:
            blob, dtype = (value.view(np.uint32) >> 16).astype(np.uint16).tobytes(), "BF16"
        else:
            blob, dtype = value.tobytes(), "I64"
        header[name] = {"dtype": dtype, "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head
                                               + b"".join(blobs))
    config = make_config()
    config = config.model_copy(update={"model": config.model.model_copy(
        update={"path": str(folder)})})
    asked = []

    def engine(cfg, text):  # FAKE engine
        asked.append(text)
        return np.ones(cfg.model.dim, dtype=np.float32)

    monkeypatch.setattr(search_lib, "embed_query_with_engine", engine)
    vector = search_lib.embed_query(config, "batteries")
    assert asked == ["batteries"] and vector.shape == (384,)


def test_max_tokens_the_engine_refuses_is_not_computed_without_it():
    """MiniLM's sentence_bert_config.json says max_seq_length 256: vLLM derives max_model_len 256
    and refuses max_tokens 512 ("User-specified max_model_len (512) is greater than the derived
    max_model_len"); the query path checks only max_position_embeddings (512) and embeds."""
    settings = make_config().model.model_copy(update={"max_tokens": 512, "token_budget": 4096})
    with pytest.raises(Unsupported):
        QueryEmbedder(settings)
