"""Tiny embedding models built on the spot, with nothing downloaded: random weights from a
``transformers`` config (``save_pretrained``), a tokenizer trained here on made-up text (the
``tokenizers`` library) and a sentence-transformers modules config (pooling, normalization,
prompts), so that sentence-transformers loads the folder as the reference and vLLM serves it.

- ``build_bert``: a ``BertModel`` with a WordPiece tokenizer (the BERT-class path newsvec runs:
  MiniLM, e5, bge).
- ``build_modernbert``: a ``ModernBertModel`` as ruri-v3 is built: several layers, local attention
  in a window smaller than the test texts, a global layer every few, a Unigram tokenizer with
  Metaspace (SentencePiece-like).
- ``build_llama`` and ``build_qwen3``: decoders as the embedders built on them are (e5-mistral,
  gte-Qwen, Qwen3-Embedding): causal attention, a byte-level BPE tokenizer that appends an end
  token, last-token pooling. The Llama is saved as ``LlamaModel`` (grouped-query attention, its
  tokenizer padding on the right); the Qwen3 as Qwen3-Embedding ships (``Qwen3ForCausalLM``, the
  query prompt ``Instruct: ...\nQuery:``, its tokenizer padding on the left). sentence-transformers'
  last-token pooling takes the last token of the attention mask, on either side.

Random weights of the usual scale (``initializer_range`` 0.02) make attention nearly uniform, so
that a mean over the tokens barely depends on what each token attends to: a test that ignores
the attention window still passes. ``build_modernbert`` uses a large ``initializer_range`` and CLS
pooling, where the window visibly changes the vector (tests/engines/test_model_parity.py shows it).

Used by the tests (tests/engines/test_model_parity.py, tests/engines/test_decoder_parity.py,
tests/engines/test_check_model.py) and ``benchmarks.batch --tiny``; run as a
script it builds them all into a folder: ``python -m tools.tiny_models OUT``.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Literal, Optional

Pooling = Literal["cls", "mean", "weightedmean", "lasttoken"]
_SYLLABLES = ("ka", "ki", "ku", "ke", "ko", "sa", "shi", "su", "ta", "to", "na", "ni", "ma", "mo",
              "ra", "ri", "ru", "ya", "yo", "n", "ba", "de", "go", "zu", "fu", "po", "wa", "hi")


def made_up_text(rng: random.Random, words: int) -> str:
    """Sentences of made-up words (a few syllables each), a full stop every few words."""
    out = []
    for i in range(words):
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        out.append(word.capitalize() if i == 0 or out[-1].endswith(".") else word)
        if rng.random() < 0.12:
            out[-1] += "."
    return " ".join(out)


def _corpus(seed: int, lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    return [made_up_text(rng, rng.randint(5, 40)) for _ in range(lines)]


def _save_tokenizer(tok, folder: Path, max_length: int, specials: list[str]) -> tuple[int, int]:
    """Put the special tokens around a text (``pad, unk, cls, sep, mask`` in ``specials``) and
    save the tokenizer in ``folder`` as ``transformers`` reads it; (cls id, sep id)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    pad, unk, cls_token, sep_token, mask = specials
    cls, sep = tok.token_to_id(cls_token), tok.token_to_id(sep_token)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls_token} $A {sep_token}", pair=f"{cls_token} $A {sep_token} $B:1 {sep_token}:1",
        special_tokens=[(cls_token, cls), (sep_token, sep)])
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, unk_token=unk,
                            pad_token=pad, cls_token=cls_token, sep_token=sep_token,
                            mask_token=mask).save_pretrained(folder)
    return cls, sep


def _write_sentence_transformers(folder: Path, pooling: Pooling, normalize: bool,
                                 max_length: int, hidden: int,
                                 prompts: Optional[dict[str, str]],
                                 include_prompt: bool = True) -> None:
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    write_pooling(folder, pooling, hidden, include_prompt)
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_length, "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts or {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}))


def write_pooling(folder: Path, pooling: Pooling, hidden: int,
                  include_prompt: bool = True) -> None:
    """The sentence-transformers pooling module's config (``1_Pooling/config.json``);
    ``include_prompt`` False: the pooling leaves the prompt's tokens out."""
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {f"pooling_mode_{m}": False for m in (
        "cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
        "lasttoken")}
    modes[{"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
           "weightedmean": "pooling_mode_weightedmean_tokens",
           "lasttoken": "pooling_mode_lasttoken"}[pooling]] = True
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, **modes,
                    "include_prompt": include_prompt},
                   indent=2))


def build_bert(folder: str | Path, *, pooling: Pooling = "mean", normalize: bool = True,
               seed: int = 0, prompts: Optional[dict[str, str]] = None,
               hidden: int = 128, layers: int = 2, max_length: int = 256) -> Path:
    """A tiny ``BertModel`` (2 heads of 64: vLLM's CPU attention refuses a head size of 16) with
    a WordPiece tokenizer (BERT's normalizer and pre-tokenizer), in ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import WordPieceTrainer
    from transformers import BertConfig, BertModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(_corpus(seed), WordPieceTrainer(vocab_size=600,
                                                            special_tokens=specials))
    _save_tokenizer(tok, folder, max_length, specials)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden,
                        num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=max_length,
                        initializer_range=0.2, pad_token_id=tok.token_to_id("[PAD]"))
    BertModel(config).eval().save_pretrained(folder)
    _write_sentence_transformers(folder, pooling, normalize, max_length, hidden, prompts)
    return folder


def build_modernbert(folder: str | Path, *, pooling: Pooling = "cls", normalize: bool = True,
                     seed: int = 0, prompts: Optional[dict[str, str]] = None,
                     local_attention: int = 16, global_every: int = 3, layers: int = 4,
                     hidden: int = 128, max_length: int = 512,
                     initializer_range: float = 0.25) -> Path:
    """A tiny ``ModernBertModel`` as ruri-v3 is built (local attention in a window of
    ``local_attention`` tokens, the half-window each side, a global layer every
    ``global_every``), with a Unigram tokenizer and Metaspace (SentencePiece-like), in
    ``folder``. ``initializer_range`` 0.25: attention far from uniform, so the window matters."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import UnigramTrainer
    from transformers import ModernBertConfig, ModernBertModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<unk>", "<cls>", "<sep>", "<mask>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(_corpus(seed), UnigramTrainer(vocab_size=400, special_tokens=specials,
                                                          unk_token="<unk>"))
    cls, sep = _save_tokenizer(tok, folder, max_length, specials)
    torch.manual_seed(seed)
    config = ModernBertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=max_length,
        local_attention=local_attention, global_attn_every_n_layers=global_every,
        initializer_range=initializer_range,
        classifier_pooling="mean" if pooling == "mean" else "cls",
        pad_token_id=tok.token_to_id("<pad>"), bos_token_id=cls, eos_token_id=sep,
        cls_token_id=cls, sep_token_id=sep)
    ModernBertModel(config).eval().save_pretrained(folder)
    _write_sentence_transformers(folder, pooling, normalize, max_length, hidden, prompts)
    return folder


# Qwen3-Embedding's query prompt (its config_sentence_transformers.json); documents get none.
QWEN3_QUERY_PROMPT = ("Instruct: Given a web search query, retrieve relevant passages that "
                      "answer the query\nQuery:")


def _decoder_tokenizer(folder: Path, seed: int, max_length: int, bos: Optional[str], eos: str,
                       padding_side: str) -> tuple[int, int, int]:
    """A byte-level BPE tokenizer (as Llama 3 and Qwen have) that appends ``eos`` (and starts
    with ``bos``), saved in ``folder``; (pad id, bos id or eos id, eos id). The pad token is the
    end token, as these models' tokenizers have it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    specials = [t for t in (bos, eos) if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(seed), BpeTrainer(
        vocab_size=500, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos_id = tok.token_to_id(eos)
    bos_id = tok.token_to_id(bos) if bos else eos_id
    single = f"{bos} $A {eos}" if bos else f"$A {eos}"
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1 {eos}:1",
        special_tokens=[(t, tok.token_to_id(t)) for t in specials])
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, eos_token=eos,
                            pad_token=eos, padding_side=padding_side,
                            **({"bos_token": bos} if bos else {})).save_pretrained(folder)
    return eos_id, bos_id, eos_id


def build_llama(folder: str | Path, *, pooling: Pooling = "lasttoken", normalize: bool = True,
                seed: int = 0, prompts: Optional[dict[str, str]] = None,
                include_prompt: bool = True, hidden: int = 64, layers: int = 2,
                max_length: int = 512, initializer_range: float = 0.2) -> Path:
    """A tiny ``LlamaModel`` embedder (2 query heads of 32 sharing 1 key/value head: vLLM's CPU
    attention takes a head size of 32, not 16), a byte-level BPE tokenizer ``<s> ... </s>``
    padding on the right, last-token pooling, in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pad, bos, eos = _decoder_tokenizer(folder, seed, max_length, "<s>", "</s>", "right")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]),
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=2 * hidden, max_position_embeddings=max_length,
        initializer_range=initializer_range, pad_token_id=pad, bos_token_id=bos,
        eos_token_id=eos, tie_word_embeddings=False)
    LlamaModel(config).eval().save_pretrained(folder)
    _write_sentence_transformers(folder, pooling, normalize, max_length, hidden, prompts,
                                 include_prompt)
    return folder


def build_qwen3(folder: str | Path, *, pooling: Pooling = "lasttoken", normalize: bool = True,
                seed: int = 0, prompts: Optional[dict[str, str]] = None,
                include_prompt: bool = True, hidden: int = 64, layers: int = 2,
                max_length: int = 512, initializer_range: float = 0.2) -> Path:
    """A tiny Qwen3 embedder as Qwen3-Embedding ships (``Qwen3ForCausalLM``: 4 query heads of 32,
    2 key/value heads, RMS-normed queries and keys; a byte-level BPE tokenizer appending
    ``<|endoftext|>``, padding on the left; last-token pooling; the query prompt
    ``QWEN3_QUERY_PROMPT`` and an empty document prompt unless ``prompts`` says otherwise), in
    ``folder``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pad, bos, eos = _decoder_tokenizer(folder, seed, max_length, None, "<|endoftext|>", "left")
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]),
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=2 * hidden,
        max_position_embeddings=max_length, initializer_range=initializer_range,
        pad_token_id=pad, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    _write_sentence_transformers(
        folder, pooling, normalize, max_length, hidden,
        {"query": QWEN3_QUERY_PROMPT, "document": ""} if prompts is None else prompts,
        include_prompt)
    return folder


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m tools.tiny_models OUT_FOLDER", file=sys.stderr)
        return 2
    print(build_bert(Path(argv[0]) / "bert"))
    print(build_modernbert(Path(argv[0]) / "modernbert"))
    print(build_llama(Path(argv[0]) / "llama"))
    print(build_qwen3(Path(argv[0]) / "qwen3"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
