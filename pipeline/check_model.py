"""``newsvec check-model``: a model's vectors from newsvec against its own reference, before it
serves.

A sample of news events (JSON Lines, the pipeline's input format) is embedded twice:
- as the pipeline embeds it: the config's PrepareText (normalization, the head or the chunks,
  ``model.document_prefix``) and its engine (vLLM, through the ``Embedder``);
- by the reference: sentence-transformers on the model folder (or ``--reference``, e.g. the
  training side's checkpoint), with the model's own tokenizer, pooling and normalization, at
  float32, on the same prepared text with the model's declared document prompt (or the config's
  prefix where it declares none), cut at the same ``model.max_tokens``.
The sample's titles are embedded as queries the same two ways: as ``newsvec search`` embeds a query
(``pipeline.search.embed_queries``: the query path without vLLM where it applies, else the engine,
after ``model.query_prefix``), and by the reference with the model's declared query prompt (or the
config's prefix): a search's vectors are checked, not only the pipeline's.
It reports the cosine of each text's two vectors (min, p05, median; by length: within and beyond
the model's local attention window, near ``max_tokens``; the worst texts), the queries' cosines,
whether newsvec's head tokenization gives the model tokenizer's own ids, every prompt the model
declares and what the config does with it, and what it found in the model folder. Exit status 1
when the lowest cosine of the texts or of the queries is below ``--min-cosine``, a head's ids
disagree, a text failed to embed, the vectors' normalization differs, the model declares a prompt
the config neither uses nor leaves out on purpose (``model.unused_prompts``), or a BERT model's
``tokenizer.json`` says otherwise than the tokenizer transformers builds (which every side here
uses, so no cosine can show it); 2 for a config or input it cannot use. What the model folder
says (its facts and declared prompts) is ``transforms.engines.model_facts``'s.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from apache_beam import pvalue
from apache_beam.io.filesystems import FileSystems

from pipeline import config as config_lib
from pipeline import parse_command
from pipeline.graph import prepare_text
from pipeline.search import embed_queries
from pipeline.terminal import escaped
from transforms.embed import EmbedFailure, embedder_for, model_inputs
from transforms.engines.base import EngineFailedError
from transforms.engines.devices import resolved_dtype
from transforms.engines.model import resolve_model_path
from transforms.engines.model_facts import (
    DOCUMENT_PROMPTS,
    LEFT_OUT,
    QUERY_PROMPTS,
    DeclaredPrompt,
    ModelFacts,
    declared_prompts,
    document_prompt,
    model_facts,
    model_prompts,
    pooling_config,
    query_prompt,
)
from transforms.engines.query import Unsupported, tokenizer_json_disagreements
from transforms.engines.vllm import resolved_pooling
from transforms.parse import ParseError, parse_event
from transforms.settings import ModelSettings
from transforms.text import normalize_text

DEFAULT_INPUT = config_lib.REPO_ROOT / "pipeline" / "sample_data" / "news-events.jsonl"
DEFAULT_MIN_COSINE = 0.99
NEAR_MAX_TOKENS = 0.9  # a text of at least this share of max_tokens is "near max_tokens"
QUERY_SAMPLE = 50  # titles of the sample embedded as queries


@dataclasses.dataclass(frozen=True)
class TextCosine:
    id: str  # the event's id; a chunk's: "ID#chunk N"
    cosine: float
    tokens: int  # the model tokenizer's count for the whole text (prefix and special tokens in)
    length: str  # "within window", "beyond window", "near max_tokens" or "shorter"


@dataclasses.dataclass(frozen=True)
class Summary:
    length: str
    texts: int
    min: float
    p05: float
    median: float


@dataclasses.dataclass(frozen=True)
class TokenDisagreement:
    id: str
    newsvec: int  # tokens of newsvec's head
    model: int  # tokens of the model tokenizer's own
    first_difference: int  # the first position where they differ


@dataclasses.dataclass(frozen=True)
class Report:
    passed: bool
    problems: list[str]  # why it failed; empty when it passed
    notes: list[str]  # what a person should know though it passed
    min_cosine: float  # the threshold
    model: ModelFacts
    events: int  # read from the input
    dead_lettered: int  # by PrepareText (or not parsed)
    failed: int  # texts that did not embed
    summaries: list[Summary]  # "all" first
    worst: list[TextCosine]
    heads_checked: int
    heads_agreeing: int
    token_disagreements: list[TokenDisagreement]
    queries: Optional[Summary] = None  # the sample's titles embedded as newsvec search does
    query_path: str = ""  # how newsvec search embedded them
    worst_queries: list[TextCosine] = dataclasses.field(default_factory=list)
    prompts: list[DeclaredPrompt] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class _Reference:
    """The reference model (sentence-transformers on a folder, at float32) and what it puts
    before every text and every query."""
    st: Any  # sentence_transformers.SentenceTransformer
    prompts: dict[str, str]  # the prompts its folder declares
    declared: Optional[str]  # its declared document prompt (not left out), if any
    prefix: str  # what it puts before every text
    declared_query: Optional[str]  # its declared query prompt (not left out), if any
    query_prefix: str  # what it puts before every query
    given_prefix: Optional[str]  # --reference-prefix


@dataclasses.dataclass(frozen=True)
class _Compared:
    """What ``check`` measured, before it is judged."""
    cosines: list[TextCosine]
    summaries: list[Summary]  # "all" first; none when no text was compared
    failed: int  # texts that did not embed
    late_chunks: int  # chunk vectors of chunking.mode late, which have no reference
    query_cosines: list[TextCosine]
    query_path: str
    query_error: Optional[str]
    heads: int
    disagreements: list[TokenDisagreement]

    @property
    def query_summary(self) -> Optional[Summary]:
        return (_summary("queries", [c.cosine for c in self.query_cosines])
                if self.query_cosines else None)


@dataclasses.dataclass(frozen=True)
class _Counted:
    """The sample's events, and those PrepareText dead-lettered (or that did not parse)."""
    events: int
    dead_lettered: int


def _sample_queries(events: Sequence) -> list[tuple[str, str]]:
    """(event id, title) of the first ``QUERY_SAMPLE`` events with a title of their own."""
    seen: set[str] = set()
    queries: list[tuple[str, str]] = []
    for event in events:
        title = (event.title or "").strip()
        if title and title not in seen and len(queries) < QUERY_SAMPLE:
            seen.add(title)
            queries.append((str(event.id), title))
    return queries


def read_events(path: str, limit: int, config: config_lib.Config) -> tuple[list, int]:
    """(the first ``limit`` events of a JSON Lines file, local or ``gs://``, parsed as the
    pipeline parses them; how many lines did not parse)."""
    events: list = []
    bad = 0
    with FileSystems.open(path) as f:
        for line in f:
            if len(events) >= limit:
                break
            if not line.strip():
                continue
            try:
                events.append(parse_event(
                    line.rstrip(b"\r\n"), max_payload_bytes=config.parse.max_payload_bytes,
                    max_future_skew=dt.timedelta(seconds=config.parse.max_future_skew_s)))
            except ParseError:
                bad += 1
    return events, bad


def _inputs(doc, doc_vector: str) -> list[tuple[str, str]]:
    """(label, text) of each input the engine embeds for a prepared document
    (``transforms.embed.model_inputs``: the head, or the chunks after the head)."""
    inputs = model_inputs(doc, doc_vector)
    texts = [(f"{doc.event.id}#chunk {k}", doc.text[c.char_start:c.char_end])
             for k, c in enumerate(doc.chunks)]
    if len(inputs) > len(texts):  # the head first (transforms.embed.model_inputs)
        texts.insert(0, (str(doc.event.id), doc.text))
    return texts


def _length(tokens: int, reach: Optional[int], max_tokens: int) -> str:
    """A text's length class: "within window" where every token sees every other in a local
    layer (at most ``reach`` + 1 tokens), "beyond window", "near max_tokens" (or cut there);
    "shorter" than that for a model without local attention."""
    if tokens >= NEAR_MAX_TOKENS * max_tokens:
        return "near max_tokens"
    if reach is None:
        return "shorter"
    return "within window" if tokens <= reach + 1 else "beyond window"


def _summary(length: str, cosines: Sequence[float]) -> Summary:
    values = np.asarray(cosines, dtype=np.float64)
    return Summary(length, len(values), round(float(values.min()), 6),
                   round(float(np.quantile(values, 0.05)), 6),
                   round(float(np.median(values)), 6))


def check(config: config_lib.Config, events: Sequence, *, reference: Optional[str] = None,
          reference_prefix: Optional[str] = None, min_cosine: float = DEFAULT_MIN_COSINE,
          worst: int = 10, unparsed: int = 0, engine_factory=None) -> Report:
    """Embed ``events`` as the pipeline would and through the reference, and compare."""
    settings = config.model
    settings.apply_engine_env()
    folder = Path(resolve_model_path(settings.path))
    reference_folder = Path(reference) if reference else folder
    prepared = prepare_text(config).prepare(events)
    docs = [d for d in prepared if not isinstance(d, pvalue.TaggedOutput)]
    counted = _Counted(len(events) + unparsed, len(prepared) - len(docs) + unparsed)
    embedder = embedder_for(settings, config.chunking, engine_factory)  # the pipeline's, late too
    try:
        handle = embedder.load_engine()
    except EngineFailedError as exc:  # refused (a pooling it does not compute, model.dim...)
        facts = model_facts(settings, folder, "refused", settings.dim,
                            settings.document_prefix, reference_folder)
        return _refused(str(exc), facts, counted, len(docs), min_cosine)
    results = embedder.embed_docs(handle, docs)
    ref = _reference(reference_folder, settings, reference_prefix)
    facts = _served_facts(settings, folder, reference_folder, ref, engine_factory)
    compared = _compare(config, events, docs, results, ref, facts, engine_factory)
    prompt_uses = declared_prompts(ref.prompts, settings)
    problems = _problems(compared, facts, settings, prompt_uses, folder, min_cosine)
    notes = _notes(compared, facts, settings, ref, reference_folder, prompt_uses)
    ranked = sorted(compared.cosines, key=lambda c: c.cosine)
    return Report(passed=not problems, problems=problems, notes=notes, min_cosine=min_cosine,
                  model=facts, events=counted.events, dead_lettered=counted.dead_lettered,
                  failed=compared.failed, summaries=compared.summaries, worst=ranked[:worst],
                  heads_checked=compared.heads,
                  heads_agreeing=compared.heads - len(compared.disagreements),
                  token_disagreements=compared.disagreements[:worst],
                  queries=compared.query_summary, query_path=compared.query_path,
                  worst_queries=sorted(compared.query_cosines, key=lambda c: c.cosine)[:worst],
                  prompts=prompt_uses)


def _refused(why: str, facts: ModelFacts, counted: _Counted, docs: int,
             min_cosine: float) -> Report:
    """The report of an engine that refused the model when it loaded: nothing was embedded."""
    return Report(passed=False, problems=[why], notes=[], min_cosine=min_cosine, model=facts,
                  events=counted.events, dead_lettered=counted.dead_lettered, failed=docs,
                  summaries=[], worst=[], heads_checked=0, heads_agreeing=0,
                  token_disagreements=[])


def _reference(folder: Path, settings: ModelSettings,
               reference_prefix: Optional[str]) -> _Reference:
    """sentence-transformers on ``folder`` at float32, on the CPU, cut at ``model.max_tokens``;
    before texts: ``--reference-prefix``, else the model's declared document prompt, else the
    config's prefix; before queries: its declared query prompt, else the config's."""
    # sentence-transformers imports transformers (seconds): only where the reference is built.
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    prompts = model_prompts(folder)
    declared = document_prompt(prompts, settings.unused_prompts)
    prefix = (reference_prefix if reference_prefix is not None
              else declared if declared is not None else settings.document_prefix)
    declared_query = query_prompt(prompts, settings.unused_prompts)
    query_prefix = declared_query if declared_query is not None else settings.query_prefix
    st.max_seq_length = min(settings.max_tokens, st.max_seq_length or settings.max_tokens)
    return _Reference(st, prompts, declared, prefix, declared_query, query_prefix,
                      reference_prefix)


def _served_facts(settings: ModelSettings, folder: Path, reference_folder: Path,
                  ref: _Reference, engine_factory) -> ModelFacts:
    """The model folder's facts, with the engine's pooling and the reference's prefixes."""
    facts = model_facts(settings, folder, _engine_pooling(settings, engine_factory),
                        ref.st.get_embedding_dimension() or settings.dim, ref.prefix,
                        reference_folder)
    facts = dataclasses.replace(facts, query_reference_prefix=ref.query_prefix)
    if reference_folder != folder:
        facts = dataclasses.replace(facts, path=f"{folder} (reference: {reference_folder})")
    return facts


def _compare(config: config_lib.Config, events: Sequence, docs: Sequence, results: Sequence,
             ref: _Reference, facts: ModelFacts, engine_factory) -> _Compared:
    """The texts' cosines with the reference's vectors, the queries', and the heads' token ids
    against the model tokenizer's."""
    served, failed, late_chunks = _served_texts(docs, results, config.chunking)
    cosines = _text_cosines(served, ref, config.model, facts.local_reach)
    query_cosines, query_path, query_error = _compare_queries(
        config, events, ref.st, ref.query_prefix, engine_factory)
    return _Compared(cosines=cosines, summaries=_summaries(cosines), failed=failed,
                     late_chunks=late_chunks, query_cosines=query_cosines, query_path=query_path,
                     query_error=query_error, heads=len(docs),
                     disagreements=_token_disagreements(docs, ref.st.tokenizer, config.model))


def _served_texts(docs: Sequence, results: Sequence, chunking
                  ) -> tuple[list[tuple[str, str, np.ndarray]], int, int]:
    """((label, text, vector) of each input the engine embedded that has a reference; the texts
    that failed to embed; the late chunk vectors left out)."""
    served: list[tuple[str, str, np.ndarray]] = []
    failed = late_chunks = 0
    for doc, result in zip(docs, results, strict=True):
        if isinstance(result, EmbedFailure):
            failed += 1
            continue
        for (label, text), vector in zip(_inputs(doc, chunking.doc_vector), result, strict=True):
            if chunking.mode == "late" and "#chunk " in label:  # a span of one pass over the
                late_chunks += 1  # head: no reference
                continue
            served.append((label, text, np.asarray(vector, dtype=np.float64)))
    return served, failed, late_chunks


def _text_cosines(served: list[tuple[str, str, np.ndarray]], ref: _Reference,
                  settings: ModelSettings, reach: Optional[int]) -> list[TextCosine]:
    """The cosine of each served vector with the reference's for its text, and its length."""
    if not served:
        return []
    texts = [text for _, text, _ in served]
    # The prefix as sentence-transformers' prompt (never its default one on top): a model
    # whose pooling leaves the prompt out (include_prompt: false) is compared as it pools.
    reference = ref.st.encode(texts, prompt=ref.prefix, convert_to_numpy=True,
                              normalize_embeddings=False).astype(np.float64)
    # model.dimensions (Matryoshka): the engine writes the head of each vector; the cosine
    # of the reference's head with it is that of the served vector, normalized again or not.
    reference = reference[:, :settings.output_dim]
    lengths = [len(ids) for ids in
               ref.st.tokenizer([ref.prefix + t for t in texts], verbose=False)["input_ids"]]
    return [TextCosine(label, _cosine(vector, r), tokens,
                       _length(tokens, reach, settings.max_tokens))
            for (label, _, vector), r, tokens in zip(served, reference, lengths, strict=True)]


def _summaries(cosines: Sequence[TextCosine]) -> list[Summary]:
    """"all", then each length class that has texts."""
    if not cosines:
        return []
    summaries = [_summary("all", [c.cosine for c in cosines])]
    for length in ("within window", "beyond window", "shorter", "near max_tokens"):
        group = [c.cosine for c in cosines if c.length == length]
        if group:
            summaries.append(_summary(length, group))
    return summaries


def _token_disagreements(docs: Sequence, tokenizer, settings: ModelSettings
                         ) -> list[TokenDisagreement]:
    """Each head whose ids are not the model tokenizer's own for the same text."""
    disagreements = []
    for doc in docs:
        expected = tokenizer(settings.document_prefix + doc.text, truncation=True,
                             max_length=settings.max_tokens)["input_ids"]
        if list(doc.token_ids) != list(expected):
            first = next((i for i, (a, b) in enumerate(zip(doc.token_ids, expected, strict=False))
                          if a != b), min(len(doc.token_ids), len(expected)))
            disagreements.append(TokenDisagreement(str(doc.event.id), len(doc.token_ids),
                                                   len(expected), first))
    return disagreements


def _problems(compared: _Compared, facts: ModelFacts, settings: ModelSettings,
              prompt_uses: list[DeclaredPrompt], folder: Path, min_cosine: float) -> list[str]:
    """Why the check fails; empty when it passes."""
    problems = []
    if not compared.cosines:
        problems.append("no text of the input was embedded")
    elif compared.summaries[0].min < min_cosine:
        problems.append(f"the lowest cosine, {compared.summaries[0].min:.4f}, is below "
                        f"--min-cosine {min_cosine}")
    query_summary = compared.query_summary
    if compared.query_error:
        problems.append(f"the sample's titles failed to embed as newsvec search embeds a query: "
                        f"{compared.query_error}")
    elif query_summary is not None and query_summary.min < min_cosine:
        problems.append(f"the lowest cosine of the queries (the sample's titles, embedded as "
                        f"newsvec search embeds them), {query_summary.min:.4f}, is below "
                        f"--min-cosine {min_cosine}")
    if compared.failed:
        problems.append(f"{compared.failed} texts failed to embed")
    if compared.disagreements:
        problems.append(f"newsvec's head tokenization differs from the model tokenizer's own in "
                        f"{len(compared.disagreements)} of {compared.heads} texts")
    if facts.normalize_reference != settings.normalize:
        problems.append(f"model.normalize is {str(settings.normalize).lower()} but the model's "
                        f"modules {'do' if facts.normalize_reference else 'do not'} normalize")
    problems += [_unused_prompt(p, settings) for p in prompt_uses if p.use == "unused"]
    return problems + _tokenizer_json_problems(folder)


def _tokenizer_json_problems(folder: Path) -> list[str]:
    """A BERT model's ``tokenizer.json`` that says otherwise than the tokenizer transformers
    builds (which every side here uses, so no cosine can show it)."""
    try:
        tokenizer_json = tokenizer_json_disagreements(folder)
    except Unsupported as exc:  # a tokenizer file it cannot read: the model's loading says more
        tokenizer_json = [str(exc)]
    if not tokenizer_json:
        return []
    return ["the model's tokenizer.json says otherwise than the tokenizer transformers "
            "builds from its tokenizer_config.json, which newsvec, the engine and the "
            "reference all use (so no cosine here can show it): "
            f"{'; '.join(tokenizer_json)}; the model may have been trained with "
            "tokenizer.json's: make the two files agree"]


def _prompt_notes(ref: _Reference, settings: ModelSettings,
                  prompt_uses: list[DeclaredPrompt]) -> list[str]:
    """What a person should know of the model's prompts and the reference's prefixes."""
    notes = [f"the model declares the prompt {p.name!r} ({p.text!r}), left out on purpose "
             "(model.unused_prompts): the reference uses the config's prefix"
             for p in prompt_uses if p.use == LEFT_OUT]
    notes += [f"model.unused_prompts names {name!r}, which the model does not declare"
              for name in settings.unused_prompts if name not in ref.prompts]
    if not ref.prompts:
        return notes + ["the model declares no prompts: the reference uses the config's "
                        f"model.document_prefix {settings.document_prefix!r} and "
                        f"model.query_prefix {settings.query_prefix!r}"]
    for texts_of, names, found, setting in (
            ("documents", DOCUMENT_PROMPTS,
             ref.declared is not None or ref.given_prefix is not None, "document_prefix"),
            ("queries", QUERY_PROMPTS, ref.declared_query is not None, "query_prefix")):
        if not found:
            notes.append(f"the reference puts the config's model.{setting} "
                         f"{getattr(settings, setting)!r} before {texts_of}: of the model's "
                         f"prompts ({', '.join(map(repr, ref.prompts))}) none is named "
                         f"{' or '.join(names)} (or each such is in model.unused_prompts)")
    return notes


def _notes(compared: _Compared, facts: ModelFacts, settings: ModelSettings, ref: _Reference,
           reference_folder: Path, prompt_uses: list[DeclaredPrompt]) -> list[str]:
    """What a person should know though the check passed."""
    notes = _prompt_notes(ref, settings, prompt_uses)
    if facts.max_positions and settings.max_tokens > facts.max_positions:
        notes.append(f"max_tokens {settings.max_tokens} is over the model's "
                     f"{facts.max_positions} positions")
    if ref.prefix and pooling_config(reference_folder).get("include_prompt") is False:
        notes.append("the model's pooling leaves the prompt's tokens out (include_prompt: "
                     "false in its pooling config); " + (
                         "it pools by the last token, after the prompt, as vLLM does"
                         if facts.pooling_reference == "lasttoken" else "vLLM pools over them"))
    if compared.late_chunks:
        notes.append(f"chunking.mode late: {compared.late_chunks} chunk vectors (each its span's "
                     "mean over one pass over the head) have no sentence-transformers reference "
                     "and were not compared; the head vectors were")
    if settings.output_dim != settings.dim:
        notes.append(f"compared at the {settings.output_dim} dimensions written "
                     f"(model.dimensions), of the model's {settings.dim}")
    if not any(c.length in ("beyond window", "near max_tokens") for c in compared.cosines):
        notes.append("no text of the sample reaches past the model's local window or near "
                     "max_tokens: check long articles too")
    if settings.dtype == "native":
        notes.append(f"dtype native resolved to {resolved_dtype(settings)} on this machine; "
                     "run the check where the pipeline runs")
    if not _same_pooling(facts.pooling_reference, facts.pooling_engine):
        notes.append(f"the reference pools by {facts.pooling_reference}, the engine by "
                     f"{facts.pooling_engine}")
    return notes


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return round(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) or 1.0)), 6)


def _compare_queries(config: config_lib.Config, events: Sequence, st, query_prefix: str,
                     engine_factory) -> tuple[list[TextCosine], str, Optional[str]]:
    """(the cosine of each sample title's vector as ``newsvec search`` embeds it, with the
    reference's after ``query_prefix``; how search embedded them; why they failed to embed)."""
    if engine_factory is not None:
        return [], "not compared: a stand-in engine (newsvec search embeds with vLLM)", None
    queries = _sample_queries(events)
    if not queries:
        return [], "not compared: no event of the sample has a title", None
    try:
        served, notes = embed_queries(config, [title for _, title in queries])
    except Exception as exc:  # pylint: disable=broad-except  # the engine failed: the answer
        return [], "failed", f"{type(exc).__name__}: {exc}"
    texts = [normalize_text(title, config.text.unicode_form) for _, title in queries]
    ref = st.encode(texts, prompt=query_prefix, convert_to_numpy=True,
                    normalize_embeddings=False).astype(np.float64)[:, :config.model.output_dim]
    lengths = [len(ids) for ids in
               st.tokenizer([query_prefix + t for t in texts], verbose=False)["input_ids"]]
    cosines = [TextCosine(f"{event_id} (title)", _cosine(np.asarray(vector, np.float64), r),
                          tokens, "query")
               for (event_id, _), vector, r, tokens in zip(queries, served, ref, lengths,
                                                           strict=True)]
    path = ("; ".join(dict.fromkeys(notes)) if notes
            else "the query path, without vLLM (transforms/engines/query.py)")
    return cosines, path, None


def _unused_prompt(prompt: DeclaredPrompt, settings: ModelSettings) -> str:
    """The problem of a declared prompt the config neither uses nor leaves out on purpose."""
    if prompt.role == "unknown":
        what = (f"the prompt {prompt.name!r} (a name check-model does not know: not "
                f"{', '.join(QUERY_PROMPTS + DOCUMENT_PROMPTS)})")
        said = (f"it is neither model.document_prefix {settings.document_prefix!r} nor "
                f"model.query_prefix {settings.query_prefix!r}")
    else:
        key = f"{prompt.role}_prefix"
        what = f"the {prompt.role} prompt {prompt.name!r}"
        said = f"model.{key} is {getattr(settings, key)!r}"
    return (f"the model declares {what}, {prompt.text!r}, which the config does not use "
            f"({said}): set the prefix it is for, or name {prompt.name!r} in "
            "model.unused_prompts if it is left out on purpose")


def _same_pooling(reference: str, engine: str) -> bool:
    names = {"cls_token": "cls", "mean_tokens": "mean", "lasttoken": "last", "max_tokens": "max"}
    return names.get(reference, reference).lower() == engine.lower()


def _engine_pooling(settings: ModelSettings, engine_factory) -> str:
    """How the engine pools (vLLM's resolved pooler config); "unknown" for a stand-in engine."""
    if engine_factory is not None:
        return "unknown"
    return resolved_pooling(settings)


def render(report: Report) -> str:
    """The report as a table for a person."""
    m = report.model
    verdict = "PASS" if report.passed else "FAIL"
    lines = [f"newsvec check-model: {verdict}" + "".join(f"\n  {p}" for p in report.problems),
             "", f"model      {m.path}",
             f"  architecture   {m.architecture} ({m.model_type})",
             f"  pooling        reference {m.pooling_reference}; engine {m.pooling_engine}",
             f"  normalization  reference {'yes' if m.normalize_reference else 'no'}; "
             f"config {'yes' if m.normalize_config else 'no'}",
             f"  dimensions     {m.dim}; Matryoshka: " + (
                 "not declared" if m.matryoshka_dimensions is None
                 else ", ".join(map(str, m.matryoshka_dimensions)) or "any size"),
             f"  max length     model positions {m.max_positions}; sentence-transformers "
             f"{m.max_seq_length}; config max_tokens {m.max_tokens}",
             "  local window   " + (f"{m.local_window} tokens ({m.local_reach} each side) in "
                                    f"{m.local_layers} layers" if m.local_window else "none"),
             f"  prefixes       document {m.document_prefix!r} (reference {m.reference_prefix!r}); "
             f"query {m.query_prefix!r}",
             f"  dtype          engine {m.dtype}; reference {m.reference_dtype}",
             "", f"texts      {report.events} events, {report.dead_lettered} not embedded "
             f"(dead letters), {report.failed} failed",
             f"{'cosine':<18}{'texts':>6}{'min':>10}{'p05':>10}{'median':>10}"]
    for s in report.summaries:
        lines.append(f"  {s.length:<16}{s.texts:>6}{s.min:>10.5f}{s.p05:>10.5f}{s.median:>10.5f}")
    lines += ["", f"token ids  {report.heads_agreeing} of {report.heads_checked} heads as the "
              "model tokenizer's own"]
    for d in report.token_disagreements:
        lines.append(f"  {escaped(d.id)}: newsvec {d.newsvec} tokens, model {d.model}, first "
                     f"difference at {d.first_difference}")
    lines += ["", f"queries    {report.queries.texts if report.queries else 0} titles of the "
              f"sample as newsvec search embeds them: {report.query_path}; reference prompt "
              f"{m.query_reference_prefix!r}"]
    if report.queries:
        q = report.queries
        lines.append(f"  {q.length:<16}{q.texts:>6}{q.min:>10.5f}{q.p05:>10.5f}{q.median:>10.5f}")
        lines += [f"    {c.cosine:.5f}  {escaped(c.id)}" for c in report.worst_queries[:3]]
    lines += ["", "prompts    " + ("none declared" if not report.prompts else
                                   f"{len(report.prompts)} declared (name, role, use, text)")]
    lines += [f"  {p.name!r:<20}{p.role:<10}{p.use:<44}{p.text!r}" for p in report.prompts]
    lines += ["", f"worst texts (lowest cosine first; --min-cosine {report.min_cosine})",
              f"  {'cosine':>8}  {'tokens':>6}  {'length':<16}id"]
    for c in report.worst:
        lines.append(f"  {c.cosine:>8.5f}  {c.tokens:>6}  {c.length:<16}{escaped(c.id)}")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="newsvec check-model",
        description="Embed a sample of news events as the pipeline would (the config's text "
        "preparation, prefix and vLLM engine) and with sentence-transformers on the model "
        "folder, and compare: cosine per text (min, p05, median, by length, the worst texts), "
        "the sample's titles embedded as newsvec search embeds a query against the reference "
        "with the model's query prompt, newsvec's token ids against the model tokenizer's, the "
        "prompts the model declares, and what the model folder says. Exit status 1 below "
        "--min-cosine, when token ids differ, or for a declared prompt the config neither uses "
        "nor leaves out (model.unused_prompts): run it before a model serves.")
    parser.add_argument("--config", default=str(config_lib.DEFAULT_CONFIG),
                        help="the config whose model and text settings to check (default: "
                        "configs/local.yaml)")
    parser.add_argument("--model-path", help="check this model folder instead of the config's "
                        "model.path (a fine-tuned checkpoint), with the config's other settings")
    parser.add_argument("--input", default=str(DEFAULT_INPUT),
                        help="news events, JSON Lines as the pipeline reads them, local or "
                        "gs:// (default: the repository's sample)")
    parser.add_argument("--limit", type=int, default=500,
                        help="check at most this many events, the first (default 500)")
    parser.add_argument("--min-cosine", type=float, default=DEFAULT_MIN_COSINE,
                        help=f"fail when any text's cosine is below this (default "
                        f"{DEFAULT_MIN_COSINE})")
    parser.add_argument("--reference", help="the reference model folder, when it is not the "
                        "served one (the training side's checkpoint); default: the model's own")
    parser.add_argument("--reference-prefix", help="what the reference puts before each text "
                        "(default: the model's declared document prompt, else the config's "
                        "model.document_prefix)")
    parser.add_argument("--worst", type=int, default=10, help="list this many worst texts")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON "
                        "object")
    args = parse_command(parser, argv)
    config = config_lib.load_for_command(args.config, run_model_code=True)
    if args.model_path:
        config = config.model_copy(update={"model": ModelSettings.model_validate(
            {**config.model.model_dump(), "path": args.model_path})})
    try:
        events, unparsed = read_events(args.input, args.limit, config)
    except OSError as exc:
        print(f"newsvec check-model: cannot read {args.input}: {exc}", file=sys.stderr)
        return 2
    if not events:
        print(f"newsvec check-model: no event in {args.input}", file=sys.stderr)
        return 2
    report = check(config, events, reference=args.reference,
                   reference_prefix=args.reference_prefix, min_cosine=args.min_cosine,
                   worst=args.worst, unparsed=unparsed)
    print(report.to_json() if args.json else render(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
