"""``newsvec search`` embeds its query without starting vLLM (transforms/engines/query.py): the
same token ids and, within the engine's own rounding, the same vector as the engine gives the same
text (real vLLM, at the configs' ``native`` dtype and at float32); a model it cannot compute
exactly goes to the engine, saying so on standard error."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline import search as search_lib
from tests.common import REPO, make_config
from transforms.engines.model import resolve_model_path
from transforms.engines.query import QueryEmbedder, Unsupported
from transforms.text import HeadTokenizer, normalize_text

QUERIES = [
    "a factory for solid-state batteries is being built where a steelworks used to be",
    "東京で新しい図書館が開館した",  # Japanese: the English MiniLM reads it as [UNK] runs
    "Élection présidentielle: résultats du premier tour",
    "[SEP] a query that writes [MASK] and [CLS] as text",
    "rates " * 300,  # past max_tokens: the head is kept
]


@pytest.mark.parametrize("dtype, at_least", [("native", 0.999), ("float32", 0.99999)])
def test_query_vectors_are_the_engines(dtype, at_least):
    """Every query's token ids are HeadTokenizer's, and its vector's cosine with the engine's is at
    least 0.999 at the configs' dtype (bfloat16 where the CPU computes it: measured 0.99996) and
    0.99999 at float32 (measured 1.0)."""
    base = make_config()
    config = base.model_copy(update={"model": base.model.model_copy(
        update={"dtype": dtype, "query_prefix": "query: "})})
    fast = QueryEmbedder(config.model)
    head = HeadTokenizer(config.model)
    cosines = []
    for query in QUERIES:
        text = config.model.query_prefix + normalize_text(query, config.text.unicode_form)
        ids = fast.ids(text)
        assert tuple(ids) == head(text)[0], query
        ours = search_lib.embed_query(config, query)
        assert ours.dtype == np.float32 and ours.shape == (config.model.dim,)
        engine = search_lib.embed_query_with_engine(config, text)
        cosines.append(float(np.dot(ours, engine)))
    assert min(cosines) >= at_least, cosines


def _model_copy(tmp_path: Path, **config_changes) -> Path:
    """The packaged MiniLM's folder, copied, with changes to its config.json."""
    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path(make_config().model.path), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


@pytest.mark.parametrize("change", [
    {"dtype": "float16"},
    {"trust_remote_code": True},
    {"dimensions": 128, "truncate_dimensions_knowingly": True},
    {"path": "sentence-transformers/all-MiniLM-L6-v2"},  # a Hugging Face id: not a local folder
])
def test_settings_it_cannot_compute_exactly_are_unsupported(change):
    settings = make_config().model.model_copy(update=change)
    with pytest.raises(Unsupported):
        QueryEmbedder(settings)


@pytest.mark.parametrize("what", ["nothing", "architecture", "activation", "pooling",
                                  "tokenizer"])
def test_models_it_cannot_compute_exactly_are_unsupported(tmp_path, what):
    """A copy of MiniLM is computed; with one change each, it is not."""
    folder = _model_copy(tmp_path, **{"architecture": {"architectures": ["XLMRobertaModel"]},
                                      "activation": {"hidden_act": "gelu_new"}}.get(what, {}))
    if what == "pooling":
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"pooling_mode_max_tokens": True}))
    if what == "tokenizer":  # not a BERT tokenizer: HeadTokenizer would build another one
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {**tokenizer_config, "tokenizer_class": "XLMRobertaTokenizer"}))
    settings = make_config().model.model_copy(update={"path": str(folder)})
    if what == "nothing":
        assert QueryEmbedder(settings).pooling == "mean"
        return
    with pytest.raises(Unsupported):
        QueryEmbedder(settings)


def test_search_embeds_with_the_engine_what_it_cannot_compute_and_says_so(monkeypatch, capsys):
    """A FAKE engine path: float16 is not computed without vLLM."""
    config = make_config()
    config = config.model_copy(update={"model": config.model.model_copy(
        update={"dtype": "float16"})})
    asked = []

    def engine(cfg, text):
        asked.append(text)
        return np.ones(cfg.model.dim, dtype=np.float32)

    monkeypatch.setattr(search_lib, "embed_query_with_engine", engine)
    vector = search_lib.embed_query(config, "batteries")
    assert asked == ["batteries"] and vector.shape == (384,)
    err = capsys.readouterr().err
    assert "embedded by the engine" in err and "dtype float16" in err


def test_a_search_in_a_fresh_process_imports_neither_vllm_nor_torch(tmp_path):
    """The query path of ``newsvec search`` (a model it computes) starts no engine: vLLM, torch
    and transformers are never imported (importing them took about 3 s, starting vLLM 7 s more)."""
    output = tmp_path / "out"
    vectors = output / "vectors"
    vectors.mkdir(parents=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((3, 384)).astype(np.float32)
    pq.write_table(pa.table({
        "id": ["a", "b", "c"], "title": ["x", "y", "z"],
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embedding.ravel()), 384)}),
        vectors / "part-0.parquet")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(json.loads(make_config(
        input="x", output=str(output)).model_dump_json())))
    script = ("import sys; from pipeline import cli; code = cli.main(sys.argv[1:]); "
              "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules),"
              " file=sys.stderr); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script, "search", "--config", str(config_file),
                           "--k", "3", "--json", "batteries"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(json.loads(line)["id"] for line in done.stdout.splitlines()) == ["a", "b", "c"]
    assert done.stderr.strip().splitlines()[-1] == "[]", done.stderr[-3000:]


# ---- the engine's tokenizer, whatever tokenizer.json says; weights numpy cannot read ------------
# HeadTokenizer (the engine's ids) is transformers' BertTokenizer, which builds its normalizer,
# pre-tokenizer and [CLS] $A [SEP] template from tokenizer_config.json and transformers' defaults,
# not from tokenizer.json: the query path must give its ids, or step aside (Unsupported).

TEXTS = ["Élection Présidentielle: Café à PARIS", "東京で新しい図書館", "tab\there\x00nul",
         "[SEP] x [MASK]"]


def _edited_copy(tmp_path: Path, tokenizer_config=None, tokenizer_json=None) -> Path:
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
    folder = _edited_copy(tmp_path, *changes)
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

    folder = _edited_copy(tmp_path)
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


# ---- what the engine applies after the pooling; special tokens as objects; a tokenizer.json ----
# whose normalizer is not the one transformers builds (issue 46: F1, F6, F7) ----------------------


def _with_module(folder: Path, kind: str, path: str) -> None:
    """``folder``'s modules.json with a module of type ``kind`` (in ``path``) before Normalize."""
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(len(modules) - 1, {"idx": 0, "name": "", "path": path, "type": kind})
    for i, module in enumerate(modules):
        module.update(idx=i, name=str(i))
    (folder / "modules.json").write_text(json.dumps(modules))


def _dense_copy(tmp_path: Path) -> Path:
    """The packaged MiniLM with a sentence-transformers Dense 384 -> 384 (Tanh, near the
    identity) between its pooling and its Normalize, as LaBSE is built (768 -> 768 Tanh). vLLM
    applies it (its sentence-transformers projector); on this model it moves the vector by a
    cosine of about 0.02."""
    import torch
    from sentence_transformers import models

    folder = _edited_copy(tmp_path)
    torch.manual_seed(0)
    dense = models.Dense(384, 384, activation_function=torch.nn.Tanh())
    with torch.no_grad():
        dense.linear.weight.copy_(torch.eye(384) + 0.01 * torch.randn(384, 384))
        dense.linear.bias.zero_()
    (folder / "2_Dense").mkdir()
    dense.save(str(folder / "2_Dense"))
    _with_module(folder, "sentence_transformers.models.Dense", "2_Dense")
    return folder


def test_a_dense_module_is_applied_as_the_engine_applies_it(tmp_path, capsys):
    """The query's vector is the engine's (which applies the Dense), and a line on standard error
    says the engine embedded it: the query path computes no Dense, so it steps aside."""
    base = make_config()
    config = base.model_copy(update={"model": base.model.model_copy(
        update={"path": str(_dense_copy(tmp_path))})})
    query = "a factory for solid-state batteries is being built where a steelworks used to be"
    text = normalize_text(query, config.text.unicode_form)
    ours = search_lib.embed_query(config, query)
    engine = search_lib.embed_query_with_engine(config, text)
    # The Dense matters: the vector without it (the packaged MiniLM's) is not the engine's.
    plain = QueryEmbedder(base.model)
    assert float(np.dot(plain.embed(plain.ids(text)), engine)) < 0.995
    assert float(np.dot(ours, engine)) >= 0.999
    err = capsys.readouterr().err
    assert "embedded by the engine" in err and "Dense" in err, err


@pytest.mark.parametrize("kind", ["sentence_transformers.models.Dense",
                                  "sentence_transformers.models.LayerNorm",
                                  "newsroom_models.Rescale"])
def test_a_module_it_does_not_compute_is_unsupported(tmp_path, kind):
    """Transformer, Pooling and Normalize are what it computes; any other module, one vLLM
    applies or one of the team's own, sends the query to the engine."""
    folder = _edited_copy(tmp_path)
    _with_module(folder, kind, "2_Module")
    settings = make_config().model.model_copy(update={"path": str(folder)})
    with pytest.raises(Unsupported, match=kind.rsplit(".", 1)[-1]):
        QueryEmbedder(settings)


_ADDED_TOKEN = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}


@pytest.mark.parametrize("keys", [("unk_token",), ("pad_token", "unk_token", "cls_token",
                                                   "sep_token", "mask_token")])
def test_special_tokens_written_as_objects_are_read_by_their_content(tmp_path, keys):
    """tokenizer_config.json as transformers 4 wrote tokens with flags: an ``AddedToken`` object.
    A query holding a character outside the vocabulary gets the engine's ids ([UNK] among them)
    and the engine's vector, not a tokenizer error (only unk an object) nor the engine (all)."""
    from transforms.engines.registry import load_engine

    def as_objects(tokenizer_config):
        for key in keys:
            tokenizer_config[key] = {**_ADDED_TOKEN, "content": tokenizer_config[key]}

    base = make_config()
    settings = base.model.model_copy(update={
        "path": str(_edited_copy(tmp_path, tokenizer_config=as_objects))})
    text = normalize_text("storm warning ⚠️ for Kraków", base.text.unicode_form)
    fast = QueryEmbedder(settings)
    ids = fast.ids(text)
    assert tuple(ids) == HeadTokenizer(settings)(text)[0] and 100 in ids  # [UNK]
    (engine,) = load_engine(base.model).embed([ids])  # the packaged MiniLM: the same weights
    assert float(np.dot(fast.embed(ids), engine)) >= 0.99999


@pytest.mark.parametrize("key", ["unk_token", "pad_token", "mask_token"])
def test_a_special_token_outside_the_vocabulary_is_unsupported(tmp_path, key):
    folder = _edited_copy(tmp_path, tokenizer_config=lambda c: c.update({key: "<x>"}))
    settings = make_config().model.model_copy(update={"path": str(folder)})
    with pytest.raises(Unsupported, match="vocabulary"):
        QueryEmbedder(settings)


def test_a_query_the_query_path_fails_on_is_embedded_by_the_engine(monkeypatch, capsys):
    """An error of the query path on one query (a tokenizer's, as ``tokenizers`` raises a plain
    Exception) is not a traceback: the engine embeds that query, and standard error says why."""
    config = make_config()

    def failing(self, text):  # pylint: disable=unused-argument
        raise Exception("WordPiece error: Missing [UNK] token from the vocabulary")

    monkeypatch.setattr(QueryEmbedder, "ids", failing)
    query = "storm warning ⚠️ for Kraków"
    vector = search_lib.embed_query(config, query)
    expected = search_lib.embed_query_with_engine(
        config, normalize_text(query, config.text.unicode_form))
    assert float(np.dot(vector, expected)) >= 0.99999
    err = capsys.readouterr().err
    assert "embedded by the engine" in err and "WordPiece error" in err, err


@pytest.mark.parametrize("field, value", [("lowercase", False), ("strip_accents", False),
                                          ("handle_chinese_chars", False)])
def test_a_tokenizer_json_normalizer_transformers_does_not_build_is_unsupported(tmp_path, field,
                                                                                  value):
    """MiniLM's tokenizer_config.json lowercases (and so strips accents) and splits Chinese
    characters; its tokenizer.json, edited, does not. transformers builds from the former, so the
    engine's ids follow it, but the model may have been trained with the latter: the query path
    refuses the pair rather than choose."""
    folder = _edited_copy(tmp_path, tokenizer_json=lambda j: j["normalizer"].update(
        {field: value}))
    settings = make_config().model.model_copy(update={"path": str(folder)})
    with pytest.raises(Unsupported, match=f"tokenizer.json.*{field}"):
        QueryEmbedder(settings)
