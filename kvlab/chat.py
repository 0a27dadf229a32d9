"""Chat: a model's chat template, and a conversation that keeps its KV cache across turns.

A chat model is trained on conversations written in one fixed layout, its chat template
(a Jinja template stored with the model: tokenizer.chat_template in a GGUF file). SmolLM2's
is ChatML:

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    What is a KV cache?<|im_end|>
    <|im_start|>assistant

and the model answers until it writes <|im_end|>, its end-of-turn token.

Every turn re-sends the whole conversation, so each prompt starts with the previous one:
the system prompt, the earlier questions and answers. That is the course's prefix reuse in
its most common real form. `Chat` keeps one KV cache for the conversation and, for each new
turn, prefills only the tokens after the longest prefix the cache already holds (the new
user message and the template's markers around it); `Turn.reused` and `Turn.prefilled` say
how many tokens each side took.

render() renders a template as Hugging Face transformers does (jinja2's sandbox, trimmed
blocks, `raise_exception`, `tojson`), so the text, and so the tokens, are the ones the model
was trained on. Not here: the tokenizer (kvlab.tokenizer, kvlab.gguf_tokenizer) and the
generation loop of one prompt (kvlab.generate, which takes messages= too).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import arguments
from .errors import ContextLengthError, TokenizerError
from .sampling import check_sampling_args, check_seed, sample

Message = Dict[str, str]          # {"role": "user", "content": "..."}
ROLES = ("system", "user", "assistant")
# The end-of-turn markers of the common chat formats (ChatML, Llama 3, Gemma, Phi-3): the
# first one the vocabulary holds as a single token ends an answer; else the EOS token does.
END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


# ---- the template ----------------------------------------------------------------------------

# A template comes with a downloaded model file, so it is untrusted input: jinja2's sandbox
# keeps it from reaching Python objects, and these bounds keep it from running for ever or
# filling memory (the sandbox bounds one range() only). Real templates use a few hundred
# loop steps and write a few kilobytes.
MAX_TEMPLATE_STEPS = 1_000_000      # items all of a render's range() calls may give, together
MAX_RENDERED_CHARS = 1 << 20        # the rendered text, and any string or list it builds
MAX_POWER_EXPONENT = 256


def render(template: str, messages: Sequence[Message], add_generation_prompt: bool = True,
           **variables) -> str:
    """The conversation as the text the template makes of it. add_generation_prompt ends
    it with the opening of the assistant's turn, where the model is to go on. `variables`
    are passed to the template as well (bos_token, eos_token ...). TokenizerError for a
    template that fails, refuses the conversation, or passes the bounds above."""
    check_messages(messages)
    add_generation_prompt = arguments.flag(add_generation_prompt, "add_generation_prompt")
    if not isinstance(template, str):
        raise TokenizerError(f"a chat template is a str, got {type(template).__name__}")
    try:
        env = _sandbox()
    except ImportError:
        raise TokenizerError("rendering a chat template needs jinja2: pip install jinja2") from None
    text, size = [], 0
    try:
        compiled = env.from_string(template)
        # generate() gives the text piece by piece, so an endless output stops at the bound
        for piece in compiled.generate(messages=[dict(m) for m in messages],
                                       add_generation_prompt=add_generation_prompt, **variables):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise _TooBig(f"it writes more than {MAX_RENDERED_CHARS:,} characters")
            text.append(piece)
    except TokenizerError:
        raise                  # raise_exception() in the template: its own words
    except _TooBig as exc:
        raise TokenizerError(f"the chat template was stopped: {exc}") from None
    except (Exception, RecursionError, MemoryError) as exc:   # TemplateError, 1/0, ...
        raise TokenizerError(f"the chat template cannot be rendered: "
                             f"{type(exc).__name__}: {exc}") from None
    return "".join(text)


class _TooBig(Exception):
    """A template passed one of the bounds (caught by render)."""


def _sandbox():
    """A jinja2 sandbox as transformers renders templates (trim_blocks and lstrip_blocks,
    which template authors write for; loop controls; raise_exception and tojson), with the
    bounds above. One per render: its range() budget is the render's."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})
        steps_left = MAX_TEMPLATE_STEPS

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > MAX_POWER_EXPONENT:
                raise _TooBig(f"it raises to the power {right}")
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                            len(seq) * times > MAX_RENDERED_CHARS:
                        raise _TooBig(f"it repeats a sequence of {len(seq):,} items "
                                      f"{times:,} times")
            return super().call_binop(context, operator, left, right)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"])

    def bounded_range(*args):
        items = range(*args)
        env.steps_left -= len(items)
        if env.steps_left < 0:
            raise _TooBig(f"its loops take more than {MAX_TEMPLATE_STEPS:,} steps")
        return items

    def raise_exception(message: str):
        raise TokenizerError(f"the chat template refused the conversation: {message}")

    env.globals.update(range=bounded_range, raise_exception=raise_exception)
    env.filters["tojson"] = _tojson
    return env


def _tojson(value, indent=None) -> str:
    import json
    return json.dumps(value, indent=indent, ensure_ascii=False)


def check_messages(messages: Sequence[Message]) -> None:
    """TypeError/ValueError naming the first message that is not {"role": one of ROLES,
    "content": a str}."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages is a list of {{'role': ..., 'content': ...}} dicts, got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: give at least one {'role': 'user', 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] is a {type(message).__name__}, not a dict with "
                            f"'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        for key in ("role", "content"):
            if key not in message:
                raise TypeError(f"messages[{i}] has no {key!r}: a message is "
                                f"{{'role': ..., 'content': ...}}")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise TypeError(f"messages[{i}]['content'] is {type(content).__name__}, not a str")


def chat_template(model) -> str:
    """The model's chat template; TokenizerError where it has none."""
    template = getattr(model.tokenizer, "chat_template", None)
    if not template:
        raise TokenizerError(f"{model.source} has no chat template (a chat model's GGUF file "
                             f"keeps one as tokenizer.chat_template): it is not a chat model, "
                             f"so give it a prompt to continue instead of messages")
    return template


def prompt(model, messages: Sequence[Message],
           add_generation_prompt: bool = True) -> Tuple[str, List[int]]:
    """The rendered conversation, and its token ids. The template writes any BOS it wants
    as text, so the tokenizer adds none of its own (as transformers' apply_chat_template)."""
    tokenizer = model.tokenizer
    text = render(chat_template(model), messages, add_generation_prompt,
                  **_special_texts(tokenizer))
    ids = tokenizer.encode(text, bos=False)
    if not ids:
        raise TokenizerError("the chat template rendered this conversation as no text at all: "
                             "the model has nothing to go on from")
    return text, ids


def _special_texts(tokenizer) -> Dict[str, str]:
    texts = {}
    for name in ("bos", "eos"):
        id = getattr(tokenizer, f"{name}_id", None)
        texts[f"{name}_token"] = tokenizer.id_to_piece(id) if id is not None else ""
    return texts


def end_of_turn_id(tokenizer) -> Optional[int]:
    """The token that ends an assistant's turn: the first of END_OF_TURN_NAMES that the
    tokenizer reads as one token, else its EOS."""
    for name in END_OF_TURN_NAMES:
        try:
            ids = tokenizer.encode(name, bos=False)
        except TokenizerError:
            continue
        if len(ids) == 1:
            return ids[0]
    return getattr(tokenizer, "eos_id", None)


# ---- a conversation over one cache -----------------------------------------------------------

@dataclasses.dataclass
class Turn:
    """One answer, and what it cost."""
    reply: str                   # the assistant's text
    tokens: List[int]            # its token ids (the end-of-turn token not included)
    prompt_tokens: int           # tokens of the whole conversation sent this turn
    reused: int                  # of those, already in the cache from earlier turns
    prefilled: int               # of those, run now (prompt_tokens - reused)
    first_token_seconds: float   # from the call to the first token chosen (the prefill)
    seconds: float               # the whole turn
    finish_reason: str           # "eos": the model ended its turn; "length": max_new_tokens

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.first_token_seconds
        return (len(self.tokens) - 1) / decode if decode > 0 and len(self.tokens) > 1 else 0.0


# Tokens decoded between two calls of a Chat.send stream callback.
STREAM_CHUNK = 4


class Chat:
    """A conversation with a chat model, its K and V kept in one cache across turns.

        chat = kvlab.Chat(kvlab.load("smollm2-135m", activations="fp32"))
        turn = chat.send("What is a KV cache?")
        turn.reply, turn.reused, turn.prefilled

    (float32 activations, as `kvlab chat` runs: int8 ones, llama.cpp's way and kvlab.load's
    default for 4- and 8-bit weights, flip this small model's near ties; README, "A real
    model".) Special tokens typed in a message ("<|im_end|>") are read as the markers they
    spell, as transformers reads them: a user can write a turn of another role.

    max_seq_len bounds the whole conversation (the cache holds that many positions, its
    memory taken up front); dtype is the cache's format, as in model.new_cache. system
    replaces the template's default system prompt."""

    def __init__(self, model, system: Optional[str] = None, max_seq_len: int = 2048,
                 dtype="fp32") -> None:
        chat_template(model)            # refuse a model without one now, not at the first turn
        max_seq_len = arguments.positive(max_seq_len, "max_seq_len")
        self.model = model
        self.system = system
        self.cache = model.new_cache(min(max_seq_len, model.config.max_seq_len), dtype)
        self.stop_id = end_of_turn_id(model.tokenizer)
        self.messages: List[Message] = []
        self.tokens: List[int] = []     # the ids whose K and V the cache holds, in order

    def reset(self) -> None:
        """Forget the conversation (the cache keeps its memory, empty)."""
        self.messages.clear()
        self.tokens.clear()
        self.cache.truncate(0)

    def conversation(self, pending: Optional[str] = None) -> List[Message]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        user = [{"role": "user", "content": pending}] if pending is not None else []
        return system + self.messages + user

    def send(self, text: str, max_new_tokens: int = 256, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             seed: Optional[int] = None,
             stream: Optional[Callable[[str], None]] = None) -> Turn:
        """The assistant's answer to `text`. Prefills only what the cache does not hold yet,
        then decodes until the end-of-turn token or max_new_tokens. stream, if given, is
        called with each new piece of the reply's text as it is made.

        A call that fails (a bad argument, the context full, Ctrl-C) leaves the conversation
        as it was: the message is not added and the cache keeps only the earlier turns."""
        if not isinstance(text, str):
            raise TypeError(f"send takes the user's message as a str, got {type(text).__name__}")
        max_new_tokens = arguments.positive(max_new_tokens, "max_new_tokens")
        check_sampling_args(temperature, top_k, top_p)
        seed = check_seed(seed)
        if stream is not None and not callable(stream):
            raise TypeError(f"stream must be a function taking text, or None, got "
                            f"{type(stream).__name__}")
        start = time.perf_counter()
        _, ids = prompt(self.model, self.conversation(pending=text))
        if len(ids) + max_new_tokens - 1 > self.cache.capacity:
            raise ContextLengthError(
                f"the conversation would take {len(ids)} tokens + up to {max_new_tokens} new "
                f"ones, more than the {self.cache.capacity} positions this chat holds: reset() "
                f"it, or start a Chat with a larger max_seq_len (the model's context is "
                f"{self.model.config.max_seq_len})")
        reused = _common_prefix(self.tokens, ids)
        reused = min(reused, len(ids) - 1)         # at least one token runs, for its logits
        rng = np.random.default_rng(seed)
        sampling = (temperature, top_k, top_p, rng)
        try:
            del self.tokens[reused:]               # drop what the new prompt does not share
            self.cache.truncate(reused)
            reply, first_seconds, finish = self._answer(ids[reused:], max_new_tokens,
                                                        sampling, stream, start)
        except BaseException:
            # Wherever it stopped (Ctrl-C may come between any two lines), the cache and
            # self.tokens are cut back to what both hold of the earlier turns.
            keep = min(self.cache.length, len(self.tokens), reused)
            del self.tokens[keep:]
            self.cache.truncate(keep)
            raise
        # the cache holds the prompt and the reply, but for a last token chosen and not run
        # (the end-of-turn token is never kept; a reply cut at max_new_tokens loses its last)
        self.tokens = ids + (reply if finish == "eos" else reply[:-1])
        if self.cache.length != len(self.tokens):      # an internal invariant of this class
            raise AssertionError(f"chat cache holds {self.cache.length} rows for "
                                 f"{len(self.tokens)} tokens")
        self.messages += [{"role": "user", "content": text},
                          {"role": "assistant", "content": self.model.decode_text(reply)}]
        return Turn(reply=self.messages[-1]["content"], tokens=reply, prompt_tokens=len(ids),
                    reused=reused, prefilled=len(ids) - reused,
                    first_token_seconds=first_seconds, seconds=time.perf_counter() - start,
                    finish_reason=finish)

    def _answer(self, new_ids: List[int], max_new_tokens: int, sampling: tuple,
                stream: Optional[Callable[[str], None]], start: float):
        """(reply ids without the end-of-turn token, seconds to the first, finish reason).
        On "eos" every reply id is in the cache; on "length" all but the last."""
        temperature, top_k, top_p, rng = sampling
        first = sample(self.model.prefill(new_ids, self.cache), *sampling)
        first_seconds = time.perf_counter() - start
        if first == self.stop_id:
            return [], first_seconds, "eos"
        reply, shown = [first], ""
        while len(reply) < max_new_tokens:
            steps = min(max_new_tokens - len(reply), STREAM_CHUNK if stream else max_new_tokens)
            picks, _ = self.model.decode_steps(reply[-1], self.cache, steps, temperature,
                                               top_k, top_p, rng, stop_token=self.stop_id)
            picks = picks.tolist()
            if picks[-1] == self.stop_id:
                reply += picks[:-1]
                shown = _stream(self.model, reply, shown, stream, final=True)
                return reply, first_seconds, "eos"
            reply += picks
            shown = _stream(self.model, reply, shown, stream, final=False)
        _stream(self.model, reply, shown, stream, final=True)
        return reply, first_seconds, "length"


def _stream(model, reply: List[int], shown: str, stream, final: bool) -> str:
    """Call stream with the text the reply added since `shown`; a character still cut in
    half by the last token (shown as U+FFFD) waits for the next call, unless final."""
    if stream is None:
        return shown
    text = model.decode_text(reply)
    if not final:
        text = text.rstrip("\ufffd")
    if text.startswith(shown) and len(text) > len(shown):
        stream(text[len(shown):])
        return text
    return shown


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


__all__ = ["Chat", "Turn", "render", "prompt", "end_of_turn_id", "check_messages",
           "chat_template", "END_OF_TURN_NAMES"]
