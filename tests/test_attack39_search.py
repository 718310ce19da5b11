"""Hostile review of issue 39 §4 (``newsvec search`` against the output it searches): what
``check_prefixes`` leaves unchecked. Each test states the behaviour a fix should have and FAILS
on the code it was written against (attack-39)."""
from __future__ import annotations

import shutil

import pytest

from pipeline import config as config_lib
from tests.test_search_any_language import (  # noqa: F401  (fixtures)
    RURI_PREFIXES,
    fake_engine,
    prefixed_batch_output,
)


def _copy_output(config, tmp_path):
    """A copy of the prefixed batch output (the module fixture is shared: never change it)."""
    copy = tmp_path / "out"
    shutil.copytree(config.output, copy)
    return config.model_copy(update={"output": str(copy)})


def test_search_refuses_a_config_whose_unicode_form_is_not_the_outputs(
        prefixed_batch_output, fake_engine):  # noqa: F811
    """The output was written with text.unicode_form NFC (recorded in _summary.json, ``text``
    and in the embedding signature); a config with NFKC normalizes the query otherwise
    (``embed_query``: ``normalize_text(query, config.text.unicode_form)``) than the articles
    were: ㈱ → (株), ① → 1, ｶ → カ. The prefixes match, so nothing is refused and the query
    is embedded as no article was."""
    from pipeline.search import search

    config = prefixed_batch_output.model_copy(update={
        "text": prefixed_batch_output.text.model_copy(update={"unicode_form": "NFKC"})})
    with pytest.raises(config_lib.ConfigError):
        search(config, "㈱北日本① の大雪", k=2)
    assert fake_engine.prompts == [], "nothing embedded"


def test_search_refuses_a_model_whose_files_are_not_the_outputs(
        prefixed_batch_output, fake_engine, tmp_path):  # noqa: F811
    """The output's summary records the model's content hash (``model.content_sha256``) and
    label; a config whose model folder holds other files (another checkpoint under the same
    name, or a gs:// folder replaced in place: search pins nothing, it fetches whatever the bucket
    holds now) embeds the query with another model than the articles'. Only the prefixes and the
    dimension are compared, so it is searched."""
    from pipeline.search import search
    from transforms.engines.model import model_folder

    other = tmp_path / "other-checkpoint"
    shutil.copytree(model_folder(prefixed_batch_output.model), other)
    (other / "config_sentence_transformers.json").write_text('{"note": "fine-tuned again"}')
    config = prefixed_batch_output.model_copy(update={
        "model": prefixed_batch_output.model.model_copy(update={"path": str(other)})})
    with pytest.raises(config_lib.ConfigError):
        search(config, "北日本の大雪", k=2)
    assert fake_engine.prompts == [], "nothing embedded"


def test_search_does_not_skip_the_prefix_check_when_the_summary_is_torn(
        prefixed_batch_output, fake_engine, tmp_path):  # noqa: F811
    """A committed output whose _summary.json is torn (or gone): ``published_summary`` falls
    back to the manifest (no ``model``), ``recorded_prefixes`` returns {} and a config with
    the wrong query prefix is searched, silently: the check fails open. It should refuse (or
    say it cannot check)."""
    from pipeline.search import search
    from transforms.output.manifest import read_manifest

    config = _copy_output(prefixed_batch_output, tmp_path)
    summary = tmp_path / "out" / read_manifest(config.output).summary
    summary.write_bytes(summary.read_bytes()[:40])  # torn
    wrong = config.model_copy(update={
        "model": config.model.model_copy(update={"query_prefix": "query: "})})
    with pytest.raises(config_lib.ConfigError):
        search(wrong, "北日本の大雪", k=2)
    assert fake_engine.prompts == [], "nothing embedded"
