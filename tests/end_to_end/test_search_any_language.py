"""Feeds in other languages (docs/languages.md): the sample's Japanese articles, the config for a
multilingual model (checked without its weights), and ``newsvec search`` with a Japanese query.
The search tests use the packaged MiniLM tokenizer and a FAKE engine (tests/fakes.py): they check
the plumbing (argv, stdin, the prefix, the normalization, printing), not what a model finds."""
from __future__ import annotations

import io
import json
import shutil
import sys
import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline import cli
from pipeline import config as config_lib
from tests.common import REPO, SAMPLE_EVENTS, make_config
from tests.fakes import FakeEngine
from transforms.text import compose_text, normalize_text
from transforms.types import NewsEvent

E5_CONFIG = REPO / "configs" / "multilingual-e5.yaml"
E5_PLACEHOLDER = "<MULTILINGUAL_E5_DIR>"
FULL_WIDTH_ASCII = range(0xFF01, 0xFF5F)  # ＡＢＣ１２３...
HALF_WIDTH_KATAKANA = range(0xFF65, 0xFFA0)  # ｶﾀｶﾅ...


def _japanese_events() -> list[NewsEvent]:
    events = []
    for line in SAMPLE_EVENTS.read_bytes().splitlines():
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if isinstance(raw, dict) and raw.get("language") == "ja":
            events.append(NewsEvent.model_validate_json(line))
    return events


def _holds(text: str, block: range) -> bool:
    return any(ord(ch) in block for ch in text)


def test_the_sample_holds_japanese_articles_with_width_and_compatibility_forms():
    events = _japanese_events()
    assert len(events) == 6 and len({e.id for e in events}) == 6
    raw = [f"{e.title}\n{e.body}" for e in events]
    assert any(_holds(text, FULL_WIDTH_ASCII) for text in raw), "an article with ＡＢＣ１２３"
    assert any(_holds(text, HALF_WIDTH_KATAKANA) for text in raw), "an article with ｶﾀｶﾅ"
    prepared = [compose_text(e) for e in events]
    # The preparation folds widths already (ftfy's fix_character_width) ...
    assert not any(_holds(text, FULL_WIDTH_ASCII) or _holds(text, HALF_WIDTH_KATAKANA)
                   for text in prepared)
    # ... and NFKC (text.unicode_form) still changes some prepared text: ㈱, ①.
    assert any(unicodedata.normalize("NFKC", text) != text for text in prepared)


def test_the_multilingual_config_needs_its_local_model_folder_and_loads_once_filled(tmp_path):
    text = E5_CONFIG.read_text(encoding="utf-8")
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.load(E5_CONFIG)
    assert "model.path" in str(info.value) and E5_PLACEHOLDER in str(info.value)
    # The placeholder is explained where it stands, and in the docs.
    (path_line,) = [line for line in text.splitlines() if line.strip().startswith("path:")]
    assert E5_PLACEHOLDER in path_line and "local folder" in path_line
    assert "huggingface-cli download intfloat/multilingual-e5-base" in text
    docs = (REPO / "docs" / "languages.md").read_text(encoding="utf-8")
    assert "configs/multilingual-e5.yaml" in docs and E5_PLACEHOLDER in docs

    folder = tmp_path / "multilingual-e5-base"
    folder.mkdir()
    filled = tmp_path / "e5.yaml"
    filled.write_text(text.replace(E5_PLACEHOLDER, str(folder)), encoding="utf-8")
    (tmp_path / "local.yaml").write_text((REPO / "configs" / "local.yaml").read_text())  # extended
    config = config_lib.load(filled)
    model = config.model
    assert (model.name, model.path, model.dim, model.max_tokens) == (
        "intfloat/multilingual-e5-base", str(folder), 768, 512)
    assert (model.document_prefix, model.query_prefix) == ("passage: ", "query: ")
    assert model.engine_env["HF_HUB_OFFLINE"] == model.engine_env["TRANSFORMERS_OFFLINE"] == "1"
    assert not model.trust_remote_code
    local = config_lib.load(REPO / "configs" / "local.yaml")
    assert config.input == local.input and config.beam == local.beam, "a local batch run"
    assert config.output != local.output, "its vectors beside MiniLM's, not over them"


RURI_CONFIG = REPO / "configs" / "ruri-v3.yaml"
RURI_PLACEHOLDER = "<RURI_V3_DIR>"


@pytest.mark.parametrize("where", ["local folder", "gs:// folder"])
def test_the_ruri_v3_config_is_ready_for_japanese_news_without_its_weights(tmp_path, where):
    """configs/ruri-v3.yaml validated as every command reads it (``config_lib.load``), without
    the model's files: the check that needs them (the folder, ``dim`` against the weights) is the
    run's and ``newsvec check-model``'s, never a config check's. Its prefixes are ruri-v3's role
    prefixes to the character, its ``max_tokens`` holds most Japanese articles whole and fits the
    engine's steps, and its Unicode form is stated."""
    text = RURI_CONFIG.read_text(encoding="utf-8")
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.load(RURI_CONFIG)
    assert "model.path" in str(info.value) and RURI_PLACEHOLDER in str(info.value)
    for size, dim in (("30m", 256), ("70m", 384), ("130m", 512), ("310m", 768)):
        assert f"cl-nagoya/ruri-v3-{size}" in text and f"{size}: {dim}" in text, "the sizes"
    assert "huggingface-cli download cl-nagoya/ruri-v3-310m" in text
    docs = (REPO / "docs" / "languages.md").read_text(encoding="utf-8")
    assert "configs/ruri-v3.yaml" in docs and RURI_PLACEHOLDER in docs

    folder = (str(tmp_path / "ruri-v3-310m") if where == "local folder"
              else "gs://news-models/models/ruri-v3-310m/")  # no weights in either
    filled = tmp_path / "ruri-v3.yaml"
    filled.write_text(text.replace(RURI_PLACEHOLDER, folder), encoding="utf-8")
    (tmp_path / "local.yaml").write_text((REPO / "configs" / "local.yaml").read_text())  # extended
    config = config_lib.load(filled)
    model = config.model
    assert (model.name, model.path, model.dim) == ("cl-nagoya/ruri-v3-310m", folder, 768)
    assert model.document_prefix == "\u691c\u7d22\u6587\u66f8: "  # 検索文書: , ASCII ": "
    assert model.query_prefix == "\u691c\u7d22\u30af\u30a8\u30ea: "  # 検索クエリ + ASCII ": "
    assert model.max_tokens == 2048 and model.max_tokens <= 8192, "within ruri-v3's context"
    assert model.token_budget >= model.max_tokens
    assert (model.max_num_batched_tokens or 4096) >= model.max_tokens  # vLLM's CPU default
    assert config.text.unicode_form == "NFC"
    assert model.engine_env["HF_HUB_OFFLINE"] == model.engine_env["TRANSFORMERS_OFFLINE"] == "1"
    assert not model.trust_remote_code
    local = config_lib.load(REPO / "configs" / "local.yaml")
    assert config.input == local.input and config.beam == local.beam, "a local batch run"
    assert config.output not in (local.output, "out/multilingual-e5"), "an output of its own"


class RecordingFakeEngine(FakeEngine):
    """FAKE: a FakeEngine that keeps the token ids it was given."""

    def __init__(self, settings=None):
        super().__init__(settings)
        self.prompts: list[tuple[int, ...]] = []

    def embed(self, prompts):
        self.prompts.extend(tuple(p) for p in prompts)
        return super().embed(prompts)


@pytest.fixture
def fake_engine(monkeypatch):
    engine = RecordingFakeEngine()
    monkeypatch.setattr("transforms.engines.registry.load_engine", lambda settings: engine)
    # newsvec search computes MiniLM's query vector without the engine: the FAKE is given its ids
    monkeypatch.setattr("transforms.engines.query.QueryEmbedder.embed",
                        lambda self, ids: engine.embed([ids])[0])
    return engine


QUERY = "ｸﾘｽﾏｽﾏｰｹｯﾄ&amp;<b>手作り雑貨</b>"  # half-width katakana, an entity, a tag
PREFIXED = make_config(model=make_config().model.model_copy(update={"query_prefix": "query: "}))


def _ids(text: str) -> tuple[int, ...]:
    from transforms.text import HeadTokenizer

    return HeadTokenizer(PREFIXED.model)(text)[0]


def test_a_japanese_query_is_prepared_like_an_article_after_the_query_prefix(fake_engine):
    from pipeline.search import embed_query

    embed_query(PREFIXED, QUERY)
    assert normalize_text(QUERY) == "クリスマスマーケット&手作り雑貨"
    assert fake_engine.prompts == [_ids("query: クリスマスマーケット&手作り雑貨")]


def _two_article_output(tmp_path) -> str:
    """An output of two articles: the one whose vector the FAKE engine gives the query, and
    another. Returns the path of a config file that searches it."""
    hit = np.asarray(FakeEngine().embed([_ids("query: " + normalize_text(QUERY))])[0])
    other = np.roll(hit, 1)
    (tmp_path / "vectors").mkdir()
    pq.write_table(pa.table({
        "id": ["sample-0052", "sample-0049"],
        "title": ["駅前商店街でｸﾘｽﾏｽﾏｰｹｯﾄ", "北日本で今季一番の冷え込み"],
        "embedding": pa.array([hit.tolist(), other.tolist()], pa.list_(pa.float32(), 384))}),
        tmp_path / "vectors" / "part-0.parquet")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(json.loads(PREFIXED.model_copy(update={
        "output": str(tmp_path)}).model_dump_json())))
    return str(config_file)


@pytest.mark.parametrize("given", ["argv", "argv undecoded", "stdin"])
def test_search_command_takes_a_japanese_query_and_prints_japanese_titles_to_an_ascii_stdout(
        given, fake_engine, tmp_path, monkeypatch):
    """stdout as ``PYTHONIOENCODING=ascii`` makes it; "argv undecoded": the argument as Python
    leaves it in a locale that is not UTF-8 (its bytes as surrogates)."""
    config_file = _two_article_output(tmp_path)
    argument = {"argv": QUERY, "stdin": "-",
                "argv undecoded": QUERY.encode("utf-8").decode("ascii", "surrogateescape")}[given]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(QUERY.encode("utf-8"))))
    shown = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(shown, encoding="ascii"))
    assert cli.main(["search", "--config", config_file, "--k", "2", argument]) == 0
    sys.stdout.flush()

    assert fake_engine.prompts == [_ids("query: クリスマスマーケット&手作り雑貨")]
    lines = shown.getvalue().decode("utf-8").splitlines()
    assert lines == ["1.0000  sample-0052  駅前商店街でｸﾘｽﾏｽﾏｰｹｯﾄ",
                     "0.0000  sample-0049  北日本で今季一番の冷え込み"]


def test_search_json_lines_hold_japanese_titles_as_text_not_escapes(fake_engine, tmp_path,
                                                                     monkeypatch):
    config_file = _two_article_output(tmp_path)
    shown = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(shown, encoding="utf-8"))
    assert cli.main(["search", "--config", config_file, "--k", "1", "--json", QUERY]) == 0
    sys.stdout.flush()

    line = shown.getvalue().decode("utf-8").strip()
    assert "駅前商店街でｸﾘｽﾏｽﾏｰｹｯﾄ" in line and "\\u" not in line
    assert json.loads(line)["title"] == "駅前商店街でｸﾘｽﾏｽﾏｰｹｯﾄ"


RURI_PREFIXES = {"document_prefix": "検索文書: ", "query_prefix": "検索クエリ: "}


@pytest.fixture(scope="module")
def prefixed_batch_output(tmp_path_factory):
    """A committed batch output of three sample articles embedded (FAKE engine) with ruri-v3's
    prefixes, and the config that wrote it."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch

    root = tmp_path_factory.mktemp("prefixed")
    lines = [line for line in SAMPLE_EVENTS.read_bytes().splitlines()[:3]]
    (root / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    base = make_config()
    config = make_config(input=str(root / "in.jsonl"), output=str(root / "out"),
                         model=base.model.model_copy(update=RURI_PREFIXES))
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]),
                        engine_factory=FakeEngine)
    assert summary["invariant_holds"] and summary["model"]["query_prefix"] == "検索クエリ: "
    return config


def _config_file(tmp_path, config) -> str:
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(json.loads(config.model_dump_json()), allow_unicode=True),
                    encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("key, other", [("query_prefix", "query: "), ("query_prefix", ""),
                                        ("document_prefix", "passage: ")])
def test_search_refuses_a_config_whose_prefixes_are_not_the_outputs(
        prefixed_batch_output, key, other, fake_engine, tmp_path, capsys):
    """A batch output records the prefixes it was written with (``_summary.json``, ``model``): a
    config with another query or document prefix is refused, both prefixes named, before a
    query is embedded. Before, the query was embedded with the config's prefix, silently."""
    from pipeline.search import PrefixMismatch, search

    config = prefixed_batch_output.model_copy(update={
        "model": prefixed_batch_output.model.model_copy(update={key: other})})
    with pytest.raises(PrefixMismatch) as info:
        search(config, "北日本の大雪", k=2)
    assert f"model.{key}" in str(info.value)
    assert repr(RURI_PREFIXES[key]) in str(info.value) and repr(other) in str(info.value)
    assert fake_engine.prompts == [], "nothing embedded"

    assert cli.main(["search", "--config", _config_file(tmp_path, config), "北日本の大雪"]) == 2
    shown = capsys.readouterr()
    assert shown.out == "" and RURI_PREFIXES[key] in shown.err and f"model.{key}" in shown.err
    assert fake_engine.prompts == []


def test_search_with_the_config_that_wrote_the_output_uses_its_query_prefix(
        prefixed_batch_output, fake_engine):
    from pipeline.search import recorded_prefixes, search
    from transforms.text import HeadTokenizer

    config = prefixed_batch_output
    assert recorded_prefixes(config.output) == RURI_PREFIXES
    hits = search(config, "北日本の大雪", k=2)
    assert len(hits) == 2
    assert fake_engine.prompts == [HeadTokenizer(config.model)("検索クエリ: 北日本の大雪")[0]]


def _copy_output(config, tmp_path):
    """A copy of the prefixed batch output (the module fixture is shared: never change it)."""
    copy = tmp_path / "out"
    shutil.copytree(config.output, copy)
    return config.model_copy(update={"output": str(copy)})


def test_search_refuses_a_config_whose_unicode_form_is_not_the_outputs(
        prefixed_batch_output, fake_engine, tmp_path, capsys):
    """The output was written with text.unicode_form NFC (recorded in _summary.json, ``text``
    and in the embedding signature); a config with NFKC normalizes the query otherwise
    (``embed_query``: ``normalize_text(query, config.text.unicode_form)``) than the articles
    were: ㈱ → (株), ① → 1, ｶ → カ. It is refused, the setting and both values named, before a
    query is embedded. Before, the prefixes matched and it was searched."""
    from pipeline.search import SettingsMismatch, search

    config = prefixed_batch_output.model_copy(update={
        "text": prefixed_batch_output.text.model_copy(update={"unicode_form": "NFKC"})})
    with pytest.raises(SettingsMismatch) as info:
        search(config, "㈱北日本① の大雪", k=2)
    assert "text.unicode_form: the output's NFC, the config's 'NFKC'" in str(info.value)
    assert fake_engine.prompts == [], "nothing embedded"
    longer = prefixed_batch_output.model_copy(update={
        "model": prefixed_batch_output.model.model_copy(update={"max_tokens": 64})})
    with pytest.raises(SettingsMismatch, match="model.max_tokens: the output's 256, the "
                                               "config's 64"):
        search(longer, "北日本の大雪", k=2)
    assert cli.main(["search", "--config", _config_file(tmp_path, config), "北日本の大雪"]) == 2
    assert "text.unicode_form" in capsys.readouterr().err
    assert fake_engine.prompts == [], "nothing embedded"


def test_search_refuses_a_model_whose_files_are_not_the_outputs(
        prefixed_batch_output, fake_engine, tmp_path):
    """The output's summary records the model's content hash (``model.content_sha256``) and
    label; a config whose model folder holds other files (another checkpoint under the same
    name, or a gs:// folder replaced in place) would embed the query with another model than the
    articles'. The recorded hash becomes the config's ``model.sha256`` (a gs:// folder is fetched
    pinned, a local one hashed) and a folder that hashes otherwise is refused, the output's model
    and both hashes named. Before, only the prefixes and the dimension were compared."""
    from pipeline.search import ModelMismatch, search
    from transforms.engines.model import model_folder
    from transforms.engines.model_files import model_content_hash

    other = tmp_path / "other-checkpoint"
    shutil.copytree(model_folder(prefixed_batch_output.model), other)
    (other / "config_sentence_transformers.json").write_text('{"note": "fine-tuned again"}')
    config = prefixed_batch_output.model_copy(update={
        "model": prefixed_batch_output.model.model_copy(update={"path": str(other)})})
    with pytest.raises(ModelMismatch) as info:
        search(config, "北日本の大雪", k=2)
    written = model_content_hash(model_folder(prefixed_batch_output.model))
    assert written in str(info.value) and model_content_hash(str(other)) in str(info.value)
    assert str(other) in str(info.value)
    assert fake_engine.prompts == [], "nothing embedded"
    assert search(prefixed_batch_output, "北日本の大雪", k=2), "the output's own model is searched"


def test_search_does_not_skip_the_checks_when_the_summary_is_torn(
        prefixed_batch_output, fake_engine, tmp_path):
    """A committed output whose _summary.json is torn (or gone): ``published_summary`` falls
    back to the manifest (no ``model``). Refused, saying the checks cannot be made and what to
    run, not searched. Before, ``recorded_prefixes`` returned {} and a config with the wrong
    query prefix was searched, silently: the check failed open."""
    from pipeline.search import OutputUncheckable, search
    from transforms.output.manifest import read_manifest

    config = _copy_output(prefixed_batch_output, tmp_path)
    summary = tmp_path / "out" / read_manifest(config.output).summary
    summary.write_bytes(summary.read_bytes()[:40])  # torn
    wrong = config.model_copy(update={
        "model": config.model.model_copy(update={"query_prefix": "query: "})})
    for searched in (wrong, config):
        with pytest.raises(OutputUncheckable, match="cannot be checked.*newsvec cleanup"):
            search(searched, "北日本の大雪", k=2)
    assert fake_engine.prompts == [], "nothing embedded"
