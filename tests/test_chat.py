"""kvlab.chat: chat templates, and a conversation whose cache is kept across turns.

Most tests use the bundled model with a small template of its own (it was trained on plain
Shakespeare, so its answers are nonsense, but the bookkeeping is the same); the real chat
model's tests take the `smollm2` fixture and skip where it cannot be fetched."""
from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab import TokenizerError
from kvlab.chat import Chat, check_messages, end_of_turn_id, render
from kvlab.tokenizer import ByteTokenizer

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# For the bundled byte-level model: short markers, so that turns stay small.
PLAIN = ("{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}A:{% endif %}")


class TemplatedBytes(ByteTokenizer):
    """The bundled model's byte tokenizer, with a chat template and an end-of-turn token
    (the newline byte)."""
    chat_template = PLAIN
    eos_id = 10


@pytest.fixture(scope="module")
def model():
    m = kvlab.load()
    m.tokenizer = TemplatedBytes()
    return m


def test_render_is_the_chatml_text():
    text = render(CHATML, [{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(CHATML, [{"role": "user", "content": "Hi"}], add_generation_prompt=False) \
        == "<|im_start|>user\nHi<|im_end|>\n"


def test_render_trims_blocks_as_transformers_does():
    template = "{% for m in messages %}\n  {{ m['content'] }}\n{% endfor %}"
    assert render(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) \
        == "  a\n  b\n"


def test_a_template_cannot_reach_python():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TokenizerError, match="cannot be rendered"):
        render(evil, [{"role": "user", "content": "x"}])


def test_a_template_may_refuse_a_conversation():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(TokenizerError, match="user first"):
        render(template, [{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("messages, error, words", [
    ("hello", TypeError, "list of"),
    ([], ValueError, "empty"),
    (["hello"], TypeError, r"messages\[0\] is a str"),
    ([{"role": "robot", "content": "x"}], ValueError, "'role'"),
    ([{"role": "user", "content": 3}], TypeError, "'content'"),
    ([{"role": "user"}], TypeError, "'content'"),
])
def test_bad_messages_are_named(messages, error, words):
    with pytest.raises(error, match=words):
        check_messages(messages)


def test_generate_with_messages_stops_at_the_end_of_turn(model):
    out = kvlab.generate(model, messages=[{"role": "user", "content": "Speak"}], max_new_tokens=60)
    assert out.prompt == "U:Speak\nA:"
    assert out.prompt_tokens == list(b"U:Speak\nA:")
    assert 10 not in out.tokens
    assert out.finish_reason == ("eos" if len(out.tokens) < 60 else "length")


def test_generate_takes_a_prompt_or_messages_not_both(model):
    with pytest.raises(TypeError, match="not both"):
        kvlab.generate(model, "x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(TypeError, match="needs a prompt"):
        kvlab.generate(model)


def test_a_model_without_a_template_is_refused_by_name():
    plain = kvlab.load()
    with pytest.raises(TokenizerError, match="no chat template"):
        kvlab.generate(plain, messages=[{"role": "user", "content": "y"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        Chat(plain)


def test_each_turn_prefills_only_what_the_cache_lacks(model):
    chat = Chat(model, max_seq_len=512)
    first = chat.send("Speak", max_new_tokens=12)
    assert first.reused == 0 and first.prefilled == first.prompt_tokens
    second = chat.send("Again", max_new_tokens=12)
    # the whole first turn is reused, up to where the new text begins
    earlier = len("U:Speak\nA:") + len(first.reply)
    assert second.reused >= earlier - 1
    assert second.prefilled == second.prompt_tokens - second.reused
    assert chat.cache.length == len(chat.tokens)
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2


def test_a_kept_cache_answers_as_a_fresh_run_does(model):
    """The cache is exact: the second turn's answer, over the first turn's cached rows, is
    the answer generate gives to the whole conversation from scratch."""
    chat = Chat(model, max_seq_len=512)
    chat.send("Speak", max_new_tokens=12)
    turn = chat.send("Again", max_new_tokens=12)
    fresh = kvlab.generate(model, messages=chat.messages[:-1], max_new_tokens=12)
    assert turn.tokens == fresh.tokens and turn.reply == fresh.completion


def test_sampled_turns_follow_the_seed(model):
    runs = []
    for _ in range(2):
        chat = Chat(model, max_seq_len=512)
        runs.append(chat.send("Speak", 20, temperature=0.9, seed=5).tokens)
    assert runs[0] == runs[1]


def test_stream_gives_the_reply_piece_by_piece(model):
    pieces = []
    turn = Chat(model, max_seq_len=512).send("Speak", 30, stream=pieces.append)
    assert "".join(pieces) == turn.reply and len(pieces) > 1


def test_a_failed_turn_changes_nothing(model):
    chat = Chat(model, max_seq_len=64)
    chat.send("Hi", max_new_tokens=4)
    before = (list(chat.messages), list(chat.tokens), chat.cache.length)
    with pytest.raises(kvlab.ContextLengthError, match="reset"):
        chat.send("x" * 80, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        chat.send("Hi", max_new_tokens=0)
    with pytest.raises(TypeError):
        chat.send(b"bytes")
    assert (chat.messages, chat.tokens, chat.cache.length) == before


def test_an_interrupted_turn_keeps_only_the_earlier_ones(model, monkeypatch):
    chat = Chat(model, max_seq_len=512)
    chat.send("Hi", max_new_tokens=4)
    before = (list(chat.messages), list(chat.tokens))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "decode_steps", interrupted)
    with pytest.raises(KeyboardInterrupt):
        chat.send("Again", max_new_tokens=8)
    monkeypatch.undo()
    assert (chat.messages, chat.tokens) == before
    assert chat.cache.length <= len(chat.tokens)
    # and the next turn still answers as a fresh run does
    turn = chat.send("Again", max_new_tokens=8)
    fresh = kvlab.generate(model, messages=chat.messages[:-1], max_new_tokens=8)
    assert turn.tokens == fresh.tokens


def test_reset_starts_again(model):
    chat = Chat(model, max_seq_len=512)
    chat.send("Hi", max_new_tokens=4)
    chat.reset()
    assert chat.messages == [] and chat.cache.length == 0
    assert chat.send("Hi", max_new_tokens=4).reused == 0


def test_a_system_prompt_comes_first(model):
    chat = Chat(model, system="Be brief", max_seq_len=512)
    assert chat.conversation("Hi")[0] == {"role": "system", "content": "Be brief"}
    turn = chat.send("Hi", max_new_tokens=4)
    assert turn.prompt_tokens == len("S:Be brief\nU:Hi\nA:")


def test_end_of_turn_prefers_the_templates_marker():
    class Fake(ByteTokenizer):
        eos_id = 7

        def encode(self, text, bos=None):
            return [3] if text == "<|im_end|>" else list(text.encode())

    assert end_of_turn_id(Fake()) == 3
    assert end_of_turn_id(TemplatedBytes()) == 10     # no marker: the EOS


# ---- the real chat model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_fp32_activations(smollm2_path):
    """SmolLM2 as `kvlab chat` runs it: float32 activations (int8 ones, llama.cpp's way,
    answer "L'Étoile, ..." to this question, as llama.cpp does on the same file: the
    answer's first token is a near tie that their rounding flips)."""
    return kvlab.load(smollm2_path, activations="fp32")


def test_smollm2_has_its_chat_template(smollm2):
    assert "<|im_start|>" in smollm2.tokenizer.chat_template
    assert end_of_turn_id(smollm2.tokenizer) == 2          # <|im_end|>
    text, ids = kvlab.chat.prompt(smollm2, [{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(1) == 3               # <|im_start|> as one token, 3 times


def test_smollm2_chat_answers_and_reuses_its_cache(smollm2_fp32_activations):
    smollm2 = smollm2_fp32_activations
    chat = Chat(smollm2, max_seq_len=512)
    first = chat.send("What is the capital of France?", max_new_tokens=24)
    assert "Paris" in first.reply and first.finish_reason == "eos"
    second = chat.send("And of Germany?", max_new_tokens=24)
    assert second.reused >= first.prompt_tokens + len(first.tokens) - 1
    fresh = kvlab.generate(smollm2, messages=chat.messages[:-1], max_new_tokens=24)
    assert second.tokens == fresh.tokens


# ---- a template is untrusted input ------------------------------------------------------------

@pytest.mark.parametrize("template, words", [
    ("{% for i in range(100000) %}{% for j in range(300) %}{% endfor %}{% endfor %}", "steps"),
    ("{{ ('x' * 10**8) | length }}", "repeats"),
    ("{{ 2 ** 100000000 }}", "power"),
    ("{% for i in range(100000) %}{{ 'abcdefghijklmnop' }}{% endfor %}", "characters"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for %}", "TemplateSyntaxError"),
])
def test_a_template_that_runs_away_is_stopped_by_name(template, words):
    with pytest.raises(TokenizerError, match=words):
        render(template, [{"role": "user", "content": "x"}])


def test_a_template_that_renders_nothing_is_refused(model, monkeypatch):
    monkeypatch.setattr(TemplatedBytes, "chat_template", "{% if false %}x{% endif %}")
    with pytest.raises(TokenizerError, match="no text"):
        kvlab.generate(model, messages=[{"role": "user", "content": "y"}])
    with pytest.raises(TokenizerError, match="no text"):
        Chat(model).send("y")


def test_a_turn_failing_mid_answer_after_cutting_the_cache_back(model):
    """The new prompt shares only part of the cached turns (the system prompt changed), so
    the cache is cut back before the answer starts; the stream then fails part-way. The
    conversation and the cache stay as they were up to the shared part, and the next turn
    is a fresh run's answer."""
    chat = Chat(model, system="Be brief", max_seq_len=512)
    chat.send("Speak", max_new_tokens=12)
    before = list(chat.messages)
    chat.system = "Be long"

    def fails_after_two(piece, seen=[]):
        seen.append(piece)
        if len(seen) == 2:
            raise RuntimeError("the notebook cell was stopped")

    with pytest.raises(RuntimeError):
        chat.send("Again", max_new_tokens=40, stream=fails_after_two)
    assert chat.messages == before
    assert chat.cache.length == len(chat.tokens) <= len("S:Be ")
    turn = chat.send("Again", max_new_tokens=12)
    fresh = kvlab.generate(model, messages=chat.conversation()[:-1], max_new_tokens=12)
    assert turn.tokens == fresh.tokens


def test_a_hugging_face_folder_brings_its_chat_template(tmp_path, write_tokenizer_json):
    from kvlab.tokenizer import HFTokenizer
    path = write_tokenizer_json(tmp_path / "tok")
    assert HFTokenizer(path).chat_template is None
    (path.parent / "chat_template.jinja").write_text(CHATML)
    assert HFTokenizer(path).chat_template == CHATML


def test_kvlab_chat_refuses_a_model_without_a_template_in_cli_words(capsys):
    from kvlab.cli import main
    assert main(["chat", "--model", str(kvlab.DEFAULT_MODEL)]) == 2
    assert "kvlab generate --model" in capsys.readouterr().err


def test_kvlab_chat_says_which_options_make_room(model, monkeypatch, capsys):
    from kvlab import cli
    monkeypatch.setattr(cli, "_load", lambda args, needs_tokenizer=False: model)
    lines = iter(["Speak", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    assert cli.main(["chat", "--context", "20", "--max-new-tokens", "30"]) == 0
    err = capsys.readouterr().err
    assert "--context" in err and "--max-new-tokens" in err and "/reset" in err
