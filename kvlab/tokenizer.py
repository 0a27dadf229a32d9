"""Tokenizers: text <-> token ids, in plain Python.

Three kinds, behind one small interface (`Tokenizer`):
  * ByteTokenizer     - one token per UTF-8 byte (vocab 256), for byte-level toy models.
  * SentencePieceBPE  - the llama2.c algorithm over a SentencePiece vocabulary (pieces and
                        scores), read from a llama2.c `tokenizer.bin` (or, for study, from a
                        GGUF file's 'llama' vocabulary).
  * HFTokenizer       - a thin wrapper around the `tokenizers` package for `tokenizer.json`.
A GGUF file's own tokenizer, as kvlab.load uses it, is built with the `tokenizers` package
from the file's metadata: kvlab.gguf_tokenizer.

This module does not run models or load weights (see kvlab.loaders). It is written to be
read: SentencePieceBPE is a faithful, readable re-statement of llama2.c's greedy merge rule,
not a full SentencePiece implementation (no normalization rules, no sampling).
"""
from __future__ import annotations

import heapq
import operator
import os
import re
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import TokenizerError
from .files import open_regular, read_bounded, read_json_object, short


class Tokenizer:
    """What every tokenizer offers. Subclasses fill in the three methods."""

    vocab_size: int = 0
    bos_id: Optional[int] = None   # beginning-of-sequence token, None if the vocab has none
    eos_id: Optional[int] = None   # end-of-sequence token, None if the vocab has none
    add_bos: bool = False          # what encode(text) does about BOS when not told

    def encode(self, text: str, bos: Optional[bool] = None) -> List[int]:
        """Token ids of `text`; BOS first if `bos`, or, when bos is None, if this tokenizer's
        model expects one (add_bos)."""
        raise NotImplementedError

    def _wants_bos(self, bos: Optional[bool]) -> bool:
        return self.add_bos if bos is None else bool(bos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a whole sequence of ids (a leading BOS is skipped)."""
        raise NotImplementedError

    def id_to_piece(self, id: int) -> str:
        """How one token looks, for display (not guaranteed to round-trip)."""
        raise NotImplementedError

    def _check_id(self, id: int) -> int:
        # Ids usually come from a model's argmax, so a bad one is a bug worth naming.
        try:
            if isinstance(id, (bool, np.bool_)):    # operator.index takes True as 1
                raise TypeError
            id = operator.index(id)  # int or NumPy integer; not float
        except TypeError:
            raise TokenizerError(f"token id must be an integer, got {id!r}") from None
        if not 0 <= id < self.vocab_size:
            raise TokenizerError(f"token id {id} is outside the vocabulary "
                                 f"(0..{self.vocab_size - 1})")
        return id

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id})")


# ---------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------
class ByteTokenizer(Tokenizer):
    """Token id = one byte of the UTF-8 encoding. No BOS/EOS exist, so `bos=` is ignored."""

    vocab_size = 256

    def encode(self, text: str, bos: Optional[bool] = None) -> List[int]:
        return list(_utf8(text))

    def decode(self, ids: Sequence[int]) -> str:
        # A model may emit half of a multi-byte character; "replace" shows it as U+FFFD.
        return bytes(self._check_id(i) for i in ids).decode("utf-8", errors="replace")

    def id_to_piece(self, id: int) -> str:
        id = self._check_id(id)
        return chr(id) if 0x20 <= id < 0x7F else f"<0x{id:02X}>"


def _utf8(text: str) -> bytes:
    if not isinstance(text, str):
        raise TokenizerError(f"text must be a str, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates cannot be UTF-8
        raise TokenizerError(f"text is not encodable as UTF-8: {exc}") from None


# ---------------------------------------------------------------------------------------
# SentencePiece vocabulary + llama2.c merge rule
# ---------------------------------------------------------------------------------------
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPM_SPACE = "\u2581"  # "▁": how SentencePiece spells a space inside a piece

# GGUF token types (llama.cpp's enum); only the ones we act on.
_GGUF_UNKNOWN, _GGUF_CONTROL = 2, 3


class SentencePieceBPE(Tokenizer):
    """llama2.c's tokenizer: start from characters, greedily merge the best-scoring pair.

    encode(text):
      1. prepend " " (SentencePiece's "dummy prefix": a word at the start of the text
         looks like a word in the middle of a sentence),
      2. one token per UTF-8 character if that character is a piece, otherwise one byte
         token `<0xXX>` per byte of it ("byte fallback", so no text is ever unknown),
      3. repeatedly merge the adjacent pair whose concatenation is a piece with the
         highest score (leftmost pair on ties), until no adjacent pair forms a piece,
      4. prepend BOS if asked.
    decode(ids): concatenate pieces, `<0xXX>` pieces become raw bytes, BOS/EOS add no text,
    and the space right after a BOS is dropped (it was the dummy prefix).
    """

    add_bos = True   # llama2.c and SentencePiece models were trained with BOS first

    def __init__(self, pieces: Sequence[str], scores: Sequence[float],
                 bos_id: Optional[int] = 1, eos_id: Optional[int] = 2,
                 unk_id: Optional[int] = 0, special_ids: Sequence[int] = ()) -> None:
        if len(pieces) != len(scores):
            raise TokenizerError(f"{len(pieces)} pieces but {len(scores)} scores")
        if not pieces:
            raise TokenizerError("empty vocabulary")
        self.pieces: List[str] = list(pieces)
        self.scores: List[float] = [float(s) for s in scores]
        self.vocab_size = len(self.pieces)
        self.bos_id = self._optional_id(bos_id)
        self.eos_id = self._optional_id(eos_id)
        self.unk_id = self._optional_id(unk_id)
        # Control tokens are markers, never spelled by text: keep them out of the lookup.
        self.special_ids = {i for i in (self.bos_id, self.eos_id, self.unk_id, *special_ids)
                            if i is not None}
        self.piece_to_id: Dict[str, int] = {}
        for i, piece in enumerate(self.pieces):
            if i not in self.special_ids:
                self.piece_to_id.setdefault(piece, i)  # first id wins on duplicates
        self.byte_of_id = self._byte_pieces()
        self.byte_ids = self._byte_table()

    def _optional_id(self, id: Optional[int]) -> Optional[int]:
        if id is None or not 0 <= int(id) < self.vocab_size:
            return None  # GGUF writes 0xFFFFFFFF for "none"
        return int(id)

    def _byte_pieces(self) -> Dict[int, int]:
        """{token id: byte value} for the `<0xXX>` pieces (llama2.c: id = byte + 3)."""
        matches = ((i, _BYTE_PIECE.match(piece)) for i, piece in enumerate(self.pieces))
        return {i: int(m.group(1), 16) for i, m in matches if m}

    def _byte_table(self) -> List[int]:
        """Token id for each byte value; <unk> where the vocabulary has no byte piece."""
        table = [self.unk_id] * 256
        for id, byte in self.byte_of_id.items():
            table[byte] = id
        if None in table:
            raise TokenizerError("vocabulary has neither byte-fallback pieces <0xXX> for "
                                 "every byte nor an <unk> token")
        return table

    # ---- constructors --------------------------------------------------------------------
    @classmethod
    def from_llama2c_file(cls, path: "str | os.PathLike[str]",
                          vocab_size: Optional[int] = None) -> "SentencePieceBPE":
        """Read llama2.c's tokenizer.bin: int32 max_token_length, then per token
        (float32 score, int32 length, bytes). vocab_size=None reads to the end of the file."""
        path = Path(path)
        data = _read_llama2c_vocab_file(path, vocab_size)
        pieces, scores = _parse_llama2c_vocab(data, vocab_size, path)
        return cls(pieces, scores, bos_id=1, eos_id=2, unk_id=0)

    @classmethod
    def from_gguf(cls, reader: Any) -> "SentencePieceBPE":
        """Read the vocabulary embedded in a GGUF file (kvlab.loaders.gguf_file.read_gguf's
        GGUFFile, or a `gguf.GGUFReader`), to step through
        the readable algorithm on it; kvlab.load builds a GGUF file's tokenizer with the
        `tokenizers` package instead (kvlab.gguf_tokenizer), which gives the same ids."""
        model = _gguf_value(reader, "tokenizer.ggml.model")
        if model != "llama":
            raise TokenizerError(f"GGUF tokenizer model is {model!r}; only 'llama' "
                                 "(SentencePiece) vocabularies are supported")
        tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
        scores = _gguf_value(reader, "tokenizer.ggml.scores")
        if tokens is None or scores is None:
            raise TokenizerError("GGUF file has no tokenizer.ggml.tokens/scores")
        types = _gguf_value(reader, "tokenizer.ggml.token_type") or []
        # A corrupt file can store any type under these keys (a float id, a string score):
        # refuse it here, by name, rather than fail inside str.replace, float() or int().
        _check_gguf_array(tokens, str, "strings", "tokenizer.ggml.tokens")
        _check_gguf_array(scores, (int, float), "numbers", "tokenizer.ggml.scores")
        _check_gguf_array(types, int, "integers", "tokenizer.ggml.token_type")
        special = [i for i, t in enumerate(types) if t in (_GGUF_UNKNOWN, _GGUF_CONTROL)]
        # llama2.c files spell spaces as " "; GGUF keeps SentencePiece's "▁". Normalize
        # so both sources give the same pieces (and the same merges).
        pieces = [t.replace(_SPM_SPACE, " ") for t in tokens]
        ids = {}
        for name in ("bos", "eos", "unknown"):
            key = f"tokenizer.ggml.{name}_token_id"
            ids[name] = _gguf_value(reader, key)
            if ids[name] is not None and type(ids[name]) is not int:  # not a float, a bool
                raise TokenizerError(f"GGUF {key} is {ids[name]!r}, expected an integer")
        return cls(pieces, scores, bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unknown"],
                   special_ids=special)

    # ---- encode --------------------------------------------------------------------------
    def encode(self, text: str, bos: Optional[bool] = None) -> List[int]:
        _utf8(text)  # type and encodability check
        ids = self._initial_tokens(" " + text if text else "")
        ids = self._merge(ids)
        if self._wants_bos(bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def _initial_tokens(self, text: str) -> List[int]:
        """One token per character, or its bytes when the character is not a piece."""
        ids: List[int] = []
        for char in text:
            id = self.piece_to_id.get(char)
            if id is not None:
                ids.append(id)
            else:
                ids.extend(self.byte_ids[b] for b in char.encode("utf-8"))
        return ids

    def _merge(self, ids: List[int]) -> List[int]:
        """Greedy BPE merges, the same result as llama2.c's rescan-every-time loop.

        llama2.c rescans all pairs after each merge (O(n^2)). We keep the tokens in a
        linked list and candidate pairs in a heap keyed by (-score, position), so the
        pick is identical - best score, leftmost on ties - but a merge costs O(log n).
        A heap entry goes stale when either side has merged since; we skip those.
        """
        n = len(ids)
        if n < 2:
            return ids
        tokens = list(ids)                       # tokens[i]: current id at node i, -1 = gone
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap: List[Tuple[float, int, int, int, int]] = []
        for i in range(n - 1):
            self._push_pair(heap, tokens, i, i + 1)
        while heap:
            _, left, right, left_id, right_id = heapq.heappop(heap)
            if tokens[left] != left_id or tokens[right] != right_id or nxt[left] != right:
                continue                          # stale: one side changed since the push
            tokens[left] = self.piece_to_id[self.pieces[left_id] + self.pieces[right_id]]
            tokens[right] = -1
            nxt[left] = nxt[right]
            if nxt[right] != -1:
                prv[nxt[right]] = left
            if prv[left] != -1:
                self._push_pair(heap, tokens, prv[left], left)
            if nxt[left] != -1:
                self._push_pair(heap, tokens, left, nxt[left])
        return [t for t in tokens if t != -1]

    def _push_pair(self, heap: list, tokens: List[int], left: int, right: int) -> None:
        merged = self.piece_to_id.get(self.pieces[tokens[left]] + self.pieces[tokens[right]])
        if merged is not None:
            # Node indices only grow along the list, so `left` orders ties leftmost-first.
            heapq.heappush(heap, (-self.scores[merged], left, right, tokens[left], tokens[right]))

    # ---- decode --------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        prev: Optional[int] = None
        for raw in ids:
            id = self._check_id(raw)
            out += self._piece_bytes(id, after_bos=(prev is not None and prev == self.bos_id))
            prev = id
        return out.decode("utf-8", errors="replace")

    def _piece_bytes(self, id: int, after_bos: bool) -> bytes:
        if id in (self.bos_id, self.eos_id):
            return b""                            # sequence markers, not text
        if id in self.byte_of_id:
            return bytes([self.byte_of_id[id]])
        piece = self.pieces[id]
        if after_bos and piece.startswith(" "):
            piece = piece[1:]                     # the dummy prefix added by encode
        return piece.encode("utf-8", errors="surrogateescape")

    def id_to_piece(self, id: int) -> str:
        return self.pieces[self._check_id(id)]


# A llama2.c token is at most 1024 bytes (max_token_length, checked below) after 8 bytes of
# score and length; with no vocab_size to go by, a file is refused past 256 MiB (Llama 3's
# 128,256 tokens take under 2 MB).
_MAX_TOKEN_BYTES = 1024
_MAX_VOCAB_FILE_BYTES = 256 << 20


def _read_llama2c_vocab_file(path: Path, vocab_size: Optional[int]) -> bytes:
    """The bytes of a tokenizer.bin: a regular file (a FIFO or a device is refused, not read
    for ever), no longer than vocab_size tokens of the longest length allow."""
    limit = _MAX_VOCAB_FILE_BYTES
    if vocab_size is not None:
        try:
            count = operator.index(vocab_size)
        except TypeError:
            raise TokenizerError(f"vocab_size must be an integer, got {vocab_size!r}") from None
        if count <= 0:
            raise TokenizerError(f"vocab_size must be positive, got {vocab_size}")
        limit = min(limit, 4 + count * (8 + _MAX_TOKEN_BYTES))
    with open_regular(path, "tokenizer file", TokenizerError) as f:
        return read_bounded(f, path, limit, "tokenizer file", TokenizerError)


def _parse_llama2c_vocab(data: bytes, vocab_size: Optional[int],
                         path: Path) -> Tuple[List[str], List[float]]:
    """Split tokenizer.bin into (pieces, scores), with an error naming the broken spot."""
    if vocab_size is not None and vocab_size <= 0:
        raise TokenizerError(f"vocab_size must be positive, got {vocab_size}")
    if len(data) < 4:
        raise TokenizerError(f"{path}: file too short ({len(data)} bytes) for a llama2.c tokenizer")
    (max_len,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_len <= _MAX_TOKEN_BYTES:
        raise TokenizerError(f"{path}: max_token_length={max_len} is implausible; "
                             "is this a llama2.c tokenizer.bin?")
    pieces: List[str] = []
    scores: List[float] = []
    offset = 4
    while (len(pieces) < vocab_size) if vocab_size is not None else (offset < len(data)):
        i = len(pieces)
        if offset + 8 > len(data):
            raise TokenizerError(_truncated(path, i, vocab_size, offset, len(data)))
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if not 0 <= length <= max_len:
            raise TokenizerError(f"{path}: token {i} has length {length} (max_token_length is "
                                 f"{max_len}); the file is corrupt or not a tokenizer")
        if offset + length > len(data):
            raise TokenizerError(_truncated(path, i, vocab_size, offset, len(data)))
        # surrogateescape keeps any non-UTF-8 bytes so decode can give them back exactly.
        pieces.append(data[offset:offset + length].decode("utf-8", errors="surrogateescape"))
        scores.append(score)
        offset += length
    if offset != len(data):
        raise TokenizerError(f"{path}: {len(data) - offset} bytes left after {len(pieces)} tokens; "
                             f"the file holds a different vocabulary size than {vocab_size}")
    return pieces, scores


def _truncated(path: Path, i: int, vocab_size: Optional[int], offset: int, size: int) -> str:
    wanted = f" of {vocab_size}" if vocab_size is not None else ""
    return (f"{path}: truncated tokenizer file: token {i}{wanted} runs past the end "
            f"(offset {offset}, file size {size} bytes)")


def _check_gguf_array(value: Any, kind: Any, kind_name: str, key: str) -> None:
    """TokenizerError unless `value` is a list of `kind` (a bool does not count as an int)."""
    if not isinstance(value, list):
        raise TokenizerError(f"GGUF {key} is {type(value).__name__}, expected an array")
    wrong = next((v for v in value if not isinstance(v, kind) or isinstance(v, bool)), None)
    if wrong is not None:
        raise TokenizerError(f"GGUF {key} holds {wrong!r} ({type(wrong).__name__}); "
                             f"expected an array of {kind_name}")


def _gguf_value(reader: Any, key: str) -> Any:
    """A GGUF metadata value as plain Python (str, int, float or list), None if absent.

    reader: kvlab's GGUFFile (kvlab.loaders.gguf_file, what kvlab.load reads with), whose
    values are plain Python already, or a gguf.GGUFReader, whose ReaderField keeps raw
    parts (`data` lists which parts hold the value(s)), decoded here the same way.
    """
    if not hasattr(reader, "fields"):   # kvlab's reader (importing its class here would
        return reader.value(key)        # make a cycle: kvlab.loaders imports this module)
    field = reader.fields.get(key)
    if field is None:
        return None
    from gguf import GGUFValueType  # only reached with a reader, so gguf is installed
    values = [_gguf_part(field.parts[i], field.types[-1], GGUFValueType) for i in field.data]
    if field.types[0] == GGUFValueType.ARRAY:
        return values
    if field.types[0] == GGUFValueType.FLOAT32:
        # A setting such as rms epsilon reads better as the shortest decimal that gives
        # the same float32: 1e-05 rather than 9.999999747378752e-06.
        return float(str(field.parts[field.data[0]][0]))
    return values[0]


def _gguf_part(part: Any, kind: Any, GGUFValueType: Any) -> Any:
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part[0]
    if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(value)
    if kind == GGUFValueType.BOOL:
        return bool(value)
    return int(value)


# ---------------------------------------------------------------------------------------
# Hugging Face tokenizer.json
# ---------------------------------------------------------------------------------------
# tokenizer.json of real models: a few MB (Llama 3's is 9 MB, Gemma's 34 MB).
_MAX_TOKENIZER_JSON_BYTES = 256 << 20

_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|eot_id|>")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` from tokenizer.json behind kvlab's interface.

    The file's own pipeline does the work (normalizer, pre-tokenizer, model, decoder);
    we only add BOS ourselves, so `encode(bos=False)` means exactly no BOS. Not told,
    encode adds BOS (add_bos), as kvlab always has for these folders.
    """

    add_bos = True

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        path = Path(path)
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError:
            raise TokenizerError("reading tokenizer.json needs the `tokenizers` package: "
                                 "pip install tokenizers") from None
        with open_regular(path, "tokenizer file", TokenizerError) as f:
            raw = read_bounded(f, path, _MAX_TOKENIZER_JSON_BYTES, "tokenizer file",
                               TokenizerError)
        try:
            self._tok = _HFTok.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"cannot read {path}: {exc}") from None
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = self._find_bos_eos(path)
        self.chat_template = _chat_template_beside(path)

    def _find_bos_eos(self, path: Path) -> Tuple[Optional[int], Optional[int]]:
        """BOS/EOS from tokenizer_config.json if present, else from well-known names."""
        named = _special_names_from_config(path.with_name("tokenizer_config.json"))
        bos = self._id_of(named.get("bos_token"), *_BOS_NAMES)
        eos = self._id_of(named.get("eos_token"), *_EOS_NAMES)
        return bos, eos

    def _id_of(self, *names: Optional[str]) -> Optional[int]:
        for name in names:
            if name is not None and self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        return None

    def encode(self, text: str, bos: Optional[bool] = None) -> List[int]:
        _utf8(text)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if self._wants_bos(bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = [self._check_id(i) for i in ids]
        if ids and ids[0] == self.bos_id:
            ids = ids[1:]
        # Special tokens (BOS/EOS/pad) mark structure, not text, as in SentencePieceBPE.
        return self._tok.decode(ids, skip_special_tokens=True)

    def id_to_piece(self, id: int) -> str:
        return self._tok.id_to_token(self._check_id(id)) or ""


def _chat_template_beside(path: Path) -> Optional[str]:
    """A Hugging Face folder's chat template: chat_template.jinja beside tokenizer.json
    (transformers 4.43 on), else tokenizer_config.json's "chat_template" when it is one
    string (a list of named templates is not read); None where there is none."""
    jinja = path.with_name("chat_template.jinja")
    if jinja.is_file():
        with open_regular(jinja, "chat template", TokenizerError) as f:
            return read_bounded(f, jinja, _MAX_TOKENIZER_JSON_BYTES, "chat template",
                                TokenizerError).decode("utf-8", errors="replace")
    config = path.with_name("tokenizer_config.json")
    if not config.exists():
        return None
    template = read_json_object(config, "tokenizer config", TokenizerError).get("chat_template")
    return template if isinstance(template, str) else None


def _special_names_from_config(path: Path) -> Dict[str, str]:
    """bos_token / eos_token spellings from tokenizer_config.json, {} if there is none.
    One that is there but unreadable, not JSON, or spells them as anything but a string,
    an {"content": ...} object or null is a TokenizerError naming the file and field."""
    if not path.exists():
        return {}
    config = read_json_object(path, "tokenizer config", TokenizerError)
    names = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        if isinstance(value, dict):  # older files: {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            names[key] = value
        elif value is not None:
            raise TokenizerError(f"tokenizer config {path}: {key!r} is {short(value)}, "
                                 "expected a token's text")
    return names


def load_tokenizer(path: "str | os.PathLike[str]",
                   vocab_size: Optional[int] = None) -> Tokenizer:
    """A tokenizer from a file: tokenizer.json -> HFTokenizer, otherwise llama2.c format."""
    path = Path(path)
    if path.suffix == ".json":
        return HFTokenizer(path)
    return SentencePieceBPE.from_llama2c_file(path, vocab_size)
