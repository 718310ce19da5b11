"""Every section of a config (``configs/*.yaml``), as pydantic models, and the small value types
they name: the one home of the config's schema.

This module is the ground floor: it imports nothing of ``pipeline/`` and only
``transforms.timing_floors`` (the lease's floor) of ``transforms/``, so every stage may import its
settings from here. The root ``Config``, reading a file (``extends:``), the overrides and the
``{model}`` / ``{date}`` fields are ``pipeline/config.py``'s. """
from __future__ import annotations

import json
import os
from typing import ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from transforms.timing_floors import require_lease_s

DedupKey = Literal["id", "text_sha256"]  # the config's ``dedup.key``
UnicodeForm = Literal["NFC", "NFKC"]
"""``text.unicode_form``. ftfy (``fix_text``) already folds full-width ASCII, half-width
katakana and Latin ligatures; NFKC also folds the other compatibility characters (①, ², ㎏, ㈱,
™, ½...)."""
VectorDtype = Literal["float32", "float16"]
"""The element type of the ``embedding`` column (``sink.vector_dtype``): float16 halves the file
(about 780 bytes a 384-dimension row instead of 1,734, zstd) and loses nothing measurable in
recall (docs/benchmarks.md); BigQuery cannot read float16 (docs/bigquery.md)."""
DEFAULT_MAX_TITLE_CHARS = 2_000
DEFAULT_PREPARE_BUDGET_S = 10.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(BaseModel):
    """Every model setting newsvec uses, read by PrepareText (tokenizer) and Embed
    (engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str = Field(
        "vllm", description="the engine backend that embeds (`transforms/engines/registry.py`): "
                            "`vllm`, vLLM's `LLM(runner=\"pooling\")`")
    name: str = Field(description="recorded in the `model` column")
    path: str = Field(description="local folder, `pypackage:MODULE` (a model inside a Python "
                                  "package), `gs://BUCKET/PATH/` (a folder in GCS, fetched once "
                                  "per machine: docs/dataflow.md), or a Hugging Face id")
    revision: Optional[str] = Field(
        None, description="Hugging Face revision of tokenizer and model, recorded in the `model` "
                          "column; null: a content hash of the files is recorded")
    sha256: Optional[str] = Field(
        None, pattern="^[0-9a-f]{64}$",
        description="the content hash the model's files must have (the summary's "
                    "`model.content_sha256`), else the run refuses the model; for a `gs://` "
                    "model, null: the launcher pins the folder's hash when the run starts, so "
                    "every worker of the job embeds with the same files")
    dim: int = Field(gt=0, description="the model's embedding dimension, checked against its "
                                       "pooler output when it loads")
    dimensions: Optional[int] = Field(
        None, gt=0, description="write vectors of this many dimensions (at most `dim`), the "
                                "head of each (Matryoshka): through vLLM's "
                                "`PoolingParams(dimensions=...)` where the model declares "
                                "Matryoshka support (`is_matryoshka` or `matryoshka_dimensions` "
                                "in its config.json, or the config's "
                                "`matryoshka_dimensions`); for any other model refused unless "
                                "`truncate_dimensions_knowingly`. null: `dim`")
    matryoshka_dimensions: Optional[list[int]] = Field(
        None, min_length=1,
        description="the Matryoshka sizes the model was trained to give (its model card says "
                    "so) where its config.json does not declare them (Qwen3-Embedding): "
                    "vLLM is told (`hf_overrides`: "
                    "`matryoshka_dimensions`), then cuts each vector to `dimensions` and "
                    "normalizes it itself, and `newsvec serve` accepts these sizes as a "
                    "request's `dimensions`; `dimensions` must be one of them. null: what "
                    "the model's config.json declares")
    truncate_dimensions_knowingly: bool = Field(
        False, description="with `dimensions`, for a model that does not declare Matryoshka "
                           "support (MiniLM): newsvec keeps the head of each vector and "
                           "L2-normalizes it again (if `normalize`); retrieval loses quality "
                           "(docs/benchmarks.md)")
    dtype: str = Field(
        "bfloat16", pattern="^(bfloat16|float16|float32|native)$",
        description="`bfloat16`, `float16`, `float32` (matches sentence-transformers exactly) or "
                    "`native`: bfloat16 where the hardware computes it (a CUDA GPU with bf16, a "
                    "CPU with AVX512_BF16 or AMX), float32 elsewhere (on an AMD EPYC without "
                    "AVX-512 vLLM ran MiniLM at 2.2 articles/s in bfloat16, 13.9 in float32); "
                    "the summary records `resolved_dtype`")
    max_tokens: int = Field(gt=2, description="longer texts keep their head; also vLLM's "
                                              "`max_model_len`")
    token_budget: int = Field(gt=0, description="maximum tokens of one call into the engine "
                                                "(a batch, or a slice of a micro-batch); at least "
                                                "`max_tokens`")
    normalize: bool = Field(True, description="L2-normalize the vectors")
    document_prefix: str = Field(
        "", description="put before every text (and chunk) the model embeds, counted in its "
                        "tokens (e5: `\"passage: \"`); recorded in the summary")
    query_prefix: str = Field(
        "", description="put before a query (`newsvec search`): the counterpart of "
                        "`document_prefix` (e5: `\"query: \"`; bge: an instruction)")
    unused_prompts: list[str] = Field(
        default_factory=list,
        description="names of prompts the model declares (`prompts` in its "
                    "`config_sentence_transformers.json`) that the config leaves out on purpose: "
                    "`newsvec check-model` fails on a declared prompt used as neither "
                    "`document_prefix` nor `query_prefix` unless it is named here (its reference "
                    "then uses the config's prefix)")
    pooling_task: Literal["embed", "token_embed"] = Field(
        "embed", description="the vLLM pooling task the engine is loaded for (one `LLM` serves "
                             "one): `embed`, vLLM pools; `token_embed`, vLLM gives a vector per "
                             "token and newsvec pools them as the model does (mean, CLS or "
                             "last). `chunking.mode: late` sets `token_embed`")
    trust_remote_code: bool = Field(False, description="off unless the operator turns it on")
    enforce_eager: bool = Field(True, description="true on the CPU (faster start-up); false on "
                                                  "GPUs (CUDA graphs)")
    gpu_memory_utilization: Optional[float] = Field(
        None, gt=0, le=1, description="vLLM's fraction of GPU memory")
    max_num_batched_tokens: Optional[int] = Field(
        None, gt=0, description="tokens per vLLM engine step; null: vLLM's default (4,096 on the "
                                "CPU, 8,192 on a GPU); at least `max_tokens`")
    max_num_seqs: Optional[int] = Field(
        None, gt=0, description="sequences per vLLM engine step; null: vLLM's default (256)")
    share_across_processes: bool = Field(
        False, description="one engine per machine (per GPU: `gpus_per_worker`), in a process "
                           "of its own, shared by every SDK process (true in the Dataflow "
                           "configs)")
    gpus_per_worker: Union[Literal["auto"], int] = Field(
        "auto", description="with `share_across_processes`: engines per machine, one per GPU, each "
                            "pinned to its device (`CUDA_VISIBLE_DEVICES`), the SDK processes "
                            "spread evenly over them. `auto`: the GPUs the worker sees "
                            "(`CUDA_VISIBLE_DEVICES`, else `nvidia-smi -L`, else `/dev/nvidiaN`), "
                            "one engine on a machine with none; a number the worker does not "
                            "have fails the step at set-up")
    call_timeout_s: Optional[float] = Field(
        None, gt=0, le=86_400,
        description="with `share_across_processes`: seconds the shared engine may spend in one "
                    "call (embed, its canary) before its process is ended and replaced; the call "
                    "is then an input failure (bisected) if the new engine passes its canary, an "
                    "engine failure if not, and the other calls waiting for it are retried on "
                    "the new engine; so is an engine silent (no heartbeat) for as long. The wait "
                    "behind other processes' calls is not counted, but a call with no answer "
                    "past its turn (this long for each call queued before it, and its own) and "
                    "10 s is an engine failure. null: 60 + `token_budget` / 250 (the engine "
                    "embedding at least 250 tokens/s, half the slowest rate measured: bfloat16 "
                    "emulated on a CPU without AVX512_BF16). An engine in the SDK process itself "
                    "is not timed")
    load_timeout_s: float = Field(
        900, gt=0, le=86_400,
        description="with `share_across_processes`: seconds an SDK process waits for the shared "
                    "engine to be spawned and loaded (a model download included), and as long "
                    "again for another process that is starting it; an engine not ready by then "
                    "is ended and the bundle fails (`EngineFailedError`, retried)")
    max_consecutive_failures: int = Field(
        64, gt=0, description="documents dead-lettered in a row (`embedding_failed`, the engine's "
                              "canary passing) by one worker process before its bundles fail with "
                              "`ModelBrokenError` (a broken model); counted across bundles and "
                              "retries, reset by a document that embeds")
    engine_env: dict[str, str] = Field(
        default_factory=dict,
        description="environment for the engine, set if unset (on the CPU: "
                    "`VLLM_CPU_KVCACHE_SPACE=1`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, "
                    "`ONEDNN_PRIMITIVE_CACHE_CAPACITY=8`, ...); with `share_across_processes` the "
                    "engine's process sets `VLLM_ENABLE_V1_MULTIPROCESSING=0` whatever the "
                    "environment says, and another value here is refused")

    @model_validator(mode="after")
    def _budget_holds_a_document(self):
        if self.token_budget < self.max_tokens:
            raise ValueError(f"token_budget ({self.token_budget}) must be at least max_tokens "
                             f"({self.max_tokens}), or a long document fits in no batch")
        if (self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_tokens):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_tokens ({self.max_tokens}): vLLM embeds a document in "
                             "one engine step")
        if self.dimensions is not None and self.dimensions > self.dim:
            raise ValueError(f"dimensions ({self.dimensions}) must be at most the model's dim "
                             f"({self.dim})")
        self._check_matryoshka_dimensions()
        if (self.share_across_processes
                and self.engine_env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0"):
            raise ValueError("engine_env sets VLLM_ENABLE_V1_MULTIPROCESSING to "
                             f"{self.engine_env['VLLM_ENABLE_V1_MULTIPROCESSING']!r}, but the "
                             "shared engine (share_across_processes) runs vLLM's engine in its own "
                             "process, which must hold all of it: leave it unset, or 0")
        if isinstance(self.gpus_per_worker, int) and not 1 <= self.gpus_per_worker <= 64:
            raise ValueError(f"gpus_per_worker ({self.gpus_per_worker}) must be `auto` or a "
                             "number of GPUs from 1 to 64")
        return self

    def _check_matryoshka_dimensions(self) -> None:
        sizes = self.matryoshka_dimensions
        if sizes is None:
            return
        wrong = [d for d in sizes if not 1 <= d <= self.dim]
        if wrong:
            raise ValueError(f"matryoshka_dimensions: {wrong[0]} is not a size of the model's "
                             f"{self.dim}-dimensional vectors (from 1 to dim)")
        if self.dimensions not in (None, self.dim, *sizes):
            raise ValueError(f"dimensions ({self.dimensions}) is not one of "
                             f"matryoshka_dimensions {sizes}: the model was trained to give "
                             "only those sizes (its model card)")

    @property
    def output_dim(self) -> int:
        """The dimension of the vectors written: ``dimensions``, else the model's ``dim``."""
        return self.dimensions if self.dimensions is not None else self.dim

    def resolved_call_timeout_s(self) -> float:
        """``call_timeout_s``, or its default from the token budget."""
        if self.call_timeout_s is not None:
            return self.call_timeout_s
        return 60.0 + self.token_budget / 250

    def apply_engine_env(self) -> None:
        """Set engine_env where unset. Call before importing transformers or vllm in a worker."""
        for key, value in self.engine_env.items():
            os.environ.setdefault(key, value)


class ChunkingSettings(BaseModel):
    """The ``chunking:`` section of a config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["head", "chunks", "late"] = Field(
        "head", description="`head`: one vector per article, of its first `model.max_tokens` "
                            "tokens; `chunks`: also a row per chunk in `chunks/`, each chunk "
                            "embedded alone; `late`: the same chunks, each vector the mean of "
                            "its tokens' vectors from one pass over the article's first "
                            "`model.max_tokens` tokens (late chunking), chunks past them "
                            "embedded alone as in `chunks`")
    chunk_tokens: Optional[int] = Field(
        None, gt=2, description="tokens per chunk, special tokens and `model.document_prefix` "
                                "included, at most `model.max_tokens` (null: "
                                "`model.max_tokens`)")
    overlap_tokens: int = Field(
        32, ge=0, description="tokens a chunk shares with the one before (at least: a chunk "
                              "starts at a word)")
    sentence_end_slack_tokens: int = Field(
        0, ge=0, description="end a chunk at a sentence end within this many tokens before the "
                             "cut (0: at the last word that fits)")
    doc_vector: Literal["head", "mean"] = Field(
        "head", description="the article's row in `vectors/` in chunks and late modes: `head` "
                            "(as in head "
                            "mode) or `mean` (of its chunk vectors, token-weighted, "
                            "L2-normalized)")

    def chunk_recipe(self, max_tokens: int, document_prefix: str) -> str:
        """Every setting that decides the chunks' ids and text, as a string: part of every chunk id
        and of the embedding signature (``embedding_signature``)."""
        recipe = {"chunk_tokens": self.chunk_tokens or max_tokens,
                  "overlap_tokens": self.overlap_tokens,
                  "sentence_end_slack_tokens": self.sentence_end_slack_tokens,
                  "document_prefix": document_prefix}
        if self.mode == "late":  # other vectors of the same chunks: other ids (chunks mode's
            recipe["mode"] = "late"  # recipe is as it was, so its ids stay)
        return json.dumps(recipe, sort_keys=True)



def embedding_signature(model: ModelSettings, chunking: ChunkingSettings,
                        unicode_form: str = "NFC") -> str:
    """The settings besides the model's files that decide an article's vectors (the dtype aside:
    bfloat16 and float32 vectors agree to a cosine of 0.9999; so is ``sink.vector_dtype``: float16
    vectors agree with float32 to its precision). ``model.dimensions`` is in it when set, and
    ``unicode_form`` (``text.unicode_form``) when not the default NFC, so keys made before they
    were settings stay valid (a text the form changes changes ``text_sha256`` too, and switching
    the form embeds every article again, its text changed or not)."""
    settings = {"max_tokens": model.max_tokens, "normalize": model.normalize,
                "document_prefix": model.document_prefix, "mode": chunking.mode}
    if unicode_form != "NFC":
        settings["unicode_form"] = unicode_form
    if model.output_dim != model.dim:  # so that keys made before it was a setting stay valid
        settings["dimensions"] = model.output_dim
    if chunking.mode != "head":
        settings.update(chunking=chunking.chunk_recipe(model.max_tokens, model.document_prefix),
                        doc_vector=chunking.doc_vector)
    return json.dumps(settings, sort_keys=True)


class ParseSettings(_Section):
    max_payload_bytes: int = Field(1 << 20, gt=0, description="larger payloads are dead-lettered")
    max_future_skew_s: float = Field(
        86400, ge=0, description="a `published_at` further ahead of now is dead-lettered")


class TextSettings(_Section):
    max_text_chars: int = Field(200_000, gt=0, description="longer title + body, as sent or once "
                                                           "normalized, is dead-lettered")
    max_title_chars: int = Field(
        DEFAULT_MAX_TITLE_CHARS, gt=0,
        description="a longer title is dead-lettered `text_too_long` (a news title is a line; "
                    "thousands of characters there are a body in the wrong field, or an attack)")
    prepare_budget_s: float = Field(
        DEFAULT_PREPARE_BUDGET_S, gt=0,
        description="CPU seconds one article's text preparation (normalization, tokenization, "
                    "chunks) may take before it is dead-lettered `prepare_failed`: a backstop, as "
                    "every step is linear in the text (a 200,000-character article takes well "
                    "under a second)")
    unicode_form: UnicodeForm = Field(
        "NFC", description="`NFC` or `NFKC`: the Unicode form of the prepared text and title "
                           "(NFKC also folds ①, ², ㎏, ㈱, ™...; which to choose for which model: "
                           "docs/input.md)")
    max_unknown_token_ratio: float = Field(
        0.2, ge=0, le=1, description="an article with more of its head's tokens unknown to the "
                                     "model's tokenizer (in chunks mode, of its whole text's) is "
                                     "dead-lettered `unreadable_for_model`; 1: never")


class DedupSettings(_Section):
    key: DedupKey = Field(
        "id", description="`id` or `text_sha256` (the same text under another id)")


class SinkSettings(_Section):
    row_group_rows: int = Field(16384, gt=0, description="rows per Parquet row group")
    dead_letter_payload_bytes: int = Field(4096, gt=0,
                                           description="raw payload kept per dead letter")
    commit_lease_s: float = Field(
        600, gt=0, description="batch: the output's publish lease: renewed every quarter of this "
                               "while a run publishes; another run takes it over once it has "
                               "stood unrenewed this long (its holder killed or stalled). At "
                               "least 360: twice the longest one GCS request can take with "
                               "retries, so that a change started just before its holder stops "
                               "lands before a taker starts")
    vector_dtype: VectorDtype = Field(
        "float32", description="`float32` or `float16`: the element type of the `embedding` "
                               "column of `vectors/` and `chunks/`; float16 about halves the "
                               "file and kept recall@10 (docs/benchmarks.md), but BigQuery "
                               "cannot read it (docs/bigquery.md)")
    store_chunk_text: bool = Field(
        False, description="chunks mode: write each chunk's text (`chunk_text`), for "
                           "retrieval-augmented generation")

    @field_validator("commit_lease_s")
    @classmethod
    def _lease_floor(cls, value: float) -> float:
        return require_lease_s(value, "sink.commit_lease_s")


class IncrementalSettings(_Section):
    previous_outputs: list[str] = Field(
        default_factory=list,
        description="batch: globs of output prefixes (may hold `{model}`) whose key index "
                    "(`keys/`) this run consults: an article already embedded there with the same "
                    "text, model and settings is counted `unchanged`, not embedded; the run's own "
                    "output is never consulted. Each entry must match an output, or name the "
                    "run's own (a daily `dt=*` on its first day): else the launch fails naming it")
    may_be_absent: list[str] = Field(
        default_factory=list,
        description="entries of `previous_outputs`, as written there, that may match no output "
                    "(a streaming output that has not written yet): a warning naming each, and "
                    "`incremental.absent_count` in `_summary.json`, instead of a failed launch")

    @model_validator(mode="after")
    def _absent_ones_are_entries(self):
        unknown = [p for p in self.may_be_absent if p not in self.previous_outputs]
        if unknown:
            raise ValueError(f"incremental.may_be_absent: {unknown[0]!r} is not an entry of "
                             f"incremental.previous_outputs (name it as written there)")
        return self


NearDuplicateAction = Literal["mark", "skip"]


class NearDuplicateSettings(_Section):
    """``near_duplicates:``: same-story copies (``transforms.stories``)."""

    enabled: bool = Field(True, description="mark each row with its story (`story_id`, "
                                            "`near_duplicate_of`, `similarity`); false: those "
                                            "columns are null")
    shingle_chars: int = Field(12, ge=3, le=64, description="characters per shingle of the "
                                                             "text (whitespace removed, case "
                                                             "folded, NFKC)")
    num_perm: int = Field(128, ge=16, le=1024, description="MinHash values per signature")
    bands: int = Field(32, ge=1, description="LSH bands: two texts equal in one band are "
                                             "candidates; more bands find copies of lower "
                                             "similarity, at more state (streaming: one state "
                                             "entry per band and story)")
    band_rows: int = Field(2, ge=1, description="signature values per band (`bands` x "
                                               "`band_rows` at most `num_perm`): fewer find "
                                               "copies of lower similarity, with more candidates "
                                               "to check")
    threshold: float = Field(0.35, gt=0, le=1, description="estimated Jaccard similarity of the "
                                                           "shingle sets from which a candidate "
                                                           "is a copy")
    action: NearDuplicateAction = Field(
        "mark", description="`mark`: copies are rows, marked; `skip`: copies at `skip_threshold` "
                            "or above are not embedded, counted `near_duplicates`")
    skip_threshold: float = Field(0.7, gt=0, le=1, description="action skip: the similarity "
                                                               "from which a copy is skipped")
    skip_min_shingles: int = Field(200, ge=1, description="action skip: the shingles of its own "
                                                          "(boilerplate cut) a copy needs to be "
                                                          "skipped; its numbers must also all be "
                                                          "its original's")
    min_shingles: int = Field(10, ge=1, description="the distinct shingles of its own "
                                                    "(boilerplate cut) a text needs to be a copy "
                                                    "or an original; fewer: its own story")
    short_chars: int = Field(300, ge=0, description="a text with at most this many characters "
                                                    "of its own (no whitespace, boilerplate cut; "
                                                    "a CJK character counts 3) "
                                                    "is short: a copy only of a short text it "
                                                    "differs from trivially (case, punctuation, "
                                                    "a spelling variant, a wire credit at an "
                                                    "end), never in a word or number")
    boilerplate_min_docs: int = Field(3, ge=2, le=255,
                                      description="a block (the title line, a sentence) that "
                                                  "this many different articles of one source "
                                                  "hold is boilerplate, left out of the "
                                                  "signatures (batch: over the run; streaming: "
                                                  "within `horizon_s`)")
    boilerplate_max_blocks: int = Field(20000, ge=100,
                                        description="streaming: the most blocks counted per "
                                                    "source (the least recently seen that are "
                                                    "not boilerplate are dropped first)")
    horizon_s: float = Field(7 * 86400, gt=0, description="how long a story is remembered "
                                                          "(streaming: event time); batch: a copy "
                                                          "is of an article published at most "
                                                          "this long before it")
    seed: int = Field(1, ge=0, description="MinHash seed: signatures of different seeds never "
                                           "compare")

    @model_validator(mode="after")
    def _bands_divide(self):
        if self.bands * self.band_rows > self.num_perm:
            raise ValueError(f"near_duplicates.bands x band_rows ({self.bands} x "
                             f"{self.band_rows}) must be at most num_perm ({self.num_perm})")
        if self.skip_threshold < self.threshold:
            raise ValueError("near_duplicates.skip_threshold must be at least "
                             "near_duplicates.threshold")
        if self.skip_min_shingles < self.min_shingles:
            raise ValueError("near_duplicates.skip_min_shingles must be at least "
                             "near_duplicates.min_shingles")
        return self


class StreamingSettings(_Section):
    subscription: Optional[str] = Field(
        None, pattern=r"^projects/[^/]+/subscriptions/[^/]+$",
        description="`projects/P/subscriptions/S`; set, the job streams (`--subscription`)")
    window_s: float = Field(60, gt=0, description="fixed event-time window")
    allowed_lateness_s: float = Field(
        600, ge=0, description="`published_at` up to this before the publish time keeps its "
                               "window (late pane); older is windowed by publish time")
    max_wait_s: int = Field(5, gt=0, description="longest a micro-batch waits when traffic is "
                                                 "light (whole seconds)")
    dedup_horizon_s: float = Field(3600, gt=0, description="how long a dedup key is remembered")
    batch_shards: int = Field(4, gt=0, description="keys micro-batches are grouped, embedded and "
                                                   "written over (2 x `max_num_workers` x GPUs a "
                                                   "worker)")




ServeSearch = Literal["auto", "parquet", "store", "off"]
"""``serve.search``: what ``POST /v1/search`` searches."""


class ServeSettings(_Section):
    """``serve:``: ``newsvec serve``, the query side over HTTP (``pipeline.serve``,
    docs/serving.md)."""

    DEFAULT_API_KEY_ENV: ClassVar[str] = "NEWSVEC_API_KEY"

    host: str = Field("127.0.0.1", min_length=1,
                      description="the address to listen on (`--host`); any other than a loopback "
                                  "one needs an API key, or the service refuses to start")
    port: int = Field(8080, ge=0, le=65535, description="the TCP port (`--port`; 0: any free one)")
    api_key_env: str = Field(
        DEFAULT_API_KEY_ENV, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="the environment variable that holds the API key clients send as "
                    "`Authorization: Bearer KEY` (never the config file); unset or empty, and no "
                    "`serve.api_key_file` or `serve.api_key_secret`: no key is asked for "
                    "(loopback only)")
    api_key_file: Optional[str] = Field(
        None, description="a file that holds the API key instead (a mounted secret); wins over "
                          "`serve.api_key_env`")
    api_key_secret: Optional[str] = Field(
        None, pattern=r"^projects/[^/\s]+/secrets/[A-Za-z0-9_-]{1,255}/versions/(latest|[0-9]+)$",
        description="a Secret Manager secret version that holds the API key instead "
                    "(`projects/P/secrets/S/versions/latest`), read at start with the machine's "
                    "credentials; wins over `serve.api_key_file` and `serve.api_key_env`")
    max_batch_tokens: int = Field(
        8192, gt=0, description="tokens of one engine call at most: the requests waiting are "
                                "embedded together up to this (at least `model.max_tokens`)")
    max_wait_ms: float = Field(
        0.0, ge=0, le=1000,
        description="how long the first input waiting may wait for others to join its engine "
                    "call while the engine is idle (0: it goes at once); while the engine is busy, "
                    "inputs gather anyway, so a wait only adds latency unless each call costs "
                    "much more than its inputs (docs/serving.md)")
    max_queue: int = Field(
        20_000, gt=0, description="inputs waiting for the engine at most; a request that would "
                                  "pass it is answered 429 with `Retry-After`")
    request_timeout_s: float = Field(
        30, gt=0, description="a request not answered within this is answered 503 (its inputs "
                              "are dropped if not yet in an engine call)")
    max_inputs_per_request: int = Field(
        2048, gt=0, description="inputs in one `/v1/embeddings` request at most (400 beyond)")
    max_input_chars: int = Field(
        100_000, gt=0, description="characters of one input (or search query) at most (400 "
                                   "beyond)")
    max_body_bytes: int = Field(
        4 << 20, gt=0, description="bytes of a request body at most, checked before it is "
                                   "parsed (413 beyond)")
    log_queries: bool = Field(False, description="log each query's text (off: only counts and "
                                                 "timings are logged)")
    drain_s: float = Field(
        8, ge=0, description="after SIGTERM: seconds to finish the requests in flight (`/readyz` "
                             "fails and new connections are refused meanwhile) before the "
                             "process exits (Cloud Run allows 10)")
    search: ServeSearch = Field(
        "auto", description="what `POST /v1/search` searches: `auto` (the store with "
                            "`store.enabled`, else the output's Parquet), `parquet`, `store`, or "
                            "`off`")
    search_refresh_s: float = Field(
        60, gt=0, description="how often the Parquet search looks for a newer run of the output "
                              "(its files listed), and loads it")
