"""Tests of kvlab.gguf_tokenizer: GGUF vocabularies built with the tokenizers package.

The oracle is transformers' own GGUF conversion, AutoTokenizer.from_pretrained(folder,
gguf_file=name), loaded once per file for the module (offline: it needs only the file).
Files: SmolLM2-135M-Instruct ('gpt2', pre 'smollm'; the smollm2_path fixture), stories260K
and a 32,000-token Llama 2 vocabulary ('llama', in ../shared/models). Each skips by itself
where its file is absent.

Where kvlab and transformers differ, kvlab follows SentencePiece and llama.cpp; the tests
below say so, one place each (test_llama_*_differs_from_transformers).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import List

import numpy as np
import pytest

import kvlab
from kvlab.errors import CheckpointError, TokenizerError
from kvlab.gguf_tokenizer import PRE_TOKENIZERS, GGUFTokenizer, UnsupportedVocabulary, from_gguf
from kvlab.loaders import load_checkpoint
from kvlab.loaders.gguf_writer import add_llama_config
from kvlab.tokenizer import SentencePieceBPE

gguf = pytest.importorskip("gguf")

# Text of every kind a tokenizer can get wrong. None starts with a space (see
# test_llama_leading_space_differs_from_transformers for those).
TEXTS = [
    "Hello world! 123",
    "Once upon a time, there was a little girl named Lily.",
    "Café déjà vu, naïve façade, Ünïcödé, straße, ÆØÅ æøå",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷 and a lone ZWJ \u200d",
    "31415926535897932384626433832795 and 1,000,000.00 and 0x1F and 2024-06-01",
    "def f(x):\n    if x > 0:\n        return x ** 2  # square\n\treturn -x\n",
    "class A:\n    '''Doc.'''\n\n    def __init__(self):\n        self.a = {'k': [1, 2]}\n",
    "runs   of    spaces     and\t\ttabs\t \t and\n\n\nnewlines\r\n\r\nend",
    "trailing spaces   ",
    "I'm sure they'll say it's John's, we've seen we'd",
    "x",
    "",
]
# Special tokens written inside the text, per vocabulary.
SPECIAL_TEXTS = {
    "gpt2": ["<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
             "text<|endoftext|>more text", "<|im_start|><|im_end|>", "a <|im_end|> b"],
    "llama": ["<s>Hello</s>", "Hello</s>", "a </s> b <unk> c"],
}


def shared_file(shared_models: Path, name: str) -> Path:
    path = shared_models / name
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


def hf_tokenizer(path: Path, tmp: Path):
    """transformers' GGUF conversion of `path`, read with the network off."""
    transformers = pytest.importorskip("transformers")
    data = path.read_bytes()
    # transformers (5.x) indexes the token list with padding_token_id even when it is
    # 0xFFFFFFFF (GGUF's "none"): IndexError. Hide the key in a copy, same length.
    key = b"tokenizer.ggml.padding_token_id"
    if _gguf_value_of(path, key.decode()) == 0xFFFFFFFF:
        data = data.replace(key, b"tokenizer.ggml.padding_token_xx")
    (tmp / path.name).write_bytes(data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoTokenizer.from_pretrained(str(tmp), gguf_file=path.name)


def _gguf_value_of(path: Path, key: str):
    from kvlab.tokenizer import _gguf_value
    return _gguf_value(gguf.GGUFReader(path), key)


class Pair:
    """kvlab's tokenizer and transformers' for one file."""

    def __init__(self, path: Path, tmp: Path) -> None:
        self.path = path
        self.reader = gguf.GGUFReader(path)
        self.ours: GGUFTokenizer = from_gguf(self.reader)
        self.hf = hf_tokenizer(path, tmp)

    def hf_ids(self, text: str) -> List[int]:
        return list(self.hf(text)["input_ids"])   # its own BOS convention (add_bos_token)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path, tmp_path_factory) -> Pair:
    return Pair(smollm2_path, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module", params=["stories260K/stories260K.gguf",
                                        "llama2-tiny-random-gguf/llama-2-tiny-random.gguf"])
def llama(request, shared_models, tmp_path_factory) -> Pair:
    return Pair(shared_file(shared_models, request.param), tmp_path_factory.mktemp("llama"))


# ---- SmolLM2: 'gpt2' byte-level BPE, pre-tokenizer 'smollm' -------------------------------
def test_smollm2_metadata(smollm2_pair: Pair) -> None:
    tok = smollm2_pair.ours
    assert (tok.model, tok.pre, tok.vocab_size) == ("gpt2", "smollm", 49152)
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (1, 2, 0, 2)
    assert tok.add_bos is False and tok.add_eos is False
    assert tok.special_tokens["<|im_start|>"] == 1 and tok.special_tokens["<|im_end|>"] == 2
    assert tok.special_ids == frozenset(range(17))
    assert "<|im_start|>" in tok.chat_template
    assert tok.id_to_piece(28) == "," and tok.id_to_piece(1) == "<|im_start|>"


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS["gpt2"])
def test_smollm2_matches_transformers(smollm2_pair: Pair, text: str) -> None:
    ids = smollm2_pair.ours.encode(text)
    assert ids == smollm2_pair.hf_ids(text)           # neither adds BOS: add_bos_token is false
    assert smollm2_pair.ours.decode(ids, skip_special=False) == text
    assert smollm2_pair.ours.decode(ids) == smollm2_pair.hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS + [" leading space", "  two", "\tx"])
def test_smollm2_round_trips(smollm2_pair: Pair, text: str) -> None:
    assert smollm2_pair.ours.decode(smollm2_pair.ours.encode(text)) == text
    assert smollm2_pair.ours.encode(text) == smollm2_pair.hf_ids(text)


def test_smollm2_special_tokens_and_bos(smollm2_pair: Pair) -> None:
    tok = smollm2_pair.ours
    assert tok.encode("<|im_start|>user") == [1, 4093]          # one id, not its characters
    assert tok.encode("hi", bos=True) == [1] + tok.encode("hi")  # forced
    assert tok.decode([1, 4093, 2]) == "user"                    # control tokens skipped
    assert tok.decode([1, 4093, 2], skip_special=False) == "<|im_start|>user<|im_end|>"


# ---- 'llama' SentencePiece vocabularies ----------------------------------------------------
@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_llama_matches_transformers(llama: Pair, text: str) -> None:
    ids = llama.ours.encode(text)
    assert ids[0] == llama.ours.bos_id == 1                      # both add BOS
    assert ids == llama.hf_ids(text)
    assert llama.ours.decode(ids) == text == llama.hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS + [" leading", "  two leading", "\n\nx", "   "])
def test_llama_matches_the_readable_tokenizer(llama: Pair, text: str) -> None:
    """The library pipeline gives the ids of kvlab's llama2.c re-statement, texts with a
    leading space included, and decodes back to the text."""
    ids = llama.ours.encode(text)
    assert ids == SentencePieceBPE.from_gguf(llama.reader).encode(text)
    assert llama.ours.decode(ids) == text


def test_llama_empty_text(llama: Pair) -> None:
    assert llama.ours.encode("") == [1] == llama.hf_ids("")
    assert llama.ours.encode("", bos=False) == []


@pytest.mark.parametrize("text", [" 12345 x", "  two spaces", " a"])
def test_llama_leading_space_differs_from_transformers(llama: Pair, text: str) -> None:
    """SentencePiece (and llama.cpp, and llama2.c) always put the dummy "▁" in front, so
    " a" is "▁▁a". transformers' Metaspace does not when the text already starts with one,
    so " a" is "▁a" there, the same ids as "a", and decoding loses the space. We follow
    SentencePiece: the ids stay apart and the text round-trips."""
    ours, theirs = llama.ours.encode(text), llama.hf_ids(text)
    assert theirs == llama.ours.encode(text[1:])                 # transformers: one "▁" less
    assert ours != theirs and llama.ours.decode(ours) == text
    assert llama.hf.decode(theirs, skip_special_tokens=True) == text[1:]


@pytest.mark.parametrize("text", SPECIAL_TEXTS["llama"])
def test_llama_text_after_a_special_token_differs_from_transformers(llama: Pair, text: str) -> None:
    """Special tokens in the text are single ids in both. llama.cpp then tokenizes each
    stretch of text between them as a text of its own, with its own dummy "▁" ("</s> b" ->
    "</s>", "▁b"); transformers adds the "▁" only at the very start ("b")."""
    tok = llama.ours
    ids = tok.encode(text)
    pieces, at = [], 0     # rebuild the ids from the fragments, llama.cpp's way
    while at < len(text):
        name = next((s for s in tok.special_tokens if text.startswith(s, at)), None)
        if name is not None:
            pieces.append(tok.special_tokens[name])
            at += len(name)
            continue
        end = min((text.find(s, at) for s in tok.special_tokens if text.find(s, at) >= 0),
                  default=len(text))
        pieces += tok.encode(text[at:end], bos=False)
        at = end
    assert ids == [1] + pieces
    theirs = llama.hf_ids(text)
    assert [i for i in theirs if i in tok.special_ids] == [i for i in ids if i in tok.special_ids]


# ---- the loader ----------------------------------------------------------------------------
SMALL = kvlab.ModelConfig(dim=16, hidden_dim=24, n_layers=1, n_heads=2, n_kv_heads=1,
                          vocab_size=10, max_seq_len=16)
# A byte-level vocabulary of 10 tokens: "Ġ" is a space, "abc" is in the vocabulary but no
# merge makes it (only llama-bpe's ignore_merges finds it whole).
GPT2_TOKENS = ["<|endoftext|>", "<|im_start|>", "a", "b", "c", "Ġ", "ab", "Ġa", "abc", "1"]
GPT2_MERGES = ["a b", "Ġ a"]


def write_vocab_gguf(path: Path, model: str = "gpt2", tokens=GPT2_TOKENS, merges=GPT2_MERGES,
                     pre="smollm", types=None, **extra) -> Path:
    """A one-layer llama model of SMALL's sizes whose vocabulary is what the arguments say
    (None leaves a key out; extra: more tokenizer.ggml.* keys)."""
    writer = gguf.GGUFWriter(path, "llama")
    add_llama_config(writer, SMALL)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    if tokens is not None:
        writer.add_token_list(tokens)
        writer.add_token_types(types if types is not None else [3, 3] + [1] * (len(tokens) - 2))
    if merges is not None:
        writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    for key, value in extra.items():
        if isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, list):
            writer.add_array(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
    weights = kvlab.Weights.random(SMALL)
    writer.add_tensor("token_embd.weight", weights.token_embedding)
    writer.add_tensor("output_norm.weight", weights.final_norm)
    for key, name in [("attn_norm", "attn_norm"), ("wq", "attn_q"), ("wk", "attn_k"),
                      ("wv", "attn_v"), ("wo", "attn_output"), ("ffn_norm", "ffn_norm"),
                      ("w1", "ffn_gate"), ("w2", "ffn_down"), ("w3", "ffn_up")]:
        writer.add_tensor(f"blk.0.{name}.weight", np.ascontiguousarray(getattr(weights, key)[0]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gpt2_vocabulary_loads_and_adds_no_bos(tmp_path: Path) -> None:
    config, weights, tok = load_checkpoint(write_vocab_gguf(tmp_path / "m.gguf"))
    assert isinstance(tok, GGUFTokenizer) and tok.add_bos is False
    assert tok.encode("ab a<|im_start|>") == [6, 7, 1]
    model = kvlab.Model(config, weights, tokenizer=tok)
    assert model.encode("ab") == [6] and model.encode("ab", bos=True) == [1, 6]
    assert kvlab.generate(model, "ab", max_new_tokens=2).prompt_tokens == [6]


def test_llama_bpe_takes_whole_words_and_adds_bos(tmp_path: Path) -> None:
    """llama.cpp's Llama 3 settings: a word that is a token is that token (ignore_merges),
    and BOS unless the file says otherwise."""
    smollm = load_checkpoint(write_vocab_gguf(tmp_path / "s.gguf"))[2]
    llama3 = load_checkpoint(write_vocab_gguf(tmp_path / "l.gguf", pre="llama-bpe"))[2]
    assert smollm.encode("abc") == [6, 4] and llama3.encode("abc") == [1, 8]
    no_bos = write_vocab_gguf(tmp_path / "n.gguf", pre="llama-bpe", add_bos_token=False)
    assert load_checkpoint(no_bos)[2].encode("abc") == [8]


def test_pre_tokenizer_words() -> None:
    """Each pre-tokenizer's regexes cut a text where llama.cpp's do (worked by hand from
    llama-vocab.cpp's regexes: digits, contractions, punctuation runs, newlines)."""
    from tokenizers import Regex, pre_tokenizers
    text = "I'm 12345 ab!!\n\n  x"
    words = {pre: [w for w, _ in pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    ).pre_tokenize_str(text)] for pre, patterns in PRE_TOKENIZERS.items()}
    assert words["gpt-2"] == ["I", "'m", " 12345", " ab", "!!", "\n\n ", " x"]
    assert words["smollm"] == ["I", "'m", " ", "1", "2", "3", "4", "5", " ab", "!!", "\n\n ", " x"]
    assert words["llama-bpe"] == ["I", "'m", " ", "123", "45", " ab", "!!\n\n", " ", " x"]
    assert words["qwen2"] == ["I", "'m", " ", "1", "2", "3", "4", "5", " ab", "!!\n\n", " ", " x"]
    assert words["default"] == ["I", "'", "m", " ", "123", "45", " ab", "!!", "\n\n ", " x"]


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv"])
def test_unsupported_vocabulary_warns_and_loads_without_one(tmp_path: Path, model: str) -> None:
    path = write_vocab_gguf(tmp_path / "m.gguf", model=model)
    with pytest.warns(UserWarning, match=f"tokenizer.ggml.model '{model}' is not supported") as got:
        _, _, tok = load_checkpoint(path)
    assert tok is None and len(got) == 1 and "\n" not in str(got[0].message)


def test_unknown_pre_tokenizer_is_named(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "m.gguf", pre="deepseek-llm")
    with pytest.raises(UnsupportedVocabulary, match="'deepseek-llm'.*default, gpt-2, llama-bpe"):
        from_gguf(gguf.GGUFReader(path))
    with pytest.warns(UserWarning, match="pre 'deepseek-llm' is not supported"):
        assert load_checkpoint(path)[2] is None


@pytest.mark.parametrize("change, message", [
    (dict(merges=["a b", "a z"]), r"merges\[1\] \('a z'\) makes 'z', which is not in"),
    (dict(merges=["a b", "b c"]), r"merges\[1\] \('b c'\) makes 'bc', which is not in"),
    (dict(merges=["a b", "ab"]), r"merges\[1\] is 'ab', expected two tokens"),
    (dict(merges=["a b", "a  b"]), r"merges\[1\] is 'a  b', expected two tokens"),
    (dict(merges=[1, 2]), r"tokenizer.ggml.merges holds 1 \(int\); expected an array of strings"),
    (dict(merges=None), "lacks tokenizer.ggml.merges"),
    (dict(types=[3, 3, 1]), "token_type has 3 entries but tokenizer.ggml.tokens has 10"),
    (dict(tokens=GPT2_TOKENS[:-1] + ["a"]), r"lists 'a' twice \(ids 2 and 9\)"),
    (dict(bos_token_id=99), "bos_token_id is 99, outside the vocabulary"),
    (dict(add_bos_token=1), "add_bos_token is 1, expected true or false"),
])
def test_corrupt_vocabulary_is_refused_by_key(tmp_path: Path, change: dict, message: str) -> None:
    change = dict(change)
    if "bos_token_id" in change:   # written by write_vocab_gguf: replace it in the bytes
        path = write_vocab_gguf(tmp_path / "m.gguf")
        data = bytearray(path.read_bytes())
        key = b"tokenizer.ggml.bos_token_id"
        at = data.index(key) + len(key) + 4          # after the key and the value type
        data[at:at + 4] = change.pop("bos_token_id").to_bytes(4, "little")
        path.write_bytes(bytes(data))
    else:
        path = write_vocab_gguf(tmp_path / "m.gguf", **change)
    with pytest.raises(TokenizerError, match=message):
        from_gguf(gguf.GGUFReader(path))
    with pytest.raises(CheckpointError, match="embedded vocabulary is unusable: .*" + message):
        load_checkpoint(path)


def test_corrupt_model_name_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "m.gguf", model="gpt2")
    data = path.read_bytes()
    # tokenizer.ggml.model's value type STRING (8) -> UINT32 (4) reading the length's first bytes
    key = b"tokenizer.ggml.model"
    at = data.index(key) + len(key)
    data = data[:at] + (4).to_bytes(4, "little") + data[at + 4:]
    path.write_bytes(data)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_bos_default_follows_each_tokenizer() -> None:
    """encode(text) without bos=: each tokenizer's own add_bos. The llama2.c tokenizer and
    tokenizer.json folders add BOS as before; bytes have none."""
    assert SentencePieceBPE.add_bos is True and kvlab.tokenizer.HFTokenizer.add_bos is True
    assert kvlab.tokenizer.ByteTokenizer().encode("ab") == [97, 98]
    model = kvlab.load()
    assert model.encode("ab") == model.tokenizer.encode("ab", bos=True)


def test_llama_any_text_matches_the_readable_tokenizer(shared_models: Path) -> None:
    """On any text (hypothesis draws them), the library pipeline of stories260K's vocabulary
    gives the readable llama2.c tokenizer's ids and decodes back to the text."""
    from hypothesis import assume, given, settings, strategies as st
    reader = gguf.GGUFReader(shared_file(shared_models, "stories260K/stories260K.gguf"))
    ours, readable = from_gguf(reader), SentencePieceBPE.from_gguf(reader)

    @settings(max_examples=300, deadline=None)
    @given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
           | st.text("ab \n\t.,'0123456789éü日🙂<>/", max_size=60))
    def check(text: str) -> None:
        # the readable tokenizer spells special tokens out: texts without them
        assume(not any(name in text for name in ours.special_tokens))
        ids = ours.encode(text)
        assert ids == readable.encode(text)
        assert ours.decode(ids) == text

    check()
