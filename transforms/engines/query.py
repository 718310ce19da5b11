"""A query's vector without starting vLLM: ``newsvec search`` embeds one short text, and starting
the engine (importing vLLM and torch, building the model) costs about 10 s of the 12 s such a
search took; the forward pass of one query costs milliseconds.

``QueryEmbedder`` runs a BERT encoder (``BertModel``: MiniLM, bge, e5...) in numpy on the model's
own ``model.safetensors``, tokenized with the ``tokenizers`` library from its ``tokenizer.json``:
the same token ids as ``transforms.text.HeadTokenizer`` (special tokens in a text read as text,
truncated on the right to ``model.max_tokens``), the pooling its sentence-transformers modules
declare (mean or CLS: what vLLM reads from them), L2-normalized when ``model.normalize``. At
``bfloat16`` the weights and each layer's output are rounded to bfloat16, as the engine computes
(tests/engines/test_query_embedder.py checks the vectors against the engine's: cosine >= 0.999).

Anything it cannot do exactly is ``Unsupported``, and the caller embeds the query with the engine:
another architecture or activation; a sentence-transformers module other than Transformer,
Pooling and Normalize (vLLM applies a ``Dense``; this path computes none); a special token outside
the vocabulary; a ``tokenizer.json`` whose normalizer, pre-tokenizer or template is not the one
transformers builds from ``tokenizer_config.json`` (``tokenizer_json_disagreements``: the model may
have been trained with either); ``dimensions``, ``float16``, remote code, a model that is not a
local folder. Imports neither vLLM nor torch nor transformers."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from transforms.engines.devices import resolved_dtype
from transforms.engines.model import ModelSettings, model_folder, pooling_modes
from transforms.engines.model_files import module_configs

_ERFC_COEFFICIENTS = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
                      0.09678418, 0.37409196, 1.00002368, -1.26551223)


def _erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise (Numerical Recipes' ``erfcc``: a relative error under
    1.2e-7, float32's own; numpy has none and scipy costs 0.6 s to import)."""
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.zeros_like(z)
    for c in _ERFC_COEFFICIENTS:
        poly = poly * t + c
    erfc = t * np.exp(-z * z + poly)
    return (np.sign(x) * (1.0 - erfc)).astype(np.float32)


class Unsupported(ValueError):
    """The model or its settings are not ones ``QueryEmbedder`` computes exactly as the engine."""


def _bfloat16(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded to the nearest bfloat16 (ties to even), kept as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) \
        & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise Unsupported(f"{path.name}: {exc}") from exc


# The sentence-transformers modules this path computes (the type's last name): any other one
# (Dense, which vLLM applies after the pooling; LayerNorm; a team's own) sends the query to the
# engine rather than be left out.
_COMPUTED_MODULES = frozenset({"Transformer", "Pooling", "Normalize"})


def _pooling(folder: Path) -> str:
    """``mean`` or ``cls``, as the model's sentence-transformers modules declare it; ``Unsupported``
    for a module it does not compute."""
    if not (folder / "modules.json").is_file():
        raise Unsupported("no sentence-transformers modules.json: the engine chooses the pooling")
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        raise Unsupported("modules.json is not a list of modules")
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else repr(module)
        if kind.rsplit(".", 1)[-1] not in _COMPUTED_MODULES:
            raise Unsupported(f"modules.json has a {kind} module; this path computes only "
                              "Transformer, Pooling and Normalize")
    pools = module_configs(folder, "Pooling")
    if len(pools) != 1 or pools[0] is None:
        raise Unsupported("modules.json declares no single readable Pooling module")
    modes = pooling_modes(pools[0])
    known = {"mean_tokens": "mean", "cls_token": "cls"}
    if len(modes) != 1 or modes[0] not in known:
        raise Unsupported(f"pooling {modes}: only mean or CLS pooling alone")
    return known[modes[0]]


# The transformers release whose BertTokenizer ``_tokenizer`` builds as it does: another one may
# build it otherwise, so the query then goes to the engine (tests/engines/test_query_embedder.py
# checks the ids against ``HeadTokenizer``'s, which is that BertTokenizer).
VERIFIED_TRANSFORMERS = "5.19."
_SPECIAL_TOKENS = (("pad_token", "[PAD]"), ("unk_token", "[UNK]"), ("cls_token", "[CLS]"),
                   ("sep_token", "[SEP]"), ("mask_token", "[MASK]"))


def _special_token(wanted: dict, key: str, default: str) -> str:
    """A special token of ``tokenizer_config.json``: a string, or an ``AddedToken`` object (as
    transformers 4 wrote a token with flags) read by its ``content``, as transformers reads it."""
    value = wanted.get(key, default)
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise Unsupported(f"tokenizer_config.json's {key} is not a token: {value!r}")
    return value


def _bert_normalizer(wanted: dict) -> dict[str, Any]:
    """The BertNormalizer transformers' BertTokenizer builds from ``tokenizer_config.json``
    (``wanted``), with its defaults for what it leaves out; ``strip_accents`` as it acts (None
    follows ``lowercase``)."""
    lowercase = wanted.get("do_lower_case", True)
    strip = wanted.get("strip_accents")
    return {"clean_text": True, "handle_chinese_chars": wanted.get("tokenize_chinese_chars", True),
            "lowercase": lowercase, "strip_accents": lowercase if strip is None else strip}


def _template(post_processor: Any) -> Optional[list[str]]:
    """A ``tokenizer.json`` post-processor's template for one text (``["[CLS]", "$A", "[SEP]"]``);
    None for one that is not a template, or not one it can read."""
    try:
        if post_processor["type"] == "BertProcessing":
            return [str(post_processor["cls"][0]), "$A", str(post_processor["sep"][0])]
        if post_processor["type"] != "TemplateProcessing":
            return None
        return [str(piece["SpecialToken"]["id"]) if "SpecialToken" in piece
                else f"${piece['Sequence']['id']}" for piece in post_processor["single"]]
    except (TypeError, KeyError, IndexError):
        return None


def tokenizer_json_disagreements(folder: Path) -> list[str]:
    """Where a BERT model's ``tokenizer.json`` says otherwise than the tokenizer transformers'
    BertTokenizer builds (from ``tokenizer_config.json``, not from it): its normalizer (lowercase,
    accents, Chinese characters, control characters), pre-tokenizer and template. Every tokenizer
    of newsvec (``HeadTokenizer``, this path) and the sentence-transformers reference are that
    BertTokenizer, so their ids agree; but the model may have been trained with
    ``tokenizer.json``'s, which no comparison of them can show. Empty for a model with no
    ``tokenizer.json`` or another tokenizer class (transformers reads those otherwise)."""
    wanted = _json(folder / "tokenizer_config.json") if (
        folder / "tokenizer_config.json").is_file() else {}
    if (wanted.get("tokenizer_class") not in ("BertTokenizer", "BertTokenizerFast")
            or not (folder / "tokenizer.json").is_file()):
        return []
    return _disagreements(wanted, _json(folder / "tokenizer.json"))


def _disagreements(wanted: dict, stored: dict) -> list[str]:
    """``tokenizer_json_disagreements`` of a parsed ``tokenizer_config.json`` and
    ``tokenizer.json``."""
    found = []
    normalizer = stored.get("normalizer")
    if not isinstance(normalizer, dict) or normalizer.get("type") != "BertNormalizer":
        kind = normalizer.get("type") if isinstance(normalizer, dict) else normalizer
        found.append(f"normalizer {kind} (transformers builds a BertNormalizer)")
    else:
        built = _bert_normalizer(wanted)
        stored_lowercase = normalizer.get("lowercase", True)
        stored_strip = normalizer.get("strip_accents")
        held = {"clean_text": normalizer.get("clean_text", True),
                "handle_chinese_chars": normalizer.get("handle_chinese_chars", True),
                "lowercase": stored_lowercase,
                "strip_accents": stored_lowercase if stored_strip is None else stored_strip}
        found += [f"normalizer {key} {held[key]} (transformers builds {built[key]})"
                  for key in built if held[key] != built[key]]
    pre_tokenizer = stored.get("pre_tokenizer")
    if not isinstance(pre_tokenizer, dict) or pre_tokenizer.get("type") != "BertPreTokenizer":
        kind = pre_tokenizer.get("type") if isinstance(pre_tokenizer, dict) else pre_tokenizer
        found.append(f"pre-tokenizer {kind} (transformers builds BertPreTokenizer)")
    try:
        cls, sep = (_special_token(wanted, key, default) for key, default in (
            ("cls_token", "[CLS]"), ("sep_token", "[SEP]")))
    except Unsupported as exc:
        return [*found, str(exc)]
    template = _template(stored.get("post_processor"))
    if template != [cls, "$A", sep]:
        found.append(f"template {' '.join(template) if template else None} (transformers builds "
                     f"{cls} $A {sep})")
    return found


def _tokenizer(folder: Path, settings: ModelSettings):
    """The tokenizer ``HeadTokenizer`` uses for a BERT model, built as transformers' BertTokenizer
    builds it: not ``tokenizer.json`` as it is, whose normalizer, pre-tokenizer and special-token
    template transformers does not read, but its vocabulary under the normalizer, pre-tokenizer
    and template made from ``tokenizer_config.json`` (with transformers' defaults for what it
    leaves out); truncated on the right at ``max_tokens``. ``Unsupported`` for another tokenizer,
    another transformers release, added tokens that are not special, a special token outside the
    vocabulary (the unknown token included: WordPiece then fails on a query it does not know), or
    a ``tokenizer.json`` that says otherwise than transformers builds."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    wanted, vocab, specials = _bert_vocabulary(folder)
    unk, cls, sep = specials["unk_token"], specials["cls_token"], specials["sep_token"]
    tok = Tokenizer(WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=wanted.get("tokenize_chinese_chars", True),
        strip_accents=wanted.get("strip_accents"), lowercase=wanted.get("do_lower_case", True))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.add_special_tokens(list(specials.values()))
    tok.encode_special_tokens = True  # "[SEP]" in a query is text, as HeadTokenizer reads it
    tok.no_padding()
    tok.enable_truncation(max_length=settings.max_tokens, direction="right")
    return tok


def _bert_vocabulary(folder: Path) -> tuple[dict, dict[str, int], dict[str, str]]:
    """(``tokenizer_config.json``, ``tokenizer.json``'s WordPiece vocabulary, the special tokens
    by key) of a BERT model whose tokenizer ``_tokenizer`` can build as transformers does;
    ``Unsupported`` for anything else (see ``_tokenizer``)."""
    from importlib import metadata

    version = metadata.version("transformers")
    if not version.startswith(VERIFIED_TRANSFORMERS):
        raise Unsupported(f"transformers {version}: the query path is built as "
                          f"{VERIFIED_TRANSFORMERS}x builds a BERT tokenizer")
    if not (folder / "tokenizer.json").is_file():
        raise Unsupported("no tokenizer.json")
    wanted = _json(folder / "tokenizer_config.json") if (
        folder / "tokenizer_config.json").is_file() else {}
    if wanted.get("tokenizer_class") not in ("BertTokenizer", "BertTokenizerFast"):
        raise Unsupported(f"tokenizer class {wanted.get('tokenizer_class')!r}, not BERT's")
    stored = _json(folder / "tokenizer.json")
    model = stored.get("model") or {}
    if model.get("type") != "WordPiece" or not isinstance(model.get("vocab"), dict):
        raise Unsupported("tokenizer.json holds no WordPiece vocabulary")
    if any(not added.get("special") for added in stored.get("added_tokens") or []):
        raise Unsupported("tokenizer.json adds tokens that are not special")
    vocab: dict[str, int] = model["vocab"]
    specials = {key: _special_token(wanted, key, default) for key, default in _SPECIAL_TOKENS}
    missing = [token for token in specials.values() if token not in vocab]
    if missing:
        raise Unsupported(f"the special tokens {missing} are not in the vocabulary")
    disagreements = _disagreements(wanted, stored)
    if disagreements:
        raise Unsupported("tokenizer.json says otherwise than the tokenizer transformers builds "
                          f"from tokenizer_config.json: {'; '.join(disagreements)}")
    return wanted, vocab, specials


def _require_float_weights(path: Path) -> None:
    """``Unsupported`` unless every tensor of the safetensors file is one numpy reads (float32,
    float16, or an integer): its header (8 bytes of length, then JSON) says, without loading it."""
    import struct

    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise Unsupported(f"{path.name}: {exc}") from exc
    dtypes = {t.get("dtype") for name, t in header.items() if name != "__metadata__"}
    if not dtypes <= {"F32", "F16", "I64", "I32"}:
        raise Unsupported(f"{path.name} holds {sorted(map(str, dtypes))} tensors")


class QueryEmbedder:
    """One short text's vector as the engine embeds it, computed in numpy (see the module)."""

    def __init__(self, settings: ModelSettings):
        if settings.trust_remote_code:
            raise Unsupported("trust_remote_code: the model runs its own code")
        if settings.dimensions is not None and settings.dimensions != settings.dim:
            raise Unsupported("model.dimensions: the engine truncates")
        self.dtype = resolved_dtype(settings)
        if self.dtype not in ("float32", "bfloat16"):
            raise Unsupported(f"dtype {self.dtype}")
        folder = Path(model_folder(settings))
        if not folder.is_dir():
            raise Unsupported(f"{settings.path} is not a local folder")
        config = _json(folder / "config.json")
        if (config.get("architectures") != ["BertModel"] or config.get("model_type") != "bert"
                or config.get("hidden_act") != "gelu"
                or config.get("position_embedding_type", "absolute") != "absolute"):
            raise Unsupported(f"architecture {config.get('architectures')} "
                              f"({config.get('hidden_act')}): only BertModel with gelu")
        if config.get("hidden_size") != settings.dim:
            raise Unsupported(f"hidden_size {config.get('hidden_size')} is not model.dim")
        if settings.max_tokens > config.get("max_position_embeddings", 0):
            raise Unsupported("max_tokens beyond the model's positions")
        sbert = folder / "sentence_bert_config.json"
        if sbert.is_file() and settings.max_tokens > _json(sbert).get("max_seq_length", 1 << 30):
            raise Unsupported("max_tokens beyond the model's max_seq_length: the engine refuses "
                              "it")
        if not (folder / "model.safetensors").is_file():
            raise Unsupported("no model.safetensors")
        _require_float_weights(folder / "model.safetensors")
        self.pooling = _pooling(folder)
        self.tokenizer = _tokenizer(folder, settings)
        self._normalize = settings.normalize
        self._heads = int(config["num_attention_heads"])
        self._layers = int(config["num_hidden_layers"])
        self._eps = float(config.get("layer_norm_eps", 1e-12))
        from safetensors.numpy import load_file

        weights = load_file(str(folder / "model.safetensors"))
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in weights else ""
        self._round: Callable[[np.ndarray], np.ndarray] = (
            _bfloat16 if self.dtype == "bfloat16" else (lambda x: x))
        # The embedding tables are rounded row by row when used (the word embeddings are most of
        # the model: rounding them whole costs more than a query).
        tables = prefix + "embeddings."
        self._w = {name[len(prefix):]: np.asarray(value, dtype=np.float32)
                   if name.startswith(tables) and name.endswith("_embeddings.weight")
                   else self._round(np.asarray(value, dtype=np.float32))
                   for name, value in weights.items()
                   if name.startswith(prefix) and value.dtype.kind == "f"}

    def ids(self, text: str) -> list[int]:
        """The token ids of ``text``'s head (the ones ``HeadTokenizer`` gives)."""
        return list(self.tokenizer.encode(text).ids)

    def embed(self, ids: list[int]) -> np.ndarray:
        """The vector of one prompt of token ids (float32)."""
        w, r = self._w, self._round
        n = len(ids)
        x = (r(w["embeddings.word_embeddings.weight"][ids])
             + r(w["embeddings.position_embeddings.weight"][:n])
             + r(w["embeddings.token_type_embeddings.weight"][0]))
        x = r(self._layer_norm(x, "embeddings.LayerNorm"))
        for i in range(self._layers):
            p = f"encoder.layer.{i}."
            attended = r(self._linear(r(self._attention(x, p)), p + "attention.output.dense"))
            x = r(self._layer_norm(attended + x, p + "attention.output.LayerNorm"))
            h = r(self._linear(x, p + "intermediate.dense"))
            h = r((0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))))
            out = r(self._linear(h, p + "output.dense"))
            x = r(self._layer_norm(out + x, p + "output.LayerNorm"))
        vector = (x.mean(axis=0) if self.pooling == "mean" else x[0]).astype(np.float32)
        if self._normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32)

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return (x @ self._w[name + ".weight"].T + self._w[name + ".bias"]).astype(np.float32)

    def _layer_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return ((x - mean) / np.sqrt(var + self._eps) * self._w[name + ".weight"]
                + self._w[name + ".bias"]).astype(np.float32)

    def _attention(self, x: np.ndarray, p: str) -> np.ndarray:
        n, d = x.shape
        head = d // self._heads
        q, k, v = (self._round(self._linear(x, p + f"attention.self.{part}"))
                   .reshape(n, self._heads, head).transpose(1, 0, 2)
                   for part in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(head)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        return (scores @ v).transpose(1, 0, 2).reshape(n, d).astype(np.float32)

