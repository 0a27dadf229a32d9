"""Tests of kvlab.tokenizer: golden stories260K tokenization, GGUF vocab, bytes, bad files.

Checks behaviour against the README's golden ids and against a deliberately naive
re-statement of llama2.c's merge loop; it does not test model loading (test_loaders.py).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import List

import pytest
from hypothesis import given, settings, strategies as st

from kvlab.errors import TokenizerError
from kvlab.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceBPE, load_tokenizer
from time_limit import time_limit  # noqa: E402

# Text without surrogates (they have no UTF-8 form), mixing ASCII words and other scripts.
TEXTS = st.text(alphabet=st.one_of(st.sampled_from("abcdefghijklmnopqrstuvwxyz ,.'\n"),
                                   st.characters(exclude_categories=("Cs",))), max_size=60)


@pytest.fixture(scope="module")
def tok512(shared_models: Path) -> SentencePieceBPE:
    return SentencePieceBPE.from_llama2c_file(shared_models / "stories260K" / "tok512.bin", 512)


@pytest.fixture(scope="module")
def gguf_tok(shared_models: Path) -> SentencePieceBPE:
    gguf = pytest.importorskip("gguf")
    return SentencePieceBPE.from_gguf(gguf.GGUFReader(shared_models / "stories260K" / "stories260K.gguf"))


# ---- golden ------------------------------------------------------------------------------
def test_golden_prompt_encodes(tok512: SentencePieceBPE, golden) -> None:
    assert tok512.encode(golden.prompt) == golden.prompt_ids
    assert tok512.encode(golden.prompt, bos=False) == golden.prompt_ids[1:]
    assert (tok512.bos_id, tok512.eos_id, tok512.vocab_size) == (1, 2, 512)


def test_golden_ids_decode(tok512: SentencePieceBPE, golden) -> None:
    # The generated sequence starts with BOS at position 0; the space after it is dropped.
    assert tok512.decode([1] + golden.ids) == golden.text
    # Without BOS the dummy-prefix space stays (llama2.c semantics: only BOS strips it).
    assert tok512.decode(golden.ids) == " " + golden.text


def test_golden_text_round_trips(tok512: SentencePieceBPE, golden) -> None:
    assert tok512.decode(tok512.encode(golden.text)) == golden.text


def test_pieces_and_byte_fallback(tok512: SentencePieceBPE) -> None:
    assert tok512.id_to_piece(403) == " Once"
    assert tok512.id_to_piece(3 + 0x41) == "<0x41>"
    # "東" is not a piece of this tiny vocab: one byte token per UTF-8 byte (id = byte + 3,
    # as in llama2.c), after the dummy-prefix space " " (id 410).
    assert tok512.encode("東", bos=False) == [410, 0xE6 + 3, 0x9D + 3, 0xB1 + 3]
    assert tok512.decode([1] + tok512.encode("héllo wörld ✓", bos=False)) == "héllo wörld ✓"
    assert tok512.encode("") == [1] and tok512.encode("", bos=False) == []


def test_bos_eos_add_no_text(tok512: SentencePieceBPE) -> None:
    ids = tok512.encode("Hi there", bos=True) + [tok512.eos_id]
    assert tok512.decode(ids) == "Hi there"


def test_bad_ids_raise(tok512: SentencePieceBPE) -> None:
    with pytest.raises(TokenizerError, match="outside"):
        tok512.decode([512])
    with pytest.raises(TokenizerError):
        tok512.id_to_piece(-1)


def test_gguf_vocab_encodes_the_same(tok512: SentencePieceBPE, gguf_tok: SentencePieceBPE, golden) -> None:
    assert gguf_tok.encode(golden.prompt) == golden.prompt_ids
    assert gguf_tok.decode([1] + golden.ids) == golden.text
    assert gguf_tok.encode(golden.text) == tok512.encode(golden.text)
    assert gguf_tok.scores == tok512.scores
    # Only the BOS/EOS spellings differ ("<s>" vs "\n<s>\n"); "▁" became " ".
    differ = [i for i in range(512) if gguf_tok.pieces[i] != tok512.pieces[i]]
    assert differ == [1, 2]
    assert (gguf_tok.bos_id, gguf_tok.eos_id) == (1, 2)


# ---- the fast merge equals llama2.c's rescan loop -----------------------------------------
def naive_llama2c_encode(tok: SentencePieceBPE, text: str) -> List[int]:
    """llama2.c's loop, literally: rescan all pairs, merge the best, repeat."""
    ids = tok._initial_tokens(" " + text if text else "")
    while True:
        best_score, best_i, best_id = -1e10, -1, -1
        for i in range(len(ids) - 1):
            merged = tok.piece_to_id.get(tok.pieces[ids[i]] + tok.pieces[ids[i + 1]])
            if merged is not None and tok.scores[merged] > best_score:
                best_score, best_i, best_id = tok.scores[merged], i, merged
        if best_i == -1:
            return ids
        ids[best_i:best_i + 2] = [best_id]


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_merge_matches_naive_loop(tok512: SentencePieceBPE, text: str) -> None:
    assert tok512.encode(text, bos=False) == naive_llama2c_encode(tok512, text)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS)
def test_round_trip_any_text(tok512: SentencePieceBPE, text: str) -> None:
    assert tok512.decode(tok512.encode(text)) == text


def test_long_text_is_fast(tok512: SentencePieceBPE, golden) -> None:
    text = (golden.text + " Zoë 🙂 ") * 12  # about 4,000 characters
    start = time.perf_counter()
    ids = tok512.encode(text)
    assert time.perf_counter() - start < 1.0
    assert tok512.decode(ids) == text


# ---- llama2.c tokenizer.bin parsing --------------------------------------------------------
def test_truncated_file_raises(shared_models: Path, tmp_path: Path) -> None:
    data = (shared_models / "stories260K" / "tok512.bin").read_bytes()
    for cut in (2, 4, 10, 3000, len(data) - 1):
        path = tmp_path / f"cut{cut}.bin"
        path.write_bytes(data[:cut])
        with pytest.raises(TokenizerError, match="too short|truncated"):
            SentencePieceBPE.from_llama2c_file(path, 512)


def test_wrong_vocab_size_and_garbage_raise(shared_models: Path, tmp_path: Path) -> None:
    source = shared_models / "stories260K" / "tok512.bin"
    with pytest.raises(TokenizerError, match="left after 100 tokens"):
        SentencePieceBPE.from_llama2c_file(source, 100)
    with pytest.raises(TokenizerError, match="truncated"):
        SentencePieceBPE.from_llama2c_file(source, 513)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(TokenizerError, match="implausible"):
        SentencePieceBPE.from_llama2c_file(garbage, 512)
    with pytest.raises(TokenizerError, match="not found"):
        SentencePieceBPE.from_llama2c_file(tmp_path / "absent.bin", 512)


def test_vocab_size_can_be_read_from_the_file(shared_models: Path, golden) -> None:
    tok = load_tokenizer(shared_models / "stories260K" / "tok512.bin")
    assert tok.vocab_size == 512 and tok.encode(golden.prompt) == golden.prompt_ids


# ---- bytes ---------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "naïve café, 東京, 🙂\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.encode(text, bos=False) == ids
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (256, None, None)
    assert tok.decode(tok.encode("ab🙂")[:-1]) == "ab\ufffd"  # a cut-off character
    assert tok.id_to_piece(65) == "A" and tok.id_to_piece(10) == "<0x0A>"
    with pytest.raises(TokenizerError):
        tok.decode([256])


@settings(max_examples=100, deadline=None)
@given(text=TEXTS)
def test_byte_tokenizer_round_trip_any_text(text: str) -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_surrogates_are_rejected() -> None:
    with pytest.raises(TokenizerError, match="UTF-8"):
        ByteTokenizer().encode("\ud800")


# ---- Hugging Face tokenizer.json -------------------------------------------------------------
def test_hf_tokenizer(tmp_path: Path, write_tokenizer_json) -> None:
    tok = HFTokenizer(write_tokenizer_json(tmp_path))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 5)
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.encode("hello world", bos=False) == [3, 4]
    assert tok.decode([1, 3, 4, 2]) == "hello world"
    assert tok.id_to_piece(4) == "world"
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("world") == [1, 4]


def test_hf_tokenizer_without_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(TokenizerError, match="pip install tokenizers"):
        HFTokenizer(path)


def test_vocab_without_byte_pieces_uses_unk() -> None:
    tok = SentencePieceBPE(["<unk>", "<s>", "</s>", " ", "a", "b", " a", "ab"],
                           [0, 0, 0, -1, -1, -1, -2, -3])
    assert tok.encode("ab", bos=False) == [6, 5]     # " a" (score -2) beats "ab" (-3)
    assert tok.encode("ax", bos=False) == [6, 0]     # "x" has no piece and no byte piece
    assert tok.decode([1, 6, 5]) == "ab"


# ---- files that are not files, values of the wrong type (issue 18) ------------------------------


def not_a_file(path: Path, kind: str) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/null")    # reads as empty: safe even where it is not refused
    else:
        path.mkdir()
    return path


KINDS = {"fifo": "named pipe", "device": "character device", "folder": "folder"}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes and /dev/null")
@pytest.mark.parametrize("kind", KINDS)
def test_tokenizer_paths_that_are_not_regular_files(tmp_path: Path, kind: str) -> None:
    """Before: a FIFO hung for ever, a device was read (without end, for /dev/zero)."""
    path = not_a_file(tmp_path / "tok.bin", kind)
    for read in (lambda: SentencePieceBPE.from_llama2c_file(path, 512),
                 lambda: load_tokenizer(path), lambda: load_tokenizer(path, 512)):
        with time_limit(10), pytest.raises(TokenizerError, match=f"{path} is a {KINDS[kind]}"):
            read()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes and /dev/null")
@pytest.mark.parametrize("kind", KINDS)
def test_hf_tokenizer_files_that_are_not_regular_files(tmp_path: Path, kind: str,
                                                       write_tokenizer_json) -> None:
    (tmp_path / "a").mkdir()
    path = not_a_file(tmp_path / "a" / "tokenizer.json", kind)
    with time_limit(10), pytest.raises(TokenizerError, match=f"{path} is a {KINDS[kind]}"):
        HFTokenizer(path)
    # the tokenizer_config.json beside a good tokenizer.json
    good = write_tokenizer_json(tmp_path / "b")
    config = not_a_file(tmp_path / "b" / "tokenizer_config.json", kind)
    with time_limit(10), pytest.raises(TokenizerError, match=f"{config} is a {KINDS[kind]}"):
        HFTokenizer(good)


@pytest.mark.parametrize("text, match", [
    ("[]", "must hold a JSON object, found list"),             # was AttributeError
    ('{"bos_token": 5}', "'bos_token' is 5"),                  # was silently ignored
    ('{"eos_token": ["</s>"]}', "'eos_token' is an array"),
    ("{not json", "cannot read tokenizer config"),
])
def test_tokenizer_config_of_the_wrong_shape(tmp_path: Path, write_tokenizer_json,
                                            text: str, match: str) -> None:
    path = write_tokenizer_json(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(text)
    with pytest.raises(TokenizerError, match=match):
        HFTokenizer(path)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": {"content": "<s>"}, '
                                                    '"eos_token": null}')
    assert HFTokenizer(path).bos_id == 1


def test_tokenizer_vocab_size_of_the_wrong_type(shared_models: Path) -> None:
    path = shared_models / "stories260K" / "tok512.bin"
    with pytest.raises(TokenizerError, match="vocab_size must be an integer"):
        SentencePieceBPE.from_llama2c_file(path, "512")         # was TypeError
    with pytest.raises(TokenizerError, match="vocab_size must be positive"):
        SentencePieceBPE.from_llama2c_file(path, 0)
