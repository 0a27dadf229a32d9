"""Tokenizers of GGUF files, assembled with the `tokenizers` library from the file's metadata.

A GGUF file carries no tokenizer.json: llama.cpp's converter stores the vocabulary as metadata
(tokenizer.ggml.tokens, .scores, .token_type, .merges, .pre, the special ids, add_bos_token,
...). This module reads those keys and builds, out of the library's parts, the pipeline a
tokenizer.json would have described, for the two kinds of vocabulary Llama-family files use:

  * "llama": SentencePiece BPE. A piece spells a space as "▁"; the text gets one leading "▁"
    (the "dummy prefix", tokenizer.ggml.add_space_prefix); a character that is no piece
    becomes its <0xXX> byte tokens; pieces merge in the order of the merged piece's score.
  * "gpt2": byte-level BPE. Each byte is spelled as one printable character (a space is
    "Ġ"); the text is first cut into words by the regular expressions that
    tokenizer.ggml.pre names (PRE_TOKENIZERS), then each word is merged by the file's merges.

Control, unknown and user-defined tokens are "added tokens": written inside the text
("<|im_start|>"), each encodes as its one id, as in llama.cpp and transformers.

The reference is transformers' own GGUF conversion (AutoTokenizer.from_pretrained(folder,
gguf_file=...)), token for token; where it differs from llama.cpp, the runtime these files are
made for, this module follows llama.cpp, and tests/test_gguf_tokenizer.py names each place.
Not here: other vocabulary kinds (bert/WPM, t5/UGM, rwkv, ...), llama.cpp's decode-time
space clean-up ("a ." -> "a."; lossy), and the readable tokenizer that teaching code steps
through (kvlab.tokenizer.SentencePieceBPE, which gives the same ids for a 'llama' vocabulary).
"""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Pipeline

from .errors import TokenizerError
from .tokenizer import Tokenizer, _check_gguf_array, _gguf_value, _utf8

# llama.cpp's token types (llama_token_type): NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4,
# UNUSED 5, BYTE 6. Unknown and control tokens are markers (decode skips them); user-defined
# ones are ordinary text that must stay whole (a "<think>").
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_SPM_SPACE = "\u2581"   # "▁": how SentencePiece spells a space inside a piece

# How each tokenizer.ggml.pre cuts text into words before the merges, as llama.cpp's
# src/llama-vocab.cpp runs it (llm_tokenizer_bpe; its comments name the tokenizer.json each
# regex comes from). A tuple is applied in order, each regex splitting the pieces the one
# before left; text between two matches stays a piece of its own, as llama.cpp keeps it.
# GPT-2's regex, as in OpenAI's encoder.py and the tokenizers ByteLevel pre-tokenizer.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's tokenizer.json (tiktoken's cl100k_base): numbers in groups of up to three digits,
# a word may take one leading non-letter, newlines gather into their own pieces.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's tokenizer.json: Llama 3's, but every digit on its own.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: Dict[str, Tuple[str, ...]] = {
    "gpt-2": (_GPT2,),
    # SmolLM's tokenizer.json: Digits(individual_digits=True), then GPT-2's regex.
    "smollm": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    # llama.cpp's fallback for a file that names no known pre-tokenizer: runs of punctuation
    # apart, GPT-2's words, then digit runs cut into threes.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
}
# llama.cpp's settings for the Llama 3 family: a word that is itself a token is that token
# (tokenizer.json's "ignore_merges": true), and BOS is added unless the file says otherwise.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})
_ADDS_BOS = frozenset({"llama-bpe", "llama3", "llama-v3"})

# "none"/"no_vocab": llama.cpp's names for a file that deliberately has no vocabulary.
_NO_VOCABULARY = ("none", "no_vocab")
SUPPORTED_MODELS = ("gpt2", "llama")


class UnsupportedVocabulary(TokenizerError):
    """A well-formed GGUF vocabulary of a kind kvlab does not build (a 'bert' or 't5' model, a
    pre-tokenizer it has no regex for). The loader warns and goes on without a tokenizer."""


class GGUFTokenizer(Tokenizer):
    """A GGUF file's tokenizer: a `tokenizers.Tokenizer` (`pipeline`) plus what the metadata
    says about using it.

    encode(text, bos=None) adds BOS when the file says so (add_bos: tokenizer.ggml.add_bos_token,
    else llama.cpp's default: yes for 'llama', no for 'gpt2' but the Llama 3 family);
    bos=True/False forces it. Special tokens written in the text become their ids.
    decode(ids) skips special tokens unless skip_special=False, and drops the dummy-prefix
    space right after a leading BOS, so decode(encode(text)) == text; a continuation decoded
    alone (generated tokens) keeps its leading space.
    """

    def __init__(self, pipeline: _Pipeline, tokens: Sequence[str], *, model: str,
                 pre: Optional[str], bos_id: Optional[int], eos_id: Optional[int],
                 unk_id: Optional[int], pad_id: Optional[int], add_bos: bool, add_eos: bool,
                 add_space_prefix: bool, special_ids: Sequence[int],
                 chat_template: Optional[str]) -> None:
        self.pipeline = pipeline
        self.tokens: List[str] = list(tokens)
        self.vocab_size = len(self.tokens)
        self.model, self.pre = model, pre
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = bos_id, eos_id, unk_id, pad_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.add_space_prefix = add_space_prefix
        self.special_ids: FrozenSet[int] = frozenset(special_ids)
        self.special_tokens: Dict[str, int] = {self.tokens[i]: i for i in sorted(self.special_ids)}
        self.chat_template = chat_template

    def encode(self, text: str, bos: Optional[bool] = None,
               eos: Optional[bool] = None) -> List[int]:
        """Token ids of `text`. bos/eos None: as the file says (add_bos, add_eos)."""
        _utf8(text)  # type and encodability check, with kvlab's error
        ids = list(self.pipeline.encode(text, add_special_tokens=False).ids)
        if self._wants_bos(bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos if eos is None else eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        ids = [self._check_id(i) for i in ids]
        if not (self.add_space_prefix and skip_special and ids[:1] == [self.bos_id]):
            return self.pipeline.decode(ids, skip_special_tokens=skip_special)
        # encode put one "▁" before the text; after a BOS it is the dummy prefix, not text.
        text = self.pipeline.decode(ids[1:], skip_special_tokens=True)
        return text[1:] if text.startswith(" ") else text

    def id_to_piece(self, id: int) -> str:
        """The token as the file spells it ("▁the" in a 'llama' vocabulary, "Ġthe" in 'gpt2')."""
        return self.tokens[self._check_id(id)]

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(model={self.model!r}, pre={self.pre!r}, "
                f"vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"add_bos={self.add_bos})")


# ---------------------------------------------------------------------------------------
# Reading the metadata
# ---------------------------------------------------------------------------------------
def from_gguf(reader: Any) -> GGUFTokenizer:
    """The tokenizer a GGUF file describes (`reader`: kvlab's GGUFFile, or a gguf.GGUFReader).

    UnsupportedVocabulary for a kind of vocabulary kvlab does not build; TokenizerError naming
    the key for metadata that is missing, of the wrong type or inconsistent (a merge naming a
    token that is not in the vocabulary, arrays of different lengths, ...)."""
    model = _string(reader, "tokenizer.ggml.model")
    if model is None or model in _NO_VOCABULARY:
        raise UnsupportedVocabulary("the GGUF file has no vocabulary (tokenizer.ggml.model is "
                                    f"{model!r})")
    if model not in SUPPORTED_MODELS:
        raise UnsupportedVocabulary(f"GGUF tokenizer.ggml.model {model!r} is not supported "
                                    f"(kvlab builds {', '.join(map(repr, SUPPORTED_MODELS))})")
    tokens = _array(reader, "tokenizer.ggml.tokens", str, "strings")
    if tokens is None or not tokens:
        raise TokenizerError("GGUF tokenizer.ggml.tokens is missing or empty")
    n = len(tokens)
    types = _array(reader, "tokenizer.ggml.token_type", int, "integers", n) or [1] * n
    ids = {name: _token_id(reader, f"tokenizer.ggml.{name}_token_id", n)
           for name in ("bos", "eos", "unknown", "padding")}
    # Markers, never text: control and unknown tokens, and whatever the file names BOS/EOS/...
    special = {i for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL)}
    special |= {i for i in ids.values() if i is not None}
    user_defined = {i for i, t in enumerate(types) if t == _USER_DEFINED} - special
    vocab = _vocab_ids(tokens)
    merges = _merges(reader, vocab)

    pre: Optional[str] = None
    if model == "llama":
        scores = _array(reader, "tokenizer.ggml.scores", (int, float), "numbers", n)
        if scores is None and merges is None:
            raise TokenizerError("GGUF file has neither tokenizer.ggml.scores nor "
                                 "tokenizer.ggml.merges for its 'llama' vocabulary")
        add_space_prefix = _flag(reader, "tokenizer.ggml.add_space_prefix", True)
        if merges is None:   # the usual case: SentencePiece stores scores, not merges
            merges = _merges_from_scores(tokens, scores, special)
        pipeline = _sentencepiece(tokens, vocab, merges, ids["unknown"], add_space_prefix)
        add_bos_default = True          # llama.cpp: an SPM vocabulary adds BOS
    else:
        pre = _string(reader, "tokenizer.ggml.pre") or "default"  # llama.cpp's fallback too
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedVocabulary(
                f"GGUF tokenizer.ggml.pre {pre!r} is not supported (kvlab knows "
                f"{', '.join(sorted(PRE_TOKENIZERS))})")
        if merges is None:
            raise TokenizerError("GGUF file lacks tokenizer.ggml.merges for its 'gpt2' vocabulary")
        # llama.cpp never adds a space prefix to a BPE vocabulary, whatever the key says.
        add_space_prefix = False
        pipeline = _byte_level(vocab, merges, pre)
        add_bos_default = pre in _ADDS_BOS

    _add_tokens(pipeline, tokens, special, user_defined)
    if pipeline.get_vocab_size(with_added_tokens=True) != n:
        # each added token is one already in the vocabulary, so none may make a new id
        raise TokenizerError(f"the GGUF vocabulary of {n} tokens became "
                             f"{pipeline.get_vocab_size(with_added_tokens=True)} once its "
                             "special tokens were added")
    add_bos = _flag(reader, "tokenizer.ggml.add_bos_token", add_bos_default)
    add_eos = _flag(reader, "tokenizer.ggml.add_eos_token", False)
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and ids[name] is None:   # llama.cpp refuses these files too
            raise TokenizerError(f"GGUF tokenizer.ggml.add_{name}_token is true, but "
                                 f"tokenizer.ggml.{name}_token_id names no token")
    template = _gguf_value(reader, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"GGUF tokenizer.chat_template is {type(template).__name__}, "
                             "expected a string")
    return GGUFTokenizer(pipeline, tokens, model=model, pre=pre, bos_id=ids["bos"],
                         eos_id=ids["eos"], unk_id=ids["unknown"], pad_id=ids["padding"],
                         add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix,
                         special_ids=sorted(special), chat_template=template)


def _string(reader: Any, key: str) -> Optional[str]:
    value = _gguf_value(reader, key)
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"GGUF {key} is {_short(value)}, expected a string")
    return value


def _flag(reader: Any, key: str, default: bool) -> bool:
    value = _gguf_value(reader, key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TokenizerError(f"GGUF {key} is {_short(value)}, expected true or false")
    return value


def _array(reader: Any, key: str, kind: Any, kind_name: str,
           length: Optional[int] = None) -> Optional[list]:
    """A list of `kind`, None if the key is absent; one of another length than the token list
    is refused (a score or type per token)."""
    value = _gguf_value(reader, key)
    if value is None:
        return None
    _check_gguf_array(value, kind, kind_name, key)
    if length is not None and len(value) != length:
        raise TokenizerError(f"GGUF {key} has {len(value)} entries but tokenizer.ggml.tokens "
                             f"has {length}")
    return value


def _token_id(reader: Any, key: str, n_tokens: int) -> Optional[int]:
    """A special token's id; None if absent or -1 (GGUF writes 0xFFFFFFFF for "none")."""
    value = _gguf_value(reader, key)
    if value is None:
        return None
    if type(value) is not int:   # not a float, not a bool
        raise TokenizerError(f"GGUF {key} is {_short(value)}, expected an integer")
    if value in (-1, 0xFFFFFFFF):
        return None
    if not 0 <= value < n_tokens:
        raise TokenizerError(f"GGUF {key} is {value}, outside the vocabulary (0..{n_tokens - 1})")
    return value


def _short(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _vocab_ids(tokens: Sequence[str]) -> Dict[str, int]:
    """{token: id}. A library BPE keeps one id per spelling, so a token listed twice would
    leave an id that nothing encodes to or decodes from: refused."""
    vocab: Dict[str, int] = {}
    for i, token in enumerate(tokens):
        first = vocab.setdefault(token, i)
        if first != i:
            raise TokenizerError(f"GGUF tokenizer.ggml.tokens lists {_short(token)} twice "
                                 f"(ids {first} and {i})")
    return vocab


def _merges(reader: Any, vocab: Dict[str, int]) -> Optional[List[Tuple[str, str]]]:
    """tokenizer.ggml.merges as pairs, None if absent. Each entry is "left right" (a space
    inside a token is spelled "Ġ" or "▁", so one space separates them); both halves and their
    concatenation must be tokens, else the library's BPE would refuse them with less to say."""
    merges = _array(reader, "tokenizer.ggml.merges", str, "strings")
    if merges is None:
        return None
    pairs = []
    for i, merge in enumerate(merges):
        left, _, right = merge.partition(" ")
        if not left or not right or " " in right:
            raise TokenizerError(f"GGUF tokenizer.ggml.merges[{i}] is {_short(merge)}, "
                                 "expected two tokens separated by one space")
        for part in (left, right, left + right):
            if part not in vocab:
                raise TokenizerError(f"GGUF tokenizer.ggml.merges[{i}] ({_short(merge)}) "
                                     f"makes {_short(part)}, which is not in "
                                     "tokenizer.ggml.tokens")
        pairs.append((left, right))
    return pairs


# ---------------------------------------------------------------------------------------
# Building the pipelines
# ---------------------------------------------------------------------------------------
# SentencePiece's own limit on a piece is 16 characters by default (max_sentencepiece_length);
# llama2.c's tokenizer.bin allows 1024 bytes (kvlab.tokenizer).
_LONGEST_MERGED_PIECE = 1024


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float],
                        special: set) -> List[Tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies.

    SentencePiece merges, among the adjacent pairs that form a piece, the one whose piece
    scores highest; a library BPE merges the pair of lowest rank. So every way to cut a piece
    in two pieces becomes a merge, ranked by that piece's score, best first (ties: lower id,
    then shorter left half): the BPE then makes the same choices. Special tokens are never
    the product of a merge, nor a half of one, as in SentencePiece.
    """
    ids = {t: i for i, t in enumerate(tokens) if i not in special}
    # Only a cut whose halves have lengths some piece has can give two pieces; and a piece
    # longer than any real one (a corrupt file's megabyte string) would cost its length
    # squared to cut, so it is left whole: no merge makes it.
    lengths = sorted({len(t) for t in ids})
    ranked = []
    for piece, id in ids.items():
        if len(piece) > _LONGEST_MERGED_PIECE:
            continue
        for cut in lengths:
            if cut >= len(piece):
                break
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[id]), id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece(tokens: Sequence[str], vocab: Dict[str, int], merges: List[Tuple[str, str]],
                   unk_id: Optional[int], add_space_prefix: bool) -> _Pipeline:
    try:
        bpe = models.BPE(vocab, merges, unk_token=None if unk_id is None else tokens[unk_id],
                         fuse_unk=True, byte_fallback=True)
    except Exception as exc:  # the library raises a bare Exception
        raise TokenizerError(f"the GGUF vocabulary does not make a BPE model: {exc}") from None
    pipeline = _Pipeline(bpe)
    # SentencePiece's own normalization, as Llama 2's tokenizer.json spells it: every space
    # becomes "▁" and the text gets one more in front (always, even before a leading space,
    # as SentencePiece and llama.cpp do), and no split into words. The Prepend normalizer
    # runs on each stretch of text between special tokens, as llama.cpp prefixes a space to
    # each text fragment that follows a special token.
    steps = [normalizers.Replace(" ", _SPM_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(_SPM_SPACE))
    pipeline.normalizer = normalizers.Sequence(steps)
    pipeline.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "),
                                          decoders.ByteFallback(), decoders.Fuse()])
    return pipeline


def _byte_level(vocab: Dict[str, int], merges: List[Tuple[str, str]], pre: str) -> _Pipeline:
    try:
        bpe = models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES)
    except Exception as exc:
        raise TokenizerError(f"the GGUF vocabulary does not make a BPE model: {exc}") from None
    pipeline = _Pipeline(bpe)
    # The words first (the regexes see the text itself), then bytes -> the byte alphabet;
    # "isolated" keeps each match and each stretch between matches as a piece.
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated")
              for pattern in PRE_TOKENIZERS[pre]]
    pipeline.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    pipeline.decoder = decoders.ByteLevel()
    return pipeline


def _add_tokens(pipeline: _Pipeline, tokens: Sequence[str], special: set,
                user_defined: set) -> None:
    """Make the special and user-defined tokens whole-matched in raw text (normalized=False:
    before the "▁" normalizer or the byte alphabet). An empty one could match nowhere."""
    pipeline.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                 for i in sorted(special) if tokens[i]])
    pipeline.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                         for i in sorted(user_defined) if tokens[i]])
